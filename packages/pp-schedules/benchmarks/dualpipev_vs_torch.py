r"""DualPipeV with its F&B steps overlapped, against ZB-V, 1F1B, theory and torch's schedules.

Every chunk stands for a layer whose work is part compute and part communication (a
mixture-of-experts layer's all-to-all, say): its forward computes ``c_f`` ms, then waits
``k_f`` ms on communication; the backward of its input waits ``k_b`` ms, then computes
``c_i`` ms; the gradient of its weight computes ``c_w`` ms. Computing sleeps while holding the
rank's device lock (one device computes one thing at a time); waiting sleeps inside
`pp_schedules.runtime.communicating()`, without the lock. Under torch's schedules and under
every schedule of ours but DualPipeV with ``fb_overlap="threads"``, communicating() does
nothing and each wait adds its time. In DualPipeV's F&B steps run in two threads, it lets the
rank's compute lock go, so the other half computes meanwhile: the forward's wait hides
behind the backward's weight gradient (the backward's own wait finds nothing left to compute).
A sleep, not a real collective: an all-to-all among the ranks of one pipeline would need them
all at the same point, and this machine has no ranks outside the pipeline to form an expert
group with.

Per microbatch and rank: F = 10 ms (6 compute, 4 waiting), I = 10 ms (4 waiting, 6 compute),
W = 10 ms (compute), halved per chunk on the V (two chunks per rank), so every schedule does
the same work. The first stage's input is data: neither executor runs its I (its backward is
its W alone), and the theory says so (stage costs per virtual stage).

Rows at each microbatch count: ``1f1b`` (ours beside torch's Schedule1F1B), ``zbv`` (beside
ScheduleZBVZeroBubble), ``dualpipev threads`` (our overlap) and ``dualpipev sequential`` (the
halves in order, as torch's runtime runs them), both beside torch's ScheduleDualPipeV, in the
same processes, steps alternating A B B A, medians. "theory" is the simulator's makespan of
our plan with each chunk's F, I, W and B timed alone (the first stage's and a middle one's;
no communication between stages) and, for threads, ``Costs.overlap`` from an F&B step timed
alone through the executor's own two-thread code: (F + B - F&B) / min(F, B). "post" is the
median time our executor spends posting an exchange (one more recorded step) and "sim" the
simulator given it. Goals: ours/theory <= 1.10, ours/torch <= 1.00.

    torchrun --standalone --nproc-per-node 4 \
        packages/pp-schedules/benchmarks/dualpipev_vs_torch.py
"""

from __future__ import annotations

import argparse
import functools
import json
import threading
import time
import types
from typing import Any, NamedTuple, cast

import _pipeline_bench as bench
import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
)

from pp_comm import P2PCommunicator
from pp_schedules import Placement, StageCosts
from pp_schedules.planning import Action, PlanReport, simulate
from pp_schedules.runtime import communicating, gather_timeline, measured_costs
from pp_schedules.runtime._overlap import run_fb_step

