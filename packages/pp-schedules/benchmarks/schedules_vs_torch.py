"""Step time of pp-schedules' executor against torch.distributed.pipelining and against theory.

Both executors run the same chunks, microbatches and seeds over gloo in the same processes:
torch's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B against this package's gpipe /
1f1b / interleaved_1f1b, at every microbatch count asked for, on two models:

- ``sleep``: each chunk's forward sleeps F ms and its backward B ms (F/vp and B/vp with vp
  chunks per rank, so each rank always does m * (F + B) of work). Sleeping uses no CPU, so the
  ratio measures the schedule and the runtime's own overhead, almost independent of load. The
  theoretical makespan is the simulator's for the plan with zero transfer time and the
  stage's own step costs: a sleep of 10 ms plus the autograd ops around it takes 10.2-10.6 ms
  on these machines, whoever runs it, so each rank first times its chunk's forward and
  backward alone (no pipeline, no communication; medians) and the slowest rank's times are
  the costs. The nominal-cost makespan is printed too.
- ``mlp``: residual MLP blocks (hidden 128 by default), real compute on one thread per rank.

Steps alternate A B B A between the two executors (one warm-up step each first); the table
shows medians. Goals: ours/torch <= 1.00 everywhere; for sleep stages ours/theory <= 1.05 at
pp 2-4 and <= 1.10 at pp 8. The simulated column is the simulator given the hop latency and
median time our executor spends posting an exchange, both measured in this run (the latter
from one more step with the timeline recorded): what is left once the plan is known.

    torchrun --standalone --nproc-per-node 4 packages/pp-schedules/benchmarks/schedules_vs_torch.py
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any

import _pipeline_bench as bench
import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from pp_comm import P2PCommunicator
from pp_schedules import Costs, Placement
from pp_schedules.planning import PlanReport, simulate
from pp_schedules.runtime import gather_timeline, measured_costs

TORCH_SCHEDULES: dict[str, bench.TorchSchedule] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))


class Chunk(bench.StageChunk):
    """A model chunk: residual MLP blocks, or a sleep of fixed forward/backward times."""

    def __init__(self, blocks: list[torch.nn.Module], sleep: tuple[float, float] | None) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.sleep = sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each block adds its MLP to the residual stream (or the chunk sleeps)."""
        if self.sleep is not None:
            return bench.Sleep.apply(x * self.weight, *self.sleep)  # type: ignore[no-any-return, no-untyped-call]
        for block in self.blocks:
            x = x + block(x)
        return x


def build(args: argparse.Namespace, model: str, pp: int, vp: int, rank: int) -> list[Chunk]:
    """This rank's chunks on the looped placement, the same weights for both executors."""
    placement = Placement.looped(pp, vp)
    if model == "sleep":
        costs = (args.forward_ms / 1e3 / vp, args.backward_ms / 1e3 / vp)
        return [Chunk([], costs) for _ in range(vp)]
    torch.manual_seed(0)
    width = args.width
    blocks: list[torch.nn.Module] = [
        torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)
        )
        for _ in range(args.blocks)
    ]
    return [
        Chunk([blocks[i] for i in placement.layers(rank, chunk, args.blocks)], None)
        for chunk in range(vp)
    ]


@functools.cache
def _stage_costs(forward_ms: float, backward_ms: float, vp: int) -> tuple[float, float]:
    chunk = Chunk([], (forward_ms / 1e3 / vp, backward_ms / 1e3 / vp))
    x, y = torch.randn(1, 4, 1), torch.randn(1, 4, 1)

    def once() -> tuple[float, float]:
        start = time.perf_counter()
        loss = bench.loss_fn(chunk(x), y)
        middle = time.perf_counter()
        loss.backward()
        return middle - start, time.perf_counter() - middle

    forward, backward = bench.slowest_medians(once)
    return forward, backward


def stage_costs(args: argparse.Namespace, vp: int) -> tuple[float, float]:
    """Median ms of one sleep chunk's forward and backward run alone (slowest rank's)."""
    return _stage_costs(args.forward_ms, args.backward_ms, vp)


def hop_latency(comm: P2PCommunicator, rounds: int = 30) -> float:
    """Median one-hop latency in seconds: ping-pong between stages 0 and 1, the others idle.

    Measured one pair at a time, as in a pipeline of sleeping stages, where the other ranks
    sleep rather than compete for the cores.
    """
    tensor = torch.ones(1, 1, 1)
    times: list[float] = []
    dist.barrier()
    for _ in range(rounds):
        start = time.perf_counter()
        if comm.stage == 0:
            comm.send_forward(tensor)
            comm.recv_backward((1, 1, 1))
        elif comm.stage == 1:
            comm.recv_forward((1, 1, 1))
            comm.send_backward(tensor)
        times.append((time.perf_counter() - start) / 2)
    hop = torch.tensor([statistics.median(times) if comm.stage == 0 else 0.0])
    dist.all_reduce(hop, op=dist.ReduceOp.MAX)
    return float(hop[0])


