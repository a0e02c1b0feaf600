r"""Step time of pp-schedules' zero-bubble schedules against torch.distributed.pipelining's.

Both executors run the same chunks, microbatches and seeds over gloo in the same processes,
at every microbatch count asked for:

- ``1f1b``: this package's 1F1B (a whole backward, I + W, per step) beside torch's Schedule1F1B:
  the baseline the zero-bubble schedules are measured against.
- ``zb_h1``: this package's ZB-H1 (one chunk per rank, looped placement) beside torch's
  ScheduleInterleavedZeroBubble given one stage per rank.
- ``zbv``: this package's ZB-V (two chunks per rank on the V placement: rank r holds stages r
  and 2p-1-r) beside torch's ScheduleZBVZeroBubble.

Every chunk is a sleep stage whose backward splits: its forward sleeps F ms, the gradient of
its input I ms and the gradient of its weight W ms (F/2, I/2 and W/2 with the V's two chunks,
so each rank always does m * (F + I + W) of work). The input's sleep is a custom autograd
function on the activation, the weight's one on the parameter alone, and a built-in add joins
them: the branch to the weight leaves the input's path at a built-in node, where both
executors split the backward. Sleeping uses no CPU, so the ratios measure the schedule and
the runtime's own overhead, almost independent of load. The theoretical makespan is the
simulator's for our plan with zero transfer time and the stage's own step costs: each rank
first times its chunk's F, I, W and whole backward alone (no pipeline, no communication;
medians) and the slowest rank's times are the costs. The nominal-cost makespan is in the JSON
records. The first stage's input is data, so neither executor runs its I sleep (its I step is
empty, its backward only W) while the simulator charges every stage the same: that puts 1F1B's
theory one I above a perfect executor's time (at pp 4, 330 against 320 nominal ms at m 8) and
leaves ZB-H1's and ZB-V's unchanged (simulated with that I at zero, their makespans stay).

Steps alternate A B B A between the two executors (one warm-up step each first); the table
shows medians. Goals: ZB-H1 <= 0.86x our 1F1B at pp 4 m 8 and <= 0.92x at pp 4 m 16; ZB-H1
and ZB-V <= torch's; each schedule <= 1.05x its theoretical makespan. Where torch's schedule
refuses the configuration or fails, its column shows '-' and the reason follows the row.

    torchrun --standalone --nproc-per-node 4 \
        packages/pp-schedules/benchmarks/zero_bubble_vs_torch.py
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from typing import Any

import _pipeline_bench as bench
import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from pp_comm import P2PCommunicator
from pp_schedules import Costs, Placement
from pp_schedules.planning import PlanReport, simulate

TORCH_SCHEDULES: dict[str, bench.TorchSchedule] = {
    "1f1b": Schedule1F1B,
    "zb_h1": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SCHEDULES = (("1f1b", 1), ("zb_h1", 1), ("zbv", 2))
# ZB-H1's time over our 1F1B's, by (pp, microbatches): the spec's goals.
ZB_H1_GOALS = {(4, 8): 0.86, (4, 16): 0.92}
THEORY_LIMIT = 1.05


class Chunk(bench.StageChunk):
    """A sleep stage of fixed F, I and W times (seconds) whose backward splits at an add."""

    def __init__(self, sleep: tuple[float, float, float]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.sleep = sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The input's branch plus the weight's (broadcast): the add is where they split."""
        forward_s, input_s, weight_s = self.sleep
        # On the activation: forward sleeps F, backward (the input gradient) sleeps I.
        activation = bench.Sleep.apply(x, forward_s, input_s)  # type: ignore[no-untyped-call]
        # On the parameter alone: forward is free, backward (the weight gradient) sleeps W.
        weight = bench.Sleep.apply(self.weight, 0.0, weight_s)  # type: ignore[no-untyped-call]
        return activation + weight  # type: ignore[no-any-return]


def placement_of(name: str, pp: int, vp: int) -> Placement:
    """The V placement for zbv, the looped one otherwise."""
    return Placement.v_shape(pp, vp) if name == "zbv" else Placement.looped(pp, vp)


