"""Contiguous gradient buffers and the data-parallel wrapper that all-reduces them in buckets.

`DistributedDataParallel` gives every trainable parameter a ``main_grad``: a view into one flat
buffer per gradient dtype. Backward adds each gradient into its ``main_grad`` (and drops the
``grad``), so gradients accumulate there over microbatches; at the end of the step the buffer is
all-reduced over the data-parallel group one bucket at a time: a bucket is a contiguous slice, so
one collective moves many parameters. Parameters are laid out in reverse order, the order
backward produces their gradients, so with ``overlap_grad_reduce`` the first buckets can travel
while backward still computes the rest. A parameter whose gradient a fused linear product
already added into ``main_grad`` (pp-tensor's ``gradient_accumulation_fusion``, Megatron's flag
``grad_added_to_main_grad``) is not added twice; its bucket still counts it as ready.

With ``use_distributed_optimizer`` each bucket is padded to a multiple of the data-parallel size
and reduce-scattered instead (rank r keeps shard r reduced; on gloo all-reduced whole, which is
faster there), and the parameters move into a parameter buffer aligned with the grad buffer,
all-gathered bucket by bucket after the `pp_optim.DistributedOptimizer` step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
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
    """A gradient reduction or parameter all-gather failed or timed out.

    The message names rank, group, operation and bucket.

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

    calculate_per_token_loss: bool = False
    """Per-token loss (Megatron's flag): each loss is a sum over its tokens, normalised by
    the token count of the whole global batch rather than averaged per microbatch, so the
    loss does not depend on how the batch is cut (packed documents, loss masks). The
    reduction then sums the gradients over data (x context) parallelism whatever
    `average_gradients` says, with or without the distributed optimizer, and the trainer
    divides them by the batch's token count (`DistributedDataParallel.scale_gradients`);
    pp-train also hands the token counts to its finalisation and logs the mean per token."""

    use_distributed_optimizer: bool = dataclasses.field(
        default=False, metadata={"flag": "--use-distributed-optimizer"}
    )
    """Lay the buffers out for `pp_optim.DistributedOptimizer` (Megatron's ZeRO-1): each
    bucket is padded to a multiple of the data-parallel size and split into one contiguous
    shard per rank; gradients are reduce-scattered (each rank ends with its shard reduced)
    and the parameters live in a parameter buffer aligned with the grad buffer, all-gathered
    after each optimizer step."""

    overlap_param_gather: bool = dataclasses.field(
        default=False, metadata={"flag": "--overlap-param-gather"}
    )
    """Start the parameters' all-gather asynchronously after the optimizer step; each module
    waits for its bucket's gather, and for the gathers started before it, just before it runs
    in the next forward. Needs `use_distributed_optimizer` and `overlap_grad_reduce` (as
    Megatron)."""

    def __post_init__(self) -> None:
        """Checks the bucket size and the overlap options.

        Raises:
            ValueError: `bucket_size` is not positive, or `overlap_param_gather` is set
                without `use_distributed_optimizer` or without `overlap_grad_reduce`.
        """
        if self.bucket_size is not None and (
            isinstance(self.bucket_size, bool)
            or not isinstance(self.bucket_size, int)
            or self.bucket_size <= 0
        ):
            raise ValueError(
                f"bucket_size must be a positive int or None, got {self.bucket_size}"
                " (--ddp-bucket-size)"
            )
        if self.overlap_param_gather and not (
            self.use_distributed_optimizer and self.overlap_grad_reduce
        ):
            missing = [
                flag
                for flag, on in (
                    ("--use-distributed-optimizer", self.use_distributed_optimizer),
                    ("--overlap-grad-reduce", self.overlap_grad_reduce),
                )
                if not on
            ]
            raise ValueError(
                "--overlap-param-gather (overlap_param_gather) needs --use-distributed-optimizer"
                f" and --overlap-grad-reduce, as in Megatron; missing: {', '.join(missing)}"
            )


