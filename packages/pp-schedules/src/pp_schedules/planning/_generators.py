"""Schedule generators: the per-rank order of forward and backward steps, as data.

Each generator returns, for every pipeline rank, its compute actions in execution order; the
registry (`SCHEDULE_REGISTRY`) names them and says where each runs. For
every configuration Megatron-LM accepts, the order equals Megatron's (checked against data
recorded from Megatron itself); configurations Megatron refuses raise a ValueError that states
the rule and suggests valid values.
"""

from __future__ import annotations

import itertools

from pp_schedules.planning._actions import Action
from pp_state.numbers import check_int

__all__ = [
    "ScheduleConfigError",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_table",
    "no_pipelining",
    "one_f_one_b",
]

Actions = list[list[Action]]


class ScheduleConfigError(ValueError, RuntimeError):
    """A configuration the interleaved schedule refuses (Megatron raises a RuntimeError)."""

    __module__ = "pp_schedules"  # where users import it from, as tracebacks name it


def no_pipelining(*, pp_size: int, num_microbatches: int, forward_only: bool = False) -> Actions:
    """One stage: forward then backward of each microbatch in turn (Megatron's no-pipelining).

    Raises:
        ValueError: `pp_size` is not 1 (use "1f1b" or "gpipe" for a pipeline).
    """
    if pp_size != 1:
        raise ValueError(
            f"no_pipelining runs one stage, but pp_size is {pp_size}; use '1f1b' or 'gpipe'"
        )
    actions: list[Action] = []
    for microbatch in range(num_microbatches):
        actions.append(Action("F", microbatch))
        if not forward_only:
            actions.append(Action("B", microbatch))
    return [actions]


def gpipe(
    *, pp_size: int, num_microbatches: int, vp_size: int = 1, forward_only: bool = False
) -> Actions:
    """Every rank: all forwards, then all backwards (in microbatch order).

    With several chunks per rank (torch's looped breadth-first schedule), every microbatch
    goes through chunk 0, then chunk 1, ...; backwards run the chunks in reverse.
    """
    forwards = [Action("F", m, c) for c in range(vp_size) for m in range(num_microbatches)]
    backwards = (
        []
        if forward_only
        else [Action("B", m, c) for c in reversed(range(vp_size)) for m in range(num_microbatches)]
    )
    return [forwards + backwards for _ in range(pp_size)]


def one_f_one_b(*, pp_size: int, num_microbatches: int, forward_only: bool = False) -> Actions:
    """Megatron's non-interleaved 1F1B: warmup forwards, steady one-forward-one-backward, cooldown.

    Rank r runs min(pp_size - r - 1, m) warmup forwards, so it holds at most pp_size - r
    microbatches' activations at once.
    """
    plan: Actions = []
    for rank in range(pp_size):
        if forward_only:
            plan.append([Action("F", m) for m in range(num_microbatches)])
            continue
        warmup = min(pp_size - rank - 1, num_microbatches)
        actions = [Action("F", m) for m in range(warmup)]
        for step in range(num_microbatches - warmup):
            actions.append(Action("F", warmup + step))
            actions.append(Action("B", step))
        actions.extend(Action("B", m) for m in range(num_microbatches - warmup, num_microbatches))
        plan.append(actions)
    return plan


def _valid_group_sizes(pp_size: int, num_microbatches: int) -> list[int]:
    return [
        n
        for n in range(pp_size, num_microbatches + 1)
        if num_microbatches % n == 0 or num_microbatches % n >= pp_size
    ]


def _counts_for_group(pp_size: int, num_microbatches: int, group: int) -> list[int]:
    """The microbatch counts nearest `num_microbatches` that groups of `group` run.

    One below and one above where they exist; none when `group` is below the pipeline size
    (no count works then). Any multiple of `group` runs, so one above always exists.
    """
    if group < pp_size:
        return []

    def runs(count: int) -> bool:
        return count % group == 0 or count % group >= pp_size

    below = next((n for n in range(num_microbatches - 1, group - 1, -1) if runs(n)), None)
    above = next(n for n in itertools.count(max(num_microbatches + 1, group)) if runs(n))
    return [n for n in (below, above) if n is not None]


