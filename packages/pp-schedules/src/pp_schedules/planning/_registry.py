"""The schedule registry: one record per named schedule, and the rules that follow from them.

Which placement a schedule runs on, how many model chunks per rank it takes, whether it
splits backwards, which schedule a configuration runs by default and which ones ``auto``
weighs are written here once; generators, ``auto``, layer balancing and the executor ask.

Pure Python (no torch): planning a named schedule is `ScheduleSpec.plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Literal

from pp_schedules.planning._actions import Action
from pp_schedules.planning._dualpipe import PairedActions, dualpipev
from pp_schedules.planning._generators import gpipe, interleaved_1f1b, no_pipelining, one_f_one_b
from pp_schedules.planning._planning_cost import (
    DEFAULT_MAX_PLAN_STEPS,
    check_plan_budget,
    collection_paused,
)
from pp_schedules.planning._plans import Plan
from pp_schedules.planning._zero_bubble import zb_h1, zbv
from pp_state.numbers import check_int
from pp_state.placement import Placement

__all__ = [
    "SCHEDULES",
    "SCHEDULE_REGISTRY",
    "PlacementName",
    "ScheduleSpec",
    "default_schedule",
    "placement_for",
    "schedule_spec",
    "schedules_for",
]

Actions = list[list[Action]]
Generated = Actions | PairedActions
PlacementName = Literal["looped", "v"]
VP_SIZE = "vp_size"
GROUP = "microbatch_group_size_per_vp_stage"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """One named schedule: what it runs on and how its plan is made.

    Attributes:
        name: The name `plan` takes.
        title: How a person names it ("interleaved 1F1B"), for log lines and tables.
        placement: The placement it runs on by default: "looped" (Megatron's) or "v". A
            schedule on "v" runs on no other.
        chunks: Model chunks per rank it takes: 1, 2, or None for any number the generator
            accepts.
        split_backward: Whether its backwards are split into I and W steps (zero bubble).
        generator: The generator (``pp_size, num_microbatches, forward_only`` and the
            `options`) returning each rank's compute actions (with its F&B steps marked:
            `PairedActions`, for a schedule that overlaps them).
        options: The keyword arguments the generator takes besides those three
            ("vp_size", "microbatch_group_size_per_vp_stage").
        instead: What to use when the chunks per rank do not fit (ends the message).
        min_chunks: The fewest chunks per rank it takes (its generator says why otherwise).
        auto_rank: Its place among ``auto``'s candidates (lower first); None: never one.
    """

    name: str
    title: str
    placement: PlacementName
    chunks: int | None
    split_backward: bool
    generator: Callable[..., Generated]
    options: frozenset[str] = frozenset()
    instead: str = ""
    min_chunks: int = 1
    auto_rank: int | None = None

    def takes(self, vp_size: int) -> bool:
        """Whether it runs a model with `vp_size` chunks per rank."""
        if self.chunks is not None:
            return vp_size == self.chunks
        return vp_size >= self.min_chunks

    def check(
        self, *, pp_size: int, num_microbatches: int, vp_size: int = 1, group: int | None = None
    ) -> None:
        """The checks every schedule shares: sizes, chunks per rank, and the group size.

        Raises:
            TypeError: A size that is not an int.
            ValueError: A size below 1, chunks it does not take, or a group size for a
                schedule without interleaving groups.
        """
        check_int("pp_size", pp_size, 1)
        check_int("num_microbatches", num_microbatches, 1)
        check_int("vp_size", vp_size, 1)
        if self.chunks is not None and vp_size != self.chunks:
            shape = "one model chunk" if self.chunks == 1 else "two model chunks"
            where = " in a V" if self.placement == "v" else ""
            raise ValueError(
                f"{self.name} runs {shape} per rank{where}, but vp_size is {vp_size}; "
                f"{self.instead}"
            )
        if group is not None and GROUP not in self.options:
            raise ValueError(
                f"microbatch_group_size_per_vp_stage applies to 'interleaved_1f1b' only, not "
                f"{self.name!r}"
            )

    def generate(
        self,
        *,
        pp_size: int,
        num_microbatches: int,
        vp_size: int = 1,
        microbatch_group_size_per_vp_stage: int | None = None,
        forward_only: bool = False,
    ) -> Generated:
        """Each rank's compute actions from the generator, passing it the options it takes."""
        given = {VP_SIZE: vp_size, GROUP: microbatch_group_size_per_vp_stage}
        options = {key: value for key, value in given.items() if key in self.options}
        return self.generator(
            pp_size=pp_size, num_microbatches=num_microbatches, forward_only=forward_only,
            **options,
        )  # fmt: skip

    def placement_of(
        self, placement: Placement | str | None, pp_size: int, vp_size: int
    ) -> Placement:
        """The placement named or given (its own by default), checked against the sizes.

        Raises:
            ValueError: A placement of another size, or another than a "v" schedule's.
        """
        where = (
            Placement.named(placement or self.placement, pp_size, vp_size)
            if placement is None or isinstance(placement, str)
            else placement
        )
        if (where.pp_size, where.vp_size) != (pp_size, vp_size):
            raise ValueError(
                f"the placement covers {where.pp_size} ranks x {where.vp_size} chunks, but the "
                f"plan has {pp_size} x {vp_size}"
            )
        if self.placement not in ("looped", where.name):
            raise ValueError(
                f"{self.name} runs on the {self.placement.upper()} placement, not {where}; "
                "leave placement unset"
            )
        return where

    @collection_paused
    def plan(
        self,
        *,
        pp_size: int,
        num_microbatches: int,
        vp_size: int = 1,
        microbatch_group_size_per_vp_stage: int | None = None,
        forward_only: bool = False,
        placement: Placement | str | None = None,
        max_plan_steps: int | None = DEFAULT_MAX_PLAN_STEPS,
    ) -> Plan:
        """The checked plan of this schedule (see `pp_schedules.plan` for the arguments).

        Raises:
            ValueError: A size, placement or group size it refuses, or a plan of more than
                `max_plan_steps` compute steps (refused before planning); the message says why.
        """
        group = microbatch_group_size_per_vp_stage
        self.check(pp_size=pp_size, num_microbatches=num_microbatches, vp_size=vp_size, group=group)
        where = self.placement_of(placement, pp_size, vp_size)
        check_plan_budget(
            self.name, pp_size=pp_size, vp_size=vp_size, num_microbatches=num_microbatches,
            kinds=1 if forward_only else 3 if self.split_backward else 2,
            max_plan_steps=max_plan_steps,
        )  # fmt: skip
        actions = self.generate(
            pp_size=pp_size, num_microbatches=num_microbatches, vp_size=vp_size,
            microbatch_group_size_per_vp_stage=group, forward_only=forward_only,
        )  # fmt: skip
        if isinstance(actions, PairedActions):
            return Plan.of(actions.actions, where, actions.overlapped)
        return Plan.of(actions, where)