class GradBucket:
    """A contiguous slice of a grad buffer, reduced by one collective.

    With the distributed optimizer the slice is padded to a multiple of the data-parallel
    size and split into equal contiguous shards: rank r owns ``shard(r)``; ``param_data``
    is the matching slice of the parameter buffer, all-gathered after each step.
    """

    def __init__(
        self,
        index: int,
        data: torch.Tensor,
        params: list[torch.nn.Parameter],
        *,
        offset: int = 0,
        num_shards: int = 1,
        param_data: torch.Tensor | None = None,
    ) -> None:
        """Describes one bucket.

        Args:
            index: Its position among its wrapper's buckets.
            data: Its slice of the grad buffer (padding included).
            params: The parameters laid out in it, in order from its start.
            offset: Where `data` starts in its grad buffer.
            num_shards: Data-parallel ranks sharing it (1 without the distributed optimizer).
            param_data: Its slice of the parameter buffer, or None without one.
        """
        assert data.numel() % num_shards == 0, "a sharded bucket is padded to the dp size"
        self.index = index
        self.data = data
        self.params = params
        self.offset = offset
        self.num_shards = num_shards
        self.param_data = param_data
        self.param_ranges: list[tuple[torch.nn.Parameter, int, int]] = []
        """Each parameter with its range [start, end) inside the bucket."""
        start = 0
        for param in params:
            self.param_ranges.append((param, start, start + param.numel()))
            start += param.numel()
        self._param_ids = frozenset(id(p) for p in params)
        self._ready: set[int] = set()
        self.work: dist.Work | None = None
        self.started = False
        self.gather_work: dist.Work | None = None
        """The parameters' all-gather in flight (overlap_param_gather), or None."""

    @property
    def shard_size(self) -> int:
        """Elements of one data-parallel shard."""
        return self.data.numel() // self.num_shards

    def shard(self, rank: int) -> tuple[int, int]:
        """The range [start, end) inside the bucket that data-parallel rank `rank` owns."""
        if not 0 <= rank < self.num_shards:
            raise ValueError(f"rank must be in [0, {self.num_shards}), got {rank}")
        return rank * self.shard_size, (rank + 1) * self.shard_size

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
        self.data_parallel_rank = (
            0 if data_parallel_group is None else dist.get_rank(data_parallel_group)
        )
        self._gloo = data_parallel_group is not None and dist.get_backend(data_parallel_group) == (
            "gloo"
        )
        self._sync_enabled = True
        params = [p for p in module.parameters() if p.requires_grad]
        # Backward produces gradients roughly last-parameter-first.
        params.reverse()
        self.buffers_by_dtype: dict[torch.dtype, torch.Tensor] = {}
        self.param_buffers: dict[torch.dtype, torch.Tensor] = {}
        """With the distributed optimizer: the parameters' storage, keyed like
        `buffers_by_dtype` (by gradient dtype) and aligned with it element for element."""
        self.buckets: list[GradBucket] = []
        self._bucket_of: dict[int, GradBucket] = {}
        bucket_size = None if disable_bucketing else self._bucket_size()
        for dtype in dict.fromkeys(self._grad_dtype(p) for p in params):
            same = [p for p in params if self._grad_dtype(p) == dtype]
            self._lay_out(dtype, same, bucket_size)
        for p in params:
            # Megatron's flag: a fused linear (pp-tensor's gradient_accumulation_fusion) that
            # added the weight gradient into main_grad itself sets it and hands back a dummy.
            p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in params
        ]
        if self.config.overlap_param_gather:
            self._hooks.extend(self._register_gather_waits())

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
        shards = self.data_parallel_size if self.config.use_distributed_optimizer else 1
        groups = self._bucket_members(params, bucket_size)
        # Padding each bucket to a multiple of the dp size gives every rank an equal shard.
        sizes = [-(-sum(p.numel() for p in members) // shards) * shards for members in groups]
        buffer = torch.zeros(sum(sizes), dtype=dtype, device=devices.pop())
        self.buffers_by_dtype[dtype] = buffer
        param_buffer = None
        if self.config.use_distributed_optimizer:
            param_buffer = torch.zeros_like(buffer, dtype=_one_param_dtype(dtype, params))
            self.param_buffers[dtype] = param_buffer
        offset = 0
        for members, size in zip(groups, sizes, strict=True):
            bucket = GradBucket(
                len(self.buckets),
                buffer[offset : offset + size],
                members,
                offset=offset,
                num_shards=shards,
                param_data=None if param_buffer is None else param_buffer[offset : offset + size],
            )
            self._add_bucket(bucket)
            offset += size

    def _bucket_members(
        self, params: list[torch.nn.Parameter], bucket_size: int | None
    ) -> list[list[torch.nn.Parameter]]:
        """Splits `params` into buckets of at least `bucket_size` elements (the last smaller).

        With the distributed optimizer a tied embedding (``shared_embedding``) gets a bucket
        of its own, as in Megatron: its copies on the first and last pipeline stage are then
        sharded alike, so summing them after the reduce-scatter sums matching shards.
        """
        groups: list[list[torch.nn.Parameter]] = []
        members: list[torch.nn.Parameter] = []
        size = 0
        for param in params:
            alone = self.config.use_distributed_optimizer and bool(
                getattr(param, "shared_embedding", False)
            )
            if alone and members:
                groups.append(members)
                members, size = [], 0
            members.append(param)
            size += param.numel()
            if alone or (bucket_size is not None and size >= bucket_size):
                groups.append(members)
                members, size = [], 0
        if members:
            groups.append(members)
        return groups

    def _add_bucket(self, bucket: GradBucket) -> None:
        self.buckets.append(bucket)
        for param, start, end in bucket.param_ranges:
            param.main_grad = bucket.data[start:end].view(param.shape)  # type: ignore[attr-defined]
            if bucket.param_data is not None:
                # The model keeps its Parameter objects; only their storage moves into the
                # parameter buffer, so all-gathering a bucket updates them in place.
                view = bucket.param_data[start:end].view(param.shape)
                with torch.no_grad():
                    view.copy_(param.data)
                param.data = view
            self._bucket_of[id(param)] = bucket

    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        if getattr(param, "grad_added_to_main_grad", False):
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        else:
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
        if self.averages and self.data_parallel_size > 1:
            bucket.data.mul_(1.0 / self.data_parallel_size)
        # A synchronous reduction is waited for here; an overlapped one where it is waited for.
        with self._recorded(bucket) if not async_op else contextlib.nullcontext():
            self._reduce(bucket, async_op=async_op)

    @property
    def averages(self) -> bool:
        """Whether the reduction averages over the data-parallel ranks (else it sums).

        It sums when `DDPConfig.average_gradients` is off or under
        `DDPConfig.calculate_per_token_loss`.
        """
        return self.config.average_gradients and not self.config.calculate_per_token_loss

    @property
    def _reduce_scatters(self) -> bool:
        """Whether buckets are reduce-scattered (with the distributed optimizer, off gloo).

        Otherwise they are all-reduced. Reduce-scattered, only this rank's shard is reduced;
        the rest of the bucket keeps this rank's own gradients. On gloo the whole bucket is
        all-reduced instead: torch 2.13's gloo reduce-scatter moves as much and measured
        1.3-2.4x slower than its all-reduce (pp-optim's distopt_bench); the shard this rank
        reads is the same.
        """
        return self.config.use_distributed_optimizer and not self._gloo

    def _reduce(self, bucket: GradBucket, *, async_op: bool) -> None:
        try:
            if self._reduce_scatters:
                start, end = bucket.shard(self.data_parallel_rank)
                bucket.work = dist.reduce_scatter_single(
                    bucket.data[start:end],
                    bucket.data,
                    group=self.data_parallel_group,
                    async_op=async_op,
                )
            else:
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
            with self._recorded(bucket):
                try:
                    bucket.work.wait()
                except RuntimeError as error:
                    raise self._sync_error(bucket, error) from error
            bucket.work = None

    def _operation(self, bucket: GradBucket, *, gather: bool = False) -> str:
        """The bucket's collective in words, as its error and the flight recorder name it."""
        if gather:
            what = "parameter all-gather"
        elif self._reduce_scatters:
            what = "gradient reduce-scatter"
        else:  # without the distributed optimizer, or with it on gloo
            what = "gradient all-reduce"
        return f"{what} over data parallel (bucket {bucket.index}, {bucket.data.numel()} elements)"

    def _recorded(self, bucket: GradBucket, *, gather: bool = False) -> collective:
        """The bucket's collective as pp-state's `collective` records it (its hook)."""
        return collective(
            self._operation(bucket, gather=gather),
            group=self.data_parallel_group,
            error_class=GradSyncError,
        )

    def _sync_error(
        self, bucket: GradBucket, error: RuntimeError, *, gather: bool = False
    ) -> GradSyncError:
        named = collective_error(
            error,
            self._operation(bucket, gather=gather),
            group=self.data_parallel_group,
            error_class=GradSyncError,
        )
        assert isinstance(named, GradSyncError)
        return named

    def start_param_sync(self, *, force_sync: bool = False) -> None:
        """All-gathers every bucket's parameters from the shards their owners updated.

        Called by `DistributedOptimizer` after a step. With ``overlap_param_gather`` (and not
        `force_sync`) the gathers only start, in bucket order: each module waits for its
        buckets, and for those started before them, just before it runs (a forward pre-hook),
        or `finish_param_sync` waits for all.

        Raises:
            GradSyncError: A gather failed or timed out.
        """
        if not self.config.use_distributed_optimizer:
            return
        self.finish_param_sync()  # a module that did not run may have left one waiting
        async_op = self.config.overlap_param_gather and not force_sync
        for bucket in self.buckets:  # in index order: `_wait_gathers_through` relies on it
            self._start_gather(bucket, async_op=async_op)

    def _start_gather(self, bucket: GradBucket, *, async_op: bool) -> None:
        if self.data_parallel_group is None or self.data_parallel_size == 1:
            return
        assert bucket.param_data is not None
        start, end = bucket.shard(self.data_parallel_rank)
        with self._recorded(bucket, gather=True) if not async_op else contextlib.nullcontext():
            self._gather(bucket, start, end, async_op=async_op)

    def _gather(self, bucket: GradBucket, start: int, end: int, *, async_op: bool) -> None:
        assert bucket.param_data is not None
        try:
            work = dist.all_gather_single(
                bucket.param_data,
                bucket.param_data[start:end],
                group=self.data_parallel_group,
                async_op=async_op,
            )
        except RuntimeError as error:
            raise self._sync_error(bucket, error, gather=True) from error
        bucket.gather_work = work if async_op else None

    def _wait_gather(self, bucket: GradBucket) -> None:
        work, bucket.gather_work = bucket.gather_work, None
        if work is None:
            return
        with self._recorded(bucket, gather=True):
            try:
                work.wait()
            except RuntimeError as error:
                raise self._sync_error(bucket, error, gather=True) from error

    def finish_param_sync(self) -> None:
        """Waits for every parameter all-gather still in flight.

        Call it before reading parameters outside a forward pass (a checkpoint, the
        parameters' norm).

        Raises:
            GradSyncError: A gather failed or timed out.
        """
        for bucket in self.buckets:
            self._wait_gather(bucket)

    def _register_gather_waits(self) -> list[torch.utils.hooks.RemovableHandle]:
        """Forward pre-hooks that wait for the gathers of a module's own parameters.

        One on every module holding parameters directly (Megatron's overlap_param_gather).
        Each waits up to its last bucket in the order the gathers started (see
        `_wait_gathers_through`).
        """
        handles = []
        for module in self.module.modules():
            owned = [
                self._bucket_of[id(p)]
                for p in module.parameters(recurse=False)
                if id(p) in self._bucket_of
            ]
            if owned:
                latest = max(owned, key=lambda bucket: bucket.index)
                handles.append(module.register_forward_pre_hook(self._waiter(latest)))
        return handles

    def _waiter(self, bucket: GradBucket) -> Callable[[torch.nn.Module, object], None]:
        def wait(module: torch.nn.Module, inputs: object) -> None:
            self._wait_gathers_through(bucket)

        return wait

    def _wait_gathers_through(self, bucket: GradBucket) -> None:
        """Waits for `bucket`'s gather and for every gather started before it.

        NCCL finishes one group's collectives in the order they started (one stream); gloo
        does not: its two worker threads run them side by side, and a later bucket's gather
        can be done while an earlier one is still being written. Waiting in start order
        makes one wait cover the earlier buckets on every backend. That matters for a
        parameter read outside its own module's forward, whose hook then never runs (a tied
        output layer's weight handed straight to a matmul): the first bucket, gathered
        first, holds the chunk's last parameters, so once any module of the chunk has run
        its hook they are whole.
        """
        for earlier in self.buckets[: bucket.index + 1]:
            self._wait_gather(earlier)

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


def _one_param_dtype(grad_dtype: torch.dtype, params: list[torch.nn.Parameter]) -> torch.dtype:
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) != 1:
        raise ValueError(
            f"use_distributed_optimizer needs one parameter dtype per gradient buffer; the"
            f" {grad_dtype} buffer holds parameters of {', '.join(dtypes)} (set"
            " grad_reduce_in_fp32=False to give each parameter dtype its own buffer)"
        )
    return params[0].dtype


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