def build(args: argparse.Namespace, vp: int) -> list[Chunk]:
    """This rank's chunks: vp sleep stages sharing the rank's F, I and W."""
    sleep = (args.forward_ms / 1e3 / vp, args.input_ms / 1e3 / vp, args.weight_ms / 1e3 / vp)
    return [Chunk(sleep) for _ in range(vp)]


def agree(error: str | None) -> str | None:
    """The first rank's error, if any rank had one (every rank gets the same answer)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    for rank, found in enumerate(errors):
        if found is not None:
            return f"rank {rank}: {found}"
    return None


def attempt(action: Callable[[], Any]) -> tuple[Any, str | None]:
    """`action`'s result, or the error some rank met (torch refusing a configuration)."""
    try:
        result, error = action(), None
    except Exception as caught:  # reported in the table instead
        result, error = None, f"{type(caught).__name__}: {caught}".splitlines()[0]
    return result, agree(error)


@functools.cache
def _stage_costs(sleep_ms: tuple[float, float, float], vp: int) -> tuple[float, ...]:
    forward_ms, input_ms, weight_ms = sleep_ms
    chunk = Chunk((forward_ms / 1e3 / vp, input_ms / 1e3 / vp, weight_ms / 1e3 / vp))
    return bench.slowest_medians(lambda: bench.split_step_times(chunk))


def stage_costs(args: argparse.Namespace, vp: int) -> tuple[float, ...]:
    """Median ms of one chunk's F, I, W and whole backward run alone (slowest rank's)."""
    return _stage_costs((args.forward_ms, args.input_ms, args.weight_ms), vp)


def measure(
    args: argparse.Namespace, comm: P2PCommunicator, name: str, vp: int, m: int
) -> tuple[float, float | None, str | None, PlanReport]:
    """Median seconds of ours and of torch's (None and why, if it fails), and our plan.

    One warm-up step each, then steps alternating A B B A.
    """
    pp, rank = comm.num_stages, comm.stage
    data = bench.microbatches(m)
    ours_step, executor = bench.ours(comm, name, vp, build(args, vp), data)
    theirs_step, error = attempt(
        lambda: bench.theirs(
            TORCH_SCHEDULES[name], placement_of(name, pp, vp), build(args, vp), data, rank=rank
        )
    )
    if error is None:  # torch's warm-up step: it infers shapes there and may still refuse
        _, error = attempt(theirs_step)
    bench.timed(ours_step)  # ours' warm-up
    steps: list[bench.Step] = [ours_step] if error is not None else [ours_step, theirs_step]
    medians = bench.alternate(steps, args.steps)
    theirs_s = medians[1] if len(medians) > 1 else None
    return medians[0], theirs_s, error, executor.plan_for(m, False)[1]


def theory(args: argparse.Namespace, name: str, vp: int, report: PlanReport) -> dict[str, Any]:
    """The plan's makespan at the chunk's measured costs, and at the nominal ones."""
    f, i, w, b = stage_costs(args, vp)
    nominal = [args.forward_ms / vp, args.input_ms / vp, args.weight_ms / vp]
    if name == "1f1b":  # whole backwards: B is I and W in one step
        costs = Costs(forward=f, backward=b)
        ideal = Costs(forward=nominal[0], backward=nominal[1] + nominal[2])
    else:
        costs = Costs(forward=f, backward=i + w, backward_input=i, backward_weight=w)
        ideal = Costs(
            forward=nominal[0],
            backward=nominal[1] + nominal[2],
            backward_input=nominal[1],
            backward_weight=nominal[2],
        )
    return {
        "theory_ms": simulate(report, costs).makespan,
        "nominal_ms": simulate(report, ideal).makespan,
        "stage_forward_ms": f,
        "stage_input_ms": i,
        "stage_weight_ms": w,
        "stage_backward_ms": b,
    }


