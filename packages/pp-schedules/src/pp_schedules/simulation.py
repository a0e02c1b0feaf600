"""Timing a plan before running it: makespan, bubbles, activation memory, and pictures.

The simulator runs the lowered plan under the executor's rules (see `validation`) with given
costs: a forward or backward step takes its cost; a transfer starts when its send is posted
and takes the transfer cost; a receive ends when its transfer arrives. It is exact for the
executor's model, so measured step times of synthetic stages can be compared with it.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict

from pp_schedules.actions import Action
from pp_schedules.validation import PlanReport

__all__ = ["Costs", "Simulation", "Span", "bubble_formula", "ideal_makespan", "simulate"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
    """Time of each kind of step, in any unit (seconds, milliseconds, ...)."""

    forward: float = 1.0
    """One forward of one microbatch on one model chunk."""
    backward: float = 2.0
    """One backward of one microbatch on one model chunk."""
    transfer: float = 0.0
    """One transfer between neighbouring stages, from posting the send to arrival."""

    def __post_init__(self) -> None:
        """Costs are not negative, and compute takes time.

        Raises:
            ValueError: A negative cost, or a zero forward or backward.
        """
        if min(self.forward, self.backward) <= 0 or self.transfer < 0:
            raise ValueError(
                f"forward and backward costs must be positive and transfer at least 0, got "
                f"forward={self.forward}, backward={self.backward}, transfer={self.transfer}"
            )


@dataclasses.dataclass(frozen=True)
class Span:
    """One compute step in time."""

    rank: int
    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The simulated timeline of a plan.

    Attributes:
        spans: Every compute step with its start and end, per rank in execution order.
        makespan: When the last rank finishes.
        bubble_fraction: For each rank, the share of the makespan it spends not computing.
        peak_activations: For each rank, the most forwards held awaiting their backward.
    """

    spans: list[list[Span]]
    makespan: float
    bubble_fraction: list[float]
    peak_activations: list[int]

    def timeline(self, width: int = 100) -> str:
        """An ASCII timeline, one row per rank.

        A forward shows as its microbatch's digit, a backward as a letter (a for microbatch 0,
        b for 1, ...), idle time as dots.
        """
        scale = width / self.makespan if self.makespan else 1.0
        rows = []
        for rank, spans in enumerate(self.spans):
            cells = ["."] * width
            for span in spans:
                first, last = (
                    int(span.start * scale),
                    max(int(span.start * scale) + 1, round(span.end * scale)),
                )
                mark = _mark(span.action)
                for cell in range(first, min(last, width)):
                    cells[cell] = mark
            rows.append(f"rank {rank} |{''.join(cells)}| bubble {self.bubble_fraction[rank]:.0%}")
        return "\n".join(rows)

    def chrome_trace(self, time_unit_us: float = 1000.0) -> str:
        """The timeline as Chrome-trace JSON (open it in Perfetto or chrome://tracing)."""
        events: list[dict[str, object]] = [
            {
                "name": str(span.action),
                "cat": "forward" if span.action.kind == "F" else "backward",
                "ph": "X",
                "ts": span.start * time_unit_us,
                "dur": (span.end - span.start) * time_unit_us,
                "pid": 0,
                "tid": span.rank,
                "args": {"microbatch": span.action.microbatch, "chunk": span.action.chunk},
            }
            for spans in self.spans
            for span in spans
        ]
        events += [
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"rank {rank}"},
            }
            for rank in range(len(self.spans))
        ]
        return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


def _mark(action: Action) -> str:
    if action.kind == "F":
        return str(action.microbatch % 10)
    return "abcdefghij"[action.microbatch % 10]


def simulate(report: PlanReport, costs: Costs | None = None) -> Simulation:
    """Time a validated plan.

    Args:
        report: What `pp_schedules.validate` returned for the plan.
        costs: Cost of a forward, a backward and a transfer.

    Returns:
        The timeline, makespan, bubble fraction and peak activations of each rank.
    """
    costs = costs or Costs()
    steps = report.steps
    pp_size = len(steps)
    clock = [0.0] * pp_size
    cursor = [0] * pp_size
    # When each send of each link was posted, in posting order.
    posted: dict[tuple[int, int, str], list[float]] = defaultdict(list)
    taken: dict[tuple[int, int, str], int] = defaultdict(int)
    sends_posted = [-1] * pp_size  # the exchange whose sends each rank has posted
    spans: list[list[Span]] = [[] for _ in range(pp_size)]
    busy = [0.0] * pp_size
    progressed = True
    while progressed:
        progressed = False
        for rank in range(pp_size):
            while cursor[rank] < len(steps[rank]):
                step = steps[rank][cursor[rank]]
                if step.compute is not None:
                    cost = costs.forward if step.compute.kind == "F" else costs.backward
                    spans[rank].append(Span(rank, step.compute, clock[rank], clock[rank] + cost))
                    clock[rank] += cost
                    busy[rank] += cost
                else:
                    assert step.exchange is not None
                    if sends_posted[rank] != cursor[rank]:
                        # Sends go out as soon as the rank reaches the exchange.
                        for message in step.exchange.messages:
                            if message.is_send:
                                posted[(rank, message.peer, message.channel)].append(clock[rank])
                        sends_posted[rank] = cursor[rank]
                    receives = [m for m in step.exchange.messages if not m.is_send]
                    if receives:
                        (message,) = receives  # lowering puts at most one receive per exchange
                        link = (message.peer, rank, message.channel)
                        if taken[link] >= len(posted[link]):
                            break  # its send is not posted yet
                        clock[rank] = max(clock[rank], posted[link][taken[link]] + costs.transfer)
                        taken[link] += 1
                cursor[rank] += 1
                progressed = True
    assert all(cursor[rank] == len(steps[rank]) for rank in range(pp_size)), "validate() first"
    makespan = max(clock) if clock else 0.0
    bubbles = [1.0 - busy[rank] / makespan if makespan else 0.0 for rank in range(pp_size)]
    return Simulation(
        spans=spans,
        makespan=makespan,
        bubble_fraction=bubbles,
        peak_activations=list(report.peak_in_flight),
    )


def ideal_makespan(
    num_microbatches: int, vp_size: int, costs: Costs, *, forward_only: bool = False
) -> float:
    """The busy time of one rank: a lower bound on any schedule's makespan."""
    per_chunk = costs.forward + (0.0 if forward_only else costs.backward)
    return num_microbatches * vp_size * per_chunk


def bubble_formula(pp_size: int, num_microbatches: int, vp_size: int = 1) -> float:
    """The textbook bubble share of 1F1B with backward = 2 x forward: (p-1) / (v*m + p-1)."""
    return (pp_size - 1) / (vp_size * num_microbatches + pp_size - 1)
