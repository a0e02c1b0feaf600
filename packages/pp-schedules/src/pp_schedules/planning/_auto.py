"""Choosing a schedule by simulation: the shortest one that fits in memory.

`choose_schedule` plans every schedule that can run the configuration (the model's chunks per
rank fix which), simulates each with the given costs, and picks the smallest makespan among
those whose peak memory stays under the limit. Costs may be given, or measured:
record one step's timeline (`PipelineExecutor.record_timeline`) and pass
`measured_costs(gather_timeline(executor))`.

Memory is counted in bytes when a `MemoryModel` is given (`memory_limit_bytes`: the most any
rank may hold), else in stage-sized units (`memory_limit`): one unit holds one microbatch's
activations of one rank's share of the model, so a chunk of a rank with two chunks counts one
half.

`choose_fitting` goes further: given several ways to build the model (`PlanOption`: chunks per
rank, layer layout, recomputation, each with its costs and bytes), it simulates every schedule
of every option and takes the shortest that fits the byte budget on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pp_schedules.planning._memory import MemoryModel, format_bytes, format_bytes_apart
from pp_schedules.planning._plan_cache import PlanCache
from pp_schedules.planning._planning_cost import DEFAULT_MAX_PLAN_STEPS, collection_paused
from pp_schedules.planning._plans import Plan
from pp_schedules.planning._registry import schedules_for
from pp_schedules.planning._simulation import Costs, Simulation, StageCosts
from pp_schedules.planning._validation import PlanError

__all__ = [
    "Candidate",
    "Choice",
    "MemoryLimitError",
    "PlanOption",
    "candidates_for",
    "choose_fitting",
    "choose_schedule",
]


class MemoryLimitError(ValueError):
    """No candidate fits the byte budget; the message names the smallest peak and its rank.

    Attributes:
        static_too_large: The parameters, gradients and optimizer state alone are over the
            limit on the rank of the smallest peak (no recomputation or smaller microbatch
            helps there).
    """

    __module__ = "pp_schedules"  # where users import it from, as tracebacks name it

    def __init__(self, message: str, *, static_too_large: bool = False) -> None:
        super().__init__(message)
        self.static_too_large = static_too_large


@dataclasses.dataclass(frozen=True)
class PlanOption:
    """One way to build the model, for `choose_fitting`.

    Attributes:
        label: Says what it is, e.g. ``"vp 2, even, recompute full"``.
        vp_size: Model chunks per rank.
        costs: Step costs (per virtual stage for uneven layouts).
        memory: Bytes per virtual stage, dtypes and optimizer.
        placement: Consider only schedules on this placement (a layout built for it).
    """

    label: str
    vp_size: int
    costs: Costs | StageCosts
    memory: MemoryModel
    placement: str | None = None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One schedule considered.

    Attributes:
        name: The schedule (`pp_schedules.plan`'s name).
        placement: Its placement's name ("looped" or "v").
        makespan: Simulated step time (the costs' unit); None if it cannot run.
        bubble: Mean share of the step a rank idles.
        peak_memory: Most activations a rank holds, in stage-sized units.
        note: Why it cannot run or does not fit; empty if it can.
        plan: The plan, when it can run.
        option: The `PlanOption` label it was simulated with; empty for `choose_schedule`.
        peak_bytes: Each rank's peak bytes, with a memory model; empty without.
    """

    name: str
    placement: str
    makespan: float | None = None
    bubble: float = 0.0
    peak_memory: float = 0.0
    note: str = ""
    plan: Plan | None = dataclasses.field(default=None, repr=False, compare=False)
    option: str = ""
    peak_bytes: tuple[int, ...] = ()

    @property
    def fits(self) -> bool:
        """It can run and stays within the limit."""
        return self.makespan is not None and not self.note


