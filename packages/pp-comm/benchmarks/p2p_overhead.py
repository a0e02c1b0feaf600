"""Overhead of pp-comm's operations against raw torch.distributed isend/irecv of the same bytes.

Run on two ranks under torchrun (``python3 -m nox -s bench`` does it):

    torchrun --standalone --nproc-per-node 2 packages/pp-comm/benchmarks/p2p_overhead.py --both

For every operation pair and payload size, both ways of moving the same tensors are timed in
many short rounds, interleaved A B B A (pp-comm, raw, raw, pp-comm, ...) in the same run.
Each round gives one ratio of two adjacent timings (pp-comm / raw); the reported ratio is the
median of those, which drift in machine load affects least, with their interquartile range
(the spread: half the rounds fall inside it); the times are the medians of each side. A last
row per size times raw against itself, the control: the ratios the machine gives for equal
work. Rank 0 prints a table (``--json``: one JSON line per row instead) with the goal and
whether the median meets it. Goal: ratio <= 1.10, with the default config (contract checks
on: every message framed, see `pp_comm.framing`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator

SIZES = {"4KB": 4 * 1024, "4MB": 4 * 1024 * 1024}
GOAL = 1.10
NOISE_ROW = "(raw vs raw: the noise)"


def raw_exchange(
    send: torch.Tensor | None, recv_like: torch.Tensor | None, peer: int, batched: bool
) -> None:
    """The same transfer with plain torch.distributed calls.

    Like any pipeline (and pp-comm), it receives into a new tensor that requires grad each
    time: received activations are kept for the backward pass, so a receive buffer cannot be
    reused, and the stage's backward needs their gradient.
    """
    recv = None if recv_like is None else _buffer(recv_like)
    if batched:
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, peer))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, peer))
        for batch_work in dist.batch_isend_irecv(ops):
            batch_work.wait()
        return
    works: list[dist.Work] = []
    # Rank 0 sends first, rank 1 receives first (the usual deadlock-free pairing).
    first_send = dist.get_rank() == 0
    pairs = [("send", send), ("recv", recv)] if first_send else [("recv", recv), ("send", send)]
    for kind, tensor in pairs:
        if tensor is not None:
            posted = (dist.isend if kind == "send" else dist.irecv)(tensor, peer)
            assert posted is not None
            works.append(posted)
    for work in works:
        work.wait()


def _buffer(like: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(like, requires_grad=True)


def raw_exchange_both_ways(out: torch.Tensor, like: torch.Tensor, peer: int, batched: bool) -> None:
    """Send and receive in both directions between the same two ranks (two of each).

    All four are posted before any is waited for, as one pipeline call does it (and Megatron's
    unbatched path): even ranks send first, odd ranks receive first.
    """
    if batched:
        ops = [
            dist.P2POp(dist.isend, out, peer),
            dist.P2POp(dist.irecv, _buffer(like), peer),
            dist.P2POp(dist.isend, out, peer),
            dist.P2POp(dist.irecv, _buffer(like), peer),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return
    works = []
    for _ in range(2):
        send_first = dist.get_rank() % 2 == 0
        for kind in ("send", "recv") if send_first else ("recv", "send"):
            posted = dist.isend(out, peer) if kind == "send" else dist.irecv(_buffer(like), peer)
            assert posted is not None
            works.append(posted)
    for work in works:
        work.wait()


def scenarios(
    comm: P2PCommunicator, numel: int
) -> dict[str, tuple[Callable[[], object], Callable[[], None]]]:
    """For each operation pair: (pp-comm call, raw equivalent) as run by this rank."""
    shape = (numel,)
    out = torch.ones(shape)
    buf = torch.empty(shape)
    first = comm.is_first_stage
    peer = comm.next_rank
    batched = comm.config.batch_p2p_comm

    def both() -> None:
        raw_exchange(out, buf, peer, batched)

    def raw_send() -> None:
        raw_exchange(out, None, peer, batched)

    def raw_recv() -> None:
        raw_exchange(None, buf, peer, batched)

    return {
        "send_forward/recv_forward": (
            (lambda: comm.send_forward(out)) if first else (lambda: comm.recv_forward(shape)),
            raw_send if first else raw_recv,
        ),
        "send_backward/recv_backward": (
            (lambda: comm.recv_backward(shape)) if first else (lambda: comm.send_backward(out)),
            raw_recv if first else raw_send,
        ),
        "send_forward_recv_backward/send_backward_recv_forward": (
            (lambda: comm.send_forward_recv_backward(out, shape))
            if first
            else (lambda: comm.send_backward_recv_forward(out, shape)),
            both,
        ),
        "send_forward_recv_forward": (
            lambda: comm.send_forward_recv_forward(out, True, shape),
            both,
        ),
        "send_backward_recv_backward": (
            lambda: comm.send_backward_recv_backward(out, True, shape),
            both,
        ),
        "send_forward_backward_recv_forward_backward": (
            lambda: comm.send_forward_backward_recv_forward_backward(out, out, True, True, shape),
            lambda: raw_exchange_both_ways(out, buf, peer, batched),
        ),
        NOISE_ROW: (both, both),
    }


@dataclasses.dataclass(frozen=True)
class Result:
    """One row: an operation pair at one size in one posting mode."""

    operation: str
    size: str
    mode: str
    pp_comm_s: float
    raw_s: float
    ratio: float
    low: float
    high: float

    @property
    def met(self) -> bool:
        """Whether the median ratio, as the table prints it, is within the goal."""
        return round(self.ratio, 2) <= GOAL

    def record(self) -> dict[str, object]:
        """The JSON form (times in microseconds)."""
        return {
            "benchmark": "p2p_overhead",
            "operation": self.operation,
            "size": self.size,
            "mode": self.mode,
            "pp_comm_us": round(self.pp_comm_s * 1e6, 1),
            "raw_us": round(self.raw_s * 1e6, 1),
            "ratio": round(self.ratio, 3),
            "ratio_q1": round(self.low, 3),
            "ratio_q3": round(self.high, 3),
            "goal": GOAL,
            "met": self.met,
        }


def timed(call: Callable[[], object], iterations: int) -> float:
    """Seconds per call, both ranks starting together."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    return (time.perf_counter() - start) / iterations