_ONE_CHUNK = "use 'interleaved_1f1b' or 'gpipe'"

SCHEDULE_REGISTRY: Mapping[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec(
            name="no_pipelining", title="no pipelining",
            placement="looped", chunks=1, split_backward=False,
            generator=no_pipelining, instead=_ONE_CHUNK,
        ),
        ScheduleSpec(
            name="gpipe", title="GPipe",
            placement="looped", chunks=None, split_backward=False,
            generator=gpipe, options=frozenset({VP_SIZE}), auto_rank=2,
        ),
        ScheduleSpec(
            name="1f1b", title="1F1B",
            placement="looped", chunks=1, split_backward=False,
            generator=one_f_one_b, instead=_ONE_CHUNK, auto_rank=0,
        ),
        ScheduleSpec(
            name="interleaved_1f1b", title="interleaved 1F1B",
            placement="looped", chunks=None, split_backward=False,
            generator=interleaved_1f1b, options=frozenset({VP_SIZE, GROUP}), min_chunks=2,
            auto_rank=0,
        ),
        ScheduleSpec(
            name="zb_h1", title="zero-bubble ZB-H1",
            placement="looped", chunks=1, split_backward=True,
            generator=zb_h1, instead="use 'zbv' or 'gpipe'", auto_rank=1,
        ),
        ScheduleSpec(
            name="zbv", title="zero-bubble ZB-V (V placement)",
            placement="v", chunks=2, split_backward=True, generator=zbv,
            instead="use vp_size=2 (or 'zb_h1' with one chunk)", auto_rank=1,
        ),
        ScheduleSpec(
            name="dualpipev", title="DualPipeV (V placement, F&B overlapped)",
            placement="v", chunks=2, split_backward=True, generator=dualpipev,
            instead="use vp_size=2 (or 'zb_h1' with one chunk)", auto_rank=1,
        ),
    )
}  # fmt: skip
"""Every named schedule, by name, in the order error messages list them."""

SCHEDULES: Mapping[str, Callable[..., Generated]] = {
    name: spec.generate for name, spec in SCHEDULE_REGISTRY.items()
}
"""Generators by name, taking every option `plan` passes (derived from the registry)."""


def schedule_spec(name: str) -> ScheduleSpec:
    """The record of the schedule called `name`.

    Raises:
        ValueError: An unknown name; the message lists the valid ones (and "auto").
    """
    spec = SCHEDULE_REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULE_REGISTRY)}, auto")
    return spec


def default_schedule(
    pp_size: int, vp_size: int = 1, placement: Placement | str | None = None
) -> str:
    """The schedule a configuration runs when none is named (Megatron's choice).

    No pipelining for one stage of one chunk, interleaved 1F1B for several chunks on the
    looped placement, GPipe for several chunks on another, 1F1B otherwise.

    Args:
        pp_size: Pipeline ranks.
        vp_size: Model chunks per rank.
        placement: The placement (or its name); looped by default.
    """
    where = placement.name if isinstance(placement, Placement) else placement or "looped"
    if pp_size == 1 and vp_size == 1:
        return "no_pipelining"
    if vp_size > 1:
        return "interleaved_1f1b" if where == "looped" else "gpipe"
    return "1f1b"


def placement_for(name: str, pp_size: int, vp_size: int) -> Placement:
    """The placement the schedule called `name` runs on by default, for these sizes.

    Raises:
        ValueError: An unknown schedule, or sizes the placement cannot take (a V needs
            chunks in pairs).
    """
    return Placement.named(schedule_spec(name).placement, pp_size, vp_size)


def schedules_for(vp_size: int) -> list[tuple[str, str]]:
    """``auto``'s candidates for `vp_size` chunks per rank: (schedule, placement) pairs."""
    ranked = [
        spec
        for spec in SCHEDULE_REGISTRY.values()
        if spec.auto_rank is not None and spec.takes(vp_size)
    ]
    ranked.sort(key=lambda spec: spec.auto_rank or 0)
    return [(spec.name, spec.placement) for spec in ranked]
