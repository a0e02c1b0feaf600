"""Telling the other ranks where this rank is, through a store that outlives the broken group.

When a pipeline stops (a p2p timeout, a lost peer, a contract mismatch, or a trainer's own stop
on SIGTERM), each rank that can still act publishes one JSON document under
``where/<global rank>`` through a `pp_state.store_channel.StoreChannel`: the default process
group's store (torchrun's TCPStore, a FileStore in tests), which does not depend on the
pipeline's connections. It then reads its neighbours' documents, and theirs', around the ring
of stages, until every stage has answered or a short bounded wait is over; a rank that never
answers is placed by the plan (`pp_schedules.stop_report`). Nothing here waits without a
bound, and a store that fails only costs a one-line note on stderr.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Protocol

import torch.distributed as dist

from pp_comm import P2PCommunicator, P2PError, P2PMismatchError, P2PTimeoutError
from pp_schedules.flight_recorder import FlightRecorder
from pp_schedules.stop_report import StopReport, build_stop_report
from pp_state.collectives import CollectiveError
from pp_state.numbers import is_real
from pp_state.store_channel import StoreChannel

__all__ = [
    "DEFAULT_REPORT_WAIT_S",
    "StopHost",
    "check_report_wait",
    "error_record",
    "gather_positions",
    "position_document",
    "publish_document",
    "publish_head",
    "read_position",
    "report_stop",
]

DEFAULT_REPORT_WAIT_S = 5.0
"""How long a stopped rank waits for the other ranks' positions, at most."""
_POLL_S = 0.05
_MESSAGE_CHARS = 400


class StopHost(Protocol):
    """What publishing and reporting read of the executor (`PipelineExecutor` is one)."""

    communicator: P2PCommunicator | None
    rank: int
    pp_size: int
    recorder: FlightRecorder
    channel: StoreChannel | None
    report_wait: float


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
    """A neighbour's pipeline rank from its global rank (errors name global ranks)."""
    stage, size = communicator.stage, communicator.num_stages
    if peer == communicator.next_rank:
        return (stage + 1) % size
    if peer == communicator.prev_rank:
        return (stage - 1) % size
    return None


def error_record(
    error: BaseException | None, communicator: P2PCommunicator
) -> dict[str, Any] | None:
    """The error a rank stopped with, as plain data.

    Keys: ``type``, ``message`` (its first line, shortened), ``peer`` (the pipeline rank it
    names, if a neighbour), ``transfer`` (a p2p or collective failure rather than the rank's
    own), ``timed_out``, ``lost`` (a peer closed or did not answer) and ``mismatch``.
    """
    if error is None:
        return None
    lines = str(error).strip().splitlines()
    # The backend's own words (source paths, advice) follow " Cause: " in pp-comm's errors.
    message = lines[0].split(" Cause: ")[0][:_MESSAGE_CHARS] if lines else ""
    transfer = isinstance(error, (P2PError, CollectiveError))
    peer = getattr(error, "peer", None) if transfer else None
    timed_out = isinstance(error, P2PTimeoutError) or bool(getattr(error, "timed_out", False))
    mismatch = isinstance(error, P2PMismatchError)
    return {
        "type": type(error).__name__,
        "message": message,
        "peer": _peer_stage(communicator, peer) if isinstance(peer, int) else None,
        "transfer": transfer,
        "timed_out": timed_out,
        "lost": transfer and not mismatch,
        "mismatch": mismatch,
    }


def position_document(host: StopHost, error: BaseException | None = None) -> dict[str, Any]:
    """What a rank publishes: where it is, its recent steps, its neighbours and its error."""
    comm = host.communicator
    assert comm is not None, "only a pipeline of two or more stages publishes positions"
    recorder = host.recorder
    return {
        "rank": host.rank,
        "global_rank": comm.rank,
        "prev_rank": comm.prev_rank,
        "next_rank": comm.next_rank,
        "pp_size": host.pp_size,
        "iteration": recorder.iteration,
        "position": recorder.head(),
        "recent": recorder.recent(),
        "error": error_record(error, comm),
        "published_at": time.time(),
        # Recorded times are perf_counter's; this moves them onto the wall clock ranks share.
        "clock_offset": time.time() - time.perf_counter(),
    }


def _note(rank: int, what: str, error: BaseException) -> None:
    print(
        f"pp-schedules: rank {rank} could not {what} ({type(error).__name__}: {error}); "
        "the stop report goes without it",
        file=sys.stderr,
        flush=True,
    )


def publish_document(channel: StoreChannel, document: dict[str, Any]) -> bool:
    """Set the rank's document in the store; False (after a note on stderr) if the store fails."""
    try:
        channel.set(_key(document["global_rank"]), json.dumps(document))
    except Exception as error:  # a gone store must not hide the real failure
        _note(document["rank"], "publish its position", error)
        return False
    return True


def _neighbours(document: dict[str, Any]) -> dict[int, int]:
    stage, size = document["rank"], document["pp_size"]
    return {(stage - 1) % size: document["prev_rank"], (stage + 1) % size: document["next_rank"]}


def read_position(channel: StoreChannel, global_rank: int) -> dict[str, Any] | None:
    """The position `global_rank` published in `channel`, or None if it has published none."""
    key = channel.prefix + _key(global_rank)
    if not channel.store.check([key]):
        return None
    document: dict[str, Any] = json.loads(channel.store.get(key))
    return document


def gather_positions(
    channel: StoreChannel, own: dict[str, Any], wait_s: float
) -> dict[int, dict[str, Any]]:
    """The documents of every stage that answers within `wait_s`, by pipeline rank.

    Stages are found around the ring: each document names its neighbours' global ranks.
    """
    known = {own["rank"]: own}
    where = _neighbours(own)
    deadline = time.monotonic() + wait_s
    while True:
        for stage, global_rank in list(where.items()):
            if stage in known:
                continue
            try:
                document = read_position(channel, global_rank)
            except Exception as error:  # a gone store ends the wait, quietly
                _note(own["rank"], "read the other ranks' positions", error)
                return known
            if document is not None:
                known[stage] = document
                where.update({s: g for s, g in _neighbours(document).items() if s not in where})
        if len(known) == own["pp_size"] or time.monotonic() >= deadline:
            return known
        time.sleep(_POLL_S)


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
    heads = gather_positions(channel, own, host.report_wait)
    return build_stop_report(host.recorder.plan, heads, host.recorder.iteration)
