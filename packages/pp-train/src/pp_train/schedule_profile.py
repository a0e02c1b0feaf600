"""Recording one training iteration's pipeline schedule as a Chrome trace (Perfetto opens it).

See `LoggingArgs.profile_schedule` and `profile_schedule_iteration` (``--profile-schedule``;
`TrainingConfig.profile_schedule_path` in the flat settings).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pp_schedules import MemoryProbe, PipelineExecutor, write_schedule_trace
from pp_schedules.runtime import check_trace_path
from pp_state import ParallelState
from pp_state.collectives import collective, collective_device
from pp_train.arguments import LoggingArgs

__all__ = ["ScheduleProfile"]


class ScheduleProfile:
    """Records one training iteration's schedule and writes its trace (see TrainingConfig).

    Args:
        logging: Where to write the trace and which iteration to record.
        train_iters: The run's length (the default iteration is at most the last).
        forward_backward_func: pp-schedules' executor (it records the timeline).
        state: The parallel state (the pipeline that records).
        start: The iteration this run starts at (trained iterations are not profiled).
        print_fn: Says so when the iteration to profile was trained before this run.
        static: The static tensors of a `MemoryProbe` that measures the profiled iteration's
            memory (when the executor has no probe then), drawn as counter tracks beside
            the spans; None: without static bytes.
        predicted: The byte model's bytes after each compute step of the profiled step, per
            pipeline rank (the simulator's ``MemoryTrack.after``), drawn beside the measured.

    Raises:
        TypeError: A trace is asked for but `forward_backward_func` is not the executor.
        ValueError: The trace path cannot be written.
    """

    def __init__(
        self,
        logging: LoggingArgs,
        train_iters: int,
        forward_backward_func: Any,
        state: ParallelState,
        *,
        start: int,
        print_fn: Callable[[str], None],
        static: Callable[[], Iterable[torch.Tensor]] | None = None,
        predicted: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.iteration: int | None = None
        self.static = static
        self.predicted = predicted
        self.probe: MemoryProbe | None = None
        """The probe this profile put on the executor (None: it found one there, or none)."""
        self.path = logging.profile_schedule
        if self.path is None:
            return
        if not isinstance(forward_backward_func, PipelineExecutor):
            raise TypeError(
                "profile_schedule_path needs pp-schedules' executor as forward_backward_func "
                f"(build_forward_backward_func), got {type(forward_backward_func).__name__}"
            )
        check_trace_path(self.path)
        self.executor = forward_backward_func
        self.state = state
        # One pipeline is enough (the others run the same plan); its first stage writes.
        self.records = 0 in state.group_ranks("pp")
        target = logging.profile_schedule_iteration
        if target is None:
            target = min(start + 2, train_iters)
        if target <= start < train_iters:
            print_fn(
                f"not profiling the schedule: iteration {target} was trained before this run "
                f"started at iteration {start}"
            )
            return
        self.iteration = target

    def starts(self, iteration: int) -> bool:
        """Turns recording on when `iteration` (1-based, about to run) is the profiled one."""
        active = iteration == self.iteration
        if active and self.records:
            self.executor.record_timeline(True)
            if self.executor.memory_probe is None:
                self.probe = MemoryProbe(self.static)
                self.executor.record_memory(self.probe)
        return active

    def finish(self, num_microbatches: int) -> str:
        """Turns recording off, writes the trace (collective over every rank); the summary."""
        assert self.path is not None
        summary = None
        if self.records:
            self.executor.record_timeline(False)
            if self.probe is not None:
                self.executor.record_memory(None)
                self.probe = None
            summary = write_schedule_trace(
                self.path,
                self.executor,
                num_microbatches=num_microbatches,
                group=self.state.group("pp"),
                predicted=self.predicted,
            )
        # Global rank 0 is in the profiled pipeline; every rank gets its summary.
        shared: list[object] = [summary]
        with collective("schedule profile broadcast", iteration=self.iteration):
            dist.broadcast_object_list(shared, src=0, device=collective_device())
        return f"schedule profile of iteration {self.iteration} written to {self.path}: {shared[0]}"