def row(
    args: argparse.Namespace, comm: P2PCommunicator, config: tuple[str, int, int], baseline: float
) -> dict[str, Any]:
    """One table row: times, theory, ratios, the goals and whether they are met.

    `baseline` is our 1F1B's median ms at the same microbatch count (0 for the 1F1B row).
    """
    name, vp, m = config
    pp = comm.num_stages
    ours_s, theirs_s, error, report = measure(args, comm, name, vp, m)
    ours_ms = ours_s * 1e3
    record: dict[str, Any] = {
        "benchmark": "zero_bubble_vs_torch", "schedule": name,
        "torch_schedule": TORCH_SCHEDULES[name].__name__, "pp": pp, "vp": vp,
        "microbatches": m, "ours_ms": ours_ms,
        "torch_ms": None if theirs_s is None else theirs_s * 1e3, "torch_error": error,
        "ours_vs_torch": None if theirs_s is None else ours_s / theirs_s,
    }  # fmt: skip
    record.update(theory(args, name, vp, report))
    record["ours_vs_theory"] = ours_ms / record["theory_ms"]
    record["ours_vs_1f1b"] = ours_ms / baseline if baseline else None
    # (description, met); a goal that cannot be measured (torch failed) is not met.
    goals = [(f"ours/theory <= {THEORY_LIMIT:.2f}", record["ours_vs_theory"] <= THEORY_LIMIT)]
    if name != "1f1b":
        versus = record["ours_vs_torch"]
        goals.insert(0, ("ours/torch <= 1.00", versus is not None and versus <= 1.0))
    limit = ZB_H1_GOALS.get((pp, m))
    if name == "zb_h1" and limit is not None:
        goals.insert(0, (f"ours/1f1b <= {limit:.2f}", record["ours_vs_1f1b"] <= limit))
    record.update(goal=", ".join(g for g, _ in goals), passed=all(ok for _, ok in goals))
    return record


HEADER = (
    f"{'configuration':<20} {'ours ms':>9} {'torch ms':>9} {'theory':>8} {'ours/torch':>10} "
    f"{'ours/theory':>11} {'ours/1f1b':>9}  {'goal':<58} pass"
)


def header(args: argparse.Namespace, pp: int) -> str:
    """The line above the table: the configuration, the chunks' measured costs, the load."""
    chunks = {"chunk": stage_costs(args, 1), "V chunk": stage_costs(args, 2)}
    alone = [
        f"{what} alone F {f:.2f}, I {i:.2f}, W {w:.2f}, B {b:.2f} ms"
        for what, (f, i, w, b) in chunks.items()
    ]
    return (
        f"pp {pp}: medians of {args.steps} alternating steps; sleep stages F "
        f"{args.forward_ms:g} ms, I {args.input_ms:g} ms, W {args.weight_ms:g} ms per "
        f"microbatch and rank (halved per chunk in the V); {'; '.join(alone)}; load average "
        f"{bench.load_average()}\n{HEADER}"
    )


def render(record: dict[str, Any]) -> str:
    """One line of the table, and torch's error on the next if it failed."""
    config = f"{record['schedule']} pp{record['pp']} vp{record['vp']} m{record['microbatches']}"
    line = (
        f"{config:<20} {record['ours_ms']:>9.1f} {bench.number(record['torch_ms'], 1):>9} "
        f"{record['theory_ms']:>8.1f} {bench.number(record['ours_vs_torch'], 3):>10} "
        f"{record['ours_vs_theory']:>11.3f} {bench.number(record['ours_vs_1f1b'], 3):>9}  "
        f"{bench.verdict(record, 58)}"
    )
    if record["torch_error"] is not None:
        line += f"\n  torch {record['torch_schedule']} failed: {record['torch_error']}"
    return line


def main() -> None:
    """Every configuration side by side; rank 0 prints the table (or JSON lines)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", default="8,16", help="comma-separated counts")
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--input-ms", type=float, default=10.0)
    parser.add_argument("--weight-ms", type=float, default=10.0)
    args, comm = bench.start(parser)
    first = dist.get_rank() == 0
    line = header(args, comm.num_stages)  # every rank: the stage costs are all-reduced
    if first and not args.json:
        print(line, flush=True)
    for m in (int(x) for x in args.microbatches.split(",")):
        baseline = 0.0
        for name, vp in SCHEDULES:
            record = row(args, comm, (name, vp, m), baseline)
            if name == "1f1b":
                baseline = record["ours_ms"]
            if first:
                print(json.dumps(record) if args.json else render(record), flush=True)
    bench.finish(comm)


if __name__ == "__main__":
    main()
