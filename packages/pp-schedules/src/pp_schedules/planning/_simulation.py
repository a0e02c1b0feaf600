"""Timing a plan before running it: makespan, bubbles, memory in bytes, and pictures.

The simulator runs the lowered plan under the executor's rules (see `validation`) with given
costs: a forward or backward step takes its cost and starts once the receives it uses have
arrived; a transfer starts when its send is posted and takes the transfer cost; an exchange
costs the rank its posting time. It is exact for the
executor's model, so measured step times of synthetic stages can be compared with it.

Given a `MemoryModel`, it also follows each rank's bytes: the static bytes (parameters,
gradients, optimizer state) plus, step by step, everything the executor holds: the
activations of every forward not yet released by its last backward step (``B``, or ``W``
after a split backward), outputs until their sends complete, received tensors, gradients
made and not yet sent, what an ``I`` keeps for its ``W``, each step's transient and the
transport's frames (see the memory walk); `Simulation.memory` holds one
`MemoryTrack` per rank.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Sequence

from pp_schedules.planning._actions import CATEGORIES, Action
from pp_schedules.planning._memory import MemoryModel, StaticBytes, format_bytes, stage_ends
from pp_schedules.planning._memory_walk import walk_rank
from pp_schedules.planning._planning_cost import collection_paused
from pp_schedules.planning._validation import Links, PlanReport, sends_delivered

__all__ = [
    "Costs",
    "MemoryTrack",
    "Simulation",
    "Span",
    "StageCosts",
    "bubble_formula",
    "fb_time",
    "ideal_makespan",
    "simulate",
    "with_memory",
]


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
    backward_input: float | None = None
    """The input-gradient half of a split backward (``I``); half of `backward` by default."""
    backward_weight: float | None = None
    """The weight-gradient half (``W``); half of `backward` by default."""
    overlap: float = 0.0
    """In an F&B step (DualPipeV), the share of the shorter half that runs hidden behind the
    longer one: 0 (the default) when nothing overlaps, the step taking both halves' sum; 1
    when it takes the longer half's time alone (`fb_time`)."""

    def __post_init__(self) -> None:
        """Costs are not negative, and compute takes time.

        Raises:
            ValueError: A negative cost, a zero forward, backward or backward half, or an
                overlap outside 0 .. 1.
        """
        halves = [h for h in (self.backward_input, self.backward_weight) if h is not None]
        if min(self.forward, self.backward, *halves) <= 0 or min(self.transfer, self.exchange) < 0:
            raise ValueError(
                "forward, backward and backward halves must be positive and transfer and "
                f"exchange at least 0, got forward={self.forward}, backward={self.backward}, "
                f"backward_input={self.backward_input}, backward_weight={self.backward_weight}, "
                f"transfer={self.transfer}, exchange={self.exchange}"
            )
        _check_overlap(self.overlap)

    def of(self, kind: str) -> float:
        """The cost of one compute step of `kind` ("F", "B", "I" or "W")."""
        if kind == "F":
            return self.forward
        if kind == "I":
            return self.backward / 2 if self.backward_input is None else self.backward_input
        if kind == "W":
            return self.backward / 2 if self.backward_weight is None else self.backward_weight
        return self.backward


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Compute time of each virtual stage, for pipelines whose stages differ.

    An uneven layout (the embedding on the first stage, the output layer and loss on the last,
    layer counts that do not divide) makes some stages slower than others; the simulator
    times each compute step with the cost of the virtual stage its (rank, chunk) holds, as
    the plan's `pp_state.Placement` says. Index ``s`` of each tuple is virtual stage ``s``.
    Build one with `from_layers` (per-layer costs and layer counts) or `from_stages`.
    """

    forward: tuple[float, ...]
    """One forward of one microbatch on each virtual stage."""
    backward: tuple[float, ...]
    """One backward of one microbatch on each virtual stage."""
    backward_input: tuple[float, ...] | None = None
    """The input-gradient half (``I``) on each stage; half of `backward` by default."""
    backward_weight: tuple[float, ...] | None = None
    """The weight-gradient half (``W``) on each stage; half of `backward` by default."""
    transfer: float = 0.0
    """One transfer between neighbouring stages, from posting the send to arrival."""
    exchange: float = 0.0
    """The fixed time a rank spends posting one exchange."""
    overlap: float = 0.0
    """In an F&B step, the share of the shorter half hidden behind the longer (`Costs`)."""

    def __post_init__(self) -> None:
        """One cost per stage in every tuple, none negative, an overlap from 0 to 1.

        Raises:
            ValueError: No stages, tuples of different lengths, or a negative cost.
        """
        columns = [self.forward, self.backward, self.backward_input, self.backward_weight]
        lengths = {len(column) for column in columns if column is not None}
        if not self.forward or len(lengths) != 1:
            raise ValueError(
                "stage costs need one forward, backward (and backward half, if given) per "
                f"virtual stage, got lengths {[None if c is None else len(c) for c in columns]}"
            )
        values = [v for column in columns if column is not None for v in column]
        if min(values) < 0 or min(self.transfer, self.exchange) < 0:
            raise ValueError(
                f"stage costs must not be negative, got forward={self.forward}, "
                f"backward={self.backward}, backward_input={self.backward_input}, "
                f"backward_weight={self.backward_weight}, transfer={self.transfer}, "
                f"exchange={self.exchange}"
            )
        _check_overlap(self.overlap)

    @property
    def num_stages(self) -> int:
        """Virtual stages costed."""
        return len(self.forward)

    def of(self, kind: str, stage: int) -> float:
        """The cost of one compute step of `kind` ("F", "B", "I" or "W") on virtual `stage`."""
        if kind == "F":
            return self.forward[stage]
        if kind == "I":
            halves = self.backward_input
        elif kind == "W":
            halves = self.backward_weight
        else:
            return self.backward[stage]
        return self.backward[stage] / 2 if halves is None else halves[stage]

    @classmethod
    def from_stages(cls, stages: Sequence[Costs]) -> StageCosts:
        """One `Costs` per virtual stage; all must agree on transfer and exchange.

        Raises:
            ValueError: No stages, or stages with different transfer or exchange costs.
        """
        links = {(c.transfer, c.exchange) for c in stages}
        if len(links) > 1:
            raise ValueError(
                "every stage's costs must have the same transfer and exchange, got "
                f"(transfer, exchange) {sorted(links)}"
            )
        overlaps = {c.overlap for c in stages}
        if len(overlaps) > 1:
            raise ValueError(
                f"every stage's costs must have the same F&B overlap, got {sorted(overlaps)}"
            )
        transfer, exchange = links.pop() if links else (0.0, 0.0)
        overlap = overlaps.pop() if overlaps else 0.0
        forward, backward, backward_input, backward_weight = (
            tuple(c.of(kind) for c in stages) for kind in "FBIW"
        )
        return cls(
            forward=forward,
            backward=backward,
            backward_input=backward_input,
            backward_weight=backward_weight,
            transfer=transfer,
            exchange=exchange,
            overlap=overlap,
        )

    @classmethod
    def from_layers(
        cls,
        counts: Sequence[int],
        *,
        layer: Costs,
        embedding: Costs | None = None,
        loss: Costs | None = None,
    ) -> StageCosts:
        """The costs of a layout: `counts[s]` transformer layers on virtual stage ``s``.

        Stage 0 also runs the embedding and the last stage the output layer and loss (see
        `pp_state`'s layer layouts); each step's cost is the sum of what the stage holds.
        Transfer and exchange costs are the layer's.

        Args:
            counts: Transformer layers of each virtual stage, in pipeline order.
            layer: One transformer layer's costs.
            embedding: The embedding's costs; none by default.
            loss: The output layer's and loss's costs; none by default.

        Raises:
            ValueError: No stages, or a negative count.
        """
        extras = stage_ends(counts, embedding, loss)
        forward, backward, backward_input, backward_weight = (
            tuple(
                n * layer.of(kind) + sum(part.of(kind) for part in extra)
                for n, extra in zip(counts, extras, strict=True)
            )
            for kind in "FBIW"
        )
        return cls(
            forward=forward,
            backward=backward,
            backward_input=backward_input,
            backward_weight=backward_weight,
            transfer=layer.transfer,
            exchange=layer.exchange,
            overlap=layer.overlap,
        )


def _check_overlap(overlap: float) -> None:
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(
            f"overlap is the share of an F&B step's shorter half hidden behind the longer, "
            f"from 0 (none) to 1 (all), got {overlap}"
        )


def fb_time(forward: float, backward: float, overlap: float) -> float:
    """An F&B step's time: both halves, less the share `overlap` of the shorter one.

    0 gives ``forward + backward`` (the halves one after the other), 1 ``max(forward,
    backward)`` (the shorter wholly hidden behind the longer).
    """
    return forward + backward - overlap * min(forward, backward)


@dataclasses.dataclass(frozen=True)
class Span:
    """One compute step in time."""

    rank: int
    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class MemoryTrack:
    """One rank's bytes over a simulated step.

    Attributes:
        static: Parameters, gradients and optimizer state.
        after: Live bytes right after each compute step, in the order of the rank's spans:
            what `MemoryProbe` samples after the same steps (``MemorySample.live_bytes``).
            The probe samples both halves of an F&B step once the step is done, and so do
            these figures.
        during: The most live bytes from the end of the compute step before (or the start)
            to the end of each step, its transient and the exchanges before it included:
            what the probe's ``peak_live_bytes`` measures over the same interval (an F&B
            step's peak on its forward's entry).
        peak: The most bytes the rank holds at any time.
        peak_step: The index (into the rank's spans) of the step where the peak occurs; None
            when the rank runs no step.
        peak_time: When the peak occurs (the end of that step; 0 without steps).
        peak_activations: The most bytes held at once above the static bytes: activations,
            gradients, tensors in transit and transfer frames.
        transfer_bytes: Transfer frames held when the step starts (kept for reuse from the
            step before).
    """

    static: StaticBytes
    after: tuple[int, ...]
    during: tuple[int, ...]
    peak: int
    peak_step: int | None
    peak_time: float
    peak_activations: int
    transfer_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The simulated timeline of a plan.

    Attributes:
        spans: Every compute step with its start and end, per rank in execution order.
        makespan: When the last rank finishes.
        bubble_fraction: For each rank, the share of the makespan it spends not computing.
        peak_activations: For each rank, the most forwards held awaiting their backward.
        memory: For each rank, its bytes over the step; None without a `MemoryModel`.
    """

    spans: list[list[Span]]
    makespan: float
    bubble_fraction: list[float]
    peak_activations: list[int]
    memory: list[MemoryTrack] | None = None

    @property
    def peak_memory(self) -> list[int]:
        """The peak bytes of each rank (empty without a memory model)."""
        return [track.peak for track in self.memory or []]

    def timeline(self, width: int = 100, *, memory: bool = False) -> str:
        """An ASCII timeline, one row per rank.

        A forward shows as its microbatch's digit, a backward (or its input half I) as a letter
        (a for microbatch 0, b for 1, ...), a weight-gradient step W as a capital letter, idle
        time as dots. With `memory` (and a memory model), each rank's row is followed by its
        live bytes drawn from low to high as `` .:-=+*#%@`` (one scale for every rank, from
        the smallest static bytes to the largest peak) and its peak.
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
            if memory and self.memory is not None:
                rows.append(self._memory_row(rank, width, scale))
        return "\n".join(rows)

    def _memory_row(self, rank: int, width: int, scale: float) -> str:
        """Rank `rank`'s bytes over time as one row of the timeline."""
        assert self.memory is not None
        low = min(track.static.total for track in self.memory)
        span_of_scale = max(max(self.peak_memory) - low, 1)
        track = self.memory[rank]
        level = [track.static.total + track.transfer_bytes] * width
        for span, after in zip(self.spans[rank], track.after, strict=True):
            for cell in range(min(int(span.end * scale), width), width):
                level[cell] = after
        ramp = " .:-=+*#%@"
        line = "".join(ramp[min(9, int((v - low) / span_of_scale * 9.999))] for v in level)
        return f"  mem  |{line}| peak {format_bytes(track.peak)}"

    def chrome_trace(self, time_unit_us: float = 1000.0) -> str:
        """The timeline as Chrome-trace JSON (open it in Perfetto or chrome://tracing)."""
        events: list[dict[str, object]] = [
            {
                "name": str(span.action),
                "cat": CATEGORIES[span.action.kind],
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
        events += self.memory_counters(pid=0, time_unit_us=time_unit_us)
        return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})

    def memory_counters(
        self, *, pid: int, time_unit_us: float = 1000.0, series: str = "predicted"
    ) -> list[dict[str, object]]:
        """Chrome-trace counter events of each rank's bytes (MB), one track per rank.

        Each track is named ``memory rank R (MB)`` and holds one series, `series`: the bytes
        held at time 0 (static and kept transfer frames), then the live bytes at the end of
        every compute step. Empty without
        a memory model.
        """
        events: list[dict[str, object]] = []
        for rank, track in enumerate(self.memory or []):
            name = f"memory rank {rank} (MB)"
            points = [(0.0, track.static.total + track.transfer_bytes)] + [
                (span.end, after) for span, after in zip(self.spans[rank], track.after, strict=True)
            ]
            events += [
                {
                    "name": name,
                    "ph": "C",
                    "pid": pid,
                    "ts": at * time_unit_us,
                    "args": {series: round(value / 2**20, 3)},
                }
                for at, value in points
            ]
        return events


def _mark(action: Action) -> str:
    if action.kind == "F":
        return str(action.microbatch % 10)
    if action.kind == "W":
        return "ABCDEFGHIJ"[action.microbatch % 10]
    return "abcdefghij"[action.microbatch % 10]


_Link = tuple[int, int, str]


class _Simulator:
    """The clocks of every rank while the lowered plan is run with `costs`."""

    def __init__(self, report: PlanReport, costs: Costs | StageCosts) -> None:
        self.steps = report.steps
        self.links = Links(report.steps)
        self.costs = costs
        self.placement = report.placement
        pp_size = len(self.steps)
        self.clock = [0.0] * pp_size
        self.cursor = [0] * pp_size
        # When each send of each link was posted, in posting order.
        self.posted: dict[_Link, list[float]] = defaultdict(list)
        self.spans: list[list[Span]] = [[] for _ in range(pp_size)]
        self.busy = [0.0] * pp_size
        self.timed: set[tuple[int, int]] = set()  # second halves of F&B steps already timed

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

    def _arrivals(self, rank: int, index: int) -> list[float] | None:
        """When each receive compute step `index` uses arrives; None if one is not sent yet."""
        times = []
        for at, number in self.links.consumer.get((rank, index), ()):
            message = self.steps[rank][at].exchange.messages[number]  # type: ignore[union-attr]
            sent = self.posted[(message.peer, rank, message.link_channel)]
            k = self.links.position[(rank, at, number)]
            if k >= len(sent):
                return None
            times.append(sent[k] + self.costs.transfer)
        return times

    def _advance(self, rank: int) -> bool:
        """Run the rank's current step; False if it waits for a send not posted yet."""
        index = self.cursor[rank]
        step = self.steps[rank][index]
        if step.exchange is not None:
            # Sends go out as soon as the rank reaches the exchange; receives are only posted.
            self.clock[rank] += self.costs.exchange
            for message in step.exchange.messages:
                if message.is_send:
                    link = (rank, message.peer, message.link_channel)
                    self.posted[link].append(self.clock[rank])
            return True
        assert step.compute is not None
        if (rank, index) in self.timed:
            return True
        steps = self.steps[rank]
        if index + 1 < len(steps) and steps[index + 1].overlap:
            return self._advance_pair(rank, index)
        arrivals = self._arrivals(rank, index)
        if arrivals is None:
            return False
        start = max([self.clock[rank], *arrivals])
        cost = self._cost(rank, step.compute)
        self.spans[rank].append(Span(rank, step.compute, start, start + cost))
        self.clock[rank] = start + cost
        self.busy[rank] += cost
        return True

    def _advance_pair(self, rank: int, index: int) -> bool:
        """Run an F&B step: both halves start together and end after `fb_time`.

        The forward's span starts with the step and the backward's ends with it, so where
        they overlap in time the halves ran together.
        """
        first, second = self._arrivals(rank, index), self._arrivals(rank, index + 1)
        if first is None or second is None:
            return False
        forward, backward = (self.steps[rank][i].compute for i in (index, index + 1))
        assert forward is not None
        assert backward is not None
        start = max([self.clock[rank], *first, *second])
        f, b = self._cost(rank, forward), self._cost(rank, backward)
        end = start + fb_time(f, b, self.costs.overlap)
        self.spans[rank] += [
            Span(rank, forward, start, start + f),
            Span(rank, backward, end - b, end),
        ]
        self.clock[rank] = end
        self.busy[rank] += end - start
        self.timed.add((rank, index + 1))
        return True

    def _cost(self, rank: int, action: Action) -> float:
        """The time `action` takes on `rank`: its virtual stage's cost with stage costs."""
        if isinstance(self.costs, Costs):
            return self.costs.of(action.kind)
        assert self.placement is not None
        return self.costs.of(action.kind, self.placement.stage(rank, action.chunk))


def _memory_tracks(
    report: PlanReport, model: MemoryModel, spans: list[list[Span]]
) -> list[MemoryTrack]:
    """Each rank's `MemoryTrack`: its static bytes and its steps' bytes (`walk_rank`)."""
    placement = report.placement
    assert placement is not None
    model.check_placement(placement)
    delivered = sends_delivered(report.steps)
    tracks = []
    for rank, steps in enumerate(report.steps):
        static = model.rank_static(placement, rank)
        walked = walk_rank(model, placement, rank, steps, delivered[rank])
        base = static.total
        during = [base + value for value in walked.during]
        peak = max([base + walked.start, *during, base + walked.closing])
        at = next((i for i, v in enumerate(during) if v == peak), None)
        if at is None and during:
            at = len(during) - 1  # in the exchanges after the last compute step
        tracks.append(
            MemoryTrack(
                static=static,
                after=tuple(base + value for value in walked.after),
                during=tuple(during),
                peak=peak,
                peak_step=at,
                peak_time=0.0 if at is None else spans[rank][at].end,
                peak_activations=peak - base,
                transfer_bytes=walked.start,
            )
        )
    return tracks


@collection_paused
def simulate(
    report: PlanReport,
    costs: Costs | StageCosts | None = None,
    *,
    memory: MemoryModel | None = None,
) -> Simulation:
    """Time a validated plan, and follow every rank's bytes when given a memory model.

    Args:
        report: What `pp_schedules.validate` returned for the plan.
        costs: Cost of a forward, a backward, a transfer and an exchange's posting: the same
            on every stage (`Costs`), or per virtual stage (`StageCosts`, looked up through
            the plan's placement).
        memory: The model's bytes per virtual stage (looked up through the plan's
            placement); `Simulation.memory` then holds each rank's track and peak.

    Returns:
        The timeline, makespan, bubble fraction and peak activations of each rank, and its
        memory track with a memory model.

    Raises:
        ValueError: Stage costs or a memory model for another number of virtual stages than
            the plan's, or for a report that carries no placement; a memory model for a
            forward-only plan.
    """
    if isinstance(costs, StageCosts):
        _check_stages(report, costs.num_stages, "stage costs", "cover")
    if memory is not None:
        _check_memory(report, memory)
    simulator = _Simulator(report, costs or Costs())
    simulator.run()
    makespan = max(simulator.clock) if simulator.clock else 0.0
    bubbles = [1.0 - busy / makespan if makespan else 0.0 for busy in simulator.busy]
    timed = Simulation(
        spans=simulator.spans,
        makespan=makespan,
        bubble_fraction=bubbles,
        peak_activations=list(report.peak_in_flight),
    )
    return timed if memory is None else with_memory(timed, report, memory)


def with_memory(timed: Simulation, report: PlanReport, memory: MemoryModel) -> Simulation:
    """`timed` (a simulation of `report`) with every rank's bytes under `memory` added.

    The bytes depend on the order of the steps, not on their times, so one timeline serves
    every memory model (`PlanCache` simulates once per cost set).

    Raises:
        ValueError: As `simulate` with this memory model.
    """
    _check_memory(report, memory)
    tracks = _memory_tracks(report, memory, timed.spans)
    return dataclasses.replace(timed, memory=tracks)


def _check_memory(report: PlanReport, memory: MemoryModel) -> None:
    _check_stages(report, memory.num_stages, "the memory model", "covers")
    if report.forward_only:
        raise ValueError(
            "a memory model follows a training step's bytes, and this plan is forward "
            "only (evaluation keeps no activations for backward); simulate it without "
            "memory=, or simulate the training plan"
        )


def _check_stages(report: PlanReport, num_stages: int, what: str, verb: str) -> None:
    if report.placement is None:
        raise ValueError(
            f"{what} {verb} virtual stages, found through the plan's placement, but the "
            "report has none: simulate the report `validate` returned"
        )
    if report.placement.num_stages != num_stages:
        raise ValueError(
            f"{what} {verb} {num_stages} virtual stages, but the plan has "
            f"{report.placement.num_stages} ({report.placement.pp_size} ranks x "
            f"{report.placement.vp_size} chunks)"
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
