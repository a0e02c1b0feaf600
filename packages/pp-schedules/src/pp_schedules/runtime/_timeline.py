"""Measured timelines: what each rank did when, beside what the simulator predicted.

The executor records one `MeasuredSpan` per compute step and per exchange when asked to
(`PipelineExecutor.record_timeline`); when not asked, it records nothing and pays one
attribute test per step. `chrome_trace` writes the measured spans of every rank and, as
separate tracks, the simulator's timeline of the same plan, as one Chrome-trace JSON document
that Perfetto (ui.perfetto.dev) and chrome://tracing open; with memory samples, each rank gets
a counter track of its measured bytes (and the byte model's predicted ones) after each compute
step. `summary` compares the two in one line.

Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pp_schedules.planning import CATEGORIES, Simulation

__all__ = [
    "MeasuredSpan",
    "TimelineRecorder",
    "chrome_trace",
    "measured_makespan",
    "memory_counters",
    "summary",
]

_MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class MeasuredSpan:
    """One step as it ran.

    Attributes:
        rank: Pipeline rank.
        name: The step's string form (``F3.1``, ``SEND_F3+RECV_B1``).
        kind: "F", "B", "I", "W" for compute; "exchange" for posting an exchange's transfers; "wait"
            for waiting, right before a compute step, for a receive it uses to arrive.
        microbatch: The compute step's microbatch (the first message's for an exchange).
        chunk: The model chunk (the first message's for an exchange).
        start: Wall-clock seconds (``time.time()``) when it began; wall clock, so that ranks
            on one machine (and on NTP-synchronised machines) share a time axis.
        end: When it ended.
    """

    rank: int
    name: str
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


class TimelineRecorder:
    """Collects the spans of one rank for one call of the executor."""

    def __init__(self, rank: int) -> None:
        """Record for pipeline rank `rank`."""
        self.rank = rank
        self.spans: list[MeasuredSpan] = []

    @staticmethod
    def now() -> float:
        """The clock spans are measured with (wall-clock seconds)."""
        return time.time()

    def add(  # noqa: PLR0917 - one span's fields
        self, name: str, kind: str, microbatch: int, chunk: int, start: float, end: float
    ) -> None:
        """Append one span."""
        self.spans.append(MeasuredSpan(self.rank, name, kind, microbatch, chunk, start, end))


def measured_makespan(spans: Sequence[Sequence[MeasuredSpan]]) -> float:
    """From the first start to the last end over every rank, in seconds."""
    flat = [span for rank in spans for span in rank]
    if not flat:
        return 0.0
    return max(s.end for s in flat) - min(s.start for s in flat)


def _busy(spans: Sequence[MeasuredSpan]) -> float:
    return sum(s.end - s.start for s in spans if s.kind in CATEGORIES)


def _origin(spans: Sequence[Sequence[MeasuredSpan]]) -> float:
    """When the first span of any rank started (the trace's time 0)."""
    return min((s.start for rank in spans for s in rank), default=0.0)


def _measured_events(spans: Sequence[Sequence[MeasuredSpan]]) -> list[dict[str, object]]:
    flat = [span for rank in spans for span in rank]
    origin = _origin(spans)
    events: list[dict[str, object]] = []
    for span in flat:
        events.append(
            {
                "name": span.name,
                "cat": {**CATEGORIES, "wait": "wait"}.get(span.kind, "exchange"),
                "ph": "X",
                "ts": (span.start - origin) * 1e6,
                "dur": (span.end - span.start) * 1e6,
                "pid": 0,
                "tid": span.rank,
                "args": {"microbatch": span.microbatch, "chunk": span.chunk},
            }
        )
    return events


def _named_series(
    memory: Sequence[Sequence[int]] | None, predicted: Sequence[Sequence[int]] | None, ranks: int
) -> list[tuple[str, Sequence[Sequence[int]]]]:
    """The counter series given, by name, after checking each has one list per rank.

    Raises:
        ValueError: A series is not given for every rank.
    """
    named = [(n, v) for n, v in (("measured", memory), ("predicted", predicted)) if v is not None]
    for name, values in named:
        if len(values) != ranks:
            raise ValueError(
                f"{name} memory is given for {len(values)} ranks, but the trace has {ranks}"
            )
    return named


def memory_counters(
    measured: Sequence[Sequence[MeasuredSpan]],
    memory: Sequence[Sequence[int]] | None = None,
    predicted: Sequence[Sequence[int]] | None = None,
) -> list[dict[str, object]]:
    """Chrome-trace counter events of each rank's bytes, at the end of each compute span.

    One counter track per rank (named "memory (MB)", with the rank as its id, in the measured
    process), one event per compute step holding up to two series: ``measured`` (the
    `MemoryProbe` samples' total bytes) and ``predicted`` (the byte model's), in MB (2**20
    bytes, as Megatron's memory report).

    Args:
        measured: Each rank's spans, in rank order; their compute spans give the times.
        memory: Each rank's measured bytes after each of its compute steps, in order.
        predicted: Each rank's predicted bytes after each of its compute steps, in order.

    Returns:
        The events (none when neither series is given).

    Raises:
        ValueError: A series does not hold one value per compute step of every rank.
    """
    origin = _origin(measured)
    named = _named_series(memory, predicted, len(measured))
    events: list[dict[str, object]] = []
    for rank, spans in enumerate(measured):
        ends = [s.end for s in spans if s.kind in CATEGORIES]
        for name, values in named:
            if len(values[rank]) != len(ends):
                raise ValueError(
                    f"rank {rank} ran {len(ends)} compute steps, but {len(values[rank])} "
                    f"{name} memory values are given (one after each compute step, in order)"
                )
        events += [
            {
                "name": "memory (MB)",
                "ph": "C",
                "pid": 0,
                "id": rank,
                "ts": (end - origin) * 1e6,
                "args": {name: values[rank][step] / _MB for name, values in named},
            }
            for step, end in enumerate(ends)
        ]
    return events


def _track_names(pid: int, label: str, ranks: int) -> list[dict[str, object]]:
    names: list[dict[str, object]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
    ]
    names += [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": r, "args": {"name": f"rank {r}"}}
        for r in range(ranks)
    ]
    return names


def chrome_trace(
    measured: Sequence[Sequence[MeasuredSpan]],
    simulation: Simulation | None = None,
    *,
    simulated_unit_s: float = 1e-3,
    memory: Sequence[Sequence[int]] | None = None,
    predicted: Sequence[Sequence[int]] | None = None,
) -> str:
    """One Chrome-trace JSON document: measured spans per rank, simulated ones beside them.

    Args:
        measured: Each rank's spans (`TimelineRecorder.spans`), rank order.
        simulation: The simulator's timeline of the same plan, drawn as a second process
            ("simulated") with one track per rank; None to leave it out.
        simulated_unit_s: Seconds per unit of the simulation's costs (1e-3 when costs are in
            milliseconds).
        memory: Each rank's measured bytes after each of its compute steps (`MemoryProbe`
            samples), drawn as a "memory (MB)" counter track per rank (`memory_counters`).
        predicted: The byte model's bytes after the same steps, a second series of it.

    Returns:
        The JSON text.

    Raises:
        ValueError: `memory` or `predicted` does not match the compute steps of every rank.
    """
    events = _track_names(0, "measured", len(measured)) + _measured_events(measured)
    events += memory_counters(measured, memory, predicted)
    if simulation is not None:
        events += _track_names(1, "simulated", len(simulation.spans))
        for rank_spans in simulation.spans:
            for span in rank_spans:
                events.append(
                    {
                        "name": str(span.action),
                        "cat": CATEGORIES[span.action.kind],
                        "ph": "X",
                        "ts": span.start * simulated_unit_s * 1e6,
                        "dur": (span.end - span.start) * simulated_unit_s * 1e6,
                        "pid": 1,
                        "tid": span.rank,
                        "args": {"microbatch": span.action.microbatch, "chunk": span.action.chunk},
                    }
                )
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


def summary(
    measured: Sequence[Sequence[MeasuredSpan]],
    simulation: Simulation | None = None,
    *,
    simulated_unit_s: float = 1e-3,
) -> str:
    """One line: measured makespan and bubble fraction, and the simulator's beside them."""
    makespan = measured_makespan(measured)
    bubbles = [1.0 - _busy(rank) / makespan if makespan else 0.0 for rank in measured]
    line = (
        f"measured makespan {makespan * 1e3:.1f} ms, bubble "
        f"{sum(bubbles) / max(len(bubbles), 1):.1%} (mean over {len(measured)} ranks)"
    )
    if simulation is not None:
        simulated = simulation.makespan * simulated_unit_s
        bubble = sum(simulation.bubble_fraction) / max(len(simulation.bubble_fraction), 1)
        ratio = makespan / simulated if simulated else float("nan")
        line += (
            f"; simulated {simulated * 1e3:.1f} ms, bubble {bubble:.1%}; "
            f"measured/simulated {ratio:.2f}"
        )
    return line


def recorded_trace(order: Sequence[int], heads: Mapping[int, Mapping[str, Any]]) -> str:
    """A Chrome trace of the steps each rank recorded, a track per rank of `order`.

    `heads` are the positions the ranks published (their ``recent`` steps, ``clock_offset``
    and ``published_at``): tracks are named by global rank, times are wall-clock (each rank's
    monotonic clock moved by the offset it published), and a step still open when the rank
    published ends at that moment. A stop report draws its ranks with it.
    """
    spans: list[list[MeasuredSpan]] = [[] for _ in order]
    for rank, head in heads.items():
        if rank not in order:
            continue
        track = list(order).index(rank)
        offset = float(head.get("clock_offset", 0.0))
        published = float(head.get("published_at", 0.0))
        for step in head.get("recent", []):
            end = step["end"] + offset if step["end"] is not None else published
            spans[track].append(
                MeasuredSpan(
                    track, step["action"], step["kind"], step["microbatch"], step["chunk"],
                    step["start"] + offset, max(end, step["start"] + offset),
                )
            )  # fmt: skip
    trace = json.loads(chrome_trace(spans))
    for event in trace["traceEvents"]:
        if event.get("name") == "thread_name":
            event["args"]["name"] = f"rank {order[event['tid']]}"
    return json.dumps(trace)