TORCH_SCHEDULES: dict[str, bench.TorchSchedule] = {
    "1f1b": Schedule1F1B,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
# (schedule, chunks per rank, fb_overlap)
ROWS = (("1f1b", 1, None), ("zbv", 2, None), ("dualpipev", 2, "threads"),
        ("dualpipev", 2, "sequential"))  # fmt: skip
THEORY_LIMIT = 1.10

DEVICE = threading.Lock()
"""This rank's device: it computes one thing at a time, whoever asks."""


def compute(seconds: float) -> None:
    """Compute: sleep holding the device."""
    with DEVICE:
        time.sleep(seconds)


def wait(seconds: float) -> None:
    """Wait on communication: sleep without the device (and, in an F&B step, the lock)."""
    with communicating():
        time.sleep(seconds)


class Sleeps(NamedTuple):
    """One chunk's times in seconds: compute and waiting, forward and backward."""

    forward: float
    forward_wait: float
    input_wait: float
    input: float
    weight: float

    @classmethod
    def of(cls, args: argparse.Namespace, vp: int) -> Sleeps:
        """The command line's per-rank times, split over `vp` chunks."""
        wait_ms = args.wait_ms
        times = (args.forward_ms - wait_ms, wait_ms, wait_ms, args.input_ms - wait_ms,
                 args.weight_ms)  # fmt: skip
        return cls(*(t / 1e3 / vp for t in times))


class Chunk(bench.StageChunk):
    """Compute then a wait; the weight's branch joins at an add, where backwards split."""

    def __init__(self, sleeps: Sleeps) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.sleeps = sleeps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The input's branch (compute, then wait) plus the weight's."""
        s, spend = self.sleeps, bench.Sleep.apply
        # The input's gradient: its wait (the dispatch's backward), then its compute.
        hidden = spend(x, s.forward, s.input, compute)  # type: ignore[no-untyped-call]
        hidden = spend(hidden, s.forward_wait, s.input_wait, wait)  # type: ignore[no-untyped-call]
        # On the parameter alone: forward is free, the weight's gradient computes.
        return hidden + spend(self.weight, 0.0, s.weight, compute)  # type: ignore[no-any-return, no-untyped-call]


def build(args: argparse.Namespace, vp: int) -> list[Chunk]:
    """This rank's chunks."""
    return [Chunk(Sleeps.of(args, vp)) for _ in range(vp)]


def _fb_alone(sleeps: Sleeps) -> tuple[float]:
    """Seconds of one F&B step of two middle chunks, run by the executor's two threads."""
    chunks = [Chunk(sleeps), Chunk(sleeps)]
    x = torch.randn(1, 4, 1, requires_grad=True)
    pending = chunks[1](x)  # the backward half's forward, run before

    def forward(action: Action) -> None:
        chunks[0](x)

    def backward(action: Action) -> None:
        torch.autograd.backward(pending, torch.ones_like(pending))

    walk = types.SimpleNamespace(
        x=types.SimpleNamespace(compute_lock=threading.Lock()), forward=forward,
        backward=backward,
    )  # fmt: skip
    start = time.perf_counter()
    run_fb_step(cast(Any, walk), "threads", Action("F", 0, 0), Action("B", 0, 1))
    return (time.perf_counter() - start,)


@functools.cache
def chunk_costs(sleeps: Sleeps) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """Median ms (slowest rank's) of the first and a middle chunk's F, I, W, B, and an F&B."""
    first = bench.slowest_medians(lambda: bench.split_step_times(Chunk(sleeps), first=True))
    middle = bench.slowest_medians(lambda: bench.split_step_times(Chunk(sleeps)))
    (fb,) = bench.slowest_medians(lambda: _fb_alone(sleeps))
    return first, middle, fb


def overlap_of(sleeps: Sleeps) -> float:
    """The share of the shorter half an F&B step hid, timed alone (`Costs.overlap`)."""
    _, (f, _, _, b), fb = chunk_costs(sleeps)
    return min(1.0, max(0.0, (f + b - fb) / min(f, b)))


def stage_costs(sleeps: Sleeps, stages: int, overlap: float, exchange: float = 0.0) -> StageCosts:
    """Each virtual stage's measured costs: the first stage's, then middle ones'."""
    first, middle, _ = chunk_costs(sleeps)
    per_stage = [first] + [middle] * (stages - 1)
    forward, input_, weight, backward = (tuple(c[k] for c in per_stage) for k in range(4))
    return StageCosts(forward=forward, backward=backward, backward_input=input_,
                      backward_weight=weight, overlap=overlap, exchange=exchange)  # fmt: skip


def nominal(sleeps: Sleeps, stages: int, overlap: bool) -> StageCosts:
    """The costs the sleeps add up to, the first stage without its I."""
    s = {k: v * 1e3 for k, v in sleeps._asdict().items()}
    forward, input_ = s["forward"] + s["forward_wait"], s["input_wait"] + s["input"]
    hidden = min(s["forward_wait"], s["weight"]) / min(forward, input_ + s["weight"])
    per_stage = [(forward, 0.0, s["weight"])] + [(forward, input_, s["weight"])] * (stages - 1)
    f, i, w = (tuple(c[k] for c in per_stage) for k in range(3))
    return StageCosts(forward=f, backward=tuple(a + b for a, b in zip(i, w, strict=True)),
                      backward_input=i, backward_weight=w,
                      overlap=hidden if overlap else 0.0)  # fmt: skip


def measure(
    args: argparse.Namespace, comm: P2PCommunicator, row: tuple[str, int, str | None], m: int
) -> tuple[float, float, PlanReport, float]:
    """Median seconds of ours and of torch's, our plan, and our ms per exchange posted.

    One warm-up step each (torch infers shapes there), then steps alternating A B B A; then
    one more step of ours with the timeline recorded.
    """
    name, vp, fb_overlap = row
    pp, rank = comm.num_stages, comm.stage
    data = bench.microbatches(m)
    ours_step, executor = bench.ours(comm, name, vp, build(args, vp), data,
                                     fb_overlap=fb_overlap)  # fmt: skip
    placement = Placement.v_shape(pp, vp) if vp == 2 else Placement.looped(pp, vp)
    theirs_step = bench.theirs(TORCH_SCHEDULES[name], placement, build(args, vp), data, rank=rank)
    ours_s, theirs_s = bench.alternate([ours_step, theirs_step], args.steps + 1, warm_up=1)
    executor.record_timeline()
    bench.timed(ours_step)
    posting = measured_costs(gather_timeline(executor)).exchange
    executor.recording = False
    return ours_s, theirs_s, executor.plan_for(m, False)[1], posting


def theory(
    args: argparse.Namespace, row: tuple[str, int, str | None], report: PlanReport, post: float
) -> dict[str, Any]:
    """The plan's makespan at the chunks' measured costs, with posting, and at nominal ones."""
    _, vp, fb_overlap = row
    sleeps = Sleeps.of(args, vp)
    stages = report.placement.num_stages if report.placement is not None else 0
    overlap = overlap_of(sleeps) if fb_overlap == "threads" else 0.0
    first, middle, fb = chunk_costs(sleeps)
    return {
        "theory_ms": simulate(report, stage_costs(sleeps, stages, overlap)).makespan,
        "simulated_ms": simulate(report, stage_costs(sleeps, stages, overlap, post)).makespan,
        "nominal_ms": simulate(report, nominal(sleeps, stages, fb_overlap == "threads")).makespan,
        "exchange_ms": post, "overlap": overlap, "fb_alone_ms": fb,
        "first_stage_ms": dict(zip("FIWB", first, strict=True)),
        "middle_stage_ms": dict(zip("FIWB", middle, strict=True)),
    }  # fmt: skip


def row_record(
    args: argparse.Namespace, comm: P2PCommunicator, row: tuple[str, int, str | None], m: int
) -> dict[str, Any]:
    """One table row: times, theory, ratios, the goals and whether they are met."""
    name, vp, fb_overlap = row
    ours_s, theirs_s, report, post = measure(args, comm, row, m)
    record: dict[str, Any] = {
        "benchmark": "dualpipev_vs_torch", "schedule": name, "fb_overlap": fb_overlap,
        "torch_schedule": TORCH_SCHEDULES[name].__name__, "pp": comm.num_stages, "vp": vp,
        "microbatches": m, "ours_ms": ours_s * 1e3, "torch_ms": theirs_s * 1e3,
        "ours_vs_torch": ours_s / theirs_s,
    }  # fmt: skip
    record.update(theory(args, row, report, post))
    record["ours_vs_theory"] = record["ours_ms"] / record["theory_ms"]
    goals = [
        ("ours/torch <= 1.00", record["ours_vs_torch"] <= 1.0),
        (f"ours/theory <= {THEORY_LIMIT:.2f}", record["ours_vs_theory"] <= THEORY_LIMIT),
    ]
    record.update(goal=", ".join(g for g, _ in goals), passed=all(ok for _, ok in goals))
    return record


HEADER = (
    f"{'configuration':<32} {'ours ms':>8} {'torch ms':>8} {'theory':>7} {'post':>5} "
    f"{'sim':>7} {'ours/torch':>10} {'ours/theory':>11} {'vs zbv':>6}  {'goal':<40} pass"
)


def header(args: argparse.Namespace, pp: int) -> str:
    """The lines above the table: the chunks, their costs timed alone, the load."""
    v = Sleeps.of(args, 2)
    first, middle, fb = chunk_costs(v)
    costs = "; ".join(
        f"{what} F {c[0]:.2f}, I {c[1]:.2f}, W {c[2]:.2f}, B {c[3]:.2f}"
        for what, c in (("first", first), ("middle", middle))
    )
    return (
        f"pp {pp}: medians of {args.steps} alternating steps; per microbatch and rank F "
        f"{args.forward_ms:g} ms ({args.forward_ms - args.wait_ms:g} compute + "
        f"{args.wait_ms:g} waiting), I {args.input_ms:g} ms ({args.wait_ms:g} waiting + "
        f"{args.input_ms - args.wait_ms:g} compute), W {args.weight_ms:g} ms, halved per "
        f"chunk on the V\nV chunk alone (ms): {costs}; F&B in two threads {fb:.2f}, "
        f"overlap {overlap_of(v):.2f}; load average {bench.load_average()}\n{HEADER}"
    )


def render(record: dict[str, Any]) -> str:
    """One line of the table."""
    name = record["schedule"] + (f" {record['fb_overlap']}" if record["fb_overlap"] else "")
    config = f"{name} pp{record['pp']} vp{record['vp']} m{record['microbatches']}"
    return (
        f"{config:<32} {record['ours_ms']:>8.1f} {record['torch_ms']:>8.1f} "
        f"{record['theory_ms']:>7.1f} {record['exchange_ms']:>5.2f} "
        f"{record['simulated_ms']:>7.1f} {record['ours_vs_torch']:>10.3f} "
        f"{record['ours_vs_theory']:>11.3f} {bench.number(record.get('ours_vs_zbv'), 3):>6}  "
        f"{bench.verdict(record, 40)}"
    )


def main() -> None:
    """Every row side by side; rank 0 prints the table (or JSON lines)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", default="8,16", help="comma-separated counts")
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--input-ms", type=float, default=10.0)
    parser.add_argument("--weight-ms", type=float, default=10.0)
    parser.add_argument(
        "--wait-ms", type=float, default=4.0, help="of F and of I, the time spent waiting"
    )
    args, comm = bench.start(parser)
    first = dist.get_rank() == 0
    line = header(args, comm.num_stages)  # every rank: the costs are all-reduced
    if first and not args.json:
        print(line, flush=True)
    for m in (int(x) for x in args.microbatches.split(",")):
        zbv = 0.0
        for row in ROWS:
            record = row_record(args, comm, row, m)
            if row[0] == "zbv":
                zbv = record["ours_ms"]
            elif row[0] == "dualpipev":
                record["ours_vs_zbv"] = record["ours_ms"] / zbv
            if first:
                print(json.dumps(record) if args.json else render(record), flush=True)
    bench.finish(comm)


if __name__ == "__main__":
    main()
