"""Telling the other ranks where this rank is, through a store that outlives the broken group.

When a pipeline stops (a p2p timeout, a lost peer, a contract mismatch, or a trainer's own stop
on SIGTERM), each rank that can still act publishes one JSON document under
``where/<global rank>`` through a `pp_state.store_channel.StoreChannel`: the default process
group's store (torchrun's TCPStore, a FileStore in tests), which does not depend on the
pipeline's connections. It then reads its neighbours' documents, and theirs', around the ring
of stages, until every stage has answered or a short bounded wait is over; a rank that never
answers is placed by the plan (`StopReport`). Nothing here waits without a
bound, and a store that fails only costs a one-line note on stderr.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch.distributed as dist

from pp_comm import P2PCommunicator, P2PError, P2PMismatchError, P2PTimeoutError
from pp_schedules.runtime._flight_recorder import FlightRecorder
from pp_schedules.runtime._stop_diagnosis import build_stop_report
from pp_schedules.runtime._stop_report import StopReport
from pp_state.collectives import CollectiveError, is_lost_peer
from pp_state.coordinates import RankCoordinates
from pp_state.liveness import assess
from pp_state.numbers import is_real
from pp_state.store_channel import StoreChannel, store_traces

__all__ = [
    "DEFAULT_REPORT_WAIT_S",
    "StopHost",
    "answer_ask",
    "ask_to_publish",
    "check_report_wait",
    "coordinates_of",
    "describe_rank",
    "error_record",
    "first_line",
    "foreign",
    "gather_positions",
    "plan_digest",
    "position_document",
    "publish_document",
    "publish_head",
    "read_position",
    "report_stop",
]

_PUBLISHING = threading.Lock()
"""Held while a thread of this process publishes its position (the main thread's failure,
the watcher's answer to an ask): an answer never overwrites a failure published meanwhile."""
DEFAULT_REPORT_WAIT_S = 5.0
"""How long a stopped rank waits for the other ranks' positions, at most."""
_POLL_S = 0.05
_EARLIER_S = 1.0  # a position without an error older than this before one's own is a snapshot
_LOOK_S = 0.5  # how often a gather reads the liveness records of the ranks it waits for
_MESSAGE_CHARS = 400


class StopHost(Protocol):
    """What publishing and reporting read of the executor (`PipelineExecutor` is one)."""

    communicator: P2PCommunicator | None
    rank: int
    pp_size: int
    recorder: FlightRecorder
    channel: StoreChannel | None
    report_wait: float
    coordinates: Callable[[int], RankCoordinates] | None
    """Where any global rank sits (pp-train: `ParallelState.coordinates`); None: its
    pipeline stage only."""
    run_token: str | None
    """Names the run, so documents another job left in a shared store are set aside."""


def check_report_wait(seconds: object) -> float:
    """`seconds` as the bounded wait for positions (a finite number > 0).

    Raises:
        ValueError: It is not a finite number of seconds above 0.
    """
    if not is_real(seconds) or not 0 < float(seconds) < math.inf:  # type: ignore[arg-type]
        raise ValueError(f"report_wait must be a finite number of seconds > 0, got {seconds!r}")
    return float(seconds)  # type: ignore[arg-type]


def _key(global_rank: int) -> str:
    return f"where/{global_rank}"


def _peer_stage(communicator: P2PCommunicator, peer: int | None) -> int | None:
    """A pipeline member's stage from its global rank (errors name global ranks)."""
    pipeline = communicator.pipeline_ranks
    return pipeline.index(peer) if peer in pipeline else None


def error_record(
    error: BaseException | None, communicator: P2PCommunicator
) -> dict[str, Any] | None:
    """The error a rank stopped with, as plain data.

    Keys: ``type``, ``message`` (its first line, shortened), ``peer`` (the global rank it
    names as lost), ``peer_stage`` (that rank's stage, when in the pipeline), ``evidence``
    (what showed the peer lost, when the error did not say it itself), ``operation`` (a
    collective's, what it was for), ``transfer`` (a p2p or
    collective failure rather than the rank's own), ``timed_out``, ``lost`` (a peer closed
    or did not answer) and ``mismatch``.
    """
    if error is None:
        return None
    lines = str(error).strip().splitlines()
    # The backend's own words (source paths, advice) follow " Cause: " in pp-comm's errors.
    message = lines[0].split(" Cause: ")[0][:_MESSAGE_CHARS] if lines else ""
    # A backend's own error for a lost peer (a collective outside `collective(...)`) is a
    # lost transfer too, though it names no rank: never this rank's own failure.
    transfer = isinstance(error, (P2PError, CollectiveError)) or is_lost_peer(error)
    peer = getattr(error, "peer", None) if transfer else None
    timed_out = isinstance(error, P2PTimeoutError) or bool(getattr(error, "timed_out", False))
    mismatch = isinstance(error, P2PMismatchError)
    peer = peer if isinstance(peer, int) else None
    return {
        "type": type(error).__name__,
        "message": message,
        "peer": peer,
        "peer_stage": _peer_stage(communicator, peer),
        "evidence": getattr(error, "peer_evidence", None),
        "operation": getattr(error, "operation", None)
        if isinstance(error, CollectiveError)
        else None,
        "transfer": transfer,
        "timed_out": timed_out,
        "lost": transfer and not mismatch,
        "mismatch": mismatch,
    }


def coordinates_of(host: StopHost, rank: int) -> RankCoordinates:
    """Where global rank `rank` sits: the host's coordinates, else its pipeline stage.

    Raises:
        ValueError: Without coordinates, a rank outside the host's pipeline.
    """
    comm = host.communicator
    assert comm is not None
    if host.coordinates is not None:
        try:
            return host.coordinates(rank)
        except (ValueError, RuntimeError):  # not a rank the layout knows, or no layout left
            pass
    pipeline = comm.pipeline_ranks
    if rank not in pipeline:
        raise ValueError(
            f"rank {rank} is not in the pipeline {pipeline} and the host has no coordinates"
        )
    return RankCoordinates(rank=rank, pipeline=tuple(pipeline), stage=pipeline.index(rank))


def describe_rank(host: StopHost, rank: int) -> str:
    """Global rank `rank` with its place, as far as it is known.

    By the host's coordinates, else by its pipeline stage, else (a rank of another pipeline
    the coordinates do not know) by its number alone.
    """
    comm = host.communicator
    if host.coordinates is not None:
        try:
            return host.coordinates(rank).describe()
        except (ValueError, RuntimeError):  # not a rank the layout knows, or no layout left
            pass
    if comm is not None and rank in comm.pipeline_ranks:
        return coordinates_of(host, rank).describe()
    return f"rank {rank}"


def plan_digest(recorder: FlightRecorder) -> str:
    """A short digest of the call's plan: documents of one run share it."""
    text = "\n".join(" ".join(str(step) for step in row) for row in recorder.plan)
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]


