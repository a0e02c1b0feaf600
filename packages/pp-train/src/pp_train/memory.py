"""Memory as Megatron reports it, measured on CPU as well: once per run, after the first log line.

`memory_report` writes Megatron's ``report_memory`` line, ``[Rank r] (after N iterations)
memory (MB) | allocated: .. | max allocated: .. | reserved: .. | max reserved: ..``, then the
most bytes saved for backward (a breakdown). allocated and max allocated are pp-schedules'
`MemoryProbe` live figures: every storage the rank holds, counted at the allocator level (on
CPU, where torch keeps no allocator statistics, every storage allocated since the probe began
plus the static tensors; on CUDA the allocator's allocated bytes, its peak reset at every
sample). reserved / max reserved are the CUDA allocator's, or on CPU the process's resident
set size now / at its largest.

Host memory is apart: a dataset's token arrays and sample indices, made before the first
step, are on the host in a GPU run and are never counted as allocated; `host_memory_line`
reports them (`host_bytes` of a dataset that says).

`MemoryReport` is what `train` runs when given a print function for it (`pretrain` gives one):
the probe counting over every iteration (the step and its optimizer step) from the first up
to and including the first logged one, then the lines (on every rank of data-parallel replica
0, as Megatron's ``report_memory``), then the probe off so later iterations pay nothing.
`empty_unused_memory` is Megatron's ``--empty-unused-memory-level``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pp_optim import MegatronOptimizer
from pp_schedules import MemoryProbe, MemorySample, PipelineExecutor
from pp_schedules.planning import MemoryTrack
from pp_state import ParallelState

__all__ = [
    "MemoryReport",
    "empty_unused_memory",
    "host_bytes",
    "host_memory_line",
    "legacy_memory_report",
    "max_rss_bytes",
    "memory_report",
    "prediction_line",
    "rss_bytes",
    "training_state_tensors",
    "uses_cuda",
]

_MB = 1024 * 1024


def training_state_tensors(
    model: Sequence[torch.nn.Module], optimizer: MegatronOptimizer
) -> list[torch.Tensor]:
    """What a rank holds for the whole step: a `MemoryProbe`'s ``static`` tensors.

    The chunks' parameters, their gradients (pp-optim's grad buffer views ``main_grad``, and
    ``grad`` where set) and the optimizer's state (`MegatronOptimizer.state_tensors`: Adam's
    moments, SGD's momentum, fp32 main copies and their own gradients). Tensors may share a
    storage (a buffer's views); the probe counts each storage once.
    """
    tensors: list[torch.Tensor] = []
    for chunk in model:
        for param in chunk.parameters():
            tensors.append(param)
            for grad in (getattr(param, "main_grad", None), param.grad):
                if isinstance(grad, torch.Tensor):
                    tensors.append(grad)
    return tensors + optimizer.state_tensors()


def rss_bytes() -> int | None:
    """This process's resident set size now; None where ``/proc`` does not say (not Linux)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def max_rss_bytes() -> int | None:
    """This process's largest resident set size so far; None without ``resource`` (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kibibytes, macOS bytes.
    return int(max_rss) if sys.platform == "darwin" else int(max_rss) * 1024


def legacy_memory_report() -> str:
    """What pp-train printed at the end of training before 0.9 (deprecated, see `memory_report`).

    Returns:
        ``"memory (MB) | max rss: ..."``, followed by CUDA allocated, max allocated, reserved
        and max reserved memory of the current device when CUDA is available.
    """
    max_rss = max_rss_bytes()
    parts = ["memory (MB)", "max rss: " + ("n/a" if max_rss is None else f"{max_rss / _MB:.1f}")]
    if torch.cuda.is_available():
        parts += [f"{name}: {count / _MB:.1f}" for name, count in _allocator_figures().items()]
    return " | ".join(parts)


def _allocator_figures() -> dict[str, int]:
    """The CUDA caching allocator's four numbers, by Megatron's names for them."""
    return {
        "allocated": torch.cuda.memory_allocated(),
        "max allocated": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "max reserved": torch.cuda.max_memory_reserved(),
    }


def _cuda_in_use() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def _measured(measured: MemoryProbe | MemorySample | None) -> tuple[int | None, int | None]:
    """Allocated and max allocated bytes by the probe's count (None without one).

    The live figures (every storage) where the probe counted them; else the static and
    saved bytes.
    """
    if measured is None:
        return None, None
    if isinstance(measured, MemorySample):
        if measured.live_bytes is not None and measured.peak_live_bytes is not None:
            return measured.live_bytes, measured.peak_live_bytes
        return measured.total_bytes, measured.peak_total_bytes
    live = measured.live_bytes
    peak = measured.peak_live_bytes
    if live is not None:
        return live, max(live, peak or 0)
    live = measured.static_bytes() + measured.saved_bytes
    return live, max([live, *(s.peak_total_bytes for s in measured.samples)])


def _most_saved(measured: MemoryProbe | MemorySample | None) -> int | None:
    """The most bytes saved for backward the probe saw (the breakdown)."""
    return None if measured is None else measured.peak_saved_bytes


def _megabytes(count: int | None) -> str:
    # Megatron prints the plain quotient: report_memory's "{}".format(bytes / 2**20).
    return "n/a" if count is None else f"{count / _MB}"


def memory_report(
    measured: MemoryProbe | MemorySample | None = None,
    prediction: str | None = None,
    *,
    iteration: int | None = None,
    rank: int | None = None,
) -> str:
    """Megatron's memory line (``report_memory``), with the byte model's prediction beside it.

    Args:
        measured: Where allocated and max allocated come from (see the module docstring):
            a probe (its live bytes now, and the most over its samples), one sample (its
            live and peak live bytes), or None ("n/a", or on CUDA the allocator's own).
        prediction: Text to print after the numbers (e.g. the simulator's predicted peak).
        iteration: Names the line ``(after N iterations)``, as Megatron's.
        rank: The global rank in ``[Rank r]``; by default this process's (0 alone).

    Returns:
        ``[Rank r] (after N iterations) memory (MB) | allocated: .. | max allocated: .. |
        reserved: .. | max reserved: .. | max saved for backward: ..`` and `` |
        <prediction>`` when given. On CPU, reserved and max reserved are the resident set
        size now and at its largest.
    """
    allocated, peak = _measured(measured)
    if _cuda_in_use():
        figures: dict[str, int | None] = {**_allocator_figures()}
        if peak is not None:  # the probe resets the allocator's peak at every sample
            figures["allocated"], figures["max allocated"] = allocated, peak
        kept = getattr(measured, "peak_reserved_bytes", None)
        if kept is not None:  # and keeps the reserved peaks it reset
            figures["max reserved"] = max(kept, figures["max reserved"] or 0)
    else:
        resident, most = rss_bytes(), max_rss_bytes()
        if resident is not None and most is not None:
            most = max(most, resident)  # the kernel's high-water mark is updated lazily
        figures = {
            "allocated": allocated,
            "max allocated": peak,
            "reserved": resident,
            "max reserved": most,
        }
    saved = _most_saved(measured)
    if saved is not None:
        figures["max saved for backward"] = saved
    fields = " | ".join(f"{name}: {_megabytes(count)}" for name, count in figures.items())
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    after = "" if iteration is None else f"(after {iteration} iterations) "
    line = f"[Rank {rank}] {after}memory (MB) | {fields}"
    return line if prediction is None else f"{line} | {prediction}"


def prediction_line(track: MemoryTrack) -> str:
    """The byte model's figures for one rank, printed beside the measured ones.

    As Megatron's theoretical memory report: weight and optimizer (parameters, gradients and
    optimizer state), the transport's buffers kept between steps, the activations (and
    gradients and tensors in transit) at the peak, and the total peak (what max allocated
    measures), in MB.
    """
    activations = track.peak_activations - track.transfer_bytes
    return (
        f"predicted (MB): weight and optimizer: {track.static.total / _MB:.3f}, "
        f"transfer buffers: {track.transfer_bytes / _MB:.3f}, "
        f"activations: {activations / _MB:.3f}, total: {track.peak / _MB:.3f}"
    )


def host_bytes(dataset: object) -> int | None:
    """The host memory a dataset holds (its ``host_bytes()``); None when it does not say."""
    method = getattr(dataset, "host_bytes", None)
    if not callable(method):
        return None
    count = method()
    return count if isinstance(count, int) else None


def host_memory_line(count: int | None, *, rank: int | None = None) -> str:
    """The host memory line printed after the memory line: the training data's bytes.

    ``[Rank r] host memory (MB) | data: ..``: token arrays and sample indices, made before the
    first step, which a GPU run keeps on the host. They are not in allocated, nor in the
    prediction, nor under ``--memory-limit-gb``, which concern the device (on a CPU run too).
    """
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    data = "n/a" if count is None else f"{count / _MB}"
    return (
        f"[Rank {rank}] host memory (MB) | data: {data} | apart from allocated: "
        "--memory-limit-gb and the prediction count the device's bytes only"
    )


def uses_cuda(model: Sequence[torch.nn.Module]) -> bool:
    """Whether the chunks' parameters live on a CUDA device."""
    if not torch.cuda.is_available():
        return False
    return any(p.is_cuda for chunk in model for p in chunk.parameters())


def empty_unused_memory(level: int, at_least: int, model: Sequence[torch.nn.Module]) -> None:
    """Megatron's ``--empty-unused-memory-level``: hand cached CUDA blocks back to the device.

    Calls ``torch.cuda.empty_cache()`` when `level` is `at_least` or more: level 1 after the
    forward-backward passes of a training step and after each evaluation step, level 2 also
    after the optimizer step. Nothing on CPU (no CUDA, or a model that is not on it).
    """
    if level >= at_least and uses_cuda(model):
        torch.cuda.empty_cache()


class MemoryReport:
    """Megatron's memory line once per run, after the first logged iteration (see `train`).

    Args:
        forward_backward_func: The step's function; pp-schedules' executor gets a probe,
            which it runs until the report (any other function: CPU numbers "n/a").
        model: This rank's chunks.
        optimizer: Its optimizer (its state is static memory).
        state: The parallel state: ranks of data-parallel replica 0 print, as Megatron's.
        print_fn: Receives the line (on the printing ranks); None: no report, and no probe.
        prediction: The byte model's prediction for this rank, printed beside the numbers.
        host_data_bytes: The training data's host bytes (`host_bytes`), printed on a line
            of their own; None: not known.
    """

    def __init__(
        self,
        forward_backward_func: Any,
        model: Sequence[torch.nn.Module],
        optimizer: MegatronOptimizer,
        state: ParallelState,
        *,
        print_fn: Callable[[str], None] | None,
        prediction: str | None = None,
        host_data_bytes: int | None = None,
    ) -> None:
        self.static = functools.partial(training_state_tensors, model, optimizer)
        """The probe's static tensors (the schedule profile measures with them too)."""
        self.print_fn = print_fn
        self.prediction = prediction
        self.host_data_bytes = host_data_bytes
        self.prints = state.group_rank("dp") == 0
        self.reported = print_fn is None
        self.executor = (
            forward_backward_func
            if isinstance(forward_backward_func, PipelineExecutor)
            and print_fn is not None
            and self.prints
            else None
        )
        self.probe = MemoryProbe(self.static) if self.executor is not None else None
        if self.executor is not None:
            self.executor.record_memory(self.probe)

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """One training iteration, counted while the report is pending (a sample at its end).

        The probe counts the whole step, its optimizer step included; the executor samples
        after each compute step, and this adds one sample after the optimizer's.
        """
        probe = self.probe
        if probe is None:
            yield
            return
        with probe.counting():
            yield
            probe.sample("step end")

    def after_log(self, iteration: int) -> None:
        """After the first logged iteration: print the lines and stop measuring; later, nothing."""
        if self.reported:
            return
        self.reported = True
        if self.prints and self.print_fn is not None:
            lines = (
                memory_report(self.probe, self.prediction, iteration=iteration),
                host_memory_line(self.host_data_bytes),
            )
            self.print_fn("\n".join(lines))  # one print: the ranks' lines stay whole
        self.stop()

    def stop(self) -> None:
        """Take the probe off the executor (unless something else replaced it)."""
        if self.executor is not None and self.executor.memory_probe is self.probe:
            self.executor.record_memory(None)
        self.probe = None
