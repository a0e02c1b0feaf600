"""Whether a rank is still there, told by evidence: its process, and its heartbeat.

A backend reports a dead peer as "Connection closed by peer [127.0.0.1]:18088": no rank, and
in a group of more than two no way to tell which member went. Each rank therefore leaves a
liveness record in the job's store (a `pp_state.store_channel.StoreChannel`):

- its **identity**, published once (`publish_identity`): host, process id, and what makes a
  process id comparable (the boot and the process-id namespace);
- a **heartbeat** (`beat`): the wall-clock time, set again and again by a thread of the
  trainer's (pp-train's signal watcher beats every half second);
- a **leaving note** (`leave`), set by a rank that stops on an error of its own seeing, just
  before it exits: a rank that left after others failed is not the one that was lost;
- its **endpoints** (`publish_endpoints`): the local side of every TCP socket the process
  holds, so that the address a backend's error names ("Connection closed by peer
  [127.0.0.1]:51099") can be mapped back to a rank (`ranks_at`, `address_book`);
- a **finished** mark (`finish`), set by every rank when it stops watching: the rank hosting
  the store waits for the others' (`wait_until_finished`) before it takes the store away.

`assess(channel, ranks)` turns them into a `Liveness` per rank: on the same host (and in the
same process-id namespace) the process itself says it (gone when it has exited, stopped when
it is stopped, SIGSTOP), elsewhere the heartbeat does (gone or stopped when it is older than
`stale_after` seconds). A rank that left a note is "left", not lost, whether its process has
exited yet or not. `lost_peer(channel,
ranks)` names the rank of a group that such evidence shows lost first (the one whose
heartbeat stopped first; without heartbeats, gone before stopped before silent), for an error
that would otherwise say "peer rank unknown". Heartbeats are compared by wall-clock time: on
several hosts, their clocks must agree within a second or so (NTP).

Nothing here waits without a bound; a store that fails makes every rank "unknown".

gloo names a peer by the remote end of the connection that failed: the peer's listening port,
or the local port of a connection the peer opened. torch 2.13's gloo prints that port with
its two bytes swapped (51099 for 39887), so `ranks_at` matches both readings; an address
that two ranks' endpoints hold under the two readings names both as candidates.
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
    "address_book",
    "assess",
    "beat",
    "by_process",
    "describe",
    "finish",
    "leave",
    "lost_first",
    "lost_peer",
    "own_endpoints",
    "own_identity",
    "peer_finder",
    "publish_endpoints",
    "publish_identity",
    "ranks_at",
    "read_identity",
    "wait_until_finished",
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
            stopped); "left" (it left a note: it stopped on an error it saw, and has exited
            or is exiting); "unknown" (no record, or no store).
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


def _endpoints_key(rank: int) -> str:
    return f"alive/{rank}/endpoints"


def _finished_key(rank: int, run: str) -> str:
    return f"alive/{rank}/finished/{run}"


def publish_identity(channel: StoreChannel, rank: int) -> bool:
    """Publish this process's identity as `rank`; False if the store fails (nothing raised).

    A leaving note an earlier process left as `rank` in the same store is removed.
    """
    try:
        with contextlib.suppress(Exception):  # a store without deletes
            channel.delete(_left_key(rank))
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


def finish(channel: StoreChannel, rank: int, run: str = "") -> bool:
    """Mark `rank` as finished with the store in `run` (see `wait_until_finished`).

    Returns:
        False if the store fails (nothing raised).
    """
    try:
        channel.set(_finished_key(rank, run), repr(time.time()))
    except Exception:  # a gone store: nobody waits for the mark any more
        return False
    return True


def wait_until_finished(
    channel: StoreChannel,
    ranks: Iterable[int],
    timeout: float,
    *,
    run: str = "",
    poll_s: float = 0.1,
) -> list[int]:
    """Wait until each of `ranks` has finished `run` (`finish`), or is gone, stopped or silent.

    For the process that hosts the store: it keeps it up until the others have done with it.
    Marks are per `run` (a token the ranks share), so that a mark of an earlier run in the
    same store is not taken for this one's. At most `timeout` seconds; a store that fails
    ends the wait.

    Returns:
        The ranks neither finished nor lost when the wait ended.
    """
    waiting = set(ranks)
    deadline = time.monotonic() + max(timeout, 0.0)
    while waiting:
        try:
            waiting = {r for r in waiting if _read(channel, _finished_key(r, run)) is None}
            found = assess(channel, waiting) if waiting else {}
        except Exception:  # nothing more can be read: nobody can use the store either
            break
        waiting -= {rank for rank, live in found.items() if live.lost}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    return sorted(waiting)


def _read(channel: StoreChannel, key: str) -> str | None:
    value = channel.read(key)
    return None if value is None else value.decode()


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


def read_identity(channel: StoreChannel, rank: int) -> Identity | None:
    """The identity `rank` published, or None (none, or a store that fails)."""
    try:
        text = _read(channel, _identity_key(rank))
    except Exception:  # evidence is best effort
        return None
    return None if text is None else Identity(**json.loads(text))


def by_process(identity: Identity) -> Liveness | None:
    """What the process of `identity` says now, without the store, when it can be seen.

    For a rank whose identity was read while the store was there: "gone", "stopped" or
    "alive" from /proc on the same host (and process-id namespace); None elsewhere.
    """
    return _by_process(identity, _space())


def _one(channel: StoreChannel, rank: int, stale_after: float, here: str) -> Liveness:
    text = _read(channel, _identity_key(rank))
    identity = None if text is None else Identity(**json.loads(text))
    beat_text = _read(channel, _beat_key(rank))
    age = None if beat_text is None else max(time.time() - float(beat_text), 0.0)
    if identity is not None:
        seen = _by_process(identity, here)
        if seen is not None and seen.state in ("gone", "alive"):
            note = _read(channel, _left_key(rank))
            if note is not None:
                reason = json.loads(note).get("reason", "")
                leaves = "left" if seen.state == "gone" else "is leaving"
                return Liveness(rank, "left", f"it {leaves} after its own error: {reason}", age)
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


# ------------------------------------------------------------------------------ endpoints
_LISTEN = "0A"  # a listening socket's state in /proc/net/tcp


def _socket_inodes() -> set[str]:
    """The inodes of this process's sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    return inodes


