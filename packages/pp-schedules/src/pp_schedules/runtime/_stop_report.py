"""Where every rank was when a pipeline stopped, and which rank is the cause.

`build_stop_report` takes the plan's lowered steps, the positions the ranks published (each
rank's flight-recorder head: the plan step or the collective it is in, its recent steps, its
error; see the stop channel) and what the store says of each rank's liveness
(`pp_state.liveness`), and returns a `StopReport`: the rank x step grid of the pipeline with
each rank's step marked, who waits for whom (in a transfer of the plan, or in a collective
outside it), and the cause in one sentence. Every rank is named by its global rank, with its
place ("rank 3 (pipeline stage 1 of [1, 3], dp 1, tp 0)").

The cause is the first of these the evidence shows:

1. a contract mismatch between two ranks;
2. a rank's own failure (an error that is not a lost transfer or collective);
3. a rank lost by liveness: gone (its process has exited), stopped, or silent (no heartbeat);
   among several, the one whose heartbeat stopped first (without heartbeats: gone, then
   stopped, then silent), naming who waits for it; a lost rank of another pipeline that the
   positions do not mention counts too (the cause then says where this pipeline's chain
   ends: a live rank is never the cause while one is lost);
4. a rank the survivors' errors show lost (a connection closed), without liveness records;
5. a rank that published nothing and that others wait for;
6. the head of the waits-for chain within one call ("busy").

Positions are compared by (call, step) and collectives by (group, sequence number): a rank
that ended call N and sits in a collective is never taken as busy in call N + 1. Documents
that cannot belong to this run (another plan, pipeline size or world size, another run's
token) are listed as ignored, never used.

A rank that published nothing is placed by the plan: it cannot have posted a send another
rank still waits for, nor passed a step whose receive a rank that published had not yet sent.

Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pp_schedules.planning import Step
from pp_schedules.runtime._timeline import recorded_trace

__all__ = ["RankPosition", "StopReport", "Wait", "build_stop_report", "describe_step"]

Head = Mapping[str, Any]
"""What one rank published: see `position_document`."""
Describe = Callable[[int], str]
"""Names a global rank with its place: ``rank 3 (pipeline stage 1 of [1, 3], dp 1, tp 0)``."""

_MARGIN = 3  # grid columns shown around the marked steps


@dataclasses.dataclass(frozen=True)
class Wait:
    """One rank waiting for another.

    Attributes:
        rank: The waiting global rank.
        step: Its plan step (index in its lowered plan); None in a collective outside a step.
        action: That step's string form, or the collective's operation.
        peer: The global rank it waits for.
        what: What it waits for, in words ("activations of mb 6 chunk 1 (recv)", "exit
            decision over ranks [0, 1, 2, 3]").
        key: The tensor's key of a transfer (channel, microbatch, sender chunk, receiver
            chunk); empty for a collective.
        call: The executor call the waiting rank is in (or last ran).
    """

    rank: int
    step: int | None
    action: str
    peer: int
    what: str
    key: tuple[Any, ...]
    call: int = 0


@dataclasses.dataclass(frozen=True)
class RankPosition:
    """Where one rank was.

    Attributes:
        rank: Global rank.
        stage: Its pipeline stage in the reported pipeline; None for a rank of another
            pipeline (a data-parallel peer in a collective).
        name: The rank with its place ("rank 3 (pipeline stage 1 of [1, 3], dp 1, tp 0)").
        step: Index in its lowered plan; None when unknown or outside the plan.
        action: The step's string form ("" when unknown).
        state: "running", "posting", "waiting" or "ended" for a rank that published (or "in
            a collective"); "gone", "stopped", "silent", "left" (it exited after an error of
            its own seeing), "not answering" or "quiet" (nobody waits for it) for one that
            did not.
        inferred: Whether the step comes from the plan rather than the rank.
        error: The error it stopped with ("Type: first line"), if it published one.
        call: The executor call it is in or last ran; None when unknown.
        collective: The collective it is in (or ran last, after its last step), in words.
        liveness: What its liveness record says, when it was read ("gone: its process 4242
            on this host has exited").
        iteration: The training iteration it said it was in, when known.
    """

    rank: int
    stage: int | None
    name: str
    step: int | None
    action: str
    state: str
    inferred: bool
    error: str | None = None
    call: int | None = None
    collective: str | None = None
    liveness: str | None = None
    iteration: int | None = None

    @property
    def order(self) -> tuple[int, int, int, int]:
        """(training iteration, call, phase, step): how far the rank got (unknown: first)."""
        iteration = -1 if self.iteration is None else self.iteration
        call = -1 if self.call is None else self.call
        step = -1 if self.step is None else self.step
        outside = 1 if self.collective is not None and self.state == "in a collective" else 0
        return iteration, call, outside, step


@dataclasses.dataclass(frozen=True)
class StopReport:
    """One report of a stopped pipeline (see `build_stop_report`).

    Attributes:
        cause: One sentence naming the rank that stopped the pipeline and why.
        positions: Every rank's position: the pipeline's stages in order, then the other
            ranks that take part (data-parallel peers of a collective).
        waits: Who waits for whom, at which step or collective, for what.
        plan: The plan's lowered steps as grid cells, by stage.
        heads: What each rank published, by global rank (plain data).
        iteration: The executor call the reporting rank was in.
        pipeline: The reported pipeline's global ranks, in stage order.
        ignored: Documents set aside, with why ("rank 5: published for another plan").
        store_traces: The stack traces torch printed for the store while this rank gathered
            (kept out of the console, written beside the report).
    """

    cause: str
    positions: list[RankPosition]
    waits: list[Wait]
    plan: list[list[str]]
    heads: dict[int, dict[str, Any]]
    iteration: int = 0
    pipeline: tuple[int, ...] = ()
    ignored: list[str] = dataclasses.field(default_factory=list)
    store_traces: list[str] = dataclasses.field(default_factory=list)

    @property
    def answered(self) -> list[int]:
        """The pipeline's global ranks that published, in stage order."""
        return [rank for rank in self.pipeline if rank in self.heads]

    @property
    def reporter(self) -> int | None:
        """The global rank that prints the report: the lowest stage that stopped and built one.

        Not a rank that only answered an ask for its position.
        """
        reporting = [r for r in self.answered if not self.heads[r].get("answers_ask")]
        return reporting[0] if reporting else None

    def grid(self) -> str:
        """The stage x step grid around the marked steps, rows named by global rank.

        ``[x]``: the step the rank published; ``(x)``: the step inferred from the plan.
        """
        in_pipeline = [p for p in self.positions if p.stage is not None]
        known = [p.step for p in in_pipeline if p.step is not None]
        longest = max((len(row) for row in self.plan), default=0)
        low = max(min(known, default=0) - _MARGIN, 0)
        high = min(max(known, default=longest) + _MARGIN, longest - 1)
        rows = [list(row[low : high + 1]) for row in self.plan]
        for position in in_pipeline:
            if position.step is not None and low <= position.step <= high:
                assert position.stage is not None
                cell = rows[position.stage][position.step - low]
                rows[position.stage][position.step - low] = (
                    f"({cell})" if position.inferred else f"[{cell}]"
                )
        width = max((len(c) for row in rows for c in row), default=1) + 2
        labels = [f"rank {rank}: " for rank in self.pipeline] or [""] * len(rows)
        label = max((len(text) for text in labels), default=0)
        header = "step".ljust(label) + "".join(str(i).ljust(width) for i in range(low, high + 1))
        lines = [header.rstrip()]
        for text, row in zip(labels, rows, strict=False):
            lines.append((text.ljust(label) + "".join(c.ljust(width) for c in row)).rstrip())
        return "\n".join(lines)

    def render(self) -> str:
        """The report as text: cause, grid, waits, every rank's position, what was ignored."""
        pipeline = f" in pipeline {list(self.pipeline)}" if self.pipeline else ""
        lines = [f"pipeline stopped (call {self.iteration}){pipeline}: {self.cause}", ""]
        lines += ["where every rank is ([x] as it said, (x) inferred from the plan):", self.grid()]
        names = {p.rank: p.name for p in self.positions}
        if self.waits:
            lines += ["", "waits:"]
            for w in self.waits:
                where = (
                    f"at step {w.step} ({w.action}) of call {w.call}"
                    if w.step is not None
                    else f"in {w.action} (after call {w.call})"
                )
                lines.append(
                    f"  {names.get(w.rank, f'rank {w.rank}')} waits {where} for rank "
                    f"{w.peer}: {w.what}"
                )
        lines += ["", "ranks (by iteration, call and step):"]
        for p in sorted(self.positions, key=lambda p: (p.order, p.rank)):
            lines.append(f"  {p.name}: {_where(p)}")
        if self.ignored:
            lines += ["", "ignored (not of this run):", *[f"  {text}" for text in self.ignored]]
        return "\n".join(lines)

    def to_json(self) -> str:
        """The report as one JSON document (cause, positions, waits, grid text, heads)."""
        return json.dumps(
            {
                "iteration": self.iteration,
                "pipeline": list(self.pipeline),
                "cause": self.cause,
                "positions": [dataclasses.asdict(p) for p in self.positions],
                "waits": [dataclasses.asdict(w) for w in self.waits],
                "grid": self.grid(),
                "heads": {str(rank): head for rank, head in self.heads.items()},
                "ignored": self.ignored,
                "store_traces": self.store_traces,
            },
            indent=1,
        )

    def chrome_trace(self) -> str:
        """A Chrome trace of the recorded steps of every rank that published, a track each.

        Tracks are named by global rank. Times are wall-clock (each rank's monotonic clock
        moved by the offset it published); a step still open when the rank published ends
        at that moment.
        """
        return recorded_trace([p.rank for p in self.positions], self.heads)

    def write(self, directory: str | Path, stem: str = "pipeline-stop") -> list[Path]:
        """Write ``<stem>.txt``, ``<stem>.json`` and ``<stem>.trace.json`` under `directory`.

        With `store_traces`, ``<stem>.store-traces.txt`` too.
        """
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        paths = [root / f"{stem}.txt", root / f"{stem}.json", root / f"{stem}.trace.json"]
        texts = [self.render(), self.to_json(), self.chrome_trace()]
        if self.store_traces:
            paths.append(root / f"{stem}.store-traces.txt")
            texts.append("\n".join(trace.rstrip() for trace in self.store_traces))
        for path, text in zip(paths, texts, strict=True):
            path.write_text(text + ("\n" if not text.endswith("\n") else ""))
        return paths


def _where(p: RankPosition) -> str:
    """One rank's line after its name: where it was, its state, its error or evidence."""
    if p.state == "in a collective":
        place = f"after call {p.call}" if p.step is None else f"call {p.call} step {p.step}"
        where = f"{place}, in {p.collective}"
        return f"{where}, {', '.join(x for x in (p.liveness or '', p.error or '') if x) or 'alive'}"
    elif p.step is None:
        where = "step unknown"
    else:
        where = (
            f"call {p.call} step {p.step} ({p.action})" if p.call else f"step {p.step} ({p.action})"
        )
    said = "inferred, published nothing" if p.inferred or p.call is None else ""
    if p.inferred and p.step is None:
        said = "published nothing"
    live = p.liveness or ""
    if live.startswith(f"{p.state}: "):  # "gone, ..., gone: its process ..." says it twice
        live = live[len(p.state) + 2 :]
    detail = ", ".join(x for x in (p.state, said, live, p.error or "") if x)
    return f"{where}, {detail}"


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


# ------------------------------------------------------------------------------ the evidence
@dataclasses.dataclass(frozen=True)
class _Context:
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


def _published_waits(rank: int, head: Head, context: _Context) -> list[Wait]:
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


def _collective_waits(rank: int, head: Head, context: _Context) -> list[Wait]:
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


def _blocked_by_survivors(stage: int, context: _Context) -> int | None:
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


def _inferred_step(rank: int, context: _Context, waits: Sequence[Wait]) -> int | None:
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


def _lost_by_errors(rank: int, context: _Context) -> list[int]:
    """The ranks whose errors say their transfer or collective with `rank` was lost."""
    return [
        other
        for other, head in sorted(context.heads.items())
        if (head.get("error") or {}).get("peer") == rank and (head.get("error") or {}).get("lost")
    ]


def _silent_state(rank: int, context: _Context, waits: Sequence[Wait]) -> str:
    """What a rank that published nothing is, by its liveness record or the others' errors."""
    live = context.liveness.get(rank)
    state = getattr(live, "state", None)
    if state in ("gone", "stopped", "silent", "left"):
        return str(state)
    if any(
        not (context.heads[other].get("error") or {}).get("timed_out")
        for other in _lost_by_errors(rank, context)
    ):
        return "gone"
    return "not answering" if any(w.peer == rank for w in waits) else "quiet"


def _liveness_text(rank: int, context: _Context) -> str | None:
    live = context.liveness.get(rank)
    if live is None or getattr(live, "state", "unknown") in ("unknown", "alive"):
        return None
    return f"{live.state}: {live.evidence}"


def _collective_text(collective: Mapping[str, Any]) -> str:
    return (
        f"{collective['operation']} over ranks {list(collective['group'])} ({collective['state']})"
    )


def _position(rank: int, context: _Context, waits: Sequence[Wait]) -> RankPosition:
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


# ------------------------------------------------------------------------------ the cause
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


def _who_waits(waits: Sequence[Wait], target: int, seen: Mapping[int, str] | None = None) -> str:
    """Who waits for `target` and where, then those behind them.

    `seen` says, for a rank whose error saw `target` lost, what it saw ("saw its connection
    close in ..."); such a rank that waits for no one is named too.
    """
    seen = seen or {}
    direct: dict[int, Wait] = {}
    for wait in sorted(waits, key=lambda w: w.rank):
        if wait.peer == target:
            direct.setdefault(wait.rank, wait)
    grouped: dict[tuple[str, str], list[int]] = {}  # ranks by what they saw and where
    for rank, wait in direct.items():
        verb = seen.get(rank, "waits for it").split(" in ", 1)[0]  # the place says where
        grouped.setdefault((verb, _wait_place(wait)), []).append(rank)
    said, last = [], ""
    for (seen_verb, place), ranks in grouped.items():  # the verb said once for a run
        plural = len(ranks) > 1 and seen_verb == "waits for it"
        verb = "wait for it" if plural else seen_verb
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_listed(ranks)}"
        said.append(f"{who}{'' if verb == last else ' ' + verb} {place}")
        last = verb
    by_verb: dict[str, list[int]] = {}
    for rank in sorted(set(seen) - set(direct)):
        by_verb.setdefault(seen[rank], []).append(rank)
    for verb, ranks in by_verb.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_listed(ranks)}"
        said.append(f"{who} {verb}")
    if not said:
        return ""
    behind = sorted({w.rank for w in waits} - set(direct) - set(seen))
    text = "; " + ", ".join(said)
    if behind:
        who = f"rank {behind[0]}" if len(behind) == 1 else f"ranks {_listed(behind)}"
        text += f" ({who} behind)"
    return text