def measure(
    args: argparse.Namespace, comm: P2PCommunicator, config: tuple[str, int, str, int]
) -> tuple[float, float, PlanReport, float]:
    """Step times of ours and torch's for one configuration, our plan, our posting time.

    Medians of steps alternating A B B A, in seconds; then one more step of ours with the
    timeline recorded gives the median ms our executor spends posting an exchange.
    """
    model, m, name, vp = config
    pp, rank = comm.num_stages, comm.stage
    rows, width = (1, 1) if model == "sleep" else (args.rows, args.width)
    data = bench.microbatches(m, rows, width)
    ours_step, executor = bench.ours(comm, name, vp, build(args, model, pp, vp, rank), data)
    chunks = build(args, model, pp, vp, rank)
    placement = Placement.looped(pp, vp)
    theirs_step = bench.theirs(TORCH_SCHEDULES[name], placement, chunks, data, rank=rank)
    # The first round warms up both.
    ours_s, theirs_s = bench.alternate([ours_step, theirs_step], args.steps + 1, warm_up=1)
    executor.record_timeline()
    bench.timed(ours_step)
    posting = measured_costs(gather_timeline(executor)).exchange
    return ours_s, theirs_s, executor.plan_for(m, forward_only=False)[1], posting


def row(
    args: argparse.Namespace,
    comm: P2PCommunicator,
    config: tuple[str, int, str, int],
    hop: float,
) -> dict[str, Any]:
    """One table row: times, theory and simulation, ratios, the goal and whether it is met."""
    model, m, name, vp = config
    pp = comm.num_stages
    ours_s, theirs_s, report, posting = measure(args, comm, config)
    record: dict[str, Any] = {
        "benchmark": "schedules_vs_torch", "model": model, "schedule": name, "pp": pp,
        "vp": vp, "microbatches": m, "ours_ms": ours_s * 1e3, "torch_ms": theirs_s * 1e3,
        "ours_vs_torch": ours_s / theirs_s,
    }  # fmt: skip
    goals = ["ours/torch <= 1.00"]
    passed = ours_s / theirs_s <= 1.0
    if model == "sleep":
        nominal = simulate(
            report, Costs(forward=args.forward_ms / vp, backward=args.backward_ms / vp)
        ).makespan
        f, b = stage_costs(args, vp)
        theory = simulate(report, Costs(forward=f, backward=b)).makespan
        sim = simulate(
            report, Costs(forward=f, backward=b, transfer=hop * 1e3, exchange=posting)
        ).makespan
        limit = 1.05 if pp <= 4 else 1.10
        record.update(
            nominal_ms=nominal,
            theory_ms=theory,
            stage_forward_ms=f,
            stage_backward_ms=b,
            simulated_ms=sim,
            exchange_ms=posting,
            ours_vs_theory=ours_s * 1e3 / theory,
        )
        goals.append(f"ours/theory <= {limit:.2f}")
        passed = passed and ours_s * 1e3 / theory <= limit
    record.update(goal=", ".join(goals), passed=passed)
    return record


HEADER = (
    f"{'configuration':<34} {'ours ms':>9} {'torch ms':>9} {'nominal':>8} {'theory':>8} "
    f"{'post':>5} {'sim':>8} {'ours/torch':>10} {'ours/theory':>11}  {'goal':<40} pass"
)


def render(record: dict[str, Any]) -> str:
    """One line of the table."""
    config = (
        f"{record['model']} {record['schedule']} pp{record['pp']} vp{record['vp']} "
        f"m{record['microbatches']}"
    )
    return (
        f"{config:<34} {record['ours_ms']:>9.1f} {record['torch_ms']:>9.1f} "
        f"{bench.number(record.get('nominal_ms'), 1):>8} "
        f"{bench.number(record.get('theory_ms'), 1):>8} "
        f"{bench.number(record.get('exchange_ms'), 2):>5} "
        f"{bench.number(record.get('simulated_ms'), 1):>8} "
        f"{record['ours_vs_torch']:>10.3f} {bench.number(record.get('ours_vs_theory'), 3):>11}  "
        f"{bench.verdict(record, 40)}"
    )


def main() -> None:
    """Every configuration side by side; rank 0 prints the table (or JSON lines)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="sleep,mlp", help="comma-separated: sleep, mlp")
    parser.add_argument("--microbatches", default="8,16", help="comma-separated counts")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--rows", type=int, default=16)
    args, comm = bench.start(parser)
    hop = hop_latency(comm)
    first = dist.get_rank() == 0
    if first and not args.json:
        print(
            f"pp {comm.num_stages}: medians of {args.steps} alternating steps; sleep stages F "
            f"{args.forward_ms:g} ms, B {args.backward_ms:g} ms per microbatch and rank; hop "
            f"{hop * 1e3:.2f} ms; load average {bench.load_average()}\n{HEADER}",
            flush=True,
        )
    wanted = set(args.schedules.split(","))
    for model in args.models.split(","):
        for m in (int(x) for x in args.microbatches.split(",")):
            for name, vp in SCHEDULES:
                if name not in wanted:
                    continue
                record = row(args, comm, (model, m, name, vp), hop)
                if first:
                    print(json.dumps(record) if args.json else render(record), flush=True)
    bench.finish(comm)


if __name__ == "__main__":
    main()
