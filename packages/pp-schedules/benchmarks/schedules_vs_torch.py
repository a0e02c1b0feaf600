"""Step time of pp-schedules' executor against torch.distributed.pipelining, side by side.

Both run the same model (Linear + tanh layers split over the stages), the same microbatches
and seeds over gloo: ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B against this
package's gpipe / 1f1b / interleaved_1f1b. Steps alternate between the two in one run; rank 0
prints one JSON line per configuration with each median step time and their ratio
(pp-schedules / torch). Goal: ratio <= 1.0.

    torchrun --standalone --nproc-per-node 2 packages/pp-schedules/benchmarks/schedules_vs_torch.py
"""

from __future__ import annotations

import argparse
import datetime
import json
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
from pp_schedules import ScheduleConfig, get_forward_backward_func

TORCH_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


class Block(torch.nn.Module):
    """Some consecutive Linear + tanh layers; takes pipeline input through set_input_tensor."""

    def __init__(self, layers: list[torch.nn.Linear]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        """Megatron's hook: the previous stage's activations."""
        self.input_tensor = tensors[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply each layer, then tanh."""
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def build(width: int, layers: int, pp: int, vp: int, rank: int) -> list[Block]:
    """This rank's chunks (virtual stage chunk * pp + rank), the same weights for both runs."""
    torch.manual_seed(0)
    everything = [torch.nn.Linear(width, width) for _ in range(layers)]
    per = layers // (pp * vp)
    return [Block(everything[(c * pp + rank) * per : (c * pp + rank + 1) * per]) for c in range(vp)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return ((output - target) ** 2).mean()


def ours(
    comm: P2PCommunicator,
    name: str,
    vp: int,
    chunks: list[Block],
    data: list[dict[str, torch.Tensor]],
) -> Callable[[], None]:
    """One training step with this package's executor."""
    rows, cols, width = data[0]["x"].shape
    forward_backward = get_forward_backward_func(
        comm, vp_size=vp, config=ScheduleConfig(hidden_size=width, schedule=name)
    )

    def forward_step(
        it: Iterator[dict[str, torch.Tensor]], model: Block
    ) -> tuple[torch.Tensor, Callable[..., Any]]:
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

    return step


def theirs(
    name: str,
    chunks: list[Block],
    data: list[dict[str, torch.Tensor]],
    *,
    pp: int,
    vp: int,
    rank: int,
) -> Callable[[], None]:
    """One training step with torch.distributed.pipelining on the same chunks and data."""
    stages = [
        PipelineStage(chunk, c * pp + rank, pp * vp, torch.device("cpu"))
        for c, chunk in enumerate(chunks)
    ]
    schedule_class = TORCH_SCHEDULES[name]
    if name == "interleaved_1f1b":
        schedule = schedule_class(stages, n_microbatches=len(data), loss_fn=loss_fn)
    else:
        schedule = schedule_class(stages[0], n_microbatches=len(data), loss_fn=loss_fn)
    inputs = torch.cat([d["x"] for d in data])
    targets = torch.cat([d["y"] for d in data])
    first, last = rank == 0, rank == pp - 1

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


def main() -> None:
    """Alternate steps of both executors per configuration; rank 0 prints JSON lines."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(minutes=2)))
    pp, rank = comm.num_stages, comm.stage
    generator = torch.Generator().manual_seed(1)
    data = [
        {
            "x": torch.randn(args.rows, 4, args.width, generator=generator),
            "y": torch.randn(args.rows, 4, args.width, generator=generator),
        }
        for _ in range(args.microbatches)
    ]
    for name, vp in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        ours_step = ours(comm, name, vp, build(args.width, args.layers, pp, vp, rank), data)
        theirs_step = theirs(
            name, build(args.width, args.layers, pp, vp, rank), data, pp=pp, vp=vp, rank=rank
        )
        ours_times: list[float] = []
        theirs_times: list[float] = []
        for index in range(args.steps + 1):
            pair = [(ours_step, ours_times), (theirs_step, theirs_times)]
            for step, times in pair if index % 2 else reversed(pair):
                elapsed = timed(step)
                if index:  # the first round warms up both
                    times.append(elapsed)
        ours_s, theirs_s = statistics.median(ours_times), statistics.median(theirs_times)
        if rank == 0:
            record = {
                "benchmark": "schedules_vs_torch",
                "schedule": name,
                "pp": pp,
                "vp": vp,
                "microbatches": args.microbatches,
                "pp_schedules_ms": round(ours_s * 1000, 2),
                "torch_pipelining_ms": round(theirs_s * 1000, 2),
                "ratio": round(ours_s / theirs_s, 3),
            }
            print(json.dumps(record), flush=True)
    comm.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
