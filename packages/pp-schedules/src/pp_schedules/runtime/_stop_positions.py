"""Where each rank of a stopped pipeline was, from what it published or from the plan.

The evidence a stop report is built from (`Context`): the plan's lowered steps, the positions
the ranks published (each rank's flight-recorder head) and their liveness records. From it,
`published_waits` says whom a rank that published waits for (in a transfer of the plan, or
in a collective outside it) and `rank_position` places every rank: as it said, or, for one
that published nothing, by the plan (it cannot have posted a send another rank still waits
for, nor passed a step whose receive a rank that published had not yet sent).

Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pp_schedules.planning import Step
from pp_schedules.runtime._stop_report import RankPosition, Wait

__all__ = ["Context", "Describe", "Head", "lost_by_errors", "published_waits", "rank_position"]

Head = Mapping[str, Any]
"""What one rank published: see `position_document`."""
Describe = Callable[[int], str]
"""Names a global rank with its place: ``rank 3 (pipeline stage 1 of [1, 3], dp 1, tp 0)``."""


@dataclasses.dataclass(frozen=True)
class Context:
    """What the report is built from."""

    steps: Sequence[Sequence[Step]]
    heads: Mapping[int, Head]
    pipeline: tuple[int, ...]
    liveness: Mapping[int, Any]
    describe: Describe

    def stage(self, rank: int) -> int | None:
        return self.pipeline.index(rank) if rank in self.pipeline else None

    def name(self, rank: int) -> str:
        head = self.heads.get(rank)
        coordinates = (head or {}).get("coordinates")
        if coordinates:
            return _describe_coordinates(coordinates)
        return self.describe(rank)


def _describe_coordinates(data: Mapping[str, Any]) -> str:
    parts = [f"pipeline stage {data['stage']} of {list(data['pipeline'])}"]
    for key, short in (("data_parallel", "dp"), ("tensor_parallel", "tp")):
        if data.get(key) is not None:
            parts.append(f"{short} {data[key]}")
    if data.get("context_parallel"):
        parts.append(f"cp {data['context_parallel']}")
    return f"rank {data['rank']} ({', '.join(parts)})"


def _position_of(head: Head) -> dict[str, Any]:
    position: dict[str, Any] = dict(head.get("position") or {})
    return position


def published_waits(rank: int, head: Head, context: Context) -> list[Wait]:
    """The transfers a rank that published waits for (or failed in, posting an exchange)."""
    position = _position_of(head)
    call = int(head.get("iteration", 0))
    transfers = position.get("waiting_for") or []
    if position.get("state") == "posting":
        # Stuck posting: on the transfers with the peer its error names, else its receives.
        peer = (head.get("error") or {}).get("peer_stage")
        posted = position.get("transfers", [])
        transfers = [t for t in posted if t["peer"] == peer] or [
            t for t in posted if t["direction"] == "recv"
        ]
    pipeline = tuple(head.get("pipeline") or context.pipeline)
    waits = []
    for t in transfers:
        if 0 <= t["peer"] < len(pipeline):
            what = f"{t['what']} ({t['direction']})"
            peer = pipeline[t["peer"]]
            waits.append(
                Wait(rank, position["step"], position["action"], peer, what, tuple(t["key"]), call)
            )
    return waits + _collective_waits(rank, head, context)


def _open_collective(head: Head) -> dict[str, Any] | None:
    collective = _position_of(head).get("collective")
    if collective and collective.get("state") in ("waiting", "failed"):
        return dict(collective)
    return None


def _collective_waits(rank: int, head: Head, context: Context) -> list[Wait]:
    """Whom a rank in a collective waits for: the group's ranks not in that collective."""
    collective = _open_collective(head)
    if collective is None:
        return []
    group, seq = tuple(collective["group"]), collective["seq"]
    what = f"{collective['operation']} over ranks {list(group)}"
    waits = []
    for member in group:
        other = context.heads.get(member)
        if member != rank and (other is None or not _reached(other, group, seq, collective)):
            step = collective.get("in_step")
            waits.append(
                Wait(rank, step, collective["operation"], member, what, (), collective["call"])
            )
    return waits


def _reached(head: Head, group: tuple[int, ...], seq: int, collective: Mapping[str, Any]) -> bool:
    """Whether a rank's document shows it in (or past) the collective (`group`, `seq`).

    In it or past it by its recorded collectives; past it, too, when it is in a later call
    (every rank runs the same collectives between two calls).
    """
    records = [*head.get("collectives", []), _position_of(head).get("collective") or {}]
    if any(tuple(r.get("group", ())) == group and r.get("seq", -1) >= seq for r in records):
        return True
    later_call = int(head.get("iteration", 0)) > int(collective.get("call", 0))
    return later_call and collective.get("in_step") is None