def _interleaving_hint(pp_size: int, num_microbatches: int, group: int) -> str:
    """What would work instead: the group sizes for this count, or the counts for this group."""
    valid = _valid_group_sizes(pp_size, num_microbatches)
    if not valid:
        return (
            f"no microbatch_group_size_per_vp_stage works for {num_microbatches} microbatches; "
            f"use at least {pp_size} microbatches"
        )
    hint = (
        f"valid microbatch_group_size_per_vp_stage values for {num_microbatches} microbatches: "
        f"{valid}"
    )
    counts = _counts_for_group(pp_size, num_microbatches, group)
    if counts:
        hint += (
            f"; or keep microbatch_group_size_per_vp_stage={group} and use "
            f"{' or '.join(map(str, counts))} microbatches"
        )
    return hint


def _check_interleaving(pp_size: int, num_microbatches: int, vp_size: int, group: int) -> None:
    if pp_size < 2:
        raise ScheduleConfigError(f"interleaved_1f1b needs pp_size of 2 or more, got {pp_size}")
    if vp_size < 2:
        raise ScheduleConfigError(
            f"interleaved_1f1b needs vp_size of 2 or more, got {vp_size}; with one chunk use '1f1b'"
        )
    hint = _interleaving_hint(pp_size, num_microbatches, group)
    if not pp_size <= group <= num_microbatches:
        raise ScheduleConfigError(
            f"microbatch_group_size_per_vp_stage {group} must lie between the pipeline size "
            f"{pp_size} "
            f"and the number of microbatches {num_microbatches} (Megatron's rule); {hint}"
        )
    remainder = num_microbatches % group
    if remainder and remainder < pp_size:
        raise ScheduleConfigError(
            f"{num_microbatches} microbatches in groups of {group} leave {remainder}: "
            "the last group "
            f"must be empty or hold at least pp_size={pp_size} microbatches, or the pipeline waits "
            f"on itself (Megatron's rule); {hint}"
        )


def interleaved_table(num_microbatches: int, vp_size: int, group: int) -> list[tuple[int, int]]:
    """Megatron's schedule table: the (microbatch, chunk) of each virtual forward step.

    Microbatches go through the chunks in groups of `group`: all of a group on chunk 0, then on
    chunk 1, ..., then the next group. Backward step k undoes forward step k on the mirrored
    chunk (vp_size - 1 - chunk).
    """
    table: list[tuple[int, int]] = []
    for start in range(0, num_microbatches, group):
        end = min(start + group, num_microbatches)  # the last group may be short
        table.extend((m, chunk) for chunk in range(vp_size) for m in range(start, end))
    return table


def interleaved_1f1b(
    *,
    pp_size: int,
    num_microbatches: int,
    vp_size: int,
    microbatch_group_size_per_vp_stage: int | None = None,
    forward_only: bool = False,
) -> Actions:
    """Megatron's interleaved 1F1B over `vp_size` model chunks per rank.

    Rank r runs (pp_size - r - 1) * 2 + (vp_size - 1) * group warmup forwards (all of them
    when that exceeds the total), then one forward and one backward per step, then the
    remaining backwards.

    Raises:
        ValueError: The group size is outside [pp_size, m], or m leaves a last group smaller
            than pp_size; the message lists the valid group sizes.
    """
    group = (
        pp_size
        if microbatch_group_size_per_vp_stage is None
        else microbatch_group_size_per_vp_stage
    )
    check_int("microbatch_group_size_per_vp_stage", group, 1)
    _check_interleaving(pp_size, num_microbatches, vp_size, group)
    table = interleaved_table(num_microbatches, vp_size, group)
    total = len(table)
    forwards = [Action("F", m, chunk) for m, chunk in table]
    backwards = [Action("B", m, vp_size - 1 - chunk) for m, chunk in table]
    plan: Actions = []
    for rank in range(pp_size):
        if forward_only:
            plan.append(list(forwards))
            continue
        warmup = min((pp_size - rank - 1) * 2 + (vp_size - 1) * group, total)
        actions = forwards[:warmup]
        for step in range(total - warmup):
            actions.append(forwards[warmup + step])
            actions.append(backwards[step])
        actions.extend(backwards[total - warmup :])
        plan.append(actions)
    return plan
