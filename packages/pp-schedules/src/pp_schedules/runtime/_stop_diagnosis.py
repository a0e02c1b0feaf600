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

Each rank is placed by `rank_position` (one that published nothing, by the plan); the report
and its renderings (text, JSON, a trace) are `StopReport`'s. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pp_schedules.planning import Step
from pp_schedules.runtime._stop_positions import (
    Context,
    Describe,
    Head,
    lost_by_errors,
    published_waits,
    rank_position,
)
from pp_schedules.runtime._stop_report import (
    RankPosition,
    StopReport,
    Wait,
    describe_step,
    paired_step,
)

__all__ = ["build_stop_report"]


def _cells(steps: Sequence[Sequence[Step]]) -> list[list[str]]:
    """Grid cells: compute steps as written, exchanges shortened (``sF6+rB2``)."""

    def cell(step: Step) -> str:
        text = str(step)
        if step.overlap:  # the backward of an F&B step, run with the forward before it
            return f"&{text}"
        return text.replace("SEND_", "s").replace("RECV_", "r") if step.exchange else text

    return [[cell(step) for step in row] for row in steps]


def _described(steps: Sequence[Step], index: int) -> str:
    """Step `index` of a rank's steps in words (an F&B step with its backward)."""
    return describe_step(steps[index], paired=paired_step(steps, index))


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


def _mismatch_cause(context: Context) -> str | None:
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


def _own_failure_cause(positions: Sequence[RankPosition], context: Context) -> str | None:
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
    positions: Sequence[RankPosition], context: Context, waits: Sequence[Wait]
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


def _lost_sentence(p: RankPosition, context: Context, waits: Sequence[Wait], how: str) -> str:
    where = ""
    if p.step is not None and p.stage is not None:
        where = (
            f"; by the plan it was at {_described(context.steps[p.stage], p.step)} "
            f"(step {p.step}, inferred)"
        )
    waiting = _who_waits(_waiting_on(p.rank, waits), p.rank, _seen(p.rank, context))
    return f"{p.name} is {how}{where}{waiting}"


def _seen(rank: int, context: Context) -> dict[int, str]:
    """What the survivors' errors saw of `rank`: its connection close, or a wait time out.

    For a collective's error, in which collective.
    """
    seen = {}
    for other in lost_by_errors(rank, context):
        error = context.heads[other].get("error") or {}
        verb = "timed out waiting for it" if error.get("timed_out") else "saw its connection close"
        operation = error.get("operation")
        seen[other] = verb if not operation else f"{verb} in {operation}"
    return seen


def _listed(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _silent_cause(
    positions: Sequence[RankPosition], context: Context, waits: Sequence[Wait]
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


def _cause(positions: Sequence[RankPosition], context: Context, waits: Sequence[Wait]) -> str:
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


def _involved(context: Context, waits: Sequence[Wait]) -> list[int]:
    """The ranks a report places: the pipeline's, then those waited for, publishing or lost.

    A rank the liveness records show lost counts wherever it is: while one is gone, the live
    head of this pipeline's waits is not the cause.
    """
    heads, ranks = context.heads, context.pipeline
    lost = {
        int(error["peer"])
        for head in heads.values()
        if (error := head.get("error") or {}).get("lost") and error.get("peer") is not None
    }
    others = sorted({w.peer for w in waits} | set(heads) | lost) if heads else []
    others += sorted(
        rank
        for rank, live in context.liveness.items()
        if getattr(live, "state", None) in _LOST and rank not in others and rank not in ranks
    )
    return list(ranks) + [r for r in others if r not in ranks]


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

    context = Context(steps, heads, ranks, liveness or {}, describe or by_pipeline)
    waits = [
        w for rank, head in sorted(heads.items()) for w in published_waits(rank, head, context)
    ]
    positions = [rank_position(rank, context, waits) for rank in _involved(context, waits)]
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