def _wait_place(wait: Wait) -> str:
    """Where a rank waits: "at step 15 (B2) of call 1" or "in exit decision over ... (call 3)"."""
    if not wait.key:  # in a collective
        at = "" if wait.step is None else f" at step {wait.step}"
        return f"in {wait.what}{at} (call {wait.call})"
    return f"at step {wait.step} ({wait.action}) of call {wait.call}"


def _mismatch_cause(context: _Context) -> str | None:
    for rank, head in sorted(context.heads.items()):
        error = head.get("error") or {}
        if error.get("mismatch"):
            peer = error.get("peer")
            low, high = sorted((rank, rank if peer is None else peer))
            return (
                f"contract mismatch between {context.name(low)} and {context.name(high)}: "
                f"{error['message']}"
            )
    return None


def _own_failure_cause(positions: Sequence[RankPosition], context: _Context) -> str | None:
    """A rank that failed on its own (not in a transfer), e.g. an error in its forward."""
    for p in positions:
        error = (context.heads.get(p.rank) or {}).get("error")
        if error and not error.get("transfer"):
            at = f"step {p.step} ({p.action})" if p.step is not None else "outside the plan"
            return f"{p.name} failed at {at} of call {p.call}: {p.error}"
    return None


_LOST = ("gone", "stopped", "silent")