def position_document(
    host: StopHost, error: BaseException | None = None, *, answers_ask: bool = False
) -> dict[str, Any]:
    """What a rank publishes: who and where it is, its recent steps, its run and its error.

    `answers_ask`: published on another rank's request, by a rank that builds no report.
    """
    comm = host.communicator
    assert comm is not None, "only a pipeline of two or more stages publishes positions"
    recorder = host.recorder
    world = dist.get_world_size() if dist.is_initialized() else None
    return {
        "rank": host.rank,
        "global_rank": comm.rank,
        "pipeline": comm.pipeline_ranks,
        "coordinates": coordinates_of(host, comm.rank).to_json(),
        "prev_rank": comm.prev_rank,
        "next_rank": comm.next_rank,
        "pp_size": host.pp_size,
        "iteration": recorder.iteration,
        "position": recorder.head(),
        "recent": recorder.recent(),
        "collectives": recorder.collectives()[-8:],
        "error": error_record(error, comm),
        "answers_ask": answers_ask,
        "run": {"world_size": world, "plan": plan_digest(recorder), "token": host.run_token},
        "published_at": time.time(),
        # Recorded times are perf_counter's; this moves them onto the wall clock ranks share.
        "clock_offset": time.time() - time.perf_counter(),
    }


def first_line(error: BaseException) -> str:
    """An error in one line: its type and the first line of its text (no C++ stack trace)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:_MESSAGE_CHARS]}" if lines else type(error).__name__


def _note(rank: int, what: str, error: BaseException) -> None:
    sys.stderr.write(
        f"pp-schedules: rank {rank} could not {what} ({first_line(error)}); "
        "the stop report goes without it\n"
    )
    sys.stderr.flush()


def publish_document(channel: StoreChannel, document: dict[str, Any]) -> bool:
    """Set the rank's document in the store; False (after a note on stderr) if the store fails."""
    try:
        channel.set(_key(document["global_rank"]), json.dumps(document))
    except Exception as error:  # a gone store must not hide the real failure
        _note(document["global_rank"], "publish its position", error)
        return False
    return True


def _wanted(document: dict[str, Any]) -> set[int]:
    """The ranks a document makes the report want: its pipeline, its open collective's group."""
    wanted = set(document.get("pipeline") or [])
    collective = (document.get("position") or {}).get("collective") or {}
    if collective.get("state") in ("waiting", "failed"):
        wanted.update(collective.get("group", []))
    return wanted


