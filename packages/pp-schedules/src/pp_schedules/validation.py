"""Checking a plan before it runs: completeness, order, and freedom from deadlock.

The deadlock check runs the lowered plan the way the executor runs it: a rank executes its
steps in order; sends are posted as soon as their tensor exists and never block (they are
waited for at the end of the step); a receive blocks until its partner send is posted; and
transfers between two ranks on one channel match in the order they were posted. It also checks
that each matched pair moves the same tensor (microbatch and chunks), so a plan cannot silently
feed a stage the wrong activations.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

from pp_schedules.actions import Action
from pp_schedules.lowering import Step, lower

__all__ = ["PlanError", "PlanReport", "render_grid", "validate"]


class PlanError(ValueError):
    """A plan is incomplete, out of order or would deadlock; the message draws the grid."""


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """What validation learnt about a valid plan.

    Attributes:
        steps: The lowered plan the executor runs (see `pp_schedules.lowering.lower`).
        peak_in_flight: For each rank, the most (microbatch, chunk) forwards whose backward
            has not run yet: the activations it must hold at once.
    """

    steps: list[list[Step]]
    peak_in_flight: list[int]


def render_grid(steps: Sequence[Sequence[object]], marks: dict[int, int] | None = None) -> str:
    """Ranks as rows, steps as columns; ``marks`` maps a rank to the step to bracket."""
    marks = marks or {}
    cells = [[str(step) for step in row] for row in steps]
    width = max((len(c) for row in cells for c in row), default=1) + 2
    lines = []
    for rank, row in enumerate(cells):
        rendered = []
        for index, cell in enumerate(row):
            text = f"[{cell}]" if marks.get(rank) == index else cell
            rendered.append(text.ljust(width))
        lines.append(f"rank {rank}: " + "".join(rendered).rstrip())
    return "\n".join(lines)


def _check_complete(
    plan: Sequence[Sequence[Action]], num_microbatches: int, vp_size: int, forward_only: bool
) -> None:
    expected_kinds = ("F",) if forward_only else ("F", "B")
    for rank, actions in enumerate(plan):
        seen: dict[tuple[str, int, int], int] = {}
        for index, action in enumerate(actions):
            if not action.is_compute:
                raise PlanError(
                    f"rank {rank} step {index}: {action} is not a compute action\n"
                    + render_grid(plan, {rank: index})
                )
            key = (action.kind, action.microbatch, action.chunk)
            if key in seen:
                raise PlanError(
                    f"rank {rank} step {index}: {action} runs twice\n"
                    + render_grid(plan, {rank: index})
                )
            if (
                action.microbatch >= num_microbatches
                or action.chunk >= vp_size
                or action.kind not in expected_kinds
            ):
                raise PlanError(
                    f"rank {rank} step {index}: {action} is outside {num_microbatches} "
                    "microbatches, "
                    f"{vp_size} chunks{' (forward only)' if forward_only else ''}\n"
                    + render_grid(plan, {rank: index})
                )
            if action.kind == "B" and ("F", action.microbatch, action.chunk) not in seen:
                raise PlanError(
                    f"rank {rank} step {index}: {action} runs before its forward\n"
                    + render_grid(plan, {rank: index})
                )
            seen[key] = index
        missing = [
            f"{kind}{m}{f'.{c}' if c else ''}"
            for kind in expected_kinds
            for m in range(num_microbatches)
            for c in range(vp_size)
            if (kind, m, c) not in seen
        ]
        if missing:
            raise PlanError(
                f"rank {rank} never runs {', '.join(missing[:8])}"
                f"{' ...' if len(missing) > 8 else ''}\n" + render_grid(plan)
            )


def _peak_in_flight(actions: Sequence[Action]) -> int:
    held = peak = 0
    for action in actions:
        held += 1 if action.kind == "F" else -1 if action.kind == "B" else 0
        peak = max(peak, held)
    return peak


_Key = tuple[str, int, int, int]
_Link = tuple[int, int, str]  # (sender, receiver, channel)


class _Links:
    """Every transfer of a lowered plan, queued per link in posting order."""

    def __init__(self, steps: Sequence[Sequence[Step]]) -> None:
        self.steps = steps
        self.sends: dict[_Link, list[tuple[_Key, int]]] = defaultdict(list)
        self.recvs: dict[_Link, list[tuple[_Key, int]]] = defaultdict(list)
        self.position: dict[tuple[int, int, int], int] = {}  # (rank, step, message) -> index
        for rank, rank_steps in enumerate(steps):
            for index, step in enumerate(rank_steps):
                for number, message in enumerate(step.exchange.messages if step.exchange else ()):
                    queue = (
                        self.sends[(rank, message.peer, message.channel)]
                        if message.is_send
                        else self.recvs[(message.peer, rank, message.channel)]
                    )
                    self.position[(rank, index, number)] = len(queue)
                    queue.append((message.key(rank), index))

    def check_pairs(self) -> None:
        """Every send has a receive, in the same order, moving the same tensor."""
        for link in set(self.sends) | set(self.recvs):
            sent, received = self.sends.get(link, []), self.recvs.get(link, [])
            src, dst, channel = link
            if len(sent) != len(received):
                k = min(len(sent), len(received))
                rank, index = (src, sent[k][1]) if k < len(sent) else (dst, received[k][1])
                raise PlanError(
                    f"rank {src} sends {len(sent)} and rank {dst} receives {len(received)} "
                    f"{channel} tensors: transfer {k} has no partner\n"
                    + render_grid(self.steps, {rank: index})
                )
            for k, ((sent_key, sent_at), (received_key, received_at)) in enumerate(
                zip(sent, received, strict=True)
            ):
                if sent_key != received_key:
                    raise PlanError(
                        f"transfer {k} from rank {src} to rank {dst} on the {channel} channel "
                        f"would deliver {_describe(sent_key)} where {_describe(received_key)} "
                        "was expected\n" + render_grid(self.steps, {src: sent_at, dst: received_at})
                    )

    def can_pass(self, rank: int, index: int, cursor: list[int]) -> bool:
        """Whether `rank` may finish step `index`: every receive's partner send is posted."""
        step = self.steps[rank][index]
        for number, message in enumerate(step.exchange.messages if step.exchange else ()):
            if message.is_send:
                continue  # posted without waiting; completed at the end of the step
            k = self.position[(rank, index, number)]
            partner_index = self.sends[(message.peer, rank, message.channel)][k][1]
            # The partner send is posted once its rank has reached that step.
            if cursor[message.peer] < partner_index:
                return False
        return True


