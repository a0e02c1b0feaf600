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
from collections.abc import Callable, Iterable, Iterator

import torch

from pp_schedules.runtime._allocation_counter import AllocationCounter

__all__ = ["MemoryProbe", "MemorySample", "StaticTensors", "storage_bytes"]

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
