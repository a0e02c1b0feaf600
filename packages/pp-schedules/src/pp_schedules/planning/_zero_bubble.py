"""Zero-bubble schedules: ZB-H1 and ZB-V (Qi et al., ICLR 2024), found by list scheduling.

A backward splits into ``I``, the gradient with respect to the stage's input (which the
previous stage waits for), and ``W``, the gradients of the stage's parameters (which nobody
waits for). A rank that would idle runs a pending W instead, so the bubbles of 1F1B fill up.

ZB-H1 is a construction (below). ZB-V comes from a greedy list scheduler run with unit costs
(F = I = W = 1): whenever a rank can start something, it starts the action that can start
earliest, preferring an I (on the critical path), then an F (if the rank holds fewer
forwards than its limit), then a W (or F before I). Where there is a choice, the order the
simulator finds shortest is kept (`unit_makespan`: the simulator's makespan for these
costs, found in one pass over the steps).
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

Cost: a step weighs again only the ranks it changed (its own and the holders of the two
neighbouring stages), so a plan of n steps costs O(n log pp): ZB-V at pp 64 with 512
microbatches (196,608 steps) is planned in seconds, the same plan as weighing every rank
before every step (0.11.0, whose cost grew as pp^2 m).
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Sequence

from pp_schedules.planning._actions import Action
from pp_schedules.planning._lowering import incoming_message, outgoing_message
from pp_schedules.planning._plans import Plan
from pp_schedules.planning._validation import validate
from pp_state.placement import Placement

__all__ = ["list_schedule", "unit_makespan", "zb_h1", "zbv"]


Actions = list[list[Action]]


_KINDS = "IFW"  # the order a rank's candidates are weighed in (ties keep the first)


class _Links:
    """For each stage and kind, the link a step receives on and the one it sends on.

    A link is a number for each (sender rank, receiver rank, channel) that carries
    something; a tensor on it is named by its sending stage and microbatch. Looked up once,
    so the scheduler never builds a message.
    """

    def __init__(self, placement: Placement) -> None:
        self.ids: dict[tuple[int, int, str], int] = {}
        stages = range(placement.num_stages)
        holders = [placement.holder(stage) for stage in stages]
        # (stage, kind) -> link id or -1; kind 0: forward (F), 1: input gradient (I).
        self.incoming = [
            [self._id(holders[s], kind, placement, True) for kind in "FI"] for s in stages
        ]
        self.outgoing = [
            [self._id(holders[s], kind, placement, False) for kind in "FI"] for s in stages
        ]

    def _id(self, holder: tuple[int, int], kind: str, placement: Placement, receive: bool) -> int:
        rank, chunk = holder
        action = Action(kind, 0, chunk)  # type: ignore[arg-type]
        find = incoming_message if receive else outgoing_message
        message = find(action, rank, placement)
        if message is None:
            return -1
        ends = (message.peer, rank) if receive else (rank, message.peer)
        return self.ids.setdefault((*ends, message.link_channel), len(self.ids))


class _Scheduler:
    """The greedy list scheduler (unit costs), weighing only the ranks a step changed.

    A rank's best candidate depends on its own clock, forwards held and next steps, on the
    finished steps of the stages next to its own, and on what arrived on its links; a step
    changes those for its own rank and the holders of the two neighbouring stages only. So
    each rank's best candidate is kept (in a heap, by the same order as weighing all ranks
    each time: start, kind's priority, -stage, kind, stage, rank) and only those three are
    weighed again: each step costs O(log pp) instead of O(pp).
    """

    def __init__(
        self, placement: Placement, num_microbatches: int, limits: Sequence[int], prefer: str
    ) -> None:
        self.placement = placement
        self.priority = {kind: prefer.index(kind) for kind in "FIW"}
        self.m = num_microbatches
        self.limits = limits
        stages = placement.num_stages
        self.num_stages = stages
        self.holders = [placement.holder(stage) for stage in range(stages)]
        self.links = _Links(placement)
        self.sent: list[list[int]] = [[] for _ in self.links.ids]  # tensor: stage * m + mb
        self.used = [0] * len(self.links.ids)
        self.next = {kind: [0] * stages for kind in "FIW"}
        self.finish = {kind: [[-1.0] * num_microbatches for _ in range(stages)] for kind in "FI"}
        self.clock = [0.0] * placement.pp_size
        self.held = [0] * placement.pp_size
        self.order: list[list[Action]] = [[] for _ in range(placement.pp_size)]
        self.version = [0] * placement.pp_size
        self.heap: list[tuple[tuple[float, int, int, str, int], int, int]] = []

    def _ready(self, kind: str, stage: int) -> float | None:
        """When the next `kind` step of `stage` may start; None if it cannot be scheduled yet."""
        m = self.next[kind][stage]
        if m >= (self.m if kind == "F" else self.next["F" if kind == "I" else "I"][stage]):
            return None
        if kind == "W":
            return self.finish["I"][stage][m]
        # F waits for the previous stage's F; I for its own F and the next stage's I.
        if kind == "F":
            other = 0.0 if stage == 0 else self.finish["F"][stage - 1][m]
            return None if other < 0 else other
        own = self.finish["F"][stage][m]
        if stage == self.num_stages - 1:
            return own
        other = self.finish["I"][stage + 1][m]
        return None if other < 0 else max(own, other)

    def _in_turn(self, kind: str, stage: int) -> bool:
        """Whether the tensor the step needs is the next to arrive on its link."""
        if kind == "W":
            return True
        link = self.links.incoming[stage][kind == "I"]
        if link < 0:
            return True
        sender = stage - 1 if kind == "F" else stage + 1
        sent, used = self.sent[link], self.used[link]
        return used < len(sent) and sent[used] == sender * self.m + self.next[kind][stage]

    def best(self, rank: int) -> tuple[float, int, int, str, int] | None:
        """(start, priority, -stage, kind, stage) of the rank's best candidate, if any."""
        found: tuple[float, int, int, str, int] | None = None
        for chunk in range(self.placement.vp_size):
            stage = self.placement.stages[rank][chunk]
            for kind in _KINDS:
                if kind == "F" and self.held[rank] >= self.limits[rank]:
                    continue
                ready = self._ready(kind, stage)
                if ready is not None and self._in_turn(kind, stage):
                    start = max(self.clock[rank], ready)
                    candidate = (start, self.priority[kind], -stage, kind, stage)
                    found = candidate if found is None or candidate < found else found
        return found

    def _weigh(self, rank: int) -> None:
        """Weigh `rank` again: its best candidate replaces whatever the heap held for it."""
        self.version[rank] += 1
        found = self.best(rank)
        if found is not None:
            heapq.heappush(self.heap, (found, rank, self.version[rank]))

    def _pop(self) -> tuple[tuple[float, int, int, str, int], int]:
        """The best candidate of all ranks (the earliest, then by kind, stage and rank)."""
        while self.heap:
            found, rank, version = heapq.heappop(self.heap)
            if version == self.version[rank]:
                return found, rank
        raise ValueError(
            f"no zero-bubble order exists with at most {list(self.limits)} forwards "
            "held per rank; raise the limit"
        )

    def _run_step(self, rank: int, kind: str, stage: int, start: float) -> None:
        """Record the step: its rank's state, its link's turn and the ranks it affects."""
        microbatch = self.next[kind][stage]
        self.order[rank].append(Action(kind, microbatch, self.holders[stage][1]))  # type: ignore[arg-type]
        if kind != "W":
            incoming = self.links.incoming[stage][kind == "I"]
            if incoming >= 0:
                self.used[incoming] += 1
            outgoing = self.links.outgoing[stage][kind == "I"]
            if outgoing >= 0:
                self.sent[outgoing].append(stage * self.m + microbatch)
            self.finish[kind][stage][microbatch] = start + 1.0
        self.next[kind][stage] = microbatch + 1
        self.clock[rank] = start + 1.0
        self.held[rank] += 1 if kind == "F" else -1 if kind == "W" else 0
        touched = {rank}
        touched.update(
            self.holders[s][0] for s in (stage - 1, stage + 1) if 0 <= s < self.num_stages
        )
        for other in sorted(touched):
            self._weigh(other)

    def run(self) -> list[list[Action]]:
        for rank in range(self.placement.pp_size):
            self._weigh(rank)
        for _ in range(3 * self.m * self.num_stages):
            (start, _, _, kind, stage), rank = self._pop()
            self._run_step(rank, kind, stage, start)
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


_UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # Costs(forward=1, backward=2)


def unit_makespan(order: Sequence[Sequence[Action]], placement: Placement) -> float | None:
    """The makespan `simulate` finds for a valid order with F = I = W = 1, B = 2.

    With no transfer or posting time a step starts when its rank is free and the step that
    makes its input (the previous stage's F, the next stage's B or I) has ended; ranks are
    walked as their inputs arrive, so each step is visited once. None when the order waits
    on itself (`validate` says where).
    """
    stages, num_stages = placement.stages, placement.num_stages
    holder = [placement.holder(stage)[0] for stage in range(num_stages)]
    finish: dict[tuple[bool, int, int], float] = {}  # (forward, microbatch, stage) -> end
    waiting: dict[tuple[bool, int, int], list[int]] = {}
    cursor, clock = [0] * len(order), [0.0] * len(order)
    ready = list(range(len(order)))
    while ready:
        rank = ready.pop()
        row, time = order[rank], clock[rank]
        while cursor[rank] < len(row):
            action = row[cursor[rank]]
            stage, forward = stages[rank][action.chunk], action.kind == "F"
            start = time
            if action.kind != "W":
                source = stage - 1 if forward else stage + 1
                if 0 <= source < num_stages and holder[source] != rank:
                    arrived = finish.get((forward, action.microbatch, source))
                    if arrived is None:
                        waiting.setdefault((forward, action.microbatch, source), []).append(rank)
                        break
                    start = max(time, arrived)
                finish[(forward, action.microbatch, stage)] = start + _UNIT[action.kind]
                ready += waiting.pop((forward, action.microbatch, stage), [])
            time = start + _UNIT[action.kind]
            cursor[rank] += 1
        clock[rank] = time
    if any(at < len(row) for at, row in zip(cursor, order, strict=True)):
        return None
    return max(clock, default=0.0)


