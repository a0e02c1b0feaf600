"""What the flight recorder costs per recorded step, in microseconds (goal: 5 us or less).

One process walks rank 1's lowered steps of a real 1F1B plan (pp 4) through the executor, with
no-op compute (a stage multiplies its input by one) and a loopback communicator whose transfers
complete at once, so the walk is all bookkeeping. Calls alternate recorder on and off
(`NullFlightRecorder`) in A B B A order; the difference of the median call times, divided by
the steps walked, is the recorder's cost per step. The cost of `begin`/`end` alone, in a bare
loop over the same steps, is printed beside it.

    python packages/pp-schedules/benchmarks/recorder_cost.py [--microbatches 32] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import _pipeline_bench as bench
import torch

from pp_comm import CommConfig, P2PCommunicator, P2PMessage
from pp_schedules import PipelineExecutor, ScheduleConfig, get_forward_backward_func
from pp_schedules.runtime._flight_recorder import FlightRecorder, NullFlightRecorder

PP, RANK, WIDTH, SEQ, BATCH = 4, 1, 4, 2, 2
GOAL_US = 5.0


class _Done:
    """A handle whose transfers have completed."""

    def wait_recv(self, messages: Sequence[int] | None = None) -> None:
        """Nothing to wait for."""

    def wait_send(self) -> None:
        """Nothing to wait for."""


class LoopbackCommunicator:
    """Stage `RANK` of a `PP`-stage pipeline whose receives arrive at once (zeros)."""

    def __init__(self) -> None:
        self.num_stages, self.stage, self.rank = PP, RANK, RANK
        self.next_rank, self.prev_rank = RANK + 1, RANK - 1
        self.device = torch.device("cpu")
        self.config = CommConfig()

    def exchange(
        self, messages: Sequence[P2PMessage], *, operation: str = "", async_op: bool = False
    ) -> tuple[list[list[torch.Tensor] | None], _Done]:
        """Receives get fresh tensors of the asked shapes; sends go nowhere."""
        received: list[list[torch.Tensor] | None] = []
        for message in messages:
            if message.tensors:
                received.append(None)
                continue
            shapes = cast("Sequence[tuple[int, ...]]", message.shapes)
            grad = bool(message.requires_grad)
            received.append([torch.zeros(shape, requires_grad=grad) for shape in shapes])
        return received, _Done()

    def invalidate(self, reason: str) -> None:
        """Nothing to break."""


class Stage(bench.StageChunk):
    """No-op compute: the input times one (so backward has a graph to run)."""

    def forward(self) -> torch.Tensor:
        """The input, through one autograd op."""
        assert self.input_tensor is not None
        return self.input_tensor * 1.0


def _forward_step(data: Iterator[int], model: Stage) -> tuple[torch.Tensor, Any]:
    next(data)
    return model(), None


def _call(executor: PipelineExecutor, microbatches: int) -> float:
    start = time.perf_counter()
    executor(
        forward_step_func=_forward_step, data_iterator=iter(range(microbatches)), model=Stage(),
        num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    return time.perf_counter() - start


def _bare_us(executor: PipelineExecutor, repeats: int) -> float:
    """`begin` + `end` alone, per step."""
    recorder = FlightRecorder()
    plan = executor.recorder.plan
    recorder.start_call(RANK, plan)
    steps = list(enumerate(plan[RANK]))
    start = time.perf_counter()
    for _ in range(repeats):
        for index, step in steps:
            recorder.begin(index, step)
            recorder.end()
    return (time.perf_counter() - start) / (repeats * len(steps)) * 1e6


def measure(microbatches: int, rounds: int) -> dict[str, Any]:
    """Median call time with the recorder on and off, and the cost per recorded step."""
    communicator = cast("P2PCommunicator", LoopbackCommunicator())
    executor = get_forward_backward_func(communicator, config=ScheduleConfig(hidden_size=WIDTH))
    recorders = {"on": FlightRecorder(), "off": NullFlightRecorder()}
    times: dict[str, list[float]] = {"on": [], "off": []}
    _call(executor, microbatches)  # plan, validate and warm up once
    steps = len(executor.recorder.plan[RANK])
    for _ in range(rounds):
        for mode in ("on", "off", "off", "on"):  # A B B A: drift cancels out
            executor.recorder = recorders[mode]
            times[mode].append(_call(executor, microbatches))
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    per_step = (on - off) / steps * 1e6
    return {
        "schedule": "1f1b", "pp": PP, "rank": RANK, "microbatches": microbatches,
        "steps_per_call": steps, "call_on_ms": on * 1e3, "call_off_ms": off * 1e3,
        "on_vs_off": on / off, "recorder_us_per_step": per_step,
        "bare_us_per_step": _bare_us(executor, rounds), "goal_us": GOAL_US,
        "passed": per_step <= GOAL_US,
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    """Print one JSON line (``--json``) or a sentence with the ratio and us per step."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    record = measure(args.microbatches, args.rounds)
    if args.json:
        print(json.dumps(record))
        return
    print(
        f"flight recorder, 1f1b pp {PP} rank {RANK} m {args.microbatches} "
        f"({record['steps_per_call']} steps per call): on/off {record['on_vs_off']:.3f}, "
        f"{record['recorder_us_per_step']:.2f} us per step in the walk, "
        f"{record['bare_us_per_step']:.2f} us bare (goal <= {GOAL_US} us): "
        f"{'yes' if record['passed'] else 'NO'}"
    )


if __name__ == "__main__":
    main()