def _host_of(hex_address: str) -> str:
    """A /proc/net/tcp address ("0100007F", or 32 digits for IPv6) as text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
    if len(words) == 4:
        return socket.inet_ntop(socket.AF_INET, words)
    if words[:12] == b"\x00" * 10 + b"\xff\xff":  # an IPv4 address mapped into IPv6
        return socket.inet_ntop(socket.AF_INET, words[12:])
    return socket.inet_ntop(socket.AF_INET6, words)


def own_endpoints(*, listening: bool = False) -> list[tuple[str, int]]:
    """The local side of every TCP socket this process holds: ``(host, port)``, sorted.

    Listening sockets and connections alike (a backend's pair sockets, the store's), from
    ``/proc/self/net/tcp`` and ``tcp6``; [] where /proc cannot tell (off Linux). With
    `listening`, the listening sockets only.
    """
    try:
        inodes = _socket_inodes()
    except OSError:
        return []
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table, encoding="ascii") as lines:
            next(lines, None)
            for line in lines:
                fields = line.split()
                if (
                    len(fields) > 9
                    and fields[9] in inodes
                    and (not listening or fields[3] == _LISTEN)
                ):
                    host, port = fields[1].rsplit(":", 1)
                    found.add((_host_of(host), int(port, 16)))
    return sorted(found)


def publish_endpoints(channel: StoreChannel, rank: int) -> bool:
    """Publish this process's TCP endpoints as `rank`'s (`own_endpoints`); False if it fails.

    Published at the start and again now and then (a group made later opens new sockets).
    """
    try:
        channel.set(_endpoints_key(rank), json.dumps(own_endpoints()))
    except Exception:  # a gone store must not stop training
        return False
    return True


def _parse_address(address: str) -> tuple[str, int] | None:
    """``[127.0.0.1]:51099`` (a backend's form) or ``127.0.0.1:51099`` as (host, port)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host.lower().startswith("::ffff:") and "." in host:
        host = host[7:]
    return (host, int(port)) if port.isdigit() and host else None


def _swapped(port: int) -> int:
    return ((port & 0xFF) << 8) | (port >> 8)


def ranks_at(channel: StoreChannel, address: str, ranks: Iterable[int]) -> list[int]:
    """The ranks of `ranks` whose published endpoints hold `address` (see the module).

    The port is matched as printed and with its bytes swapped; the host must match too
    (or the endpoint listen on every address). Ranks without published endpoints, or a
    store that fails, match nothing.
    """
    parsed = _parse_address(address)
    if parsed is None:
        return []
    host, port = parsed
    ports = {port, _swapped(port)}
    found: list[int] = []
    for rank in ranks:
        try:
            text = _read(channel, _endpoints_key(rank))
        except Exception:  # evidence is best effort
            return found
        endpoints = [] if text is None else json.loads(text)
        if any(int(p) in ports and h in (host, "0.0.0.0", "::") for h, p in endpoints):
            found.append(rank)
    return found


def address_book(
    channel: StoreChannel, *, wait_s: float = 4 * HEARTBEAT_S
) -> Callable[[str, tuple[int, ...]], tuple[tuple[int, ...], str | None]]:
    """An address book for `pp_state.collectives.set_address_book`, over `channel`.

    It maps a backend's address to the ranks of a group whose endpoints hold it (`ranks_at`)
    and, for one rank, says what its liveness record shows of it, unless it is alive. A
    killed process closes its sockets a moment before it shows as exited: a rank that still
    runs is looked at again for up to `wait_s` seconds.
    """

    def look_up(address: str, ranks: tuple[int, ...]) -> tuple[tuple[int, ...], str | None]:
        found = tuple(ranks_at(channel, address, ranks))
        if len(found) != 1:
            return found, None
        deadline = time.monotonic() + wait_s
        live = assess(channel, found)[found[0]]
        while live.state == "alive" and time.monotonic() < deadline:
            time.sleep(0.05)
            live = assess(channel, found)[found[0]]
        return found, None if live.state in ("alive", "unknown") else describe(live)

    return look_up
