"""Measured memory: every byte a rank holds, and the part of it saved for backward.

A `MemoryProbe` measures what a step really holds, two ways:

- **live** (the figure to compare with the byte model's prediction): every storage the rank
  holds. On CPU, where torch keeps no allocator statistics, an `AllocationCounter` sees each
  operator's new storages (a ``TorchDispatchMode``) and their frees (a ``weakref.finalize``
  on each): the live bytes are the static storages below plus every storage allocated since
  counting started and not freed yet; the peak is kept as storages appear. It sees what
  torch.profiler's allocator events (``profile_memory=True``) see, less the workspace an
  operator allocates and frees inside itself (a fused attention kernel's: 0.05-1.4% of the
  peak in pp-train's memory benchmark). On CUDA
  the caching allocator says it: ``torch.cuda.memory_allocated()``, and
  ``torch.cuda.max_memory_allocated()`` with the peak reset at every sample. That reset is
  the allocator's, seen by every reader of ``torch.cuda.max_memory_*`` in the process: the
  probe keeps the reserved peaks it resets (`MemoryProbe.peak_reserved_bytes`).
- **saved**, a breakdown: tensors autograd saved for backward and still alive.

Storages alive before counting started and not listed as static (a dataset's token arrays,
its sample indices) are host memory to pp, and not counted. Counting costs a Python call per
operator while it is on (pp-train counts only until its first memory line).

Both are counted as distinct storages (``untyped_storage()``, deduped by ``data_ptr()``,
``nbytes()`` each):

- **static**: what its ``static`` callable lists: parameter storage, gradient storage
  (pp-optim's contiguous ``main_grad`` buffers, or ``.grad`` where there is no buffer) and
  optimizer state (Adam's moments, SGD's momentum, fp32 master copies and their gradients);
  pp-train's ``training_state_tensors`` lists exactly these.
- **saved**: tensors autograd saved for backward and still alive, seen through
  ``torch.autograd.graph.saved_tensors_hooks`` while `MemoryProbe.saved_tensors` is active.
  Parameters, views of parameters (a matmul saves ``weight.t()``) and storages of static
  tensors pass through uncounted, so nothing counts twice.

The saved figure leaves out p2p buffers, outputs waiting for their sends, gradients and
temporaries: the live figure has them. torch's non-reentrant checkpoint keeps the tensors it
recomputes during backward under saved-tensor hooks of its own, which the saved figure does
not see either.

`PipelineExecutor.record_memory` runs every call inside `MemoryProbe.counting` and takes one
`MemorySample` after each compute step, in the order of the rank's steps: the order of the
simulator's predicted bytes (`pp_schedules.simulate(..., memory=...)`, whose ``during``
matches each sample's ``peak_live_bytes`` and ``after`` its ``live_bytes``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pp_schedules.planning import StageMemory
from pp_schedules.runtime._autograd import custom_backward, deallocate_output_tensor
from pp_schedules.runtime._split_backward import backward_input

__all__ = [
    "AllocationCounter",
    "MemoryProbe",
    "MemorySample",
    "StaticTensors",
    "measure_stage",
    "storage_bytes",
]

StaticTensors = Callable[[], Iterable[torch.Tensor]]
"""Lists the tensors a rank holds for the whole step (parameters, gradients, optimizer state)."""


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (each storage counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@dataclasses.dataclass(frozen=True)
class MemorySample:
    """What a rank held right after one step.

    Attributes:
        label: The step, ``str(action)`` (e.g. ``"F0.1"``) when the executor samples, or a
            caller's label.
        static_bytes: Parameter, gradient and optimizer-state storage (distinct storages).
        saved_bytes: Bytes autograd holds saved for backward now (parameters excluded).
        peak_saved_bytes: The most saved bytes since the previous sample (the high-water mark,
            updated as tensors are saved).
        allocated_bytes: ``torch.cuda.memory_allocated()`` once CUDA is initialised; None on
            CPU (torch keeps no CPU allocator statistics).
        live_bytes: Everything held now: static storage and every storage allocated since
            counting started and not yet freed (on CUDA the allocator's allocated bytes);
            None when the probe does not count allocations.
        peak_live_bytes: The most `live_bytes` since the previous sample (at least what was
            held then); None when the probe does not count allocations.
    """

    label: str
    static_bytes: int
    saved_bytes: int
    peak_saved_bytes: int
    allocated_bytes: int | None
    live_bytes: int | None = None
    peak_live_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        """Static and saved bytes after the step (what the byte model predicts after it)."""
        return self.static_bytes + self.saved_bytes

    @property
    def peak_total_bytes(self) -> int:
        """Static and the most saved bytes since the previous sample."""
        return self.static_bytes + self.peak_saved_bytes


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


class _Held:
    """What the pack hook hands autograd: the saved tensor, and its storage's key.

    When autograd frees the graph it frees this object, which queues its storage's release;
    the probe applies the queue under its lock (a release never takes a lock itself, so it
    cannot deadlock when garbage collection runs it in the middle of a pack).
    """

    __slots__ = ("key", "release", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, release: Callable[[int], None]) -> None:
        self.tensor = tensor
        self.key = key
        self.release = release

    def __del__(self) -> None:
        self.release(self.key)


class MemoryProbe:
    """Counts the bytes a rank holds: everything live, and what is saved for backward.

    Args:
        static: Lists the static tensors (see the module docstring); None: no static bytes,
            and only parameters (and their views) are left out of the saved bytes.
        count_allocations: Measure the live bytes (`AllocationCounter` on CPU, the allocator
            on CUDA); False: the saved bytes only, at no cost per operator.
        device: "cpu" or "cuda": where the live bytes are read; None: CUDA when the static
            tensors live there (without static tensors: when this process has started
            CUDA), else CPU.
    """

    def __init__(
        self,
        static: StaticTensors | None = None,
        *,
        count_allocations: bool = True,
        device: str | None = None,
    ) -> None:
        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"device {device!r} is unknown; valid: 'cpu', 'cuda' or None")
        self._static = static
        self.samples: list[MemorySample] = []
        """One sample per `sample` call since creation or `clear`."""
        self._lock = threading.Lock()
        # storage key -> [saves holding it, its bytes]
        self._held: dict[int, list[int]] = {}
        self._released: collections.deque[int] = collections.deque()
        self._saved = 0
        self._peak = 0
        self._interval_peak = 0
        self._static_keys: frozenset[int] = frozenset()
        self._depth = 0
        # The storages saved during each `saved_by` call in progress.
        self._calls: list[set[int]] = []
        self.counts_allocations = count_allocations
        """Whether samples carry live bytes."""
        self.counter = AllocationCounter()
        """What counts the live bytes on CPU."""
        self._device = device
        self._counting = False
        self._static_before = 0  # the static bytes the counter's exclusions go with
        self._pending_peak = 0  # the most live bytes since the previous sample, so far
        self._reserved_peak: int | None = None  # CUDA: the reserved peaks the samples reset

    @property
    def device(self) -> str:
        """Where the live bytes are read: "cuda" (the allocator) or "cpu" (the counter)."""
        if self._device is None:
            first = next(iter(self._static()), None) if self._static is not None else None
            cuda = first.is_cuda if first is not None else _cuda_started()
            self._device = "cuda" if cuda else "cpu"
        return self._device

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count saved tensors and (on CPU, with `count_allocations`) every new storage.

        What a step holds is measured while this is active; nested use is fine.
        """
        counts = self.counts_allocations and self.device == "cpu"
        if counts and not self._counting:
            self._restate_static()
        outer = counts and not self._counting
        self._counting = self._counting or counts
        try:
            with self.saved_tensors(), self.counter.counting() if counts else _nothing():
                yield
        finally:
            if outer:
                self._counting = False

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count `tensors` made before counting started as held from now on.

        See `AllocationCounter.adopt`; on CUDA, or without counting, nothing to do.
        """
        if self.counts_allocations and self.device == "cpu":
            self.counter.adopt(tensors)

    def _restate_static(self) -> int:
        """Leave the static storages out of the counter (their bytes count apart).

        The counter's peak so far is kept with the static bytes it went with, since the
        static list may have taken in storages the counter counted (an optimizer's state
        made in its first step). Returns the static bytes now.
        """
        self._pending_peak = max(self._pending_peak, self._static_before + self.counter.take_peak())
        storages = {}
        for tensor in self._static() if self._static is not None else ():
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        self.counter.exclude(storages)
        self.counter.take_peak()
        self._static_before = sum(storages.values())
        return self._static_before

    # ------------------------------------------------------------------ counting saves
    @contextlib.contextmanager
    def saved_tensors(self) -> Iterator[None]:
        """While active, count tensors autograd saves for backward (nested use is fine).

        Saved tensors come back from the hooks as detached aliases of the same storage (the
        same values): the executor frees a sent output by swapping its ``.data``, which must
        not reach the copy autograd saved, and keeping the output itself would tie it to its
        own graph. So a double backward (``create_graph=True``) through passes run here does
        not see through saved tensors; the executor never runs one.
        """
        if self._depth == 0:
            self._static_keys = self._storage_keys()
        self._depth += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._depth -= 1

    def _storage_keys(self) -> frozenset[int]:
        if self._static is None:
            return frozenset()
        return frozenset(t.untyped_storage().data_ptr() for t in self._static())

    def _uncounted(self, tensor: torch.Tensor) -> bool:
        """Parameters, their views, static storage and tensors without a storage of their own."""
        if tensor.layout != torch.strided or isinstance(tensor, torch.nn.Parameter):
            return True
        if isinstance(tensor._base, torch.nn.Parameter):  # a view such as weight.t()
            return True
        return tensor.untyped_storage().data_ptr() in self._static_keys

    def _pack(self, tensor: torch.Tensor) -> object:
        if self._uncounted(tensor):
            return tensor
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            self._apply_releases()
            entry = self._held.setdefault(key, [0, nbytes])
            for call in self._calls:
                call.add(key)
            entry[0] += 1
            if entry[0] == 1:
                self._saved += nbytes
                self._interval_peak = max(self._interval_peak, self._saved)
                self._peak = max(self._peak, self._saved)
        return _Held(tensor.detach(), key, self._released.append)

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        if isinstance(packed, _Held):
            return packed.tensor
        assert isinstance(packed, torch.Tensor)
        return packed

    def _apply_releases(self) -> None:
        """Drop the storages whose last save autograd has freed (call with the lock held)."""
        while self._released:
            key = self._released.popleft()
            entry = self._held[key]
            entry[0] -= 1
            if entry[0] == 0:
                self._saved -= entry[1]
                del self._held[key]

    @property
    def saved_bytes(self) -> int:
        """Bytes saved for backward and still held now (distinct storages)."""
        with self._lock:
            self._apply_releases()
            return self._saved

    @property
    def peak_saved_bytes(self) -> int:
        """The most saved bytes held at once since creation or `clear`."""
        return self._peak

    # ------------------------------------------------------------------ samples
    def static_bytes(self) -> int:
        """Bytes of the distinct storages the ``static`` callable lists now (0 without one)."""
        if self._static is None:
            return 0
        return storage_bytes(self._static())

    def sample(self, label: str) -> MemorySample:
        """Record what is held now as `label`; appended to `samples` and returned.

        On CUDA (counting allocations) the allocator's peak statistic is reset here, so each
        sample's ``peak_live_bytes`` covers the interval since the one before.
        """
        saved = self.saved_bytes
        allocated = torch.cuda.memory_allocated() if _cuda_started() else None
        with self._lock:
            peak, self._interval_peak = self._interval_peak, self._saved
        live, peak_live = self._live()
        taken = MemorySample(
            label, self.static_bytes(), saved, max(peak, saved), allocated, live, peak_live
        )
        self.samples.append(taken)
        return taken

    def _live(self) -> tuple[int | None, int | None]:
        """Everything held now, and the most since the previous sample (None: not counted)."""
        if not self.counts_allocations:
            return None, None
        if self.device == "cuda":
            live, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            self._reset_cuda_peaks()
            return live, max(live, peak)
        static = self._restate_static()
        live = static + self.counter.live_bytes
        peak, self._pending_peak = max(live, self._pending_peak), 0
        return live, peak

    @property
    def live_bytes(self) -> int | None:
        """Everything held now (None without `count_allocations`); on CPU, as counted."""
        if not self.counts_allocations:
            return None
        if self.device == "cuda":
            return torch.cuda.memory_allocated()
        # The static list may have taken in storages counted before (an optimizer's state).
        return self._restate_static() + self.counter.live_bytes

    @property
    def peak_live_bytes(self) -> int | None:
        """The most live bytes over the samples taken (None without samples or counting)."""
        peaks = [s.peak_live_bytes for s in self.samples if s.peak_live_bytes is not None]
        return max(peaks) if peaks else None

    def clear(self) -> None:
        """Forget the samples and the peaks; what is held now stays counted."""
        self.samples = []
        with self._lock:
            self._apply_releases()
            self._peak = self._interval_peak = self._saved
        self._restate_static()
        self._pending_peak = 0
        if self.counts_allocations and self.device == "cuda":
            self._reset_cuda_peaks()

    def _reset_cuda_peaks(self) -> None:
        """Reset the allocator's peak statistics, keeping the reserved peak they held."""
        reserved = torch.cuda.max_memory_reserved()
        self._reserved_peak = max(self._reserved_peak or 0, reserved)
        torch.cuda.reset_peak_memory_stats()

    @property
    def peak_reserved_bytes(self) -> int | None:
        """CUDA: the most bytes the allocator reserved since the probe's first sample.

        The peaks its samples reset included (``torch.cuda.max_memory_reserved()`` alone
        covers the interval since the last sample); None on CPU or before any sample.
        """
        if self._reserved_peak is None:
            return None
        return max(self._reserved_peak, torch.cuda.max_memory_reserved())

    def saved_by(self, fn: Callable[[], object]) -> int:
        """Bytes one call of `fn` saved for backward that are still held when it returns.

        What `fn` returns is kept until they are counted (its graph holds them). A storage
        the call saved counts even if something else held it already (an input saved by an
        earlier graph too). Measures, for instance, one chunk's activation bytes for one
        microbatch alone.
        """
        saved: set[int] = set()
        with self._lock:
            self._calls.append(saved)
        try:
            with self.saved_tensors():
                result = fn()
        finally:
            with self._lock:
                self._calls = [call for call in self._calls if call is not saved]
        with self._lock:
            self._apply_releases()
            held = sum(self._held[key][1] for key in saved if key in self._held)
        del result
        return held


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _cuda_started() -> bool:
    """Whether this process uses CUDA (a CPU run is not made to create a context)."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def measure_stage(
    forward: Callable[[torch.Tensor | None], torch.Tensor],
    given: torch.Tensor | None,
    params: Iterable[torch.Tensor],
    *,
    loss: bool = False,
) -> StageMemory:
    """Every byte one microbatch through a chunk (or part of one) holds, step by step.

    Counted by an `AllocationCounter` over a forward and a plain backward, then a forward
    and a split backward (``I``, then ``W``, as the zero-bubble schedules run it), as
    `pp_schedules.StageMemory` defines the figures. The chunk runs as the executor runs it:
    its input a fresh tensor (a receive's), its output's storage freed once sent, and the
    parameters' gradients added into existing tensors (as into pp-optim's gradient buffers,
    so only the transient gradient counts; existing ``.grad`` tensors are restored after).

    Args:
        forward: Runs the chunk's forward on its input (None for a first stage, which reads
            its own data) and returns its output, or with `loss` its scalar loss.
        given: An input as the previous stage would send it (its values do not matter; a
            copy that requires grad is used); None for a first stage.
        params: The chunk's parameters.
        loss: `forward` ends in the loss (the last stage): backward starts from it and
            nothing is sent.

    Returns:
        The figures; `parameters` is the number of elements of `params`.
    """
    trainable = [p for p in params if p.requires_grad]
    kept_grads = [p.grad for p in trainable]
    for param in trainable:
        param.grad = torch.zeros_like(param)
    try:
        plain = _counted_steps(forward, given, trainable, loss=loss, split=False)
        split = _counted_steps(forward, given, trainable, loss=loss, split=True)
    finally:
        for param, grad in zip(trainable, kept_grads, strict=True):
            param.grad = grad
    return dataclasses.replace(
        plain,
        input_transient_bytes=split.input_transient_bytes,
        deferred_bytes=split.deferred_bytes,
        weight_transient_bytes=split.weight_transient_bytes,
        weight_kept_bytes=split.weight_kept_bytes,
        keeps_output_grad=split.keeps_output_grad,
    )


def _counted_steps(
    forward: Callable[[torch.Tensor | None], torch.Tensor],
    given: torch.Tensor | None,
    params: list[torch.Tensor],
    *,
    loss: bool,
    split: bool,
) -> StageMemory:
    """One forward and backward (split into I and W with `split`), counted."""
    base = None if given is None else given.detach().clone().requires_grad_()
    counter = AllocationCounter()
    with counter.counting():
        received = None if base is None else base.clone()  # what a receive allocates
        received_bytes = 0 if received is None else received.untyped_storage().nbytes()
        output = forward(received)
        forward_peak = counter.take_peak() - received_bytes
        before = counter.live_bytes
        del received
        holds_input = base is not None and counter.live_bytes == before
        held_input = received_bytes if holds_input else 0
        output_bytes = 0 if loss else output.untyped_storage().nbytes()
        kept = counter.live_bytes - held_input
        grad = None if loss else torch.randn_like(output)  # what the next stage sends back
        if grad is not None:  # sent: the executor frees the output's storage
            deallocate_output_tensor(output, deallocate_pipeline_outputs=True)
        sent = 0 if grad is None else grad.nbytes + output.untyped_storage().nbytes()
        activation = counter.live_bytes - held_input - sent
        start = counter.live_bytes
        counter.take_peak()
        figures: dict[str, Any] = {}
        if split:
            figures = _split_steps(counter, (output, grad), base, params, start)
        else:
            custom_backward(output, grad)
            figures["backward_transient_bytes"] = max(counter.take_peak() - start, 0)
            made = base.grad if base is not None else None
            figures["input_grad_bytes"] = 0 if made is None else made.untyped_storage().nbytes()
    return StageMemory(
        parameters=sum(p.numel() for p in params),
        activation_bytes=max(activation, 0),
        output_bytes=output_bytes,
        forward_transient_bytes=max(forward_peak - kept, 0),
        holds_input=holds_input or base is None,
        **figures,
    )


def _split_steps(
    counter: AllocationCounter,
    root: tuple[torch.Tensor, torch.Tensor | None],
    base: torch.Tensor | None,
    params: list[torch.Tensor],
    start: int,
) -> dict[str, Any]:
    """Count an ``I`` and then a ``W`` (pp-schedules' split backward) from `start`.

    `root` is the output and the gradient it gets (None for a loss).
    """
    output, grad = root
    inputs = [] if base is None else [base]
    grads = None if grad is None else [grad]
    input_grads, weights = backward_input([output], grads, inputs, params)
    input_peak = counter.take_peak() - start
    made = sum(g.untyped_storage().nbytes() for g in input_grads if g is not None)
    deferred = counter.live_bytes - start - made
    captured = {t.untyped_storage().data_ptr() for ts in weights.captured.values()
                for t in ts if t is not None}  # fmt: skip
    keeps = grad is not None and grad.untyped_storage().data_ptr() in captured
    del input_grads
    weight_start = counter.live_bytes
    counter.take_peak()
    kept: list[int] = []
    weights.run(before_exit=lambda: kept.append(counter.live_bytes - weight_start))
    return {
        "input_grad_bytes": made,
        "input_transient_bytes": max(input_peak, 0),
        "deferred_bytes": max(deferred, 0),
        "weight_transient_bytes": max(counter.take_peak() - weight_start, 0),
        "weight_kept_bytes": max(kept[0] if kept else 0, 0),
        "keeps_output_grad": keeps,
    }
