"""Profiling a pipeline step: gather every rank's measured timeline and set it beside the plan's.

After a call of an executor with `PipelineExecutor.record_timeline` on, `write_schedule_trace`
gathers the spans of every rank of the pipeline group, simulates the same plan with the costs
measured in that step, writes one Chrome-trace JSON file (Perfetto opens it) from the first
stage, and returns a one-line summary (measured vs simulated makespan and bubble). When the
step also ran with a memory probe, each rank's measured bytes after every compute step (every
storage it holds, `MemorySample.live_bytes`; the saved-tensor figure where the probe did not
count allocations), and the byte model's predicted bytes when given, are drawn as counter
tracks beside its spans.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from pp_schedules.planning import Costs, Simulation, simulate
from pp_schedules.runtime._executor import PipelineExecutor
from pp_schedules.runtime._memory_probe import MemorySample
from pp_schedules.runtime._timeline import MeasuredSpan, chrome_trace, summary

__all__ = [
    "check_trace_path",
    "gather_memory",
    "gather_timeline",
    "measured_costs",
    "write_schedule_trace",
]


def check_trace_path(path: str | os.PathLike[str]) -> Path:
    """`path` as a Path, after checking a file can be written there (nothing is left behind).

    Raises:
        ValueError: The folder does not exist or is not writable, or the path is a folder.
    """
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"trace path {target} is a folder; give a file name such as trace.json")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"trace path {target}: folder {folder} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".pp-trace-check-"):
            pass
    except OSError as error:
        raise ValueError(f"trace path {target} cannot be written: {error.strerror}") from None
    return target


def gather_timeline(
    executor: PipelineExecutor, group: dist.ProcessGroup | None = None
) -> list[list[MeasuredSpan]]:
    """Every pipeline rank's spans of the executor's last call, in pipeline-rank order.

    Collective over `group` (the pipeline group; the default group when None): every member
    calls it.
    """
    size = dist.get_world_size(group)
    gathered: list[object] = [None] * size
    dist.all_gather_object(gathered, list(executor.timeline), group=group)
    ranks: list[list[MeasuredSpan]] = [list(spans) for spans in gathered]  # type: ignore[call-overload]
    return sorted(ranks, key=lambda spans: spans[0].rank if spans else 0)


def gather_memory(
    executor: PipelineExecutor, group: dist.ProcessGroup | None = None
) -> list[list[MemorySample]]:
    """Every pipeline rank's memory samples of the executor's last call, in pipeline-rank order.

    Empty lists where the call ran without a probe (`PipelineExecutor.record_memory`).
    Collective over `group` (the pipeline group; the default group when None).
    """
    gathered: list[object] = [None] * dist.get_world_size(group)
    mine = (executor.rank, list(executor.memory_samples))
    dist.all_gather_object(gathered, mine, group=group)
    ranks: list[tuple[int, list[MemorySample]]] = gathered  # type: ignore[assignment]
    return [samples for _, samples in sorted(ranks, key=lambda pair: pair[0])]


def _held(sample: MemorySample) -> int:
    """What a rank held after a step: everything live, where the probe counted it."""
    return sample.live_bytes if sample.live_bytes is not None else sample.total_bytes


def measured_costs(spans: Sequence[Sequence[MeasuredSpan]]) -> Costs:
    """Median forward, backward (or its halves) and exchange-posting times, in ms."""

    def median_ms(kind: str, floor: float) -> float:
        times = [(s.end - s.start) * 1e3 for rank in spans for s in rank if s.kind == kind]
        return max(statistics.median(times), floor) if times else floor

    halves = {kind: median_ms(kind, 0.0) for kind in ("I", "W")}
    backward = median_ms("B", 0.0) or halves["I"] + halves["W"] or 1e-6
    return Costs(
        forward=median_ms("F", 1e-6),
        backward=backward,
        exchange=median_ms("exchange", 0.0),
        backward_input=halves["I"] or None,
        backward_weight=halves["W"] or None,
    )


def write_schedule_trace(
    path: str | os.PathLike[str],
    executor: PipelineExecutor,
    *,
    num_microbatches: int,
    group: dist.ProcessGroup | None = None,
    costs: Costs | None = None,
    predicted: Sequence[Sequence[int]] | None = None,
) -> str:
    """Write the measured and simulated timelines of the executor's last call; return a summary.

    When that call also ran with a memory probe (`PipelineExecutor.record_memory`) on every
    pipeline rank, each rank's bytes after each compute step are drawn as a counter track
    beside its spans, with `predicted` as a second series.

    Args:
        path: The Chrome-trace JSON file, written by the first pipeline rank.
        executor: An executor whose last call ran with `record_timeline` on.
        num_microbatches: The microbatches of that call (selects the plan to simulate).
        group: The pipeline group (the default group when None).
        costs: Costs for the simulator in milliseconds; by default the measured medians.
        predicted: The byte model's bytes after each compute step, per pipeline rank, in the
            rank's plan order (the simulator's ``MemoryTrack.after``); None to leave it out.

    Returns:
        One line: measured makespan and bubble, the simulator's, and their ratio.

    Raises:
        ValueError: `predicted` does not hold one value per compute step of every rank.
    """
    spans = gather_timeline(executor, group)
    samples = gather_memory(executor, group)
    memory = [[_held(s) for s in rank] for rank in samples] if all(samples) else None
    _, report = executor.plan_for(num_microbatches, forward_only=False)
    simulation: Simulation = simulate(report, costs or measured_costs(spans))
    if dist.get_rank(group) == 0:
        trace = chrome_trace(spans, simulation, memory=memory, predicted=predicted)
        Path(path).write_text(trace, encoding="utf-8")
    return summary(spans, simulation)
