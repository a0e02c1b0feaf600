"""A few keys shared by every rank of a job, before and after its process groups exist.

Under torchrun the ranks can talk before ``init_process_group``: torchrun's agent hosts a
TCPStore at ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``) and torch's
own ``env://`` rendezvous connects to it as a client. `StoreChannel` does the same, so one rank
can tell the others that it has printed an error, and the others wait for that instead of a
fixed sleep::

    channel = StoreChannel.from_torchrun_environment(os.environ, timeout=60.0)
    if channel is not None and rank == 0:
        channel.set("flag-error", "printed")
    elif channel is not None:
        channel.wait(["flag-error"])  # a TimeoutError naming the key, rank and seconds

Keys live under a prefix holding torchrun's run id and restart count, so a restarted job (or
another job on the same store) never sees a stale key. After the default process group
exists, `from_default_group` uses its store instead; tests use `from_file` (a FileStore).

A TCPStore lives in one process (torchrun's agent, or rank 0 under other launchers). When that
process has exited, each call of torch's client prints a C++ stack trace before it raises. A
channel over a TCPStore therefore keeps one idle connection of its own to the store's server
(one per process and address): once the server has closed it, `gone` says so, and every call
of the channel raises `StoreGoneError` at once, without calling torch. A call that still
meets the gone store (its host exited a moment before) prints nothing either: while the
channel's quick calls (`set`, `read`, `delete`, `add`) run, what torch's C++ side writes to
stderr is caught, a store's stack trace kept aside (`store_traces` hands the kept ones to a
report's files) and everything else written back.

pp-state reads no environment variable: the entry point hands `from_torchrun_environment`
its ``os.environ``.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar, TypeVar

import torch.distributed as dist
from torch.distributed import distributed_c10d

from pp_state.numbers import is_real

__all__ = ["StoreChannel", "StoreGoneError", "StoreTimeoutError", "store_traces"]

_DEFAULT_NAMESPACE = "pp"


class StoreTimeoutError(TimeoutError):
    """A key did not appear in the store within the timeout.

    Attributes:
        keys: The keys waited for (without the channel's prefix).
        rank: The rank that waited.
        seconds: How long it waited.
    """

    def __init__(self, keys: list[str], rank: int, seconds: float, cause: str = "") -> None:
        """Names the keys, the rank and the seconds, and the store's own words if any."""
        self.keys = keys
        self.rank = rank
        self.seconds = seconds
        detail = f" ({cause})" if cause else ""
        super().__init__(
            f"rank {rank} waited {seconds:g} s for store key(s) {', '.join(keys)}; no rank "
            f"set it in that time{detail}"
        )


class StoreGoneError(RuntimeError):
    """The store's server has closed its connections: the process that hosted it has exited.

    Attributes:
        address: The store's ``host:port``.
    """

    def __init__(self, address: str) -> None:
        """Names the store's address."""
        self.address = address
        super().__init__(
            f"the job's store at {address} is gone: the process that hosted it has exited "
            "(rank 0, or torchrun's agent)"
        )


class _Sentinels:
    """One idle connection per TCPStore address, opened on first use (see the module)."""

    lock = threading.Lock()
    sockets: ClassVar[dict[tuple[str, int], socket.socket | None]] = {}


def _tcp_address(store: dist.Store) -> tuple[str, int] | None:
    """The ``(host, port)`` of the TCPStore under `store` (prefixes removed), or None."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 16:
        store, seen = store.underlying_store, seen + 1
    if isinstance(store, dist.TCPStore):
        return str(store.host), int(store.port)
    return None


def _sentinel(address: tuple[str, int]) -> socket.socket | None:
    """The idle connection to the store at `address`; None when none could be opened."""
    with _Sentinels.lock:
        if address not in _Sentinels.sockets:
            try:
                link: socket.socket | None = socket.create_connection(address, timeout=5.0)
            except ConnectionRefusedError:  # nothing listens: told by `_closed` below
                link = socket.socket()
                link.close()
            except OSError:  # unreachable for now: no sentinel, the store is used as it is
                link = None
            if link is not None and link.fileno() >= 0:
                link.setblocking(False)
            _Sentinels.sockets[address] = link
        return _Sentinels.sockets[address]


def _closed(link: socket.socket) -> bool:
    """Whether the server closed `link` (or it could never be opened)."""
    if link.fileno() < 0:
        return True
    try:
        return link.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):  # open, nothing to read: the server is there
        return False
    except OSError:  # reset by the server's exit
        return True


_T = TypeVar("_T")
_TRACE_HEAD = re.compile(rb"^\[[EWI]\d{4} [^\]]*\] ")
_TRACE_LINES = (b"Exception raised from ", b"frame #", b"<omitting python frames>")
_TRACES_KEPT = 32


class _Catcher:
    """The process's catch of what C++ writes to stderr during a store call (see the module)."""

    lock = threading.Lock()
    file: ClassVar[list[int]] = []  # the catch file's descriptor, made on first use
    traces: ClassVar[list[str]] = []


def _split_traces(text: bytes) -> tuple[bytes, list[bytes]]:
    """`text` without the C++ stack traces in it, and those traces.

    A trace is a log line (``[W1206 02:52:11.93 TCPStore.cpp:106] ...``) followed by
    ``Exception raised from ...``, its frames and the blank line that ends them.
    """
    lines = text.splitlines(keepends=True)
    kept, traces, index = [], [], 0
    while index < len(lines):
        following = lines[index + 1] if index + 1 < len(lines) else b""
        if _TRACE_HEAD.match(lines[index]) and following.startswith(_TRACE_LINES[0]):
            end = index + 2
            while end < len(lines) and lines[end].startswith(_TRACE_LINES):
                end += 1
            if end < len(lines) and not lines[end].strip():
                end += 1
            traces.append(b"".join(lines[index:end]))
            index = end
        else:
            kept.append(lines[index])
            index += 1
    return b"".join(kept), traces


def _caught(call: Callable[[], _T]) -> _T:
    """`call()` with stderr's C++ output caught: traces kept, the rest written back."""
    with _Catcher.lock:
        if not _Catcher.file:
            with tempfile.TemporaryFile() as made:  # unlinked: the descriptor keeps it
                _Catcher.file.append(os.dup(made.fileno()))
        catch = _Catcher.file[0]
        try:
            saved = os.dup(2)
        except OSError:  # no stderr at all: nothing to catch
            return call()
        try:
            os.dup2(catch, 2)
            return call()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            _release(catch)


def _release(catch: int) -> None:
    """Write back what was caught, less the traces (the last few dozen kept)."""
    size = os.lseek(catch, 0, os.SEEK_END)
    if not size:
        return
    os.lseek(catch, 0, os.SEEK_SET)
    text = os.read(catch, size)
    os.ftruncate(catch, 0)
    os.lseek(catch, 0, os.SEEK_SET)
    rest, traces = _split_traces(text)
    _Catcher.traces.extend(t.decode(errors="replace") for t in traces)
    del _Catcher.traces[:-_TRACES_KEPT]
    with contextlib.suppress(OSError):
        while rest:
            rest = rest[os.write(2, rest) :]


def store_traces() -> list[str]:
    """The stack traces torch printed in this process's channel calls since the last ask.

    Each is one trace's text (its log line, ``Exception raised from ...``, its frames);
    taking them empties the list. A stop report keeps them in its files.
    """
    with _Catcher.lock:
        taken = list(_Catcher.traces)
        _Catcher.traces.clear()
    return taken


def _timedelta(seconds: float) -> datetime.timedelta:
    if not (is_real(seconds) and 0 < seconds < math.inf):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {seconds!r}")
    return datetime.timedelta(seconds=seconds)


class StoreChannel:
    """Keys every rank of a job can set and wait for, under one prefix.

    Args:
        store: A torch.distributed store (TCPStore, FileStore, a group's store).
        rank: This process's global rank (it appears in errors).
        world_size: The number of processes.
        prefix: Put before every key, so runs sharing a store do not collide.
        timeout: Default seconds `wait` and `get` wait for a key.
        hosts_store: Whether this process hosts the store's server: its keys go when it
            exits, so it should wait for the others to read what it set before leaving.

    Raises:
        ValueError: `timeout` is not a positive number of seconds.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        prefix: str = _DEFAULT_NAMESPACE,
        timeout: float = 60.0,
        hosts_store: bool = False,
    ) -> None:
        _timedelta(timeout)
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix.rstrip("/") + "/"
        self.timeout = float(timeout)
        self.hosts_store = hosts_store
        self._address = _tcp_address(store)

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        *,
        rank: int,
        world_size: int,
        prefix: str = _DEFAULT_NAMESPACE,
        timeout: float = 60.0,
        agent_store: bool = True,
    ) -> StoreChannel:
        """Connects to the TCPStore at `host`:`port`.

        Args:
            host: The store's host (torchrun's ``MASTER_ADDR``).
            port: Its port (``MASTER_PORT``).
            rank: This process's global rank.
            world_size: The number of processes.
            prefix: Put before every key.
            timeout: Seconds to connect, and the default wait.
            agent_store: True when torchrun's agent hosts the store (every rank is a client).
                False as in torch's ``env://`` without it: rank 0 hosts the store, shared
                (``multi_tenant``) with the ``init_process_group`` that follows in the process.

        Raises:
            ValueError: `port` is outside 0..65535 or `timeout` is not positive.
            RuntimeError: Nothing answers at `host`:`port` within `timeout` (torch's error).
        """
        if not 0 <= port < 2**16:
            raise ValueError(f"port must be 0 to 65535, got {port}")
        hosting = not agent_store and rank == 0
        store = dist.TCPStore(
            host, port, world_size=world_size if hosting else None, is_master=hosting,
            timeout=_timedelta(timeout), wait_for_workers=False, multi_tenant=hosting,
        )  # fmt: skip
        return cls(
            store, rank=rank, world_size=world_size, prefix=prefix, timeout=timeout,
            hosts_store=hosting,
        )  # fmt: skip

    @classmethod
    def from_file(
        cls,
        path: str,
        *,
        rank: int,
        world_size: int,
        prefix: str = _DEFAULT_NAMESPACE,
        timeout: float = 60.0,
    ) -> StoreChannel:
        """A channel over a FileStore at `path` (every rank names the same file)."""
        store = dist.FileStore(path, world_size)
        store.set_timeout(_timedelta(timeout))
        return cls(store, rank=rank, world_size=world_size, prefix=prefix, timeout=timeout)

    @classmethod
    def from_default_group(
        cls, *, prefix: str = _DEFAULT_NAMESPACE, timeout: float = 60.0
    ) -> StoreChannel:
        """A channel over the default process group's store (after ``init_process_group``).

        Raises:
            RuntimeError: No default process group exists.
        """
        if not dist.is_initialized():
            raise RuntimeError("StoreChannel.from_default_group needs init_process_group first")
        # torch has no public accessor for the default group's store; this one has existed
        # unchanged since torch 1.x.
        store = distributed_c10d._get_default_store()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        return cls(store, rank=rank, world_size=world_size, prefix=prefix, timeout=timeout)

    @classmethod
    def from_torchrun_environment(
        cls,
        environ: Mapping[str, str],
        *,
        namespace: str = _DEFAULT_NAMESPACE,
        timeout: float = 60.0,
    ) -> StoreChannel | None:
        """The channel of a job torchrun (or another ``env://`` launcher) started.

        With torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE=True``) every rank
        connects to it as a client, before or after the process groups exist. Without it,
        the default group's store once the group exists, else rank 0 hosts the store at
        ``MASTER_ADDR:MASTER_PORT`` as torch's ``env://`` rendezvous does.

        Args:
            environ: The process's environment (the entry point passes ``os.environ``).
            namespace: The keys' first prefix component; the run id and restart count follow.
            timeout: Seconds to connect, and the default wait.

        Returns:
            The channel, or None without a job of two or more processes (no
            ``MASTER_ADDR``/``MASTER_PORT``, or ``WORLD_SIZE`` below 2).

        Raises:
            ValueError: ``RANK``, ``WORLD_SIZE`` or ``MASTER_PORT`` is not a whole number.
            RuntimeError: The store does not answer within `timeout`.
        """
        world_size = _int_variable(environ, "WORLD_SIZE", "1")
        host, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
        if world_size < 2 or host is None or port is None:
            return None
        rank = _int_variable(environ, "RANK", "0")
        run = environ.get("TORCHELASTIC_RUN_ID", "none")
        restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"{namespace}/{run}/{restart}"
        agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        if not agent and dist.is_initialized():
            return cls.from_default_group(prefix=prefix, timeout=timeout)
        return cls.connect(
            host, _int_variable(environ, "MASTER_PORT", port), rank=rank,
            world_size=world_size, prefix=prefix, timeout=timeout, agent_store=agent,
        )  # fmt: skip

    @property
    def address(self) -> str | None:
        """The store's ``host:port`` when it is a TCPStore, else None."""
        return None if self._address is None else f"{self._address[0]}:{self._address[1]}"

    def gone(self) -> bool:
        """Whether the store's server has closed its connections (its process exited).

        Always False for a store that is not a TCPStore (a FileStore, a HashStore).
        """
        if self._address is None:
            return False
        link = _sentinel(self._address)
        return link is not None and _closed(link)

    def _reachable(self) -> None:
        """Raises `StoreGoneError` when the store is gone (see `gone`)."""
        if self.gone():
            raise StoreGoneError(str(self.address))

    def set(self, key: str, value: str) -> None:
        """Sets `key` (under the prefix) to `value`; every waiter on it wakes.

        Raises:
            StoreGoneError: The store is gone; torch was not called.
        """
        self._reachable()
        _caught(lambda: self.store.set(self.prefix + key, value))

    def read(self, key: str) -> bytes | None:
        """The value of `key` if it is set, else None, without waiting.

        Raises:
            StoreGoneError: The store is gone; torch was not called.
        """
        self._reachable()
        full = self.prefix + key

        def read() -> bytes | None:
            if not self.store.check([full]):
                return None
            value: bytes = self.store.get(full)
            return value

        return _caught(read)

    def delete(self, key: str) -> None:
        """Removes `key` if it is set (a store without deletes keeps it).

        Raises:
            StoreGoneError: The store is gone; torch was not called.
        """
        self._reachable()

        def delete() -> None:
            with contextlib.suppress(RuntimeError, NotImplementedError):  # a store without it
                self.store.delete_key(self.prefix + key)

        _caught(delete)

    def add(self, key: str, amount: int) -> int:
        """Adds `amount` to the counter `key` (0 when unset); returns the new value.

        Raises:
            StoreGoneError: The store is gone; torch was not called.
        """
        self._reachable()
        return int(_caught(lambda: self.store.add(self.prefix + key, amount)))

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Returns once every key in `keys` is set.

        Args:
            keys: Keys without the prefix.
            timeout: Seconds (default: the channel's).

        Raises:
            StoreTimeoutError: A key was not set in time; it names the keys, the rank and the
                seconds.
            StoreGoneError: The store is gone; torch was not called.
        """
        names = list(keys)
        seconds = self.timeout if timeout is None else float(timeout)
        self._reachable()
        try:
            self.store.wait([self.prefix + key for key in names], _timedelta(seconds))
        except RuntimeError as error:  # torch's DistStoreError, or a FileStore's timeout
            missing = [key for key in names if not self.store.check([self.prefix + key])]
            if not missing:
                raise
            raise StoreTimeoutError(missing, self.rank, seconds, str(error)) from error

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of `key`, waiting for it as `wait` does.

        Raises:
            StoreTimeoutError: The key was not set in time.
        """
        self.wait([key], timeout)
        return self.store.get(self.prefix + key)

    def publish(self, key: str, value: str) -> None:
        """Sets `key` for every other rank to `receive`.

        A rank hosting the store takes its keys with it when it exits, so it returns only
        once every other rank has received the key (or the channel's timeout ran out).

        Raises:
            StoreTimeoutError: Hosting, a rank did not receive the key in time.
        """
        self.set(key, value)
        if self.hosts_store:
            readers = (rank for rank in range(self.world_size) if rank != self.rank)
            self.wait([f"{key}/seen/{rank}" for rank in readers])

    def receive(self, key: str, timeout: float | None = None) -> str:
        """The value another rank `publish`-ed under `key`, waiting for it; says it was read.

        Raises:
            StoreTimeoutError: The key was not set in time.
        """
        value = self.get(key, timeout).decode()
        # Said only once read: a rank hosting the store may leave as soon as all have said it.
        self.set(f"{key}/seen/{self.rank}", "1")
        return value


def _int_variable(environ: Mapping[str, str], name: str, default: str) -> int:
    text = environ.get(name, default)
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"environment variable {name} must be a whole number, got {text!r}"
        ) from None
