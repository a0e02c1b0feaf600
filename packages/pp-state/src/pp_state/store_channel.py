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

pp-state reads no environment variable: the entry point hands `from_torchrun_environment`
its ``os.environ``.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Mapping

import torch.distributed as dist
from torch.distributed import distributed_c10d

from pp_state.numbers import is_real

__all__ = ["StoreChannel", "StoreTimeoutError"]

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

    def set(self, key: str, value: str) -> None:
        """Sets `key` (under the prefix) to `value`; every waiter on it wakes."""
        self.store.set(self.prefix + key, value)

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Returns once every key in `keys` is set.

        Args:
            keys: Keys without the prefix.
            timeout: Seconds (default: the channel's).

        Raises:
            StoreTimeoutError: A key was not set in time; it names the keys, the rank and the
                seconds.
        """
        names = list(keys)
        seconds = self.timeout if timeout is None else float(timeout)
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