@dataclasses.dataclass(frozen=True)
class Choice:
    """The chosen schedule and every candidate."""

    chosen: Candidate
    candidates: list[Candidate]
    costs: Costs | None = None
    """The costs simulated with, when the same on every stage."""
    stage_costs: StageCosts | None = None
    """The costs simulated with, when given per virtual stage."""
    option: PlanOption | None = None
    """The chosen option (`choose_fitting`)."""
    memory_limit_bytes: float | None = None
    """The byte limit the candidates were held to, if any."""

    @property
    def plan(self) -> Plan:
        """The chosen plan."""
        assert self.chosen.plan is not None
        return self.chosen.plan

    def table(self) -> str:
        """The candidates as a small table, the choice marked with '*'.

        With bytes: the option, each rank's peak and whether it fits (or why not), every peak
        in one unit and to one number of digits, enough to keep each apart from the limit.
        """
        with_bytes = any(c.peak_bytes for c in self.candidates)
        option = max((len(c.option) for c in self.candidates), default=0)
        head = f"  {'schedule':<18} {'placement':<9} " + (
            f"{'option':<{option}} " if option else ""
        )
        head += f"{'makespan':>9} {'bubble':>7} " + ("peak per rank" if with_bytes else "memory")
        lines = [head.rstrip()]
        peaks = iter(self._bytes([b for c in self.candidates for b in c.peak_bytes]))
        for c in self.candidates:
            mark = "*" if c is self.chosen else " "
            row = f"{mark} {c.name:<18} {c.placement:<9} " + (
                f"{c.option:<{option}} " if option else ""
            )
            if c.makespan is None:
                lines.append(f"{row}{'-':>9} {'-':>7} {'-':>7}  {c.note}")
                continue
            memory = (
                ", ".join(next(peaks) for _ in c.peak_bytes)
                if with_bytes
                else f"{c.peak_memory:>6.1f}"
            )
            fits = ("fits" if not c.note else c.note) if with_bytes else c.note
            lines.append(f"{row}{c.makespan:>9.1f} {c.bubble:>7.1%} {memory}  {fits}".rstrip())
        return "\n".join(lines)

    def _bytes(self, peaks: Sequence[int]) -> list[str]:
        """Peaks as the table writes them: apart from the limit, or as `format_bytes`."""
        if self.memory_limit_bytes is None:
            return [format_bytes(b) for b in peaks]
        return format_bytes_apart(peaks, self.memory_limit_bytes)[1]


def candidates_for(vp_size: int) -> list[tuple[str, str]]:
    """The (schedule, placement) pairs that run a model with `vp_size` chunks per rank.

    The registry's `schedules_for`, under the name pp-train and earlier releases use.
    """
    return schedules_for(vp_size)


@dataclasses.dataclass(frozen=True)
class _Limits:
    """The memory limits a candidate is held to (none, stage units, bytes or both)."""

    units: float | None = None
    bytes: float | None = None

    def note(self, units: float, simulation: Simulation) -> str:
        """Why a simulated candidate does not fit; empty when it does."""
        if self.units is not None and units > self.units:
            return f"over the memory limit {self.units:g}"
        peaks = simulation.peak_memory
        if self.bytes is not None and peaks and max(peaks) > self.bytes:
            rank = peaks.index(max(peaks))
            limit, (need,) = format_bytes_apart([peaks[rank]], self.bytes)
            return f"over {limit}: rank {rank} needs {need}"
        return ""


@dataclasses.dataclass(frozen=True)
class _Lowering:
    """How the run posts its exchanges, and what the candidates share.

    The simulated plan is the one that runs; `cache` holds the plans, validations and
    timelines made for the candidates.
    """

    prefetch: int
    transport: str
    cache: PlanCache


def _candidate(
    spec: tuple[str, str, int],
    sizes: tuple[int, int],
    costs: Costs | StageCosts,
    limits: _Limits,
    option: PlanOption | None = None,
    *,
    lowering: _Lowering,
) -> Candidate:
    name, placement, vp_size = spec
    pp_size, num_microbatches = sizes
    label = "" if option is None else option.label
    try:
        chosen = lowering.cache.plan(
            name, pp_size=pp_size, num_microbatches=num_microbatches, vp_size=vp_size,
            placement=placement,
        )  # fmt: skip
    except ValueError as error:
        return Candidate(name, placement, note=f"cannot run: {error}", option=label)
    try:
        report = lowering.cache.report(
            chosen, prefetch=lowering.prefetch, transport=lowering.transport
        )
    except PlanError as error:
        reason = str(error).splitlines()[0]
        return Candidate(name, placement, note=f"cannot run on {lowering.transport}: {reason}",
                         option=label)  # fmt: skip
    simulation = lowering.cache.simulate(report, costs, None if option is None else option.memory)
    units = max(report.peak_in_flight) / vp_size
    return Candidate(
        name,
        placement,
        makespan=simulation.makespan,
        bubble=sum(simulation.bubble_fraction) / len(simulation.bubble_fraction),
        peak_memory=units,
        note=limits.note(units, simulation),
        plan=chosen,
        option=label,
        peak_bytes=tuple(simulation.peak_memory),
    )