def compare(
    ours: Callable[[], object], raw: Callable[[], object], iterations: int, rounds: int
) -> tuple[float, float, list[float]]:
    """Median seconds per call of each, and the per-round ratios (ours / raw)."""
    for _ in range(3):  # warm up both paths
        ours()
        raw()
    ours_times, raw_times = [], []
    for round_ in range(rounds):
        # A B B A: alternate which goes first, so drift in machine load hits both alike.
        if round_ % 2:
            raw_times.append(timed(raw, iterations))
            ours_times.append(timed(ours, iterations))
        else:
            ours_times.append(timed(ours, iterations))
            raw_times.append(timed(raw, iterations))
    ratios = [o / r for o, r in zip(ours_times, raw_times, strict=True)]
    return statistics.median(ours_times), statistics.median(raw_times), ratios


def spread(ratios: list[float]) -> tuple[float, float, float]:
    """Median and interquartile range (first and third quartiles) of per-round ratios."""
    median = statistics.median(ratios)
    if len(ratios) < 2:
        return median, median, median
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, low, high


def run_mode(comm: P2PCommunicator, args: argparse.Namespace) -> list[Result]:
    """Every operation pair at every size with `comm`'s posting mode."""
    mode = "batched" if comm.config.batch_p2p_comm else "unbatched"
    results = []
    for label, nbytes in SIZES.items():
        # Many short rounds: a burst of load from elsewhere spoils a few rounds, not the median.
        iterations = 10 if nbytes < 1024 * 1024 else 2
        if args.quick:
            iterations = 2
        for name, (ours, raw) in scenarios(comm, nbytes // 4).items():
            ours_s, raw_s, ratios = compare(ours, raw, iterations, args.rounds)
            results.append(Result(name, label, mode, ours_s, raw_s, *spread(ratios)))
            if args.json and dist.get_rank() == 0 and name != NOISE_ROW:
                print(json.dumps(results[-1].record()), flush=True)
    return results


def table(results: list[Result]) -> str:
    """The results as an aligned text table."""
    header = ("operation", "size", "mode", "pp-comm ms", "raw ms", "ratio", "IQR", "goal", "met")
    rows = [
        (
            r.operation,
            r.size,
            r.mode,
            f"{r.pp_comm_s * 1e3:.3f}",
            f"{r.raw_s * 1e3:.3f}",
            f"{r.ratio:.2f}",
            f"{r.low:.2f}-{r.high:.2f}",
            f"<= {GOAL:.2f}",
            "" if r.operation == NOISE_ROW else ("yes" if r.met else "NO"),
        )
        for r in results
    ]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.ljust(width) if i < 3 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * width for width in widths))
    checked = [r for r in results if r.operation != NOISE_ROW]
    met = sum(r.met for r in checked)
    lines.append(
        f"goal met by {met} of {len(checked)} (median of per-round ratios <= {GOAL:.2f}); "
        "the control rows (raw vs raw) show the spread the machine gives for equal work"
    )
    return "\n".join(lines)


def main() -> None:
    """Time every operation pair against its raw equivalent; rank 0 prints the results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40, help="A B B A: an even count")
    parser.add_argument("--unbatched", action="store_true", help="post isend/irecv one by one")
    parser.add_argument("--both", action="store_true", help="batched, then unbatched")
    parser.add_argument("--quick", action="store_true", help="few iterations: check it runs")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    parser.add_argument(
        "--debug", action="store_true", help="pp-comm with debug=True (contract checks on)"
    )
    parser.add_argument(
        "--no-checks", action="store_true", help="pp-comm with check_contracts=False (bare)"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    assert dist.get_world_size() == 2, "run on 2 ranks"
    modes = [True, False] if args.both else [not args.unbatched]
    results = []
    for batched in modes:
        config = CommConfig(
            batch_p2p_comm=batched, debug=args.debug, check_contracts=not args.no_checks
        )
        comm = P2PCommunicator(None, config=config)
        results += run_mode(comm, args)
        comm.destroy()
    if not args.json and dist.get_rank() == 0:
        print(table(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