def foreign(document: dict[str, Any], own: dict[str, Any]) -> str | None:
    """Why `document` cannot belong to `own`'s run (None when it can)."""
    mine, theirs = own.get("run") or {}, document.get("run") or {}
    if theirs.get("token") != mine.get("token"):
        return "published by another run (another run token)"
    if theirs.get("world_size") != mine.get("world_size"):
        return f"published for world size {theirs.get('world_size')}, not {mine.get('world_size')}"
    if document.get("pp_size") != own.get("pp_size"):
        return f"published for {document.get('pp_size')} pipeline stages, not {own.get('pp_size')}"
    same_pipeline = document.get("pipeline") == own.get("pipeline")
    if same_pipeline and theirs.get("plan") != mine.get("plan"):
        return "published for another plan (another schedule or microbatch count)"
    stale = _training_iteration(document)
    now = _training_iteration(own)
    if stale is not None and now is not None and stale < now - 1:
        # Every iteration ends in a collective over all ranks: no rank is two behind.
        return f"published at iteration {stale}, long before this stop (iteration {now})"
    return None


def _training_iteration(document: dict[str, Any]) -> int | None:
    value = (document.get("position") or {}).get("training_iteration")
    return value if isinstance(value, int) else None


def _ask_key(global_rank: int) -> str:
    return f"ask/{global_rank}"


def ask_to_publish(channel: StoreChannel, ranks: Iterable[int], asker: int) -> None:
    """Ask `ranks` to publish where they are now (a trainer's thread answers: `answer_ask`)."""
    for rank in ranks:
        channel.set(_ask_key(rank), json.dumps({"asker": asker, "time": time.time()}))


def answer_ask(host: StopHost, answered: bytes | None = None) -> bytes | None:
    """Publish this rank's position if another rank asked for it since `answered`.

    For a thread of the trainer's that polls (pp-train's signal watcher): a rank that is
    alive but busy (a long computation, a collective of another group) then shows where it
    is, instead of being placed by the plan. A position with this call's error is never
    overwritten. A failing store raises (the caller notes it).

    Returns:
        The ask now answered (pass it back next time), or `answered` when none is new.
    """
    comm = host.communicator
    channel = host.channel
    if comm is None or channel is None or not host.recorder.plan:
        return answered
    asked = channel.read(_ask_key(comm.rank))
    if asked is None or asked == answered:
        return answered
    with _PUBLISHING:  # never over the position this rank's failure publishes meanwhile
        published = read_position(channel, comm.rank)
        own_error = published is not None and published.get("error") and (
            published.get("iteration") == host.recorder.iteration
        )  # fmt: skip
        if not own_error:
            publish_document(channel, position_document(host, None, answers_ask=True))
    return asked


def read_position(channel: StoreChannel, global_rank: int) -> dict[str, Any] | None:
    """The position `global_rank` published in `channel`, or None if it has published none."""
    text = channel.read(_key(global_rank))
    if text is None:
        return None
    document: dict[str, Any] = json.loads(text)
    return document


def gather_positions(
    channel: StoreChannel, own: dict[str, Any], wait_s: float
) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """The documents of the ranks the report wants that answer within `wait_s`, by global rank.

    Wanted: the pipeline's ranks, and the ranks of each open collective a document shows
    (found as documents come in). A document that cannot belong to this run is set aside.
    A rank that has not answered after a second is asked where it is (`ask_to_publish`). A
    position without an error published before this rank's own (an earlier SIGTERM's, an
    earlier answer) is used only if no newer one comes in time.

    Returns:
        The documents by global rank, and what was set aside, in words.
    """
    known = {own["global_rank"]: own}
    ignored: dict[int, str] = {}
    earlier: dict[int, dict[str, Any]] = {}
    wanted = _wanted(own)
    deadline = time.monotonic() + wait_s
    ask_at, asked = time.monotonic() + min(1.0, wait_s / 4), set[int]()
    lost = _Lost(channel, own["global_rank"])
    while True:
        missing = wanted - set(known) - set(ignored) - asked
        if missing and time.monotonic() >= ask_at:  # alive but busy ranks: say where you are
            try:
                ask_to_publish(channel, missing, own["global_rank"])
            except Exception as error:  # the gather goes on without it
                _note(own["global_rank"], "ask the other ranks for their positions", error)
            asked |= missing
        if asked:  # a rank its record shows lost cannot answer: no need to wait for it
            lost.look(wanted - set(known) - set(ignored))
        for global_rank in sorted(wanted - set(known) - set(ignored)):
            try:
                document = read_position(channel, global_rank)
            except Exception as error:  # a gone store ends the wait, quietly
                _note(own["global_rank"], "read the other ranks' positions", error)
                return {**earlier, **known}, list(ignored.values())
            if document is not None:
                _take(document, own, known, ignored, earlier)
                wanted |= _wanted(known.get(global_rank, {}))
        if not wanted - set(known) - set(ignored) - lost.ranks or time.monotonic() >= deadline:
            return {**earlier, **known}, list(ignored.values())
        time.sleep(_POLL_S)