def _sent_at(steps: Sequence[Step], key: tuple[Any, ...]) -> int | None:
    """The exchange of a stage's steps that sends the tensor `key`."""
    for index, step in enumerate(steps):
        for message in step.exchange.messages if step.exchange is not None else ():
            if message.is_send and message.key(0) == key:
                return index
    return None


def _consumer(steps: Sequence[Step], start: int, channel: str, mb: int, chunk: int) -> int:
    """The compute step at or after `start` that uses a received (channel, mb, chunk)."""
    kinds = ("F",) if channel == "forward" else ("B", "I")
    for index in range(start, len(steps)):
        action = steps[index].compute
        if action is not None and action.kind in kinds and (action.microbatch, action.chunk) == (
            mb, chunk,
        ):  # fmt: skip
            return index
    return start


def _blocked_by_survivors(stage: int, context: Context) -> int | None:
    """The first step of `stage` that needs a transfer a rank that published had not sent."""
    steps = context.steps
    for index, step in enumerate(steps[stage]):
        for message in step.exchange.messages if step.exchange is not None else ():
            peer_head = context.heads.get(context.pipeline[message.peer])
            if message.is_send or peer_head is None:
                continue
            sent = _sent_at(steps[message.peer], message.key(0))
            where = _position_of(peer_head).get("step")
            if sent is not None and (where is None or where < sent):
                action = message.action
                return _consumer(steps[stage], index, message.channel, action.microbatch,
                                 action.chunk)  # fmt: skip
    return None


def _inferred_step(rank: int, context: Context, waits: Sequence[Wait]) -> int | None:
    """Where a silent stage was, by the plan: before its first send that someone waits for."""
    stage = context.stage(rank)
    if stage is None:
        return None
    candidates = []
    for wait in waits:
        if wait.peer == rank and wait.key:
            sent = _sent_at(context.steps[stage], wait.key)
            if sent is not None:
                candidates.append(max(sent - 1, 0))
    blocked = _blocked_by_survivors(stage, context)
    if blocked is not None:
        candidates.append(blocked)
    return min(candidates, default=None)


def _error_text(head: Head) -> str | None:
    error = head.get("error")
    return None if not error else f"{error['type']}: {error['message']}"


def lost_by_errors(rank: int, context: Context) -> list[int]:
    """The ranks whose errors say their transfer or collective with `rank` was lost."""
    return [
        other
        for other, head in sorted(context.heads.items())
        if (head.get("error") or {}).get("peer") == rank and (head.get("error") or {}).get("lost")
    ]


def _silent_state(rank: int, context: Context, waits: Sequence[Wait]) -> str:
    """What a rank that published nothing is, by its liveness record or the others' errors."""
    live = context.liveness.get(rank)
    state = getattr(live, "state", None)
    if state in ("gone", "stopped", "silent", "left"):
        return str(state)
    if any(
        not (context.heads[other].get("error") or {}).get("timed_out")
        for other in lost_by_errors(rank, context)
    ):
        return "gone"
    return "not answering" if any(w.peer == rank for w in waits) else "quiet"


def _liveness_text(rank: int, context: Context) -> str | None:
    live = context.liveness.get(rank)
    if live is None or getattr(live, "state", "unknown") in ("unknown", "alive"):
        return None
    return f"{live.state}: {live.evidence}"


def _collective_text(collective: Mapping[str, Any]) -> str:
    return (
        f"{collective['operation']} over ranks {list(collective['group'])} ({collective['state']})"
    )


def rank_position(rank: int, context: Context, waits: Sequence[Wait]) -> RankPosition:
    stage, name = context.stage(rank), context.name(rank)
    head = context.heads.get(rank)
    if head is None:
        step = _inferred_step(rank, context, waits)
        action = str(context.steps[stage][step]) if step is not None and stage is not None else ""
        return RankPosition(
            rank, stage, name, step, action, _silent_state(rank, context, waits), True,
            liveness=_liveness_text(rank, context),
        )  # fmt: skip
    position = _position_of(head)
    collective = position.get("collective")
    state, step, action = position.get("state", "ended"), position.get("step"), position.get(
        "action", "")  # fmt: skip
    if collective is not None and collective.get("state") == "waiting":
        state, step = "in a collective", collective.get("in_step")
        action = "" if step is None or stage is None else str(context.steps[stage][step])
    return RankPosition(
        rank, stage, name, step, action, state, False,
        _error_text(head), int(head.get("iteration", 0)),
        None if collective is None else _collective_text(collective),
        _liveness_text(rank, context), position.get("training_iteration"),
    )  # fmt: skip
