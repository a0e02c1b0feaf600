"""Zero-bubble schedules: ZB-H1 and ZB-V (Qi et al., ICLR 2024), found by list scheduling.

A backward splits into ``I``, the gradient with respect to the stage's input (which the
previous stage waits for), and ``W``, the gradients of the stage's parameters (which nobody
waits for). A rank that would idle runs a pending W instead, so the bubbles of 1F1B fill up.

ZB-H1 is a construction (below). ZB-V comes from a greedy list scheduler run with unit costs
(F = I = W = 1): whenever a rank can start something, it starts the action that can start
earliest, preferring an I (on the critical path), then an F (if the rank holds fewer
forwards than its limit), then a W (or F before I). Where there is a choice, the order the
simulator finds shortest is kept.
Within a stage, microbatches keep their order, and a rank takes the tensors arriving on one
link in the order they were sent (on the V placement a link carries activations one way and
gradients of the other chunk the same way). The order is then fixed data: the validator
proves it complete and deadlock-free whatever the real costs are, and the simulator times it.

- ``zb_h1``: one chunk per rank, looped placement: 1F1B's warm-up, then on rank r each I is
  followed by the W of r steps before and the next F, so at most ``min(p, m)`` forwards are
  held (1F1B's most loaded rank). Simulated with F = I = W = 1 it takes 3m + (p - 1), the
  known optimum (pp 2..8, m = p..3p checked).
- ``zbv``: two chunks per rank on the V placement (rank r holds stages r and 2p-1-r), at most
  ``2 min(p, m)`` half-size forwards held per rank (the same memory); 6m + (p - 1) or less
  for m >= 2p.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from pp_schedules.actions import Action
from pp_schedules.lowering import incoming_message, outgoing_message
from pp_schedules.plans import Plan
from pp_schedules.simulation import Costs, simulate
from pp_schedules.validation import validate
from pp_state.placement import Placement

__all__ = ["list_schedule", "zb_h1", "zbv"]


Actions = list[list[Action]]


class _Scheduler:
    """The state of the greedy list scheduler (unit costs)."""

    def __init__(
        self, placement: Placement, num_microbatches: int, limits: Sequence[int], prefer: str
    ) -> None:
        self.placement = placement
        self.priority = {kind: prefer.index(kind) for kind in "FIW"}
        self.m = num_microbatches
        self.limits = limits
        self.num_stages = placement.num_stages
        self.finish: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, stage)
        self.next = {(k, s): 0 for k in "FIW" for s in range(self.num_stages)}
        self.clock = [0.0] * placement.pp_size
        self.held = [0] * placement.pp_size
        self.order: list[list[Action]] = [[] for _ in range(placement.pp_size)]
        # Per link (sender, receiver, channel): what was sent, in order, and how much was used.
        self.sent: dict[tuple[int, int, str], list[tuple[str, int, int, int]]] = {}
        self.used: dict[tuple[int, int, str], int] = {}

    def _ready(self, kind: str, stage: int) -> float | None:
        """When the next `kind` step of `stage` may start; None if it cannot be scheduled yet."""
        m = self.next[(kind, stage)]
        before = {"F": None, "I": "F", "W": "I"}[kind]
        limit = self.m if before is None else self.next[(before, stage)]
        if m >= limit:
            return None
        if kind == "W":
            return self.finish[("I", m, stage)]
        # F waits for the previous stage's F; I for its own F and the next stage's I.
        own = 0.0 if kind == "F" else self.finish[("F", m, stage)]
        edge = stage == 0 if kind == "F" else stage == self.num_stages - 1
        if edge:
            return own
        other = self.finish.get((kind, m, stage - 1 if kind == "F" else stage + 1))
        return None if other is None else max(own, other)

    def _action(self, rank: int, kind: str, stage: int) -> Action:
        chunk = self.placement.chunk_of(rank, stage)
        return Action(kind, self.next[(kind, stage)], chunk)  # type: ignore[arg-type]

    def _in_turn(self, rank: int, kind: str, stage: int) -> bool:
        """Whether the tensor the step needs is the next to arrive on its link."""
        message = incoming_message(self._action(rank, kind, stage), rank, self.placement)
        if message is None:
            return True
        link = (message.peer, rank, message.link_channel)
        sent = self.sent.get(link, [])
        used = self.used.get(link, 0)
        return used < len(sent) and sent[used] == message.key(rank)

    def _record(self, rank: int, action: Action) -> None:
        incoming = incoming_message(action, rank, self.placement)
        if incoming is not None:
            link = (incoming.peer, rank, incoming.link_channel)
            self.used[link] = self.used.get(link, 0) + 1
        outgoing = outgoing_message(action, rank, self.placement)
        if outgoing is not None:
            link = (rank, outgoing.peer, outgoing.link_channel)
            self.sent.setdefault(link, []).append(outgoing.key(rank))

    def best(self, rank: int) -> tuple[float, int, int, str, int] | None:
        """(start, priority, -stage, kind, stage) of the rank's best candidate, if any."""
        found: list[tuple[float, int, int, str, int]] = []
        for chunk in range(self.placement.vp_size):
            stage = self.placement.stage(rank, chunk)
            for kind in "IFW":
                if kind == "F" and self.held[rank] >= self.limits[rank]:
                    continue
                ready = self._ready(kind, stage)
                if ready is not None and self._in_turn(rank, kind, stage):
                    start = max(self.clock[rank], ready)
                    found.append((start, self.priority[kind], -stage, kind, stage))
        return min(found) if found else None

    def run(self) -> list[list[Action]]:
        total = 3 * self.m * self.num_stages
        for _ in range(total):
            choices = [(c, rank) for rank in range(len(self.clock)) if (c := self.best(rank))]
            if not choices:
                raise ValueError(
                    f"no zero-bubble order exists with at most {list(self.limits)} forwards "
                    "held per rank; raise the limit"
                )
            (start, _, _, kind, stage), rank = min(choices)
            action = self._action(rank, kind, stage)
            self._record(rank, action)
            self.next[(kind, stage)] = action.microbatch + 1
            self.finish[(kind, action.microbatch, stage)] = start + 1.0
            self.clock[rank] = start + 1.0
            self.held[rank] += 1 if kind == "F" else -1 if kind == "W" else 0
            self.order[rank].append(action)
        return self.order


