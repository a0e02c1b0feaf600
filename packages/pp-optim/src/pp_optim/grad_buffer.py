"""Contiguous gradient buffers and the data-parallel wrapper that all-reduces them in buckets.

`DistributedDataParallel` gives every trainable parameter a ``main_grad``: a view into one flat
buffer per gradient dtype. Backward adds each gradient into its ``main_grad`` (and drops the
``grad``), so gradients accumulate there over microbatches; at the end of the step the buffer is
all-reduced over the data-parallel group one bucket at a time: a bucket is a contiguous slice, so
one collective moves many parameters. Parameters are laid out in reverse order, the order
backward produces their gradients, so with ``overlap_grad_reduce`` the first buckets can travel
while backward still computes the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pp_state.collectives import CollectiveError, collective, collective_error

if TYPE_CHECKING:
    from pp_state import ParallelState

__all__ = [
    "DDPConfig",
    "DistributedDataParallel",
    "GradBucket",
    "GradSyncError",
    "all_reduce_grads",
]

# Megatron's bucket size when overlapping: large enough that per-collective latency is small
# next to the transfer, scaled with the data-parallel size.
_DEFAULT_BUCKET_ELEMENTS = 40_000_000
_BUCKET_ELEMENTS_PER_DP_RANK = 1_000_000


class GradSyncError(CollectiveError):
    """A gradient all-reduce failed or timed out; the message names rank, group and bucket.

    A `pp_state.CollectiveError`: ``rank``, ``peer``, ``operation``, ``group_ranks``.
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """How gradients are accumulated and reduced over data parallelism."""

    grad_reduce_in_fp32: bool = dataclasses.field(
        default=True, metadata={"flag": "--accumulate-allreduce-grads-in-fp32"}
    )
    """Accumulate and all-reduce gradients in fp32 whatever the parameters' dtype; False keeps
    each parameter's own dtype (half the memory and traffic for fp16/bf16)."""

    overlap_grad_reduce: bool = False
    """Start a bucket's all-reduce from backward as soon as all its gradients are final (in the
    last microbatch, outside `DistributedDataParallel.no_sync`)."""

    bucket_size: int | None = dataclasses.field(
        default=None, metadata={"flag": "--ddp-bucket-size"}
    )
    """Elements per bucket. None: Megatron's ``max(40M, 1M * dp)`` when overlapping, one
    bucket per dtype otherwise."""

    average_gradients: bool = True
    """Divide by the data-parallel size (the mean over the global batch); False sums."""

    def __post_init__(self) -> None:
        """Checks the bucket size.

        Raises:
            ValueError: `bucket_size` is not positive.
        """
        if self.bucket_size is not None and (
            isinstance(self.bucket_size, bool)
            or not isinstance(self.bucket_size, int)
            or self.bucket_size <= 0
        ):
            raise ValueError(f"bucket_size must be a positive int or None, got {self.bucket_size}")