def _lost_first(live: Any) -> tuple[int, float, int]:
    """The rank lost first first: by when its heartbeat stopped, else gone, stopped, silent.

    (`pp_state.liveness.lost_first`'s order, kept here without its import: pure Python.)
    """
    order = _LOST.index(live.state)
    age = getattr(live, "heartbeat_age", None)
    return (0, -float(age), order) if age is not None else (1, 0.0, order)


def _lost_cause(
    positions: Sequence[RankPosition], context: _Context, waits: Sequence[Wait]
) -> str | None:
    """The rank its liveness record shows lost first (gone, stopped or silent).

    With who waits for it; a rank that published a position is not lost.
    """
    lost = [
        (context.liveness[p.rank], p)
        for p in positions
        if p.rank in context.liveness
        and context.liveness[p.rank].state in _LOST
        and p.rank not in context.heads
    ]
    if not lost:
        return None
    live, p = min(lost, key=lambda pair: _lost_first(pair[0]))
    sentence = _lost_sentence(p, context, waits, f"{live.state} ({live.evidence})")
    if _waiting_on(p.rank, waits) or _seen(p.rank, context):
        return sentence
    return _elsewhere(sentence, positions, waits)


def _lost_sentence(p: RankPosition, context: _Context, waits: Sequence[Wait], how: str) -> str:
    where = ""
    if p.step is not None and p.stage is not None:
        where = (
            f"; by the plan it was at {describe_step(context.steps[p.stage][p.step])} "
            f"(step {p.step}, inferred)"
        )
    waiting = _who_waits(_waiting_on(p.rank, waits), p.rank, _seen(p.rank, context))
    return f"{p.name} is {how}{where}{waiting}"


