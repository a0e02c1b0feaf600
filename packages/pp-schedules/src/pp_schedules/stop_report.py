"""Where every rank was when a pipeline stopped, and which rank is the cause.

`build_stop_report` takes the plan's lowered steps and the positions the ranks published (each
rank's flight-recorder head, its recent steps and its error; see `pp_schedules.stop_channel`)
and returns a `StopReport`: the rank x step grid with each rank's step marked, the waits-for
chain, and the cause in one sentence ("rank 3 is gone; by the plan it was at F mb 6 chunk 1
...").

A rank that published nothing (dead, or stopped) is placed by the plan: it cannot have posted
a send another rank still waits for, nor passed a step whose receive a rank that published had
not yet sent. The earliest such step is where it was; the report says it was inferred.

Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pp_schedules.lowering import Step
from pp_schedules.timeline import MeasuredSpan, chrome_trace
from pp_schedules.validation import render_grid

__all__ = ["RankPosition", "StopReport", "Wait", "build_stop_report", "describe_step"]

Head = Mapping[str, Any]
"""What one rank published: see `pp_schedules.stop_channel.position_document`."""

_MARGIN = 3  # grid columns shown around the marked steps


@dataclasses.dataclass(frozen=True)
class Wait:
    """One rank waiting for a transfer of another.

    Attributes:
        rank: The waiting pipeline rank.
        step: Its step (index in its lowered plan).
        action: That step's string form.
        peer: The pipeline rank it waits for.
        what: The transfer, in words ("activations of mb 6 chunk 1 (recv)").
        key: The tensor's key (channel, microbatch, sender chunk, receiver chunk).
    """

    rank: int
    step: int
    action: str
    peer: int
    what: str
    key: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class RankPosition:
    """Where one rank was.

    Attributes:
        rank: Pipeline rank.
        step: Index in its lowered plan; None when unknown.
        action: The step's string form ("" when unknown).
        state: "running", "posting", "waiting" or "ended" for a rank that published; "gone",
            "not answering" or "silent" (nobody waits for it) for one that did not.
        inferred: Whether the step comes from the plan rather than the rank.
        error: The error it stopped with ("Type: first line"), if it published one.
    """

    rank: int
    step: int | None
    action: str
    state: str
    inferred: bool
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class StopReport:
    """One report of a stopped pipeline (see `build_stop_report`).

    Attributes:
        cause: One sentence naming the rank that stopped the pipeline and why.
        positions: Every rank's position, by rank.
        waits: Who waits for whom, at which step, for what.
        plan: The plan's lowered steps as grid cells, by rank.
        heads: What each rank published, by rank (plain data).
        iteration: The executor call the ranks were in (the reporting rank's).
    """

    cause: str
    positions: list[RankPosition]
    waits: list[Wait]
    plan: list[list[str]]
    heads: dict[int, dict[str, Any]]
    iteration: int = 0

    def grid(self) -> str:
        """The rank x step grid around the marked steps: ``[x]`` published, ``(x)`` inferred."""
        known = [p.step for p in self.positions if p.step is not None]
        longest = max((len(row) for row in self.plan), default=0)
        low = max(min(known, default=0) - _MARGIN, 0)
        high = min(max(known, default=longest) + _MARGIN, longest - 1)
        rows = [list(row[low : high + 1]) for row in self.plan]
        for position in self.positions:
            if position.step is not None and low <= position.step <= high:
                # Bracketed here, not by render_grid's marks, so the columns make room.
                cell = rows[position.rank][position.step - low]
                rows[position.rank][position.step - low] = (
                    f"({cell})" if position.inferred else f"[{cell}]"
                )
        grid = render_grid(rows)
        width = max((len(c) for row in rows for c in row), default=1) + 2
        label = len("rank 0: ")
        header = "step".ljust(label) + "".join(str(i).ljust(width) for i in range(low, high + 1))
        return f"{header.rstrip()}\n{grid}"

    def render(self) -> str:
        """The report as text: cause, grid, waits, and each rank's position and error."""
        lines = [f"pipeline stopped (call {self.iteration}): {self.cause}", ""]
        lines += ["where every rank is ([x] as it said, (x) inferred from the plan):", self.grid()]
        if self.waits:
            lines += ["", "waits:"]
            lines += [
                f"  rank {w.rank} waits at step {w.step} ({w.action}) for rank {w.peer}: {w.what}"
                for w in self.waits
            ]
        lines += ["", "ranks:"]
        for p in self.positions:
            where = "step unknown" if p.step is None else f"step {p.step} ({p.action})"
            said = (
                "inferred, published nothing"
                if p.inferred or (p.step is None and p.state != "ended")
                else ""
            )
            detail = ", ".join(x for x in (p.state, said, p.error or "") if x)
            lines.append(f"  rank {p.rank}: {where}, {detail}")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The report as one JSON document (cause, positions, waits, grid text, heads)."""
        return json.dumps(
            {
                "iteration": self.iteration,
                "cause": self.cause,
                "positions": [dataclasses.asdict(p) for p in self.positions],
                "waits": [dataclasses.asdict(w) for w in self.waits],
                "grid": self.grid(),
                "heads": {str(rank): head for rank, head in self.heads.items()},
            },
            indent=1,
        )

    def chrome_trace(self) -> str:
        """A Chrome trace of the recorded steps of every rank that published, a track per rank.

        Times are wall-clock (each rank's monotonic clock moved by the offset it published);
        a step still open when the rank published ends at that moment.
        """
        spans: list[list[MeasuredSpan]] = [[] for _ in self.positions]
        for rank, head in self.heads.items():
            offset = float(head.get("clock_offset", 0.0))
            published = float(head.get("published_at", 0.0))
            for step in head.get("recent", []):
                end = step["end"] + offset if step["end"] is not None else published
                spans[rank].append(
                    MeasuredSpan(
                        rank,
                        step["action"],
                        step["kind"],
                        step["microbatch"],
                        step["chunk"],
                        step["start"] + offset,
                        max(end, step["start"] + offset),
                    )
                )
        return chrome_trace(spans)

    def write(self, directory: str | Path, stem: str = "pipeline-stop") -> list[Path]:
        """Write ``<stem>.txt``, ``<stem>.json`` and ``<stem>.trace.json`` under `directory`."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        paths = [root / f"{stem}.txt", root / f"{stem}.json", root / f"{stem}.trace.json"]
        for path, text in zip(
            paths, (self.render(), self.to_json(), self.chrome_trace()), strict=True
        ):
            path.write_text(text + ("\n" if not text.endswith("\n") else ""))
        return paths


def describe_step(step: Step | None, text: str = "") -> str:
    """A step in words: ``F mb 6 chunk 1``, or ``exchange SEND_F6.1+RECV_B2.1``."""
    if step is None:
        return text or "an unknown step"
    if step.compute is not None:
        action = step.compute
        return f"{action.kind} mb {action.microbatch} chunk {action.chunk}"
    return f"exchange {step}"


def _cells(steps: Sequence[Sequence[Step]]) -> list[list[str]]:
    """Grid cells: compute steps as written, exchanges shortened (``sF6+rB2``)."""

    def cell(step: Step) -> str:
        text = str(step)
        return text.replace("SEND_", "s").replace("RECV_", "r") if step.exchange else text

    return [[cell(step) for step in row] for row in steps]


def _published_waits(rank: int, head: Head) -> list[Wait]:
    """The transfers a rank that published waits for (or failed in, posting an exchange)."""
    position = head.get("position") or {}
    transfers = position.get("waiting_for") or []
    if position.get("state") == "posting":
        # Stuck posting: on the transfers with the peer its error names, else its receives.
        peer = (head.get("error") or {}).get("peer")
        posted = position.get("transfers", [])
        transfers = [t for t in posted if t["peer"] == peer] or [
            t for t in posted if t["direction"] == "recv"
        ]
    return [
        Wait(
            rank,
            position["step"],
            position["action"],
            t["peer"],
            f"{t['what']} ({t['direction']})",
            tuple(t["key"]),
        )
        for t in transfers
    ]


def _sent_at(steps: Sequence[Step], key: tuple[Any, ...]) -> int | None:
    """The exchange of a rank's steps that sends the tensor `key`."""
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


def _blocked_by_survivors(
    rank: int, steps: Sequence[Sequence[Step]], heads: Mapping[int, Head]
) -> int | None:
    """The first step of `rank` that needs a transfer a rank that published had not sent."""
    for index, step in enumerate(steps[rank]):
        for message in step.exchange.messages if step.exchange is not None else ():
            peer_head = heads.get(message.peer)
            if message.is_send or peer_head is None:
                continue
            sent = _sent_at(steps[message.peer], message.key(0))
            where = (peer_head.get("position") or {}).get("step")
            if sent is not None and (where is None or where < sent):
                action = message.action
                return _consumer(
                    steps[rank], index, message.channel, action.microbatch, action.chunk
                )
    return None


def _inferred_step(
    rank: int, steps: Sequence[Sequence[Step]], heads: Mapping[int, Head], waits: Sequence[Wait]
) -> int | None:
    """Where a silent rank was, by the plan: before its first send that someone waits for."""
    candidates = []
    for wait in waits:
        if wait.peer == rank:
            sent = _sent_at(steps[rank], wait.key)
            if sent is not None:
                candidates.append(max(sent - 1, 0))
    blocked = _blocked_by_survivors(rank, steps, heads)
    if blocked is not None:
        candidates.append(blocked)
    return min(candidates, default=None)


def _error_text(head: Head) -> str | None:
    error = head.get("error")
    return None if not error else f"{error['type']}: {error['message']}"


def _silent_state(rank: int, heads: Mapping[int, Head], waits: Sequence[Wait]) -> str:
    """Gone when a rank's error says the connection to it closed; else not answering."""
    for head in heads.values():
        error = head.get("error") or {}
        if error.get("peer") == rank and error.get("lost") and not error.get("timed_out"):
            return "gone"
    return "not answering" if any(w.peer == rank for w in waits) else "silent"


def _position(
    rank: int, steps: Sequence[Sequence[Step]], heads: Mapping[int, Head], waits: Sequence[Wait]
) -> RankPosition:
    head = heads.get(rank)
    if head is None:
        step = _inferred_step(rank, steps, heads, waits)
        action = str(steps[rank][step]) if step is not None else ""
        return RankPosition(rank, step, action, _silent_state(rank, heads, waits), True)
    position = head.get("position") or {}
    return RankPosition(
        rank, position.get("step"), position.get("action", ""),
        position.get("state", "ended"), False, _error_text(head),
    )  # fmt: skip


def _waiting_on(target: int, waits: Sequence[Wait]) -> list[Wait]:
    """The waits whose chain ends at `target`, nearest first (one per waiting rank)."""
    found: list[Wait] = []
    frontier = [target]
    seen = {target}
    while frontier:
        peer = frontier.pop(0)
        for wait in waits:
            if wait.peer == peer and wait.rank not in seen:
                seen.add(wait.rank)
                found.append(wait)
                frontier.append(wait.rank)
    return found


def _ranks_and_steps(waits: Sequence[Wait]) -> str:
    ranks = [str(w.rank) for w in waits]
    steps = [str(w.step) for w in waits]
    if len(waits) == 1:
        return f"rank {ranks[0]} waits for it at step {steps[0]}"
    joined_ranks = ", ".join(ranks[:-1]) + f" and {ranks[-1]}"
    joined_steps = ", ".join(steps[:-1]) + f" and {steps[-1]}"
    return f"ranks {joined_ranks} wait for it at steps {joined_steps}"


def _mismatch_cause(heads: Mapping[int, Head]) -> str | None:
    for rank, head in sorted(heads.items()):
        error = head.get("error") or {}
        if error.get("mismatch"):
            peer = error.get("peer")
            low, high = sorted((rank, rank if peer is None else peer))
            return f"contract mismatch between rank {low} and rank {high}: {error['message']}"
    return None


def _silent_cause(
    positions: Sequence[RankPosition], steps: Sequence[Sequence[Step]], waits: Sequence[Wait]
) -> str | None:
    for p in positions:
        if not p.inferred or p.state == "silent":
            continue
        where = describe_step(steps[p.rank][p.step]) if p.step is not None else "an unknown step"
        at = f" (step {p.step}, inferred)" if p.step is not None else ""
        cause = f"rank {p.rank} is {p.state}; by the plan it was at {where}{at}"
        waiting = _waiting_on(p.rank, waits)
        return cause + (f"; {_ranks_and_steps(waiting)}" if waiting else "")
    return None


def _own_failure_cause(positions: Sequence[RankPosition], heads: Mapping[int, Head]) -> str | None:
    """A rank that failed on its own (not in a transfer), e.g. an error in its forward."""
    for p in positions:
        error = heads[p.rank].get("error") if p.rank in heads else None
        if error and not error.get("transfer"):
            return f"rank {p.rank} failed at step {p.step} ({p.action}): {p.error}"
    return None


def _cause(
    positions: Sequence[RankPosition],
    steps: Sequence[Sequence[Step]],
    heads: Mapping[int, Head],
    waits: Sequence[Wait],
) -> str:
    for found in (
        _mismatch_cause(heads),
        _own_failure_cause(positions, heads),
        _silent_cause(positions, steps, waits),
    ):
        if found is not None:
            return found
    waiting = {w.rank for w in waits}
    for p in positions:
        if p.rank not in waiting and _waiting_on(p.rank, waits):
            chain = _waiting_on(p.rank, waits)
            return f"rank {p.rank} is busy at step {p.step} ({p.action}); {_ranks_and_steps(chain)}"
    return "no rank is named: every rank that published waits for another or has ended"


def build_stop_report(
    steps: Sequence[Sequence[Step]], heads: Mapping[int, Head], iteration: int = 0
) -> StopReport:
    """One report from the plan's lowered steps and the positions the ranks published.

    Args:
        steps: The lowered plan of the stopped call, by rank (`PlanReport.steps`).
        heads: What each rank that answered published, by pipeline rank.
        iteration: The executor call the ranks were in.

    Returns:
        The report; ranks absent from `heads` are placed by the plan (marked inferred).
    """
    waits = [w for rank, head in sorted(heads.items()) for w in _published_waits(rank, head)]
    positions = [_position(rank, steps, heads, waits) for rank in range(len(steps))]
    return StopReport(
        cause=_cause(positions, steps, heads, waits),
        positions=positions,
        waits=waits,
        plan=_cells(steps),
        heads={rank: dict(head) for rank, head in heads.items()},
        iteration=iteration,
    )
