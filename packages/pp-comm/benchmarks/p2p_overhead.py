"""Overhead of pp-comm's operations against raw torch.distributed isend/irecv of the same bytes.

Run on two ranks under torchrun (``python3 -m nox -s bench`` does it):

    torchrun --standalone --nproc-per-node 2 packages/pp-comm/benchmarks/p2p_overhead.py

For every operation pair and payload size, both ways of moving the same tensors are timed in
alternating rounds in the same run, and rank 0 prints one JSON line with the median time per
call of each and their ratio (pp-comm / raw). Goal: ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator

SIZES = {"4KB": 4 * 1024, "4MB": 4 * 1024 * 1024}


def raw_exchange(
    send: torch.Tensor | None, recv_like: torch.Tensor | None, peer: int, batched: bool
) -> None:
    """The same transfer with plain torch.distributed calls.

    Like any pipeline (and pp-comm), it receives into a new tensor each time: received
    activations are kept for the backward pass, so a receive buffer cannot be reused.
    """
    recv = None if recv_like is None else torch.empty_like(recv_like)
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

    return {
        "send_forward/recv_forward": (
            (lambda: comm.send_forward(out)) if first else (lambda: comm.recv_forward(shape)),
            (lambda: raw_exchange(out, None, peer, batched))
            if first
            else (lambda: raw_exchange(None, buf, peer, batched)),
        ),
        "send_backward/recv_backward": (
            (lambda: comm.recv_backward(shape)) if first else (lambda: comm.send_backward(out)),
            (lambda: raw_exchange(None, buf, peer, batched))
            if first
            else (lambda: raw_exchange(out, None, peer, batched)),
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
    }


def raw_exchange_both_ways(out: torch.Tensor, like: torch.Tensor, peer: int, batched: bool) -> None:
    """Send and receive in both directions between the same two ranks (two of each)."""
    if batched:
        ops = [
            dist.P2POp(dist.isend, out, peer),
            dist.P2POp(dist.irecv, torch.empty_like(like), peer),
            dist.P2POp(dist.isend, out, peer),
            dist.P2POp(dist.irecv, torch.empty_like(like), peer),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return
    raw_exchange(out, like, peer, batched)
    raw_exchange(out, like, peer, batched)


def timed(call: Callable[[], object], iterations: int) -> float:
    """Seconds per call, both ranks starting together."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    return (time.perf_counter() - start) / iterations


def main() -> None:
    """Time every operation pair against its raw equivalent; rank 0 prints JSON lines."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--unbatched", action="store_true", help="post isend/irecv one by one")
    parser.add_argument("--quick", action="store_true", help="few iterations: check it runs")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    assert dist.get_world_size() == 2, "run on 2 ranks"
    config = CommConfig(batch_p2p_comm=not args.unbatched)
    comm = P2PCommunicator(None, config=config)
    for label, nbytes in SIZES.items():
        numel = nbytes // 4
        iterations = 200 if nbytes < 1024 * 1024 else 20
        if args.quick:
            iterations = 2
        for name, (ours, raw) in scenarios(comm, numel).items():
            for _ in range(3):  # warm up both paths
                ours()
                raw()
            ours_times, raw_times = [], []
            for round_ in range(args.rounds):
                # Alternate which goes first, so drift in machine load hits both alike.
                if round_ % 2:
                    raw_times.append(timed(raw, iterations))
                    ours_times.append(timed(ours, iterations))
                else:
                    ours_times.append(timed(ours, iterations))
                    raw_times.append(timed(raw, iterations))
            ours_s, raw_s = statistics.median(ours_times), statistics.median(raw_times)
            if dist.get_rank() == 0:
                record = {
                    "benchmark": "p2p_overhead",
                    "operation": name,
                    "size": label,
                    "mode": "unbatched" if args.unbatched else "batched",
                    "pp_comm_us": round(ours_s * 1e6, 1),
                    "raw_us": round(raw_s * 1e6, 1),
                    "ratio": round(ours_s / raw_s, 3),
                }
                print(json.dumps(record), flush=True)
    comm.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