def list_schedule(
    placement: Placement, num_microbatches: int, limits: Sequence[int], prefer: str = "IFW"
) -> list[list[Action]]:
    """The greedy zero-bubble order of F, I and W steps for any placement.

    Args:
        placement: Which stage each (rank, chunk) holds.
        num_microbatches: Microbatches per step.
        limits: For each rank, the most forwards it may hold (from F until W).
        prefer: The kinds in order of preference among steps that can start at once.

    Raises:
        ValueError: The limits leave no order (a rank could never start a forward it needs).
    """
    return _Scheduler(placement, num_microbatches, limits, prefer).run()


def _check(name: str, pp_size: int, num_microbatches: int) -> None:
    if pp_size < 2 or num_microbatches < pp_size:
        raise ValueError(
            f"{name} needs pp_size of 2 or more and at least pp_size microbatches, got "
            f"pp_size {pp_size} and {num_microbatches} microbatches; use num_microbatches >= "
            f"{max(pp_size, 2)} (or '1f1b' for one stage)"
        )


def _shortest(placement: Placement, m: int, tries: Sequence[tuple[list[int], str]]) -> Actions:
    """The order the simulator finds shortest (with unit costs) among the tries; ties: first."""
    best: tuple[float, Actions] | None = None
    for limits, prefer in tries:
        try:
            order = list_schedule(placement, m, limits, prefer)
        except ValueError:
            continue
        report = validate(Plan.of(order, placement), num_microbatches=m)
        makespan = simulate(report, Costs(forward=1, backward=2)).makespan
        if best is None or makespan < best[0]:
            best = (makespan, order)
    assert best is not None, "the uniform limit always leaves an order"
    return [list(rank) for rank in best[1]]


def _h1_rank(pp_size: int, m: int, rank: int, cycle: str) -> list[Action]:
    """ZB-H1 on one rank.

    1F1B's warm-up, then each I followed by the W held back `rank` steps and the next F (in
    `cycle` order: "WF" or "FW"), then the W's left.
    """
    warmup = min(m, pp_size - rank)
    order = [Action("F", k) for k in range(warmup)]
    forwards, weights = warmup, 0
    for k in range(m):
        order.append(Action("I", k))
        for kind in cycle:
            if kind == "W" and k >= rank:
                order.append(Action("W", weights))
                weights += 1
            elif kind == "F" and forwards < m:
                order.append(Action("F", forwards))
                forwards += 1
    return order + [Action("W", k) for k in range(weights, m)]


@functools.lru_cache(maxsize=64)
def _zb_h1(pp_size: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    placement = Placement.looped(pp_size, 1)
    best: tuple[float, list[list[Action]]] | None = None
    for cycle in ("WF", "FW"):
        order = [_h1_rank(pp_size, num_microbatches, r, cycle) for r in range(pp_size)]
        report = validate(Plan.of(order, placement), num_microbatches=num_microbatches)
        makespan = simulate(report, Costs(forward=1, backward=2)).makespan
        if best is None or makespan < best[0]:
            best = (makespan, order)
    assert best is not None
    return tuple(tuple(rank) for rank in best[1])


@functools.lru_cache(maxsize=64)
def _zbv(pp_size: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    limits = [2 * min(pp_size, num_microbatches)] * pp_size
    tries = [(limits, "IFW"), (limits, "FIW")]
    order = _shortest(Placement.v_shape(pp_size, 2), num_microbatches, tries)
    return tuple(tuple(rank) for rank in order)


def zb_h1(*, pp_size: int, num_microbatches: int, forward_only: bool = False) -> Actions:
    """ZB-H1: one chunk per rank, 1F1B's peak memory, bubble about (p - 1)(F + I - W).

    Raises:
        ValueError: Fewer than 2 ranks or fewer microbatches than ranks.
    """
    _check("zb_h1", pp_size, num_microbatches)
    if forward_only:
        return [[Action("F", m) for m in range(num_microbatches)] for _ in range(pp_size)]
    return [list(rank) for rank in _zb_h1(pp_size, num_microbatches)]


def zbv(*, pp_size: int, num_microbatches: int, forward_only: bool = False) -> Actions:
    """ZB-V: two half-size chunks per rank in a V, the same memory as 1F1B's busiest rank.

    Raises:
        ValueError: Fewer than 2 ranks or fewer microbatches than ranks.
    """
    _check("zbv", pp_size, num_microbatches)
    if forward_only:
        forwards = [Action("F", m, c) for c in range(2) for m in range(num_microbatches)]
        return [list(forwards) for _ in range(pp_size)]
    return [list(rank) for rank in _zbv(pp_size, num_microbatches)]