@collection_paused
def choose_schedule(
    *,
    pp_size: int,
    num_microbatches: int,
    vp_size: int = 1,
    costs: Costs | StageCosts | None = None,
    memory_limit: float | None = None,
    placement: str | None = None,
    names: Sequence[str] | None = None,
    memory: MemoryModel | None = None,
    memory_limit_bytes: float | None = None,
    prefetch: int = 0,
    transport: str = "gloo",
    cache: PlanCache | None = None,
) -> Choice:
    """The schedule with the smallest simulated makespan that fits the memory limits.

    Args:
        pp_size: Pipeline ranks.
        num_microbatches: Microbatches per step.
        vp_size: Model chunks per rank (which schedules apply depends on it).
        costs: Per chunk step; F:B = 1:2 with I = W = B / 2 by default. Measured costs come
            from `measured_costs` of a recorded step. `StageCosts` (one per virtual stage,
            e.g. of an uneven layout) time each step with its stage's cost.
        memory_limit: Most activations a rank may hold, in stage-sized units (1F1B's
            first rank holds `pp_size`); no limit by default.
        placement: Consider only schedules on this placement (the model is built for it).
        names: Consider only these schedules.
        memory: The model's bytes per virtual stage: every candidate's peak bytes per rank
            are simulated (and drawn by `Choice.table`).
        memory_limit_bytes: Most bytes any rank may hold (needs `memory`).
        prefetch: Receives are posted this many exchanges early, as the run posts them
            (`resolve_schedule`'s default is 1 on gloo): the simulated step, its peak bytes
            included, is the one that runs.
        transport: Whose rules the plans run under (a plan NCCL's rules refuse cannot run).
        cache: Plans, validations and timelines to reuse, with the planning budget.

    Returns:
        The choice and every candidate (`Choice.table` draws them).

    Raises:
        ValueError: No schedule runs the configuration within the memory limit; the message
            lists each candidate's memory and why it was left out. Stage costs for another
            number of virtual stages than ``pp_size * vp_size``; a byte limit without a
            memory model.
        MemoryLimitError: Schedules run, but none within `memory_limit_bytes`.
    """
    unit = costs or Costs(forward=1.0, backward=2.0)
    _check_choice(unit, (pp_size, vp_size), memory, memory_limit_bytes)
    option = None if memory is None else PlanOption("", vp_size, unit, memory, placement)
    limits = _Limits(memory_limit, memory_limit_bytes)
    lowering = _Lowering(prefetch, transport, cache or PlanCache())
    sizes = (pp_size, num_microbatches)
    considered = [
        _candidate((name, where, vp_size), sizes, unit, limits, option, lowering=lowering)
        for name, where in candidates_for(vp_size)
        if (placement is None or where == placement) and (names is None or name in names)
    ]
    best = _best(considered, limits, f"{pp_size} ranks x {vp_size} chunks", num_microbatches)
    return _choice(best, considered, unit, option, memory_limit_bytes)


def _check_choice(
    costs: Costs | StageCosts,
    sizes: tuple[int, int],
    memory: MemoryModel | None,
    memory_limit_bytes: float | None,
) -> None:
    """Refuse stage costs for another number of stages, or a byte limit without bytes.

    Raises:
        ValueError: Naming both counts, or the missing memory model.
    """
    pp_size, vp_size = sizes
    if isinstance(costs, StageCosts) and costs.num_stages != pp_size * vp_size:
        raise ValueError(
            f"stage costs cover {costs.num_stages} virtual stages, but {pp_size} ranks x "
            f"{vp_size} chunks make {pp_size * vp_size}"
        )
    if memory_limit_bytes is not None and memory is None:
        raise ValueError("memory_limit_bytes needs a memory model (memory=MemoryModel(...))")