class GradBucket:
    """A contiguous slice of a grad buffer, all-reduced by one collective."""

    def __init__(self, index: int, data: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        self.index = index
        self.data = data
        self.params = params
        self._param_ids = frozenset(id(p) for p in params)
        self._ready: set[int] = set()
        self.work: dist.Work | None = None
        self.started = False

    def mark_ready(self, param: torch.nn.Parameter) -> bool:
        """Records that `param`'s gradient is final; True when the whole bucket is."""
        if self.started:
            raise RuntimeError(
                f"a gradient for a parameter of bucket {self.index} ({tuple(param.shape)}) arrived"
                " after the bucket's all-reduce started; call zero_grad_buffer() before each"
                " step and run the microbatches before the last inside no_sync()"
            )
        self._ready.add(id(param))
        return len(self._ready) == len(self._param_ids)

    def reset(self) -> None:
        """Forgets the last step's progress."""
        self._ready.clear()
        self.work = None
        self.started = False


class DistributedDataParallel(torch.nn.Module):
    """Wraps a module (one model chunk) with contiguous grad buffers and bucketed all-reduce.

    Use it like Megatron's: backward fills ``param.main_grad``; `finish_grad_sync` (or
    `start_grad_sync` then `finish_grad_sync`) reduces over the data-parallel group;
    `zero_grad_buffer` starts the next step. `no_sync` keeps the microbatches before the last
    from starting reductions when overlapping.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        config: DDPConfig | None = None,
        *,
        data_parallel_group: dist.ProcessGroup | None,
        disable_bucketing: bool = False,
    ) -> None:
        """Lays out the buffers and registers the gradient hooks.

        Args:
            module: The model chunk; its trainable parameters get ``main_grad``.
            config: Accumulation and reduction options; defaults to `DDPConfig()`.
            data_parallel_group: The ranks holding replicas of this chunk; None for no data
                parallelism (the buffers are still used, nothing is reduced).
            disable_bucketing: One bucket per dtype whatever `config.bucket_size` says
                (Megatron does this for every chunk but the first pipeline stage's first).
        """
        super().__init__()
        self.module = module
        self.config = config if config is not None else DDPConfig()
        self.data_parallel_group = data_parallel_group
        self.data_parallel_size = (
            1 if data_parallel_group is None else dist.get_world_size(data_parallel_group)
        )
        self._sync_enabled = True
        params = [p for p in module.parameters() if p.requires_grad]
        # Backward produces gradients roughly last-parameter-first.
        params.reverse()
        self.buffers_by_dtype: dict[torch.dtype, torch.Tensor] = {}
        self.buckets: list[GradBucket] = []
        self._bucket_of: dict[int, GradBucket] = {}
        bucket_size = None if disable_bucketing else self._bucket_size()
        for dtype in dict.fromkeys(self._grad_dtype(p) for p in params):
            same = [p for p in params if self._grad_dtype(p) == dtype]
            self._lay_out(dtype, same, bucket_size)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in params
        ]

    @classmethod
    def from_parallel_state(
        cls,
        module: torch.nn.Module,
        state: ParallelState,
        config: DDPConfig | None = None,
        *,
        disable_bucketing: bool = False,
    ) -> DistributedDataParallel:
        """Wraps `module` to reduce over `state`'s data-parallel group with context parallelism.

        Megatron reduces over data x context parallel ranks: context-parallel ranks hold the
        same weights and see different parts of each sequence.
        """
        return cls(
            module,
            config,
            data_parallel_group=state.group("dp_cp"),
            disable_bucketing=disable_bucketing,
        )

    def _grad_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return torch.float32 if self.config.grad_reduce_in_fp32 else param.dtype

    def _bucket_size(self) -> int | None:
        if self.config.bucket_size is not None:
            return self.config.bucket_size
        if not self.config.overlap_grad_reduce:
            return None
        return max(_DEFAULT_BUCKET_ELEMENTS, _BUCKET_ELEMENTS_PER_DP_RANK * self.data_parallel_size)

    def _lay_out(
        self, dtype: torch.dtype, params: list[torch.nn.Parameter], bucket_size: int | None
    ) -> None:
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"parameters of one module chunk on several devices: {devices}")
        total = sum(p.numel() for p in params)
        buffer = torch.zeros(total, dtype=dtype, device=devices.pop())
        self.buffers_by_dtype[dtype] = buffer
        offset, bucket_start, members = 0, 0, []
        for param in params:
            param.main_grad = buffer[offset : offset + param.numel()].view(param.shape)  # type: ignore[attr-defined]
            offset += param.numel()
            members.append(param)
            if bucket_size is not None and offset - bucket_start >= bucket_size:
                self._add_bucket(buffer[bucket_start:offset], members)
                bucket_start, members = offset, []
        if members:
            self._add_bucket(buffer[bucket_start:offset], members)

    def _add_bucket(self, data: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        bucket = GradBucket(len(self.buckets), data, params)
        self.buckets.append(bucket)
        for param in params:
            self._bucket_of[id(param)] = bucket

    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
        param.grad = None
        if self.config.overlap_grad_reduce and self._sync_enabled:
            bucket = self._bucket_of[id(param)]
            if bucket.mark_ready(param):  # type: ignore[arg-type]
                self._start_bucket(bucket, async_op=True)

    def forward(self, *inputs: object, **kwargs: object) -> object:
        """Calls the wrapped module."""
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this context backward only accumulates; no bucket starts its reduction."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _start_bucket(self, bucket: GradBucket, *, async_op: bool) -> None:
        bucket.started = True
        if self.data_parallel_group is None:
            return
        if self.config.average_gradients and self.data_parallel_size > 1:
            bucket.data.mul_(1.0 / self.data_parallel_size)
        try:
            bucket.work = dist.all_reduce(
                bucket.data, group=self.data_parallel_group, async_op=async_op
            )
        except RuntimeError as error:
            raise self._sync_error(bucket, error) from error

    def start_grad_sync(self) -> None:
        """Starts the all-reduce of every bucket not yet started, without waiting."""
        for bucket in self.buckets:
            if not bucket.started:
                self._start_bucket(bucket, async_op=True)

    def finish_grad_sync(self) -> None:
        """Reduces every bucket not yet reduced and waits for all of them.

        Buckets whose parameters got no gradient this step (an unused layer) are reduced
        here too, so every rank runs the same collectives.

        Raises:
            GradSyncError: A collective failed or timed out (the process group's timeout).
        """
        self.start_grad_sync()
        for bucket in self.buckets:
            if bucket.work is None:
                continue
            try:
                bucket.work.wait()
            except RuntimeError as error:
                raise self._sync_error(bucket, error) from error
            bucket.work = None

    def _sync_error(self, bucket: GradBucket, error: RuntimeError) -> GradSyncError:
        operation = (
            f"gradient all-reduce over data parallel (bucket {bucket.index},"
            f" {bucket.data.numel()} elements)"
        )
        named = collective_error(
            error, operation, group=self.data_parallel_group, error_class=GradSyncError
        )
        assert isinstance(named, GradSyncError)
        return named

    def scale_gradients(self, factor: float) -> None:
        """Multiplies every accumulated gradient by `factor`."""
        for buffer in self.buffers_by_dtype.values():
            buffer.mul_(factor)

    def zero_grad_buffer(self) -> None:
        """Zeroes the buffers and forgets the last step's reductions (call before each step)."""
        for buffer in self.buffers_by_dtype.values():
            buffer.zero_()
        for bucket in self.buckets:
            bucket.reset()
        for param in self.module.parameters():
            param.grad = None

    def broadcast_params(self) -> None:
        """Copies every parameter from the data-parallel group's first rank to the others."""
        if self.data_parallel_group is None:
            return
        group = self.data_parallel_group
        source = dist.get_global_rank(group, 0)
        with torch.no_grad(), collective("parameter broadcast over data parallel", group=group):
            for param in self.module.parameters():
                dist.broadcast(param.data, src=source, group=group)


def all_reduce_grads(params: list[torch.nn.Parameter], *, group: dist.ProcessGroup | None) -> None:
    """Sums the gradients of `params` over `group`, in place, one collective per dtype.

    For weights that several stages hold copies of, such as the word embedding tied between
    the first and the last pipeline stage (Megatron's embedding group) or the position
    embedding (its group): after the sum every copy holds the gradient of the tied weight.
    A parameter's ``main_grad`` is used when a grad buffer holds one, else its ``grad``;
    parameters with neither are skipped. Every rank of `group` must pass the same number of
    gradients of the same shapes.

    Args:
        params: The copies this rank holds.
        group: The ranks holding the other copies; None does nothing.
    """
    if group is None:
        return
    grads: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        if grad is not None:
            grads.setdefault(grad.dtype, []).append(grad)
    for same_dtype in grads.values():
        flat = torch.cat([grad.reshape(-1) for grad in same_dtype])
        with collective("shared-weight gradient all-reduce", group=group):
            dist.all_reduce(flat, group=group)
        offset = 0
        for grad in same_dtype:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