def _run(steps: Sequence[Sequence[Step]]) -> None:
    """Execute the plan under the executor's rules; raise PlanError on deadlock or mismatch."""
    links = _Links(steps)
    links.check_pairs()
    cursor = [0] * len(steps)
    progressed = True
    while progressed:
        progressed = False
        for rank, rank_steps in enumerate(steps):
            while cursor[rank] < len(rank_steps) and links.can_pass(rank, cursor[rank], cursor):
                cursor[rank] += 1
                progressed = True
    stuck = {rank: cursor[rank] for rank in range(len(steps)) if cursor[rank] < len(steps[rank])}
    if stuck:
        waits = "; ".join(
            f"rank {rank} waits at step {index} ({steps[rank][index]})"
            for rank, index in stuck.items()
        )
        raise PlanError(f"the plan deadlocks: {waits}\n" + render_grid(steps, stuck))


def _describe(key: tuple[str, int, int, int]) -> str:
    channel, microbatch, sender_chunk, receiver_chunk = key
    what = "activations" if channel == "forward" else "gradients"
    return f"the {what} of microbatch {microbatch} (chunk {sender_chunk} -> chunk {receiver_chunk})"


def validate(
    plan: Sequence[Sequence[Action]],
    *,
    num_microbatches: int,
    vp_size: int = 1,
    forward_only: bool = False,
) -> PlanReport:
    """Check a compute plan and lower it for execution.

    Checks that every rank forwards (and, unless `forward_only`, backwards) each
    (microbatch, chunk) exactly once, forward before backward; that every transfer has a
    partner moving the same tensor; and that the exchanges cannot deadlock.

    Args:
        plan: One list of compute actions per rank.
        num_microbatches: Microbatches per step.
        vp_size: Model chunks per rank.
        forward_only: The plan has no backward steps.

    Returns:
        The lowered steps and each rank's peak number of activations held.

    Raises:
        PlanError: The first problem found, with the rank x step grid and the failing step in
            brackets.
    """
    _check_complete(plan, num_microbatches, vp_size, forward_only)
    steps = lower(plan, vp_size=vp_size)
    _run(steps)
    return PlanReport(steps=steps, peak_in_flight=[_peak_in_flight(actions) for actions in plan])
