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
    exchange: float = 0.0
    """The fixed time a rank spends posting one exchange (the per-call work of the
    communication library and the executor), whatever it moves."""

    def __post_init__(self) -> None:
        """Costs are not negative, and compute takes time.

        Raises:
            ValueError: A negative cost, or a zero forward or backward.
        """
        if min(self.forward, self.backward) <= 0 or min(self.transfer, self.exchange) < 0:
            raise ValueError(
                "forward and backward costs must be positive and transfer and exchange at least "
                f"0, got forward={self.forward}, backward={self.backward}, "
                f"transfer={self.transfer}, exchange={self.exchange}"
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


_Link = tuple[int, int, str]


class _Simulator:
    """The clocks of every rank while the lowered plan is run with `costs`."""

    def __init__(self, report: PlanReport, costs: Costs) -> None:
        self.steps = report.steps
        self.costs = costs
        pp_size = len(self.steps)
        self.clock = [0.0] * pp_size
        self.cursor = [0] * pp_size
        # When each send of each link was posted, in posting order; how many were received.
        self.posted: dict[_Link, list[float]] = defaultdict(list)
        self.taken: dict[_Link, int] = defaultdict(int)
        self.sends_posted = [-1] * pp_size  # the exchange whose sends each rank has posted
        self.spans: list[list[Span]] = [[] for _ in range(pp_size)]
        self.busy = [0.0] * pp_size

    def run(self) -> None:
        """Advance every rank as far as it can, until none can."""
        progressed = True
        while progressed:
            progressed = False
            for rank in range(len(self.steps)):
                while self.cursor[rank] < len(self.steps[rank]) and self._advance(rank):
                    self.cursor[rank] += 1
                    progressed = True
        assert all(self.cursor[rank] == len(self.steps[rank]) for rank in range(len(self.steps))), (
            "validate() first"
        )

    def _advance(self, rank: int) -> bool:
        """Run the rank's current step; False if it waits for a send not posted yet."""
        step = self.steps[rank][self.cursor[rank]]
        if step.compute is not None:
            cost = self.costs.forward if step.compute.kind == "F" else self.costs.backward
            start = self.clock[rank]
            self.spans[rank].append(Span(rank, step.compute, start, start + cost))
            self.clock[rank] += cost
            self.busy[rank] += cost
            return True
        assert step.exchange is not None
        if self.sends_posted[rank] != self.cursor[rank]:
            # Sends go out as soon as the rank reaches the exchange.
            self.clock[rank] += self.costs.exchange
            for message in step.exchange.messages:
                if message.is_send:
                    self.posted[(rank, message.peer, message.link_channel)].append(self.clock[rank])
            self.sends_posted[rank] = self.cursor[rank]
        links = [(m.peer, rank, m.link_channel) for m in step.exchange.messages if not m.is_send]
        arrivals = _arrivals(links, self.posted, self.taken)
        if arrivals is None:
            return False
        self.clock[rank] = max([self.clock[rank], *(t + self.costs.transfer for t in arrivals)])
        for link in links:
            self.taken[link] += 1
        return True


def simulate(report: PlanReport, costs: Costs | None = None) -> Simulation:
    """Time a validated plan.

    Args:
        report: What `pp_schedules.validate` returned for the plan.
        costs: Cost of a forward, a backward, a transfer and an exchange's posting.

    Returns:
        The timeline, makespan, bubble fraction and peak activations of each rank.
    """
    simulator = _Simulator(report, costs or Costs())
    simulator.run()
    makespan = max(simulator.clock) if simulator.clock else 0.0
    bubbles = [1.0 - busy / makespan if makespan else 0.0 for busy in simulator.busy]
    return Simulation(
        spans=simulator.spans,
        makespan=makespan,
        bubble_fraction=bubbles,
        peak_activations=list(report.peak_in_flight),
    )


def _arrivals(
    links: list[_Link], posted: dict[_Link, list[float]], taken: dict[_Link, int]
) -> list[float] | None:
    """When the partner send of each receive was posted; None if one is not posted yet."""
    times = []
    seen: dict[_Link, int] = defaultdict(int)
    for link in links:
        index = taken[link] + seen[link]
        seen[link] += 1
        if index >= len(posted[link]):
            return None
        times.append(posted[link][index])
    return times


def ideal_makespan(
    num_microbatches: int, vp_size: int, costs: Costs, *, forward_only: bool = False
) -> float:
    """The busy time of one rank: a lower bound on any schedule's makespan."""
    per_chunk = costs.forward + (0.0 if forward_only else costs.backward)
    return num_microbatches * vp_size * per_chunk


def bubble_formula(pp_size: int, num_microbatches: int, vp_size: int = 1) -> float:
    """The textbook bubble share of 1F1B with backward = 2 x forward: (p-1) / (v*m + p-1)."""
    return (pp_size - 1) / (vp_size * num_microbatches + pp_size - 1)
