"""The zero-bubble generators as pp-schedules 0.11.0 wrote them: the reference for new ones.

A copy of 0.11.0's greedy list scheduler (every rank's candidates weighed again before each
step, so its cost grows with pp x m x pp) and of its ZB-H1 construction, each choosing between
its tries by `validate` and `simulate` with unit costs, as 0.11.0 did. Tests compare the
package's generators with these action for action; nothing in the package imports this.
"""

from __future__ import annotations

from collections.abc import Sequence

from pp_schedules import Costs, Plan
from pp_schedules.planning import Action, simulate, validate
from pp_schedules.planning._lowering import incoming_message, outgoing_message
from pp_state.placement import Placement

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
        self.finish: dict[tuple[str, int, int], float] = {}
        self.next = {(k, s): 0 for k in "FIW" for s in range(self.num_stages)}
        self.clock = [0.0] * placement.pp_size
        self.held = [0] * placement.pp_size
        self.order: list[list[Action]] = [[] for _ in range(placement.pp_size)]
        self.sent: dict[tuple[int, int, str], list[tuple[str, int, int, int]]] = {}
        self.used: dict[tuple[int, int, str], int] = {}

    def _ready(self, kind: str, stage: int) -> float | None:
        m = self.next[(kind, stage)]
        before = {"F": None, "I": "F", "W": "I"}[kind]
        limit = self.m if before is None else self.next[(before, stage)]
        if m >= limit:
            return None
        if kind == "W":
            return self.finish[("I", m, stage)]
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
        for _ in range(3 * self.m * self.num_stages):
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
) -> Actions:
    """0.11.0's `pp_schedules.planning._zero_bubble.list_schedule`."""
    return _Scheduler(placement, num_microbatches, limits, prefer).run()


def _makespan(order: Actions, placement: Placement, m: int) -> float:
    report = validate(Plan.of(order, placement), num_microbatches=m)
    return simulate(report, Costs(forward=1, backward=2)).makespan


def _h1_rank(pp_size: int, m: int, rank: int, cycle: str) -> list[Action]:
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


def zb_h1(pp_size: int, num_microbatches: int) -> Actions:
    """0.11.0's ZB-H1 plan (training)."""
    placement = Placement.looped(pp_size, 1)
    best: tuple[float, Actions] | None = None
    for cycle in ("WF", "FW"):
        order = [_h1_rank(pp_size, num_microbatches, r, cycle) for r in range(pp_size)]
        makespan = _makespan(order, placement, num_microbatches)
        if best is None or makespan < best[0]:
            best = (makespan, order)
    assert best is not None
    return best[1]


def zbv(pp_size: int, num_microbatches: int) -> Actions:
    """0.11.0's ZB-V plan (training)."""
    placement = Placement.v_shape(pp_size, 2)
    limits = [2 * min(pp_size, num_microbatches)] * pp_size
    best: tuple[float, Actions] | None = None
    for prefer in ("IFW", "FIW"):
        try:
            order = list_schedule(placement, num_microbatches, limits, prefer)
        except ValueError:
            continue
        makespan = _makespan(order, placement, num_microbatches)
        if best is None or makespan < best[0]:
            best = (makespan, order)
    assert best is not None
    return best[1]
