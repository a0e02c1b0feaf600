"""What the benchmarks against torch.distributed.pipelining share: steps, timing, the table.

Each benchmark script imports it as ``import _pipeline_bench as bench``: a script's own
directory is first on ``sys.path``, under torchrun as under ``python script.py`` (and mypy,
given the benchmarks folder, finds it there too).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import PipelineExecutor, Placement, ScheduleConfig, get_forward_backward_func
from pp_schedules.runtime import resolve_for
from pp_schedules.runtime._split_backward import backward_input

Step = Callable[[], None]
# One of torch's schedules: a single stage per rank, or a list of them.
TorchSchedule = type[PipelineScheduleSingle] | type[PipelineScheduleMulti]
Batch = dict[str, torch.Tensor]


class Sleep(torch.autograd.Function):
    """Forward sleeps one time, backward another: a stage with fixed costs.

    `spend` does the sleeping (`time.sleep` by default; one that holds a lock while it sleeps
    stands for compute on a device); a time of 0 is not spent at all.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        forward_s: float,
        backward_s: float,
        spend: Callable[[float], None] = time.sleep,
    ) -> torch.Tensor:
        if forward_s:
            spend(forward_s)
        ctx.backward_s, ctx.spend = backward_s, spend
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.backward_s:
            ctx.spend(ctx.backward_s)
        return grad, None, None, None


class StageChunk(torch.nn.Module):
    """A model chunk that takes the previous stage's activations through Megatron's hook."""

    def __init__(self) -> None:
        super().__init__()
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        """Megatron's hook: the previous stage's activations."""
        self.input_tensor = tensors[0]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return ((output - target) ** 2).mean()


def microbatches(m: int, rows: int = 1, width: int = 1) -> list[Batch]:
    """`m` microbatches of inputs ``x`` and targets ``y`` of shape (rows, 4, width), seeded."""
    generator = torch.Generator().manual_seed(1)
    return [
        {key: torch.randn(rows, 4, width, generator=generator) for key in ("x", "y")}
        for _ in range(m)
    ]


def ours(
    comm: P2PCommunicator,
    name: str,
    vp: int,
    chunks: Sequence[StageChunk],
    data: list[Batch],
    *,
    fb_overlap: str | None = None,
) -> tuple[Step, PipelineExecutor]:
    """One training step with this package's executor, and the executor.

    `fb_overlap` is how F&B steps run (`ScheduleConfig.fb_overlap`, DualPipeV only).
    """
    rows, cols, width = data[0]["x"].shape
    resolved = resolve_for(comm, name, vp_size=vp, microbatch_counts=[len(data)])
    config = ScheduleConfig(hidden_size=width, fb_overlap=fb_overlap)
    forward_backward = get_forward_backward_func(comm, resolved, config=config)

    def forward_step(it: Iterator[Batch], model: StageChunk) -> tuple[Any, Any]:
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
    schedule_class: TorchSchedule,
    placement: Placement,
    chunks: Sequence[StageChunk],
    data: list[Batch],
    *,
    rank: int,
) -> Step:
    """One training step with torch.distributed.pipelining on the same chunks and data."""
    stages = [
        PipelineStage(chunk, placement.stage(rank, c), placement.num_stages, torch.device("cpu"))
        for c, chunk in enumerate(chunks)
    ]
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    if issubclass(schedule_class, PipelineScheduleSingle):
        schedule = schedule_class(stages[0], n_microbatches=len(data), loss_fn=loss_fn)
    else:
        # A fresh list: torch's is typed list[_PipelineStageBase], and lists are invariant.
        schedule = schedule_class(list(stages), n_microbatches=len(data), loss_fn=loss_fn)
    inputs = torch.cat([d["x"] for d in data])
    targets = torch.cat([d["y"] for d in data])
    first, last = placement.holds_first(rank), placement.holds_last(rank)

    def step() -> None:
        if first and last:  # one rank holds both ends (rank 0 on the V)
            schedule.step(inputs, target=targets)
        elif first:
            schedule.step(inputs)
        elif last:
            schedule.step(target=targets)
        else:
            schedule.step()

    return step


def timed(step: Step) -> float:
    """Seconds for one step, all ranks starting and ending together."""
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def alternate(steps: Sequence[Step], rounds: int, warm_up: int = 0) -> list[float]:
    """Median seconds of each step over `rounds` rounds alternating A B B A.

    The first `warm_up` rounds run but are not counted.
    """
    times: list[list[float]] = [[] for _ in steps]
    order = list(enumerate(steps))
    for index in range(rounds):
        for which, step in order if index % 2 == 0 else reversed(order):
            elapsed = timed(step)
            if index >= warm_up:
                times[which].append(elapsed)
    return [statistics.median(t) for t in times]


def split_step_times(chunk: torch.nn.Module, *, first: bool = False) -> tuple[float, ...]:
    """Seconds of one F, I, W and whole B of `chunk` run alone (no pipeline, no communication).

    A middle stage's input needs a gradient; the first stage's is data, which needs none:
    its I is empty and its W is its whole backward, as the executors run it.
    """
    x = torch.randn(1, 4, 1, requires_grad=not first)
    start = time.perf_counter()
    out = chunk(x)
    forward = time.perf_counter()
    grad = torch.ones_like(out)
    if not first:
        _, weights = backward_input([out], [grad], [x], list(chunk.parameters()))
        middle = time.perf_counter()
        weights.run()
        end = time.perf_counter()
        out = chunk(x)
    whole = time.perf_counter()
    torch.autograd.backward(out, grad)
    backward = time.perf_counter() - whole
    if first:
        return forward - start, 0.0, backward, backward
    return forward - start, middle - forward, end - middle, backward


def slowest_medians(once: Callable[[], Sequence[float]], rounds: int = 20) -> tuple[float, ...]:
    """Median ms of each phase that `once` times (in seconds), the slowest rank's.

    `once` runs a chunk alone (no pipeline, no communication) `rounds` times.
    """
    times = [once() for _ in range(rounds)]
    medians = [statistics.median(phase) for phase in zip(*times, strict=True)]
    costs = torch.tensor(medians) * 1e3
    dist.all_reduce(costs, op=dist.ReduceOp.MAX)
    return tuple(float(c) for c in costs)


def start(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, P2PCommunicator]:
    """The command line (with --steps and --json added) and this rank's communicator.

    Joins the gloo process group and keeps torch to one thread per rank.
    """
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print JSON lines, not a table")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(minutes=2)))
    return args, comm


def finish(comm: P2PCommunicator) -> None:
    """Close the communicator and leave the process group."""
    comm.destroy()
    dist.destroy_process_group()


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages, as the table's first line shows them."""
    load = os.getloadavg()
    return f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def number(value: float | None, digits: int) -> str:
    """A table cell: `value` to `digits` decimals, or '-' where there is none."""
    return "-" if value is None else f"{value:.{digits}f}"


def verdict(record: dict[str, Any], width: int) -> str:
    """The table's last two cells: the row's goals, padded to `width`, and whether met."""
    return f"{record['goal']:<{width}} {'yes' if record['passed'] else 'NO'}"
