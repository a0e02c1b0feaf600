"""Measured memory: the bytes a rank holds, counted the way the simulator's byte model predicts.

A `MemoryProbe` counts two things, both as distinct storages (``untyped_storage()``, deduped by
``data_ptr()``, ``nbytes()`` each):

- **static**: what its ``static`` callable lists: parameter storage, gradient storage
  (pp-optim's contiguous ``main_grad`` buffers, or ``.grad`` where there is no buffer) and
  optimizer state (Adam's moments, SGD's momentum, fp32 master copies and their gradients);
  pp-train's ``training_state_tensors`` lists exactly these.
- **saved**: tensors autograd saved for backward and still alive, seen through
  ``torch.autograd.graph.saved_tensors_hooks`` while `MemoryProbe.saved_tensors` is active.
  Parameters, views of parameters (a matmul saves ``weight.t()``) and storages of static
  tensors pass through uncounted, so nothing counts twice.

Left out, as the byte model leaves them out: p2p buffers, the outputs a stage keeps for its
backward (unless an op saved them), and temporaries inside one op. torch's non-reentrant
checkpoint saves its inputs where these hooks see them, but keeps the tensors it recomputes
during backward under hooks of its own: on CPU the probe does not see recomputed tensors (on
CUDA ``torch.cuda.memory_allocated``, in each sample's ``allocated_bytes``, sees everything).

`PipelineExecutor.record_memory` runs every call inside `MemoryProbe.saved_tensors` and takes
one `MemorySample` after each compute step, in the order of the rank's steps: the order of the
simulator's predicted bytes (`pp_schedules.simulate(..., memory=...)`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator

import torch

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
    """

    label: str
    static_bytes: int
    saved_bytes: int
    peak_saved_bytes: int
    allocated_bytes: int | None

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
    """Counts the bytes a rank holds: static storage and tensors saved for backward.

    Args:
        static: Lists the static tensors (see the module docstring); None: no static bytes,
            and only parameters (and their views) are left out of the saved bytes.
    """

    def __init__(self, static: StaticTensors | None = None) -> None:
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
        """Record what is held now as `label`; appended to `samples` and returned."""
        saved = self.saved_bytes
        allocated = torch.cuda.memory_allocated() if _cuda_started() else None
        with self._lock:
            peak, self._interval_peak = self._interval_peak, self._saved
        taken = MemorySample(label, self.static_bytes(), saved, max(peak, saved), allocated)
        self.samples.append(taken)
        return taken

    def clear(self) -> None:
        """Forget the samples and the peaks; what is held now stays counted."""
        self.samples = []
        with self._lock:
            self._apply_releases()
            self._peak = self._interval_peak = self._saved

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


def _cuda_started() -> bool:
    """Whether this process uses CUDA (a CPU run is not made to create a context)."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
