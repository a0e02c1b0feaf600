"""Measured step time of synthetic stages against the simulator's prediction.

Each forward sleeps F ms and each backward B ms (sleeping uses no CPU, so 8 ranks fit on 2
cores); the executor runs the real schedule over gloo, and rank 0 prints one JSON line per
schedule with the measured step time, the simulator's makespan for the same costs and their
ratio. The transfer cost given to the simulator is measured first, by a ping-pong between
neighbouring stages with the same communicator. Goal: within 5%.

    python3 -m nox -s bench   (or torchrun with 8 ranks on this file)
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

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import Costs, ScheduleConfig, get_forward_backward_func, plan, simulate, validate


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


class SleepStage(torch.nn.Module):
    """A model chunk whose forward and backward take fixed times."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.forward_s, self.backward_s = forward_s, backward_s
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        """Megatron's hook: the previous stage's activations."""
        self.input_tensor = tensors[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Sleep for the forward cost (and, in backward, the backward cost)."""
        return _Sleep.apply(x * self.weight, self.forward_s, self.backward_s)  # type: ignore[no-any-return, no-untyped-call]


def forward_step(
    data: Iterator[torch.Tensor], model: SleepStage
) -> tuple[torch.Tensor, Callable[..., Any]]:
    """Megatron's forward_step_func for the synthetic stages."""
    x = next(data)
    out = model(x if model.input_tensor is None else model.input_tensor)
    return out, lambda o: (o.sum(), {"loss": o.sum().detach()})


def transfer_cost(comm: P2PCommunicator, rounds: int = 20) -> float:
    """Seconds for one transfer between neighbouring stages (half a ping-pong, averaged).

    Every pair of stages (0-1, 2-3, ...) measures at once, as the schedules load all links.
    """
    tensor = torch.ones(1, 1, 1)
    pinger = comm.stage % 2 == 0 and comm.stage + 1 < comm.num_stages
    ponger = comm.stage % 2 == 1
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if pinger:
            comm.send_forward(tensor)
            comm.recv_backward((1, 1, 1))
        elif ponger:
            comm.recv_forward((1, 1, 1))
            comm.send_backward(tensor)
    elapsed = torch.tensor([(time.perf_counter() - start) / (2 * rounds) if pinger else 0.0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def main() -> None:
    """Time each schedule's step and compare with the simulator; rank 0 prints JSON lines."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--backward-ms", type=float, default=40.0)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(minutes=2)))
    pp, m = comm.num_stages, args.microbatches
    transfer = transfer_cost(comm)
    for name, vp in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        f, b = args.forward_ms / 1000 / vp, args.backward_ms / 1000 / vp
        chunks = [SleepStage(f, b) for _ in range(vp)]
        config = ScheduleConfig(hidden_size=1, schedule=name)
        forward_backward = get_forward_backward_func(comm, vp_size=vp, config=config)
        data = [torch.ones(1, 1, 1) for _ in range(m)]
        times = []
        for _ in range(args.steps + 1):  # the first step warms up
            dist.barrier()
            start = time.perf_counter()
            forward_backward(
                forward_step_func=forward_step,
                data_iterator=[iter(data) for _ in range(vp)],
                model=chunks,
                num_microbatches=m,
                seq_length=1,
                micro_batch_size=1,
            )
            dist.barrier()
            times.append(time.perf_counter() - start)
        measured = statistics.median(times[1:])
        report = validate(
            plan(name, pp_size=pp, num_microbatches=m, vp_size=vp), num_microbatches=m, vp_size=vp
        )
        predicted = simulate(report, Costs(forward=f, backward=b, transfer=transfer)).makespan
        if dist.get_rank() == 0:
            record = {
                "benchmark": "synthetic_vs_simulator",
                "schedule": name,
                "pp": pp,
                "vp": vp,
                "microbatches": m,
                "measured_ms": round(measured * 1000, 1),
                "simulated_ms": round(predicted * 1000, 1),
                "transfer_ms": round(transfer * 1000, 2),
                "ratio": round(measured / predicted, 3),
            }
            print(json.dumps(record), flush=True)
    comm.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
