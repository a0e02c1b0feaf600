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
import datetime
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import (
    Costs,
    PipelineExecutor,
    Placement,
    PlanReport,
    ScheduleConfig,
    gather_timeline,
    get_forward_backward_func,
    measured_costs,
    simulate,
)

TORCH_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))


class _Sleep(torch.autograd.Function):
    """Forward sleeps one time, backward another: a stage with fixed costs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class Chunk(torch.nn.Module):
    """A model chunk: residual MLP blocks, or a sleep of fixed forward/backward times."""

    def __init__(self, blocks: list[torch.nn.Module], sleep: tuple[float, float] | None) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.sleep = sleep
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        """Megatron's hook: the previous stage's activations."""
        self.input_tensor = tensors[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each block adds its MLP to the residual stream (or the chunk sleeps)."""
        if self.sleep is not None:
            return _Sleep.apply(x * self.weight, *self.sleep)  # type: ignore[no-any-return, no-untyped-call]
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


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return ((output - target) ** 2).mean()


def ours(
    comm: P2PCommunicator, name: str, vp: int, chunks: list[Chunk], data: list[dict[str, Any]]
) -> tuple[Callable[[], None], PipelineExecutor]:
    """One training step with this package's executor, and the executor."""
    rows, cols, width = data[0]["x"].shape
    forward_backward = get_forward_backward_func(
        comm, vp_size=vp, config=ScheduleConfig(hidden_size=width, schedule=name)
    )

    def forward_step(it: Iterator[dict[str, Any]], model: Chunk) -> tuple[Any, Any]:
        batch = next(it)
        out = model(batch["x"] if model.input_tensor is None else model.input_tensor)
        return out, lambda o: (loss_fn(o, batch["y"]), {})

    def step() -> None:
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(data) for _ in range(vp)],
            model=chunks,
            num_microbatches=len(data),
            seq_length=rows,
            micro_batch_size=cols,
        )

    return step, forward_backward


def theirs(
    name: str, chunks: list[Chunk], data: list[dict[str, Any]], *, pp: int, vp: int, rank: int
) -> Callable[[], None]:
    """One training step with torch.distributed.pipelining on the same chunks and data."""
    placement = Placement.looped(pp, vp)
    stages = [
        PipelineStage(chunk, placement.stage(rank, c), pp * vp, torch.device("cpu"))
        for c, chunk in enumerate(chunks)
    ]
    schedule_class = TORCH_SCHEDULES[name]
    target = stages if name == "interleaved_1f1b" else stages[0]
    schedule = schedule_class(target, n_microbatches=len(data), loss_fn=loss_fn)
    inputs = torch.cat([d["x"] for d in data])
    targets = torch.cat([d["y"] for d in data])
    first, last = placement.holds_first(rank), placement.holds_last(rank)

    def step() -> None:
        if first and last:
            schedule.step(inputs, target=targets)
        elif first:
            schedule.step(inputs)
        elif last:
            schedule.step(target=targets)
        else:
            schedule.step()

    return step


def timed(step: Callable[[], None]) -> float:
    """Seconds for one step, all ranks starting and ending together."""
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


@functools.cache
def _stage_costs(forward_ms: float, backward_ms: float, vp: int) -> tuple[float, float]:
    args = argparse.Namespace(forward_ms=forward_ms, backward_ms=backward_ms)
    return _time_stage(args, vp)


def stage_costs(args: argparse.Namespace, vp: int) -> tuple[float, float]:
    """Median ms of one sleep chunk's forward and backward run alone (slowest rank's)."""
    return _stage_costs(args.forward_ms, args.backward_ms, vp)


def _time_stage(args: argparse.Namespace, vp: int, rounds: int = 20) -> tuple[float, float]:
    (chunk,) = build(args, "sleep", 1, 1, 0)
    chunk.sleep = (args.forward_ms / 1e3 / vp, args.backward_ms / 1e3 / vp)
    x, y = torch.randn(1, 4, 1), torch.randn(1, 4, 1)
    forward: list[float] = []
    backward: list[float] = []
    for _ in range(rounds):
        start = time.perf_counter()
        loss = loss_fn(chunk(x), y)
        middle = time.perf_counter()
        loss.backward()
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
    costs = torch.tensor([statistics.median(forward), statistics.median(backward)]) * 1e3
    dist.all_reduce(costs, op=dist.ReduceOp.MAX)
    return float(costs[0]), float(costs[1])


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
    generator = torch.Generator().manual_seed(1)
    width = 1 if model == "sleep" else args.width
    rows = 1 if model == "sleep" else args.rows
    data = [
        {
            "x": torch.randn(rows, 4, width, generator=generator),
            "y": torch.randn(rows, 4, width, generator=generator),
        }
        for _ in range(m)
    ]
    ours_step, executor = ours(comm, name, vp, build(args, model, pp, vp, rank), data)
    theirs_step = theirs(name, build(args, model, pp, vp, rank), data, pp=pp, vp=vp, rank=rank)
    ours_times: list[float] = []
    theirs_times: list[float] = []
    pair = [(ours_step, ours_times), (theirs_step, theirs_times)]
    for index in range(args.steps + 1):
        for step, times in pair if index % 2 == 0 else reversed(pair):
            elapsed = timed(step)
            if index:  # the first round warms up both
                times.append(elapsed)
    executor.record_timeline()
    timed(ours_step)
    posting = measured_costs(gather_timeline(executor)).exchange
    return (
        statistics.median(ours_times),
        statistics.median(theirs_times),
        executor.plan_for(m, forward_only=False)[1],
        posting,
    )


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
    theory = record.get("theory_ms")
    nominal = record.get("nominal_ms")
    sim = record.get("simulated_ms")
    post = record.get("exchange_ms")
    versus = record.get("ours_vs_theory")
    return (
        f"{config:<34} {record['ours_ms']:>9.1f} {record['torch_ms']:>9.1f} "
        f"{'-' if nominal is None else f'{nominal:.1f}':>8} "
        f"{'-' if theory is None else f'{theory:.1f}':>8} "
        f"{'-' if post is None else f'{post:.2f}':>5} "
        f"{'-' if sim is None else f'{sim:.1f}':>8} "
        f"{record['ours_vs_torch']:>10.3f} {'-' if versus is None else f'{versus:.3f}':>11}  "
        f"{record['goal']:<40} {'yes' if record['passed'] else 'NO'}"
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
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print JSON lines, not a table")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(minutes=2)))
    hop = hop_latency(comm)
    first = dist.get_rank() == 0
    if first and not args.json:
        load = os.getloadavg()
        print(
            f"pp {comm.num_stages}: medians of {args.steps} alternating steps; sleep stages F "
            f"{args.forward_ms:g} ms, B {args.backward_ms:g} ms per microbatch and rank; hop "
            f"{hop * 1e3:.2f} ms; load average "
            f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n{HEADER}",
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
    comm.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
