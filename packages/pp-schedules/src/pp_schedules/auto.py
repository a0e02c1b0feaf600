"""Choosing a schedule by simulation: the shortest one that fits in memory.

`choose_schedule` plans every schedule that can run the configuration (the model's chunks per
rank fix which), simulates each with the given costs, and picks the smallest makespan among
those whose peak activation memory stays under the limit. Costs may be given, or measured:
record one step's timeline (`PipelineExecutor.record_timeline`) and pass
`measured_costs(gather_timeline(executor))`.

Memory is counted in stage-sized units: one unit holds one microbatch's activations of one
rank's share of the model, so a chunk of a rank with two chunks counts one half.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pp_schedules.plans import Plan
from pp_schedules.registry import schedule_spec, schedules_for
from pp_schedules.simulation import Costs, StageCosts, simulate
from pp_schedules.validation import validate

__all__ = ["Candidate", "Choice", "candidates_for", "choose_schedule"]


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
    """

    name: str
    placement: str
    makespan: float | None = None
    bubble: float = 0.0
    peak_memory: float = 0.0
    note: str = ""
    plan: Plan | None = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The chosen schedule and every candidate."""

    chosen: Candidate
    candidates: list[Candidate]
    costs: Costs | None = None
    """The costs simulated with, when the same on every stage."""
    stage_costs: StageCosts | None = None
    """The costs simulated with, when given per virtual stage."""

    @property
    def plan(self) -> Plan:
        """The chosen plan."""
        assert self.chosen.plan is not None
        return self.chosen.plan

    def table(self) -> str:
        """The candidates as a small table, the choice marked with '*'."""
        lines = [f"  {'schedule':<18} {'placement':<9} {'makespan':>9} {'bubble':>7} {'memory':>7}"]
        for c in self.candidates:
            mark = "*" if c is self.chosen else " "
            if c.makespan is None:
                lines.append(
                    f"{mark} {c.name:<18} {c.placement:<9} {'-':>9} {'-':>7} {'-':>7}  {c.note}"
                )
                continue
            lines.append(
                f"{mark} {c.name:<18} {c.placement:<9} {c.makespan:>9.1f} {c.bubble:>7.1%} "
                f"{c.peak_memory:>7.1f}  {c.note}".rstrip()
            )
        return "\n".join(lines)


def candidates_for(vp_size: int) -> list[tuple[str, str]]:
    """The (schedule, placement) pairs that run a model with `vp_size` chunks per rank.

    The registry's `schedules_for`, under the name pp-train and earlier releases use.
    """
    return schedules_for(vp_size)


def _candidate(
    name: str,
    placement: str,
    sizes: tuple[int, int, int],
    costs: Costs | StageCosts,
    limit: float | None,
) -> Candidate:
    pp_size, num_microbatches, vp_size = sizes
    try:
        chosen = schedule_spec(name).plan(
            pp_size=pp_size,
            num_microbatches=num_microbatches,
            vp_size=vp_size,
            placement=placement,
        )
    except ValueError as error:
        return Candidate(name, placement, note=f"cannot run: {error}")
    report = validate(chosen)
    simulation = simulate(report, costs)
    memory = max(report.peak_in_flight) / vp_size
    over = limit is not None and memory > limit
    return Candidate(
        name,
        placement,
        makespan=simulation.makespan,
        bubble=sum(simulation.bubble_fraction) / len(simulation.bubble_fraction),
        peak_memory=memory,
        note=f"over the memory limit {limit:g}" if over else "",
        plan=chosen,
    )


def choose_schedule(
    *,
    pp_size: int,
    num_microbatches: int,
    vp_size: int = 1,
    costs: Costs | StageCosts | None = None,
    memory_limit: float | None = None,
    placement: str | None = None,
    names: Sequence[str] | None = None,
) -> Choice:
    """The schedule with the smallest simulated makespan that fits `memory_limit`.

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

    Returns:
        The choice and every candidate (`Choice.table` draws them).

    Raises:
        ValueError: No schedule runs the configuration within the memory limit; the message
            lists each candidate's memory and why it was left out. Stage costs for another
            number of virtual stages than ``pp_size * vp_size``.
    """
    unit = costs or Costs(forward=1.0, backward=2.0)
    if isinstance(unit, StageCosts) and unit.num_stages != pp_size * vp_size:
        raise ValueError(
            f"stage costs cover {unit.num_stages} virtual stages, but {pp_size} ranks x "
            f"{vp_size} chunks make {pp_size * vp_size}"
        )
    sizes = (pp_size, num_microbatches, vp_size)
    considered = [
        _candidate(name, where, sizes, unit, memory_limit)
        for name, where in candidates_for(vp_size)
        if (placement is None or where == placement) and (names is None or name in names)
    ]
    fitting = [c for c in considered if c.makespan is not None and not c.note]
    if not fitting:
        reasons = "; ".join(
            f"{c.name}: {c.note or 'fits'}"
            + (f" (holds {c.peak_memory:g})" if c.makespan is not None else "")
            for c in considered
        )
        raise ValueError(
            f"no schedule runs {pp_size} ranks x {vp_size} chunks with {num_microbatches} "
            f"microbatches within memory {memory_limit}: {reasons or 'no candidates'}; raise "
            "the limit or use more microbatches"
        )
    best = min(fitting, key=lambda c: (c.makespan, c.peak_memory))
    if isinstance(unit, StageCosts):
        return Choice(best, considered, stage_costs=unit)
    return Choice(best, considered, unit)
