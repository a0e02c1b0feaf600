"""Whether a rank is still there, told by evidence: its process, and its heartbeat.

A backend reports a dead peer as "Connection closed by peer [127.0.0.1]:18088": no rank, and
in a group of more than two no way to tell which member went. Each rank therefore leaves a
liveness record in the job's store (a `pp_state.store_channel.StoreChannel`):

- its **identity**, published once (`publish_identity`): host, process id, and what makes a
  process id comparable (the boot and the process-id namespace);
- a **heartbeat** (`beat`): the wall-clock time, set again and again by a thread of the
  trainer's (pp-train's signal watcher beats every half second);
- a **leaving note** (`leave`), set by a rank that stops on an error of its own seeing, just
  before it exits: a rank that left after others failed is not the one that was lost.

`assess(channel, ranks)` turns them into a `Liveness` per rank: on the same host (and in the
same process-id namespace) the process itself says it (gone when it has exited, stopped when
it is stopped, SIGSTOP), elsewhere the heartbeat does (gone or stopped when it is older than
`stale_after` seconds). A gone rank that left a note is "left", not lost. `lost_peer(channel,
ranks)` names the rank of a group that such evidence shows lost first (the one whose
heartbeat stopped first; without heartbeats, gone before stopped before silent), for an error
that would otherwise say "peer rank unknown". Heartbeats are compared by wall-clock time: on
several hosts, their clocks must agree within a second or so (NTP).

Nothing here waits without a bound; a store that fails makes every rank "unknown".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from typing import Literal

from pp_state.store_channel import StoreChannel

__all__ = [
    "HEARTBEAT_S",
    "STALE_AFTER_S",
    "Identity",
    "Liveness",
    "assess",
    "beat",
    "describe",
    "leave",
    "lost_first",
    "lost_peer",
    "own_identity",
    "peer_finder",
    "publish_identity",
]

HEARTBEAT_S = 0.5
"""How often a trainer's thread is meant to beat (pp-train's signal watcher)."""
STALE_AFTER_S = 3.0
"""A heartbeat older than this says the rank is gone or stopped."""

State = Literal["alive", "gone", "stopped", "silent", "left", "unknown"]


@dataclasses.dataclass(frozen=True)
class Identity:
    """Which process a rank is, as another process can check it.

    Attributes:
        rank: The global rank.
        host: The host name.
        pid: The process id.
        space: The boot and process-id namespace the pid belongs to ("" where unknown): two
            processes with the same `space` can look at each other's pid.
    """

    rank: int
    host: str
    pid: int
    space: str = ""


@dataclasses.dataclass(frozen=True)
class Liveness:
    """What the evidence says of one rank.

    Attributes:
        rank: The global rank.
        state: "alive"; "gone" (its process has exited without a note); "stopped" (its
            process is stopped); "silent" (no heartbeat for a while, on another host: gone or
            stopped); "left" (it exited after a note: it stopped on an error it saw);
            "unknown" (no record, or no store).
        evidence: In words: "its process 4242 on this host has exited", "no heartbeat for
            6.1 s".
        heartbeat_age: Seconds since its last heartbeat, when it beat at all.
    """

    rank: int
    state: State
    evidence: str
    heartbeat_age: float | None = None

    @property
    def lost(self) -> bool:
        """Whether the evidence says the rank cannot answer (gone, stopped or silent)."""
        return self.state in ("gone", "stopped", "silent")


def _space() -> str:
    """This process's boot and process-id namespace ("" off Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
        return f"{boot_id}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def own_identity(rank: int) -> Identity:
    """This process's identity as global rank `rank`."""
    return Identity(rank=rank, host=socket.gethostname(), pid=os.getpid(), space=_space())


def _identity_key(rank: int) -> str:
    return f"alive/{rank}/identity"


def _beat_key(rank: int) -> str:
    return f"alive/{rank}/beat"


def _left_key(rank: int) -> str:
    return f"alive/{rank}/left"


def publish_identity(channel: StoreChannel, rank: int) -> bool:
    """Publish this process's identity as `rank`; False if the store fails (nothing raised).

    A leaving note an earlier process left as `rank` in the same store is removed.
    """
    try:
        with contextlib.suppress(Exception):  # no such key, or a store without deletes
            channel.store.delete_key(channel.prefix + _left_key(rank))
        channel.set(_identity_key(rank), json.dumps(dataclasses.asdict(own_identity(rank))))
    except Exception:  # a gone store must not stop training
        return False
    return True


def beat(channel: StoreChannel, rank: int) -> bool:
    """Set `rank`'s heartbeat to now; False if the store fails (nothing raised)."""
    try:
        channel.set(_beat_key(rank), repr(time.time()))
    except Exception:  # a gone store must not stop training
        return False
    return True


def leave(channel: StoreChannel, rank: int, reason: str) -> bool:
    """Note that `rank` leaves on an error of its own seeing (`reason`, one line).

    Set just before the process exits. Returns False if the store fails (nothing raised).
    """
    try:
        channel.set(_left_key(rank), json.dumps({"reason": reason[:300], "time": time.time()}))
    except Exception:  # a gone store must not stop a rank from leaving
        return False
    return True


