"""Every storage torch allocates while counting, held until it is freed (CPU).

torch keeps no allocator statistics on CPU. An `AllocationCounter` sees each operator's new
storages through a ``TorchDispatchMode`` and their frees through a ``weakref.finalize`` on
each, and keeps the live bytes and their peak as storages appear. It sees what
torch.profiler's allocator events (``profile_memory=True``) see, less the workspace an
operator allocates and frees inside itself. `MemoryProbe` counts a rank's live bytes with
one; `measure_stage` counts one microbatch through a chunk with another.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AllocationCounter"]


class _Entry:
    """One counted storage: its key, bytes, finalizer, and whether it counts (not static)."""

    __slots__ = ("counted", "finalizer", "key", "nbytes")

    def __init__(self, key: int, nbytes: int, counted: bool) -> None:
        self.key = key
        self.nbytes = nbytes
        self.counted = counted
        self.finalizer: weakref.finalize[Any, Any] | None = None

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """Whether this entry counts `storage` (and not a freed one at the same address)."""
        finalizer = self.finalizer
        found = finalizer.peek() if finalizer is not None else None
        return found is not None and found[0] is storage


class AllocationCounter:
    """Counts the bytes of every storage allocated while counting, until it is freed.

    While `counting` is active on a thread (and in the autograd engine's work for it), each
    operator's outputs are looked at: a storage that none of the operator's inputs share and
    that is not counted yet is new (views and in-place results share an input's). An
    operator that may write its inputs (``out=``, ``resize_``) is looked at before it runs
    too, so an input storage it grows (reallocates) counts at its new size. A storage counts
    from then on, and stops when it is freed, whenever and on whichever thread that happens
    (a free is queued and applied at the counter's next use: a finalizer never takes a lock,
    so garbage collection running one anywhere cannot deadlock). Storages allocated before
    counting started are never counted (nor their frees); `exclude` leaves out storages
    counted elsewhere (a probe's static tensors).

    Not seen: meta tensors (no storage), and storages made without an operator (a tensor
    built from a Python list or a NumPy array: ``torch.tensor``, ``as_tensor``,
    ``from_numpy``), which torch.profiler's allocator events do see. (On CUDA `MemoryProbe`
    reads the allocator's statistics instead, which see every allocation.)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, _Entry] = {}
        self._freed_queue: collections.deque[_Entry] = collections.deque()
        self._excluded: frozenset[int] = frozenset()
        self._live = 0
        self._peak = 0
        self._local = threading.local()
        self._mode = _CountingMode(self)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count new storages on this thread while active (nested use is fine)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            if depth:
                yield
            else:
                with self._mode:
                    yield
        finally:
            self._local.depth = depth

    @property
    def live_bytes(self) -> int:
        """Bytes of the counted storages alive now (excluded ones left out)."""
        with self._lock:
            self._apply_frees()
            return self._live

    def take_peak(self) -> int:
        """The most `live_bytes` since the previous call (or creation); restarts from now."""
        with self._lock:
            self._apply_frees()
            peak, self._peak = max(self._peak, self._live), self._live
        return peak

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of `tensors` not counted yet as if allocated now, until freed.

        For storages made before counting started and held from now on (buffers kept for
        reuse).
        """
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            entry = self._held.get(key)
            if nbytes and not (entry is not None and entry.holds(storage)):
                self._add(key, storage, nbytes)

    def exclude(self, keys: Iterable[int]) -> None:
        """Leave the storages at these ``data_ptr()`` keys out of `live_bytes` from now on."""
        excluded = frozenset(keys)
        with self._lock:
            self._apply_frees()
            entries = list(self._held.values())
            self._excluded = excluded
            self._live = 0
            for entry in entries:
                entry.counted = entry.key not in excluded
                self._live += entry.nbytes if entry.counted else 0
            self._peak = max(self._peak, self._live)

    def saw(self, outputs: object, inputs: object, before: dict[int, Any] | None = None) -> None:
        """Count the new storages among an operator's `outputs` (called by the mode).

        `before` maps ``id()`` of each input storage of an operator that may write its
        inputs to ``(storage, data_ptr, nbytes)`` as they were before it ran.
        """
        if before:
            self._saw_rewritten(before)
        shared: set[int] | None = None
        for tensor in tree_leaves(outputs):
            if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
                continue
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if not nbytes:
                continue
            entry = self._held.get(key)
            if entry is not None and entry.holds(storage):
                continue
            if shared is None:
                shared = _storage_keys(inputs)
            if key in shared:
                continue  # a view of, or the very storage of, an input
            self._add(key, storage, nbytes)

    def _saw_rewritten(self, before: dict[int, Any]) -> None:
        """Input storages an operator reallocated: their entry moves, or they count anew."""
        for storage, key, nbytes in before.values():
            now_key, now_bytes = storage.data_ptr(), storage.nbytes()
            if (now_key, now_bytes) == (key, nbytes) or not now_bytes:
                continue
            entry = self._held.get(key)
            if entry is not None and entry.holds(storage):
                self._move(entry, now_key, now_bytes)
            elif now_key != key or now_bytes > nbytes:
                self._add(now_key, storage, now_bytes)

    def _add(self, key: int, storage: torch.UntypedStorage, nbytes: int) -> None:
        entry = _Entry(key, nbytes, key not in self._excluded)
        with self._lock:
            self._apply_frees()
            stale = self._held.pop(key, None)
            if stale is not None:  # freed on another thread, its finalizer not run yet
                self._live -= stale.nbytes if stale.counted else 0
            self._held[key] = entry
            if entry.counted:
                self._live += nbytes
                self._peak = max(self._peak, self._live)
        entry.finalizer = weakref.finalize(storage, self._freed_queue.append, entry)
        entry.finalizer.atexit = False

    def _move(self, entry: _Entry, key: int, nbytes: int) -> None:
        with self._lock:
            self._apply_frees()
            if self._held.get(entry.key) is entry:
                del self._held[entry.key]
            stale = self._held.pop(key, None)
            if stale is not None:
                self._live -= stale.nbytes if stale.counted else 0
            if entry.counted:
                if key != entry.key:  # reallocated: the new block came before the old went
                    self._peak = max(self._peak, self._live + nbytes)
                self._live += nbytes - entry.nbytes
                self._peak = max(self._peak, self._live)
            entry.key, entry.nbytes = key, nbytes
            self._held[key] = entry

    def _apply_frees(self) -> None:
        """Forget the storages freed since (call with the lock held)."""
        while self._freed_queue:
            entry = self._freed_queue.popleft()
            if self._held.get(entry.key) is not entry:
                continue  # a newer storage at the same address is counted now
            del self._held[entry.key]
            self._live -= entry.nbytes if entry.counted else 0
            if entry.key in self._excluded:  # a static storage gone: its address is free
                self._excluded = self._excluded - {entry.key}


class _CountingMode(TorchDispatchMode):
    """Hands every operator's inputs and outputs to its counter."""

    def __init__(self, counter: AllocationCounter) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counter = counter

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        before = None
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:  # may reallocate an input (out=, resize_)
            before = {
                id(storage): (storage, storage.data_ptr(), storage.nbytes())
                for storage in _storages((args, kwargs))
            }
        result = func(*args, **(kwargs or {}))
        self.counter.saw(result, (args, kwargs), before)
        return result


def _storages(tensors: object) -> list[torch.UntypedStorage]:
    """The storage behind every strided tensor with one in `tensors`."""
    return [
        t.untyped_storage()
        for t in tree_leaves(tensors)
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"
    ]


def _storage_keys(tensors: object) -> set[int]:
    """The ``data_ptr()`` of the storage behind every strided tensor in `tensors`."""
    return {storage.data_ptr() for storage in _storages(tensors)}