def _seen(rank: int, context: _Context) -> dict[int, str]:
    """What the survivors' errors saw of `rank`: its connection close, or a wait time out.

    For a collective's error, in which collective.
    """
    seen = {}
    for other in _lost_by_errors(rank, context):
        error = context.heads[other].get("error") or {}
        verb = "timed out waiting for it" if error.get("timed_out") else "saw its connection close"
        operation = error.get("operation")
        seen[other] = verb if not operation else f"{verb} in {operation}"
    return seen


def _listed(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _silent_cause(
    positions: Sequence[RankPosition], context: _Context, waits: Sequence[Wait]
) -> str | None:
    for wanted in (("gone",), ("not answering",)):
        for p in positions:
            if p.inferred and p.state in wanted and (p.state != "not answering" or waits):
                how = "gone" if p.state == "gone" else "not answering (published nothing)"
                return _lost_sentence(p, context, waits, how)
    return None


def _busy_cause(positions: Sequence[RankPosition], waits: Sequence[Wait]) -> str | None:
    """The head of a waits-for chain within one call: a rank others wait for, itself not."""
    waiting = {w.rank for w in waits}
    for p in positions:
        if p.rank in waiting or p.inferred:
            continue
        chain = [w for w in _waiting_on(p.rank, waits) if w.call == p.call]
        if chain and p.step is not None:
            at = f"step {p.step} ({p.action}) of call {p.call}"
            return f"{p.name} is busy at {at}{_who_waits(chain, p.rank)}"
    for p in positions:
        if p.rank not in waiting and not p.inferred and _waiting_on(p.rank, waits):
            left = "in " + p.collective if p.collective else f"after call {p.call}"
            return (
                f"{p.name} has not reached the others' call: it is {left}"
                f"{_who_waits(_waiting_on(p.rank, waits), p.rank)}"
            )
    return None


def _cause(positions: Sequence[RankPosition], context: _Context, waits: Sequence[Wait]) -> str:
    for found in (
        _mismatch_cause(context),
        _own_failure_cause(positions, context),
        _lost_cause(positions, context, waits),
        _silent_cause(positions, context, waits),
        _busy_cause(positions, waits),
    ):
        if found is not None:
            return found
    return "no rank is named: every rank that published waits for another or has ended"


def _elsewhere(cause: str, positions: Sequence[RankPosition], waits: Sequence[Wait]) -> str:
    """A lost rank nobody here waits for: say too where this pipeline's chain ends."""
    busy = _busy_cause(positions, waits)
    return cause if busy is None else f"{cause}; in this pipeline {busy}"


def build_stop_report(
    steps: Sequence[Sequence[Step]],
    heads: Mapping[int, Head],
    iteration: int = 0,
    *,
    pipeline: Sequence[int] | None = None,
    liveness: Mapping[int, Any] | None = None,
    describe: Describe | None = None,
    ignored: Sequence[str] = (),
) -> StopReport:
    """One report from the plan's lowered steps and the positions the ranks published.

    Args:
        steps: The lowered plan of the stopped call, by stage (`PlanReport.steps`).
        heads: What each rank that answered published, by global rank.
        iteration: The executor call the reporting rank was in.
        pipeline: The pipeline's global ranks in stage order; by default stage `s` is
            global rank `s`.
        liveness: What the store says of each rank (`pp_state.liveness.Liveness` by global
            rank: ``state`` and ``evidence``); none by default. A lost rank in it that no
            position mentions is placed among the other ranks.
        describe: Names a rank that published nothing, with its place; by default its
            pipeline stage only.
        ignored: Documents set aside as not of this run, in words.

    Returns:
        The report; stages absent from `heads` are placed by the plan (marked inferred).
    """
    ranks = tuple(pipeline) if pipeline is not None else tuple(range(len(steps)))

    def by_pipeline(rank: int) -> str:
        if rank in ranks:
            return f"rank {rank} (pipeline stage {ranks.index(rank)} of {list(ranks)})"
        return f"rank {rank}"

    context = _Context(steps, heads, ranks, liveness or {}, describe or by_pipeline)
    waits = [
        w for rank, head in sorted(heads.items()) for w in _published_waits(rank, head, context)
    ]
    lost = {
        int(error["peer"])
        for head in heads.values()
        if (error := head.get("error") or {}).get("lost") and error.get("peer") is not None
    }
    others = sorted({w.peer for w in waits} | set(heads) | lost) if heads else []
    # A rank the liveness records show lost counts wherever it is: while one is gone, the
    # live head of this pipeline's waits is not the cause.
    others += sorted(
        rank
        for rank, live in context.liveness.items()
        if getattr(live, "state", None) in _LOST and rank not in others and rank not in ranks
    )
    involved = list(ranks) + [r for r in others if r not in ranks]
    positions = [_position(rank, context, waits) for rank in involved]
    return StopReport(
        cause=_cause(positions, context, waits),
        positions=positions,
        waits=waits,
        plan=_cells(steps),
        heads={rank: dict(head) for rank, head in heads.items()},
        iteration=iteration,
        pipeline=ranks,
        ignored=list(ignored),
    )
