"""What the candidates of one choice share: each plan made, validated and timed once.

``auto`` and the memory planner weigh every schedule that could run (for each way of
building the model); a resolution then validates the chosen plan under the transport's
rules. Candidates share most of that work: one plan per (schedule, sizes), one lowering
validated per prefetch (a plan valid under NCCL's rules is valid under gloo's with the same
steps), one timeline per cost set (memory models only add bytes to it). A `PlanCache` holds
them for one choice or resolution; refusals are kept too, so a schedule that cannot run is
asked once.

Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Hashable

from pp_schedules.planning._memory import MemoryModel
from pp_schedules.planning._planning_cost import DEFAULT_MAX_PLAN_STEPS
from pp_schedules.planning._plans import Plan
from pp_schedules.planning._registry import schedule_spec
from pp_schedules.planning._simulation import Costs, Simulation, StageCosts, simulate, with_memory
from pp_schedules.planning._validation import PlanReport, validate
from pp_state.placement import Placement

__all__ = ["PlanCache"]

_Made = tuple[Plan | None, ValueError | None]


class PlanCache:
    """Plans, validated plans and timelines made for one choice, to be made only once.

    Args:
        max_plan_steps: The planning budget of every plan it makes (see
            `check_plan_budget`); None: no limit.
    """

    def __init__(self, *, max_plan_steps: int | None = DEFAULT_MAX_PLAN_STEPS) -> None:
        self.max_plan_steps = max_plan_steps
        self._plans: dict[Hashable, _Made] = {}
        self._reports: dict[Hashable, tuple[Plan, PlanReport | None, ValueError | None]] = {}
        self._timelines: dict[Hashable, tuple[PlanReport, Simulation]] = {}

    def plan(
        self,
        name: str,
        *,
        pp_size: int,
        num_microbatches: int,
        vp_size: int = 1,
        microbatch_group_size_per_vp_stage: int | None = None,
        forward_only: bool = False,
        placement: Placement | str | None = None,
    ) -> Plan:
        """The schedule's plan (`ScheduleSpec.plan`), made once.

        Raises:
            ValueError: What the schedule raised the first time it was asked.
        """
        group = microbatch_group_size_per_vp_stage
        key = (name, pp_size, num_microbatches, vp_size, group, forward_only, placement)
        if key not in self._plans:
            try:
                made = schedule_spec(name).plan(
                    pp_size=pp_size, num_microbatches=num_microbatches, vp_size=vp_size,
                    microbatch_group_size_per_vp_stage=group, forward_only=forward_only,
                    placement=placement, max_plan_steps=self.max_plan_steps,
                )  # fmt: skip
                self._plans[key] = (made, None)
            except ValueError as refused:
                self._plans[key] = (None, refused)
        found, error = self._plans[key]
        if error is not None:
            raise error
        assert found is not None
        return found

    def report(
        self,
        plan: Plan,
        *,
        num_microbatches: int | None = None,
        forward_only: bool = False,
        prefetch: int = 0,
        transport: str = "gloo",
        exchanges_shapes: bool = False,
    ) -> PlanReport:
        """`validate(plan, ...)`, made once; a plan NCCL's rules passed passes gloo's.

        Raises:
            PlanError: What `validate` raised the first time (ValueError: a bad argument).
        """
        count = plan.num_microbatches if num_microbatches is None else num_microbatches
        base = (id(plan), count, forward_only, prefetch)
        shapes = exchanges_shapes and transport == "nccl"
        key = (*base, transport, shapes)
        if transport == "gloo":  # any NCCL verdict of the same steps that passed will do
            for nccl in ((*base, "nccl", False), (*base, "nccl", True)):
                if nccl in self._reports and self._reports[nccl][1] is not None:
                    key = nccl
        if key not in self._reports:
            try:
                report = validate(
                    plan, num_microbatches=count, forward_only=forward_only,
                    prefetch=prefetch, transport=transport, exchanges_shapes=exchanges_shapes,
                )  # fmt: skip
                self._reports[key] = (plan, report, None)
            except ValueError as refused:
                self._reports[key] = (plan, None, refused)
        _, found, error = self._reports[key]
        if error is not None:
            raise error
        assert found is not None
        return found

    def simulate(
        self,
        report: PlanReport,
        costs: Costs | StageCosts,
        memory: MemoryModel | None = None,
    ) -> Simulation:
        """`simulate(report, costs, memory=memory)`, the timeline made once per cost set.

        Raises:
            ValueError: As `simulate`.
        """
        key = (id(report), costs)
        if key not in self._timelines:
            self._timelines[key] = (report, simulate(report, costs))
        timed = self._timelines[key][1]
        return timed if memory is None else with_memory(timed, report, memory)