class _Lost:
    """The ranks a gather waits for that their liveness records show lost (read now and then)."""

    def __init__(self, channel: StoreChannel, rank: int) -> None:
        self.channel = channel
        self.rank = rank
        self.ranks: set[int] = set()
        self._next = 0.0

    def look(self, ranks: set[int]) -> None:
        """Read the records of `ranks` again, at most every half second."""
        if not ranks - self.ranks or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + _LOOK_S
        found = _evidence(self.channel, sorted(ranks - self.ranks), self.rank)
        self.ranks |= {rank for rank, live in found.items() if getattr(live, "lost", False)}


def _take(
    document: dict[str, Any],
    own: dict[str, Any],
    known: dict[int, dict[str, Any]],
    ignored: dict[int, str],
    earlier: dict[int, dict[str, Any]],
) -> None:
    """File a document read for the report: used, set aside, or kept until a newer comes."""
    rank = int(document["global_rank"])
    why = foreign(document, own)
    if why is not None:
        ignored[rank] = f"rank {rank}: {why}"
    elif not document.get("error") and (
        float(document.get("published_at", 0.0)) < float(own["published_at"]) - _EARLIER_S
    ):
        earlier[rank] = document
    else:
        earlier.pop(rank, None)
        known[rank] = document


def _evidence(channel: StoreChannel, ranks: Iterable[int], rank: int) -> dict[int, Any]:
    """What the liveness records say of `ranks` (nothing, after one line, if that fails)."""
    try:
        return dict(assess(channel, ranks))
    except Exception as error:  # evidence is best effort
        _note(rank, "read the liveness records", error)
        return {}


def _channel(host: StopHost) -> StoreChannel | None:
    if host.channel is not None:
        return host.channel
    if not dist.is_initialized():
        return None
    try:
        return StoreChannel.from_default_group(timeout=host.report_wait)
    except Exception as error:  # no store: no report, the error stands
        _note(host.rank, "reach the default group's store", error)
        return None


def publish_head(
    host: StopHost, error: BaseException | None = None
) -> tuple[StoreChannel, dict[str, Any]] | None:
    """Publish this rank's position (its recorder head, recent steps and `error`).

    Returns:
        The channel and the document published, or None: a single stage, no store, no call
        run yet, or a store that failed (noted on stderr).
    """
    channel = _channel(host) if host.communicator is not None and host.pp_size > 1 else None
    if channel is None or not host.recorder.plan:
        return None
    with _PUBLISHING:
        own = position_document(host, error)
        return (channel, own) if publish_document(channel, own) else None


def report_stop(host: StopHost, error: BaseException | None = None) -> StopReport | None:
    """Publish this rank's position, wait for the other ranks' and build the report.

    Waits at most ``host.report_wait`` seconds (less once every stage has answered).

    Args:
        host: The executor.
        error: What stopped this rank, if anything (a signal-driven stop passes None).

    Returns:
        The report, or None when nothing was published (see `publish_head`).
    """
    published = publish_head(host, error)
    if published is None:
        return None
    channel, own = published
    heads, ignored = gather_positions(channel, own, host.report_wait)
    comm = host.communicator
    assert comm is not None
    named = {int(peer) for h in heads.values() if (peer := (h.get("error") or {}).get("peer"))
             is not None}  # fmt: skip
    involved = set(own["pipeline"]) | named | {r for h in heads.values() for r in _wanted(h)}
    liveness = _evidence(channel, sorted(involved - set(heads)), comm.rank)
    if not any(getattr(live, "lost", False) for live in liveness.values()):
        # Nothing lost among the ranks these positions name: a rank lost elsewhere in the
        # job still comes before a live rank that is merely at the head of the waits.
        world = int((own.get("run") or {}).get("world_size") or 0)
        elsewhere = sorted(set(range(world)) - involved - set(heads))
        lost = _evidence(channel, elsewhere, comm.rank)
        liveness |= {rank: live for rank, live in lost.items() if getattr(live, "lost", False)}
    report = build_stop_report(
        host.recorder.plan, heads, host.recorder.iteration, pipeline=comm.pipeline_ranks,
        liveness=liveness, describe=lambda rank: describe_rank(host, rank),
        ignored=ignored,
    )  # fmt: skip
    return dataclasses.replace(report, store_traces=store_traces())