def _read(channel: StoreChannel, key: str) -> str | None:
    full = channel.prefix + key
    if not channel.store.check([full]):
        return None
    value: bytes = channel.store.get(full)
    return value.decode()


def _process_state(pid: int) -> str | None:
    """The state letter of process `pid` ("R", "S", "T", "Z", ...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            text = stat.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()[0] if ")" in text else "?"


def _by_process(identity: Identity, here: str) -> Liveness | None:
    """What the process says, when it can be seen from here (same boot and namespace).

    A running process is alive whatever its heartbeat says (a thread that beats can be
    starved or busy); None when the process cannot be seen from here.
    """
    if not identity.space or identity.space != here:
        return None
    where = f"its process {identity.pid} on this host"
    state = _process_state(identity.pid)
    if state is None or state in ("Z", "X", "x"):
        return Liveness(identity.rank, "gone", f"{where} has exited")
    if state in ("T", "t"):
        return Liveness(identity.rank, "stopped", f"{where} is stopped")
    return Liveness(identity.rank, "alive", f"{where} runs")


def _one(channel: StoreChannel, rank: int, stale_after: float, here: str) -> Liveness:
    text = _read(channel, _identity_key(rank))
    identity = None if text is None else Identity(**json.loads(text))
    beat_text = _read(channel, _beat_key(rank))
    age = None if beat_text is None else max(time.time() - float(beat_text), 0.0)
    if identity is not None:
        seen = _by_process(identity, here)
        if seen is not None and seen.state == "gone":
            note = _read(channel, _left_key(rank))
            if note is not None:
                reason = json.loads(note).get("reason", "")
                return Liveness(rank, "left", f"it left after its own error: {reason}", age)
        if seen is not None:
            return dataclasses.replace(seen, heartbeat_age=age)
    if age is not None and age > stale_after and _read(channel, _left_key(rank)) is not None:
        return Liveness(rank, "left", "it left after its own error", age)
    if age is not None and age > stale_after:
        where = "" if identity is None else f" (host {identity.host}, process {identity.pid})"
        return Liveness(rank, "silent", f"no heartbeat for {age:.1f} s{where}", age)
    if identity is None and age is None:
        return Liveness(rank, "unknown", "it left no liveness record")
    return Liveness(rank, "alive", "its process runs" if age is None else "it beats", age)


def assess(
    channel: StoreChannel, ranks: Iterable[int], *, stale_after: float = STALE_AFTER_S
) -> dict[int, Liveness]:
    """What the evidence says of each rank of `ranks` (see the module docstring).

    A store that fails (its host gone) makes the rest "unknown", saying so; nothing raises.
    """
    here = _space()
    found: dict[int, Liveness] = {}
    for rank in ranks:
        try:
            found[rank] = _one(channel, rank, stale_after, here)
        except Exception as error:  # evidence is best effort
            reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
            found[rank] = Liveness(rank, "unknown", f"the store did not answer ({reason})")
    return found


def lost_peer(
    channel: StoreChannel,
    ranks: Iterable[int],
    *,
    wait_s: float = 0.0,
    stale_after: float = STALE_AFTER_S,
) -> Liveness | None:
    """The first of `ranks` the evidence shows lost, looking for up to `wait_s` seconds.

    A process on this host is seen at once; a rank elsewhere only once its heartbeat is
    stale, hence the wait (None when no evidence came).
    """
    candidates = list(ranks)
    deadline = time.monotonic() + max(wait_s, 0.0)
    while True:
        found = assess(channel, candidates, stale_after=stale_after)
        lost = [live for live in found.values() if live.lost]
        if lost:
            return min(lost, key=lost_first)
        unknown = all(live.state == "unknown" for live in found.values())
        if time.monotonic() >= deadline or unknown:
            return None
        time.sleep(min(HEARTBEAT_S, max(deadline - time.monotonic(), 0.0)))


def lost_first(live: Liveness) -> tuple[int, float, int]:
    """Sort key: the rank lost first comes first.

    Ranks that beat are ordered by when their heartbeat stopped (oldest first), whatever
    their state: a rank on another host silent for 10 s went before one here gone for 1 s.
    Ranks without a heartbeat come after, gone before stopped before silent.
    """
    order = ("gone", "stopped", "silent").index(live.state) if live.lost else 3
    if live.heartbeat_age is not None:
        return 0, -live.heartbeat_age, order
    return 1, 0.0, order


def describe(live: Liveness) -> str:
    """``gone: its process 4242 on this host has exited``."""
    return f"{live.state}: {live.evidence}"


def peer_finder(
    channel: StoreChannel, *, wait_s: float = STALE_AFTER_S + 2 * HEARTBEAT_S
) -> Callable[[tuple[int, ...]], tuple[int, str] | None]:
    """A peer finder for `pp_state.collectives.set_peer_finder`: `lost_peer` over `channel`."""

    def find(ranks: tuple[int, ...]) -> tuple[int, str] | None:
        live = lost_peer(channel, ranks, wait_s=wait_s)
        return None if live is None else (live.rank, describe(live))

    return find