def _shortest(placement: Placement, m: int, tries: Sequence[Callable[[], Actions]]) -> Actions:
    """The order the simulator finds shortest (with unit costs) among the tries; ties: first.

    A try that raises ValueError (no order within its limits) is left out.
    """
    best: tuple[float, Actions] | None = None
    for make in tries:
        try:
            order = make()
        except ValueError:
            continue
        makespan = unit_makespan(order, placement)
        if makespan is None:  # never for these generators; validate names the deadlock
            validate(Plan.of(order, placement), num_microbatches=m)
            raise AssertionError("an order that waits on itself passed validation")
        if best is None or makespan < best[0]:
            best = (makespan, order)
    assert best is not None, "the uniform limit always leaves an order"
    return best[1]


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
    def h1(cycle: str) -> Actions:
        return [_h1_rank(pp_size, num_microbatches, r, cycle) for r in range(pp_size)]

    tries = [functools.partial(h1, cycle) for cycle in ("WF", "FW")]
    order = _shortest(Placement.looped(pp_size, 1), num_microbatches, tries)
    return tuple(tuple(rank) for rank in order)


@functools.lru_cache(maxsize=64)
def _zbv(pp_size: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    placement = Placement.v_shape(pp_size, 2)
    limits = [2 * min(pp_size, num_microbatches)] * pp_size
    tries = [
        functools.partial(list_schedule, placement, num_microbatches, limits, prefer)
        for prefer in ("IFW", "FIW")
    ]
    order = _shortest(placement, num_microbatches, tries)
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
