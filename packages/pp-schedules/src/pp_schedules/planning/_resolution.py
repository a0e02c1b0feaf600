"""Resolving a schedule once: name, placement, prefetch and every validated plan of a run.

`resolve_schedule` turns what a run asks for (a schedule name, "auto", a plan, or nothing)
into a `ResolvedSchedule`: the schedule's name and placement, the transport and receive
prefetch, and the validated plan of every microbatch count the run steps with (and their
forward-only plans). The executor takes it and plans nothing more; a configuration check
calls it before any process group starts, so every schedule error surfaces there.

What it costs: near-linear in the compute steps planned (``pp_size * vp_size * m`` times 2,
or 3 for the zero-bubble schedules, per count; forward-only plans a third of that). Each
plan is generated once (ZB-V's list scheduler in O(steps log pp), the others in O(steps)),
lowered and validated once per transport and prefetch (O(steps): the exchanges are run once,
and NCCL's rules replay the posted batches once), and for "auto" each candidate is planned,
validated under the transport's rules and simulated once (O(steps)) for the largest count,
through one `PlanCache`, so the chosen plan's validation is the resolution's. On one core,
any built-in schedule or "auto" resolves pp 32 with 256 microbatches in seconds and pp 64
with 512 in well under half a minute (docs/pp-schedules.md has the table). A plan over
`max_plan_steps` compute steps is refused, naming the sizes, before any planning.

Pure Python (no torch). `plan` (a plan by name, "auto" included) lives here, above both the
registry and `choose_schedule`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from pp_schedules.planning._actions import Action
from pp_schedules.planning._auto import Choice, choose_schedule
from pp_schedules.planning._nccl_rules import TRANSPORTS, check_transport
from pp_schedules.planning._plan_cache import PlanCache
from pp_schedules.planning._planning_cost import DEFAULT_MAX_PLAN_STEPS, collection_paused
from pp_schedules.planning._plans import Plan, as_plan
from pp_schedules.planning._registry import (
    SCHEDULE_REGISTRY,
    default_schedule,
    schedule_spec,
    schedules_for,
)
from pp_schedules.planning._simulation import Costs, StageCosts
from pp_schedules.planning._validation import PlanError, PlanReport
from pp_state.numbers import check_int
from pp_state.placement import Placement

__all__ = [
    "TRANSPORTS",
    "ResolvedSchedule",
    "check_plan_fits",
    "check_prefetch",
    "check_transport",
    "default_prefetch",
    "plan",
    "resolve_on_demand",
    "resolve_schedule",
]


def plan(
    name: str,
    *,
    pp_size: int,
    num_microbatches: int,
    vp_size: int = 1,
    microbatch_group_size_per_vp_stage: int | None = None,
    forward_only: bool = False,
    placement: Placement | str | None = None,
    costs: Costs | StageCosts | None = None,
    memory_limit: float | None = None,
    max_plan_steps: int | None = DEFAULT_MAX_PLAN_STEPS,
) -> Plan:
    """One list of compute actions per pipeline rank, in execution order.

    Args:
        name: "no_pipelining", "gpipe", "1f1b", "interleaved_1f1b", or the zero-bubble
            "zb_h1" (one chunk) and "zbv" (two chunks on the V placement), whose backwards
            are split into I and W steps; or "auto": the one `choose_schedule` picks (the
            shortest simulated makespan under `memory_limit`, with `costs`).
        pp_size: Pipeline stages (ranks).
        num_microbatches: Microbatches per step.
        vp_size: Model chunks per rank (interleaved_1f1b and gpipe; 1 otherwise).
        microbatch_group_size_per_vp_stage: Interleaving group size; pp_size by default.
        forward_only: Forward steps only (evaluation).
        placement: Which stage each (rank, chunk) holds: "looped" (Megatron's, the default),
            "v", or a `pp_state.Placement`. The order of steps does not change; `validate`
            says whether it runs on that placement. For "auto", a placement name limits the
            choice to schedules on it.
        costs: For "auto": the costs to simulate with (see `choose_schedule`).
        memory_limit: For "auto": the most activations a rank may hold, in stage-sized units.
        max_plan_steps: Refuse a plan of more compute steps before making it
            (`check_plan_budget`); None: no limit.

    Returns:
        A `Plan`: for each rank, its actions (each has ``kind`` "F", "B", "I" or "W",
        ``microbatch`` and ``chunk``), and the placement.

    Raises:
        ValueError: An unknown schedule, a size below 1, a configuration the schedule
            refuses, or a plan over `max_plan_steps`; the message states the rule and the
            valid values.
    """
    if name == "auto":
        chosen = choose_schedule(
            pp_size=pp_size, num_microbatches=num_microbatches, vp_size=vp_size, costs=costs,
            memory_limit=memory_limit, placement=_placement_name(placement),
            cache=PlanCache(max_plan_steps=max_plan_steps),
        ).plan  # fmt: skip
        return chosen.without_backward() if forward_only else chosen
    return schedule_spec(name).plan(
        pp_size=pp_size, num_microbatches=num_microbatches, vp_size=vp_size,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
        forward_only=forward_only, placement=placement, max_plan_steps=max_plan_steps,
    )  # fmt: skip


def _placement_name(placement: Placement | str | None) -> str | None:
    return placement.name if isinstance(placement, Placement) else placement


def default_prefetch(transport: str, exchanges_shapes: bool) -> int:
    """How many exchanges early receives are posted by default.

    1 on gloo with fixed shapes, where a receive posted only when needed costs a round trip;
    0 on NCCL, which completes transfers in posting order (an early receive would hold up
    later sends), and with shape headers, which are waited for when a receive is posted.

    Raises:
        ValueError: An unknown transport.
    """
    return 1 if check_transport(transport) == "gloo" and not exchanges_shapes else 0


def check_prefetch(prefetch: int, exchanges_shapes: bool) -> int:
    """`prefetch`, checked to be 0 or more, and 0 when shapes travel in headers.

    Raises:
        ValueError: A negative prefetch, or one above 0 with shape headers.
    """
    if prefetch < 0:
        raise ValueError(
            f"prefetch_receives must be 0 (receives where needed) or more, got {prefetch}"
        )
    if prefetch and exchanges_shapes:
        raise ValueError(
            f"prefetch_receives={prefetch} needs fixed shapes: with shape headers "
            "(variable_seq_lengths or debug) a receive waits for its header when posted, "
            "so posting it early would wait for a send not made yet; use 0"
        )
    return prefetch


def check_plan_fits(
    given: Plan, pp_size: int, vp_size: int, placement: Placement | str | None = None
) -> Placement:
    """The placement of a given plan, checked against the pipeline and the asked placement.

    Raises:
        ValueError: The plan is for other sizes, or on another placement than asked.
    """
    where = given.placement
    if (where.pp_size, where.vp_size) != (pp_size, vp_size):
        raise ValueError(
            f"the plan is for {where.pp_size} ranks x {where.vp_size} chunks, but the "
            f"pipeline has {pp_size} ranks and vp_size {vp_size}"
        )
    if placement is not None and str(placement) != str(where):
        raise ValueError(f"the plan runs on placement {where}, but the config asks for {placement}")
    return where


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedSchedule:
    """A schedule resolved once for a run: what runs, where, and every validated plan.

    Attributes:
        name: The schedule's name (auto's choice for "auto"); None for a given plan.
        placement: Which stage each (rank, chunk) holds.
        pp_size: Pipeline ranks.
        vp_size: Model chunks per rank.
        transport: "gloo" or "nccl".
        prefetch: How many exchanges early receives are posted (part of the plans).
        microbatch_counts: Every microbatch count resolved, smallest first.
        choice: For "auto": the choice and every candidate; None otherwise.
        plan: The given plan; None for a named schedule.
        reports: The validated plans by (microbatch count, forward only).
        microbatch_group_size_per_vp_stage: The interleaving group size asked for (None:
            the schedule's default).
        exchanges_shapes: Whether the plans were validated for transfers with shape headers.
        on_demand: Whether a microbatch count not yet resolved is resolved when a step first
            runs it (`with_count`; Megatron's argument-free executor, `resolve_on_demand`);
            otherwise such a count is refused.
    """

    name: str | None
    placement: Placement
    pp_size: int
    vp_size: int
    transport: str
    prefetch: int
    microbatch_counts: tuple[int, ...]
    choice: Choice | None = None
    plan: Plan | None = None
    reports: Mapping[tuple[int, bool], PlanReport] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    microbatch_group_size_per_vp_stage: int | None = None
    exchanges_shapes: bool = False
    on_demand: bool = False

    @property
    def include_forward_only(self) -> bool:
        """Whether forward-only plans (evaluation) were resolved beside the training ones."""
        return any(forward_only for _, forward_only in self.reports)

    def with_schedule(
        self, name: str, *, vp_size: int | None = None, choice: Choice | None = None
    ) -> ResolvedSchedule:
        """The same run resolved for schedule `name` on `vp_size` chunks per rank, with `choice`.

        The microbatch counts, forward-only plans, transport and prefetch stay this
        resolution's; nothing is planned again when the schedule and the chunks are already
        this resolution's (a measured ``auto`` that kept its pick).

        Raises:
            ValueError: The schedule cannot run these sizes (see `resolve_schedule`).
        """
        vp = self.vp_size if vp_size is None else vp_size
        again = self
        if (name, vp) != (self.name, self.vp_size):
            again = resolve_schedule(
                name, pp_size=self.pp_size, vp_size=vp,
                microbatch_counts=self.microbatch_counts,
                include_forward_only=self.include_forward_only,
                transport=self.transport, prefetch=self.prefetch,
            )  # fmt: skip
        return dataclasses.replace(again, choice=choice)

    def with_count(self, num_microbatches: int) -> ResolvedSchedule:
        """This resolution grown by `num_microbatches` (and its forward-only plan).

        The count is planned and validated as the others were: same schedule, placement,
        chunks per rank, interleaving group, transport and prefetch.

        Raises:
            ValueError: A given plan (it runs its own count only), or a count the schedule
                refuses (the message names the rule and the valid counts).
            PlanError: The plan would not run on the transport.
        """
        if num_microbatches in self.microbatch_counts:
            return self
        if self.name is None:
            assert self.plan is not None
            _given_plan_count(self.plan, (num_microbatches,))
        more = resolve_schedule(
            self.name, pp_size=self.pp_size, vp_size=self.vp_size,
            microbatch_counts=(num_microbatches,), include_forward_only=True,
            placement=self.placement,
            microbatch_group_size_per_vp_stage=self.microbatch_group_size_per_vp_stage,
            transport=self.transport, prefetch=self.prefetch,
            exchanges_shapes=self.exchanges_shapes,
        )  # fmt: skip
        return dataclasses.replace(
            self,
            microbatch_counts=tuple(sorted({*self.microbatch_counts, num_microbatches})),
            reports={**self.reports, **more.reports},
        )

    def report(self, num_microbatches: int, forward_only: bool = False) -> PlanReport:
        """The validated plan of a step of `num_microbatches` microbatches.

        Raises:
            ValueError: That count (or its forward-only plan) was not resolved; the message
                names the counts that were.
        """
        found = self.reports.get((num_microbatches, forward_only))
        if found is not None:
            return found
        kind = "forward-only plan" if forward_only else "plan"
        resolved = [str(count) for count, fo in sorted(self.reports) if fo == forward_only]
        raise ValueError(
            f"no {kind} was resolved for {num_microbatches} microbatches; resolved: "
            f"{', '.join(resolved) or 'none'}; resolve the schedule with every count the run "
            "steps with"
        )

    def actions(self, rank: int, num_microbatches: int, forward_only: bool = False) -> list[Action]:
        """The compute actions of `rank` in a step of `num_microbatches`, in order."""
        steps = self.report(num_microbatches, forward_only).steps[rank]
        return [step.compute for step in steps if step.compute is not None]


def _checked_counts(microbatch_counts: Sequence[int]) -> tuple[int, ...]:
    counts = tuple(sorted({check_int("num_microbatches", c, 1) for c in microbatch_counts}))
    if not counts:
        raise ValueError("microbatch_counts is empty; give every count the run steps with")
    return counts


def _given_plan_count(given: Plan, counts: tuple[int, ...]) -> None:
    """A given plan runs its own microbatch count, and only it."""
    if counts == (given.num_microbatches,):
        return
    if len(counts) == 1:
        (count,) = counts
        raise ValueError(
            f"the plan covers {given.num_microbatches} microbatches, but this step runs "
            f"{count}; give a plan for {count} or change num_microbatches"
        )
    raise ValueError(
        f"the plan covers {given.num_microbatches} microbatches, but the run steps with "
        f"{', '.join(map(str, counts))}; a plan runs one microbatch count"
    )


@dataclasses.dataclass(frozen=True)
class _Request:
    """The sizes and options every plan of one resolution shares."""

    pp_size: int
    vp_size: int
    counts: tuple[int, ...]
    group: int | None
    placement: Placement | str | None
    include_forward_only: bool
    transport: str = "gloo"
    prefetch: int = 0
    exchanges_shapes: bool = False
    cache: PlanCache = dataclasses.field(default_factory=PlanCache)

    def named(self, name: str, placement: Placement | str | None) -> dict[tuple[int, bool], Plan]:
        """Every plan of the schedule called `name` on `placement`."""
        kinds = (False, True) if self.include_forward_only else (False,)
        return {
            (count, fo): self.cache.plan(
                name,
                pp_size=self.pp_size,
                num_microbatches=count,
                vp_size=self.vp_size,
                microbatch_group_size_per_vp_stage=self.group,
                forward_only=fo,
                placement=placement,
            )
            for count in self.counts
            for fo in kinds
        }

    def given(self, given: Plan) -> dict[tuple[int, bool], Plan]:
        """A given plan (and its forward steps); a forward-only plan has only those."""
        check_plan_fits(given, self.pp_size, self.vp_size, self.placement)
        _given_plan_count(given, self.counts)
        (count,) = self.counts
        plans = {} if given.forward_only else {(count, False): given}
        if self.include_forward_only or given.forward_only:
            plans[(count, True)] = given.without_backward()
        return plans

    def auto(self, choose: _AutoOptions) -> tuple[Choice, dict[tuple[int, bool], Plan]]:
        """Auto's choice among the candidates that run every count, and its plans."""
        where = _placement_name(self.placement)
        runnable: dict[str, dict[tuple[int, bool], Plan]] = {}
        refused: list[str] = []
        for name, on in schedules_for(self.vp_size):
            if (where is None or on == where) and (choose.names is None or name in choose.names):
                try:
                    runnable[name] = self.named(name, on)
                    self.check_transport_runs(runnable[name][(self.counts[-1], False)])
                except ValueError as error:
                    runnable.pop(name, None)
                    refused.append(f"{name}: {str(error).splitlines()[0]}")
        if not runnable and refused:
            raise ValueError(
                f"no schedule runs {self.pp_size} ranks x {self.vp_size} chunks with "
                f"{', '.join(map(str, self.counts))} microbatches: {'; '.join(refused)}"
            )
        choice = choose_schedule(
            pp_size=self.pp_size, num_microbatches=self.counts[-1], vp_size=self.vp_size,
            costs=choose.costs, memory_limit=choose.memory_limit, placement=where,
            names=list(runnable), cache=self.cache,
        )  # fmt: skip
        return choice, runnable[choice.chosen.name]

    def check_transport_runs(self, plan: Plan) -> None:
        """On NCCL, refuse a candidate NCCL's rules refuse, so auto skips it.

        Raises:
            PlanError: The plan would mis-pair or hang on NCCL as it is posted there.
        """
        if self.transport == "nccl":
            self.cache.report(
                plan, num_microbatches=self.counts[-1], prefetch=self.prefetch,
                transport=self.transport, exchanges_shapes=self.exchanges_shapes,
            )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _AutoOptions:
    costs: Costs | StageCosts | None
    memory_limit: float | None
    names: Sequence[str] | None


def _plans(
    schedule: str | Plan | None, request: _Request, auto: _AutoOptions
) -> tuple[str | None, Choice | None, Plan | None, dict[tuple[int, bool], Plan]]:
    """The schedule's name, auto's choice, the given plan, and every plan to validate."""
    if isinstance(schedule, str) and any(c.isspace() for c in schedule.strip()):
        schedule = as_plan(schedule)
    if isinstance(schedule, Plan):
        return None, None, schedule, request.given(schedule)
    if schedule == "auto":
        choice, plans = request.auto(auto)
        return choice.chosen.name, choice, None, plans
    name = schedule or default_schedule(request.pp_size, request.vp_size, request.placement)
    return name, None, None, request.named(name, request.placement)


def _validated(
    plans: Mapping[tuple[int, bool], Plan], request: _Request
) -> dict[tuple[int, bool], PlanReport]:
    """Each plan validated under the transport's rules, receives moved `prefetch` early.

    A plan refused so is validated once more as written, so that the error describes the
    steps the user wrote (or the generator made), not the moved receives.
    """
    reports = {}
    for (count, forward_only), plan in plans.items():
        check = functools.partial(
            request.cache.report, plan, num_microbatches=count, forward_only=forward_only,
            transport=request.transport, exchanges_shapes=request.exchanges_shapes,
        )  # fmt: skip
        try:
            reports[(count, forward_only)] = check(prefetch=request.prefetch)
        except PlanError:
            if request.prefetch == 0:
                raise
            check()
            raise
    return reports


def _prefetch(transport: str, exchanges_shapes: bool, prefetch: int | None) -> int:
    """The prefetch asked for, checked, or the transport's default (checking the transport)."""
    early = default_prefetch(transport, exchanges_shapes)
    return early if prefetch is None else check_prefetch(prefetch, exchanges_shapes)


def _default_vp(schedule: str | Plan | None, vp_size: int | None) -> int:
    """`vp_size` checked, or the schedule's own: the registry's (its fewest), a plan's, else 1."""
    if vp_size is not None:
        return check_int("vp_size", vp_size, 1)
    if isinstance(schedule, Plan):
        return schedule.vp_size
    if isinstance(schedule, str) and schedule in SCHEDULE_REGISTRY:
        spec = SCHEDULE_REGISTRY[schedule]
        return spec.chunks if spec.chunks is not None else spec.min_chunks
    return 1


@collection_paused
def resolve_schedule(
    schedule: str | Plan | None = None,
    *,
    pp_size: int,
    vp_size: int | None = None,
    microbatch_counts: Sequence[int],
    include_forward_only: bool = True,
    placement: Placement | str | None = None,
    microbatch_group_size_per_vp_stage: int | None = None,
    transport: str = "gloo",
    prefetch: int | None = None,
    exchanges_shapes: bool = False,
    costs: Costs | StageCosts | None = None,
    memory_limit: float | None = None,
    names: Sequence[str] | None = None,
    max_plan_steps: int | None = DEFAULT_MAX_PLAN_STEPS,
) -> ResolvedSchedule:
    """Plan and validate a run's schedule once, for every microbatch count it steps with.

    Cost: O(steps) per plan, each made and validated once per transport and prefetch; "auto"
    plans, validates and simulates each candidate once (module docstring).

    Args:
        schedule: A schedule name, "auto", a `Plan` or its text; None: `default_schedule`.
        pp_size: Pipeline ranks.
        vp_size: Chunks per rank; the schedule's own by default (2: interleaved_1f1b, zbv).
        microbatch_counts: Every number of microbatches a step runs (a given plan: its own).
        include_forward_only: Resolve each count's forward-only plan too (evaluation).
        placement: "looped", "v" or a `Placement`; by default the schedule's own.
        microbatch_group_size_per_vp_stage: Interleaving group size (interleaved_1f1b).
        transport: "gloo" or "nccl": whose rules plans are validated under (`nccl_rules`).
        prefetch: Post receives this many exchanges early (default: `default_prefetch`).
        exchanges_shapes: Whether transfers carry shape headers (no prefetch then).
        costs: For "auto": the costs to simulate with.
        memory_limit: For "auto": the most activations a rank may hold (stage-sized units).
        names: For "auto": consider only these schedules.
        max_plan_steps: The planning budget (`check_plan_budget`); None: no limit.

    Returns:
        The resolved schedule (`ResolvedSchedule.report`: each count's validated plan).

    Raises:
        ValueError: A bad schedule, size, transport or prefetch, no auto candidate, a given
            plan of other sizes or count, a plan over `max_plan_steps` (names the numbers).
        PlanError: A plan is invalid or would not run on the transport (with the grid).
    """
    request = _Request(
        check_int("pp_size", pp_size, 1), _default_vp(schedule, vp_size),
        _checked_counts(microbatch_counts), microbatch_group_size_per_vp_stage, placement,
        include_forward_only, transport, _prefetch(transport, exchanges_shapes, prefetch),
        exchanges_shapes, PlanCache(max_plan_steps=max_plan_steps),
    )  # fmt: skip
    name, choice, given, plans = _plans(schedule, request, _AutoOptions(costs, memory_limit, names))
    return ResolvedSchedule(
        name=name, placement=next(iter(plans.values())).placement, pp_size=pp_size,
        vp_size=request.vp_size, transport=transport, prefetch=request.prefetch,
        microbatch_counts=request.counts, choice=choice, plan=given,
        reports=_validated(plans, request), microbatch_group_size_per_vp_stage=request.group,
        exchanges_shapes=exchanges_shapes,
    )  # fmt: skip


def resolve_on_demand(
    schedule: str | None = None,
    *,
    pp_size: int,
    vp_size: int = 1,
    placement: Placement | str | None = None,
    microbatch_group_size_per_vp_stage: int | None = None,
    transport: str = "gloo",
    prefetch: int | None = None,
    exchanges_shapes: bool = False,
) -> ResolvedSchedule:
    """A named schedule whose plans are resolved when a step first runs each count.

    For code that learns its microbatch counts only while it runs (Megatron's argument-free
    ``get_forward_backward_func()``): the executor grows it by each new count
    (`ResolvedSchedule.with_count`), planning and validating that count once. A count the
    schedule refuses is refused then, before anything is sent.

    Args:
        schedule: A schedule name; None: `default_schedule` (Megatron's choice: no
            pipelining on one stage, interleaved 1F1B with several chunks, 1F1B otherwise).
        pp_size: Pipeline ranks.
        vp_size: Chunks per rank.
        placement: "looped", "v" or a `Placement`; by default the schedule's own.
        microbatch_group_size_per_vp_stage: Interleaving group size (interleaved_1f1b).
        transport: "gloo" or "nccl".
        prefetch: Post receives this many exchanges early (default: `default_prefetch`).
        exchanges_shapes: Whether transfers carry shape headers.

    Raises:
        ValueError: An unknown schedule, transport or placement, a size below 1, or a
            prefetch the transfers cannot take.
    """
    pp, vp = check_int("pp_size", pp_size, 1), check_int("vp_size", vp_size, 1)
    name = schedule or default_schedule(pp, vp, placement)
    return ResolvedSchedule(
        name=name, placement=schedule_spec(name).placement_of(placement, pp, vp), pp_size=pp,
        vp_size=vp, transport=check_transport(transport),
        prefetch=_prefetch(transport, exchanges_shapes, prefetch), microbatch_counts=(),
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
        exchanges_shapes=exchanges_shapes, on_demand=True,
    )  # fmt: skip