@collection_paused
def choose_fitting(
    options: Sequence[PlanOption],
    *,
    pp_size: int,
    num_microbatches: int,
    memory_limit_bytes: float | None,
    names: Sequence[str] | None = None,
    prefetch: int = 0,
    transport: str = "gloo",
    max_plan_steps: int | None = DEFAULT_MAX_PLAN_STEPS,
) -> Choice:
    """The shortest simulated (option, schedule) whose peak bytes fit on every rank.

    Every schedule that runs each option's chunks per rank is simulated with the option's
    costs and memory model. Options share the work that does not depend on them: each
    schedule is planned and validated once per chunks per rank, its timeline simulated
    once per cost set, and only the bytes are followed per option.

    Args:
        options: The ways to build the model (chunks per rank, layout, recomputation).
        pp_size: Pipeline ranks.
        num_microbatches: Microbatches per step.
        memory_limit_bytes: Most bytes any rank may hold; None: the shortest wins.
        names: Consider only these schedules.
        prefetch: Receives are posted this many exchanges early, as the run posts them (see
            `choose_schedule`).
        transport: Whose rules the plans run under.
        max_plan_steps: Refuse candidates of more compute steps before planning them
            (`check_plan_budget`); None: no limit.

    Returns:
        The choice (`Choice.option` is the chosen option) and every candidate.

    Raises:
        ValueError: No options, or none of them can run.
        MemoryLimitError: Nothing fits; the message names the smallest peak found, its rank
            and candidate, and what would make it fit.
    """
    if not options:
        raise ValueError("choose_fitting needs at least one PlanOption")
    limits = _Limits(bytes=memory_limit_bytes)
    considered: list[Candidate] = []
    by_label = {option.label: option for option in options}
    sizes = (pp_size, num_microbatches)
    lowering = _Lowering(prefetch, transport, PlanCache(max_plan_steps=max_plan_steps))
    for option in options:
        for name, where in candidates_for(option.vp_size):
            if (option.placement is None or where == option.placement) and (
                names is None or name in names
            ):
                spec = (name, where, option.vp_size)
                considered.append(
                    _candidate(spec, sizes, option.costs, limits, option, lowering=lowering)
                )
    best = _best(considered, limits, f"{pp_size} ranks", num_microbatches, by_label)
    chosen = by_label[best.option]
    return _choice(best, considered, chosen.costs, chosen, memory_limit_bytes)


def _choice(
    best: Candidate,
    considered: list[Candidate],
    costs: Costs | StageCosts,
    option: PlanOption | None,
    limit: float | None,
) -> Choice:
    """The `Choice`, its costs in the field their kind goes to."""
    if isinstance(costs, StageCosts):
        return Choice(best, considered, stage_costs=costs, option=option, memory_limit_bytes=limit)
    return Choice(best, considered, costs, option=option, memory_limit_bytes=limit)


def _best(
    considered: list[Candidate],
    limits: _Limits,
    what: str,
    num_microbatches: int,
    options: dict[str, PlanOption] | None = None,
) -> Candidate:
    """The fastest fitting candidate (the smaller peak breaks ties)."""
    fitting = [c for c in considered if c.fits]
    if fitting:
        return min(fitting, key=lambda c: (c.makespan, max(c.peak_bytes, default=0), c.peak_memory))
    runnable = [c for c in considered if c.makespan is not None]
    if runnable and limits.bytes is not None and limits.units is None:
        message, static_too_large = _nothing_fits(runnable, limits.bytes, options or {})
        raise MemoryLimitError(message, static_too_large=static_too_large)
    reasons = "; ".join(
        f"{c.name}: {c.note or 'fits'}"
        + (f" (holds {c.peak_memory:g})" if c.makespan is not None else "")
        for c in considered
    )
    limit = limits.units if limits.bytes is None else format_bytes(limits.bytes)
    raise ValueError(
        f"no schedule runs {what} with {num_microbatches} microbatches within memory "
        f"{limit}: {reasons or 'no candidates'}; raise the limit or use more microbatches"
    )


def _nothing_fits(
    runnable: list[Candidate], limit: float, options: dict[str, PlanOption]
) -> tuple[str, bool]:
    """The message naming the smallest peak, and whether the static bytes alone exceed `limit`.

    The message says where the smallest peak is and what would bring it under the limit.
    """
    least = min(runnable, key=lambda c: max(c.peak_bytes))
    peak = max(least.peak_bytes)
    rank = least.peak_bytes.index(peak)
    where = f"{least.name}" + (f" ({least.option})" if least.option else "")
    limit_text, (peak_text,) = format_bytes_apart([peak], limit)
    message = (
        f"no schedule fits the memory limit {limit_text}: the smallest peak is "
        f"{peak_text} on rank {rank}, with {where}"
    )
    option = options.get(least.option)
    if option is None:
        return message + "; " + _hint(None, peak - limit), False
    assert least.plan is not None
    static = option.memory.rank_static(least.plan.placement, rank).total
    return f"{message}; {_hint(static, peak - limit, limit)}", static >= limit


def _hint(static: int | None, over: float, limit: float = 0.0) -> str:
    """What would fit: fewer static bytes per rank, or fewer activation bytes."""
    if static is not None and static >= limit:
        return (
            f"parameters, gradients and optimizer state alone need {format_bytes(static)} "
            "there: use more pipeline stages (or shard the optimizer state)"
        )
    return (
        f"{format_bytes(over)} too much: recompute (more) activations, use a smaller "
        "microbatch, or more pipeline stages"
    )
