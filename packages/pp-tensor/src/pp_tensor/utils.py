"""Sizes, vocabulary ranges, shards and the tensor-parallel attributes of parameters.

A tensor-parallel group of None means no tensor parallelism: size 1, rank 0. The attribute
names on parameters are Megatron's (`tensor_model_parallel`, `partition_dim`,
`partition_stride`, `sequence_parallel`, `expert_tp`, `is_qkv`, `qkv_split_shapes`);
pp-optim's norms and clipping read them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pp_state.collectives import collective
from pp_state.numbers import check_int
from pp_state.params import param_is_not_tensor_parallel_duplicate

__all__ = [
    "TENSOR_PARALLEL_ATTRIBUTE_DEFAULTS",
    "PendingCollective",
    "VocabUtility",
    "copy_tensor_model_parallel_attributes",
    "divide",
    "gather_split_1d_tensor",
    "join_shards",
    "mark_sequence_parallel",
    "pad_vocab_size",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "shard_of",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
    "start_all_gather_first",
    "start_reduce_scatter_first",
    "strided_shard_of",
    "tp_rank",
    "tp_size",
]

# torch 2.13 renamed the single-tensor collectives and deprecated the old names, which older
# torch releases (this package allows >= 2.2) have alone.
all_gather_single: Callable[..., Any] = getattr(
    dist, "all_gather_single", dist.all_gather_into_tensor
)
reduce_scatter_single: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)

TENSOR_PARALLEL_ATTRIBUTE_DEFAULTS: dict[str, bool | int | None] = {
    "expert_tp": False,
    "is_qkv": False,
    "qkv_split_shapes": None,
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}
"""The attributes of a parameter every tensor-parallel rank holds whole, by name (Megatron's
six: `expert_tp` marks an expert-tensor-parallel weight, `is_qkv` a fused query-key-value
weight and `qkv_split_shapes` its parts' sizes)."""


def tp_size(tp_group: dist.ProcessGroup | None) -> int:
    """Number of ranks in `tp_group` (1 for None)."""
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def tp_rank(tp_group: dist.ProcessGroup | None) -> int:
    """This rank's position in `tp_group` (0 for None)."""
    return 0 if tp_group is None else dist.get_rank(tp_group)


def divide(numerator: int, denominator: int, what: str, *, by: str = "tensor-parallel size") -> int:
    """`numerator / denominator`, which must be a whole number.

    Args:
        numerator: The size to split.
        denominator: The number of parts.
        what: What `numerator` is, for the error ("hidden size").
        by: What `denominator` is, for the error.

    Returns:
        The size of one part.

    Raises:
        ValueError: The division leaves a remainder, e.g. "hidden size 10 is not divisible by
            tensor-parallel size 4".
    """
    check_int(by, denominator, 1)
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by {by} {denominator}")
    return numerator // denominator


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """The padded vocabulary: the smallest multiple of ``divisible_by * tp_size`` >= `vocab_size`.

    Megatron's rule for ``--make-vocab-size-divisible-by``: every tensor-parallel rank gets
    an equal slice whose size is a multiple of `divisible_by`.

    Args:
        vocab_size: The tokenizer's vocabulary size.
        divisible_by: Megatron's ``--make-vocab-size-divisible-by``.
        tp_size: The tensor-parallel size.

    Raises:
        TypeError: An argument is not an int.
        ValueError: An argument is below 1.
    """
    check_int("vocab_size", vocab_size, 1)
    check_int("make_vocab_size_divisible_by", divisible_by, 1)
    check_int("tensor-parallel size", tp_size, 1)
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


class VocabUtility:
    """Which contiguous range ``[start, end)`` of the vocabulary a tensor-parallel rank holds."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """The range of `rank` when each of the `world_size` ranks holds the given size."""
        del world_size  # the range depends on the rank alone; kept for Megatron's signature
        start = rank * per_partition_vocab_size
        return start, start + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """The range of `rank` when `world_size` ranks split the whole vocabulary equally.

        Raises:
            ValueError: The vocabulary does not divide by `world_size`.
        """
        per_partition = divide(global_vocab_size, world_size, "vocabulary size")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition, rank, world_size
        )


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """`tensor` split into `num_partitions` equal views along its last dimension.

    Args:
        tensor: The tensor to split.
        num_partitions: How many parts.
        contiguous_split_chunks: Return contiguous copies instead of views.

    Raises:
        ValueError: The last dimension does not divide by `num_partitions`.
    """
    last = divide(tensor.size(-1), num_partitions, "last dimension", by="number of partitions")
    chunks = torch.split(tensor, last, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return tuple(chunks)


def shard_of(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Part `rank` of `size` contiguous equal parts of `full` along `dim`, as a new tensor.

    Raises:
        ValueError: `full` does not divide along `dim`, or `rank` is not in ``[0, size)``.
    """
    part = divide(
        full.size(dim), size, f"dimension {dim} of shape {tuple(full.shape)}:", by="shard count"
    )
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is out of range for {size} shards")
    return full.narrow(dim, rank * part, part).clone()


def strided_shard_of(
    full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1
) -> torch.Tensor:
    """Megatron's strided split of `full` along `dim` over `size` ranks.

    `full` is cut into ``size * stride`` equal blocks; rank r keeps blocks r, r + size,
    r + 2 size, ... concatenated (stride 1: `shard_of`).

    A fused weight of `stride` parts (gate and up projections side by side) then gives every
    rank its slice of each part.

    Raises:
        ValueError: `full` does not divide into ``size * stride`` blocks along `dim`.
    """
    check_int("stride", stride, 1)
    if stride == 1:
        return shard_of(full, dim, rank, size)
    block = divide(
        full.size(dim),
        size * stride,
        f"dimension {dim} of shape {tuple(full.shape)}:",
        by="shard count x stride",
    )
    blocks = torch.split(full, block, dim=dim)[rank::size]
    return torch.cat(blocks, dim=dim)


def join_shards(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse of `shard_of`: the shards of ranks 0, 1, ... concatenated along `dim`."""
    return torch.cat(list(shards), dim=dim)


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Marks `tensor` as split (or not) over tensor parallelism along `dim` with `stride`."""
    tensor.tensor_model_parallel = is_parallel  # type: ignore[attr-defined]
    tensor.partition_dim = dim  # type: ignore[attr-defined]
    tensor.partition_stride = stride  # type: ignore[attr-defined]


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Gives `tensor` the attributes of a replicated parameter where it has none yet."""
    for name, default in TENSOR_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, default)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copies the tensor-parallel attributes `source_tensor` has onto `destination_tensor`."""
    for name in TENSOR_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


def mark_sequence_parallel(params_or_module: torch.nn.Module | Iterable[torch.Tensor]) -> None:
    """Sets ``sequence_parallel = True`` on parameters replicated over tensor parallelism.

    Under sequence parallelism each tensor-parallel rank sees a different part of the
    sequence, so the gradients of such parameters (layer norms, a row-parallel bias) are
    partial sums to be all-reduced over the tensor-parallel group.

    Args:
        params_or_module: The parameters, or a module whose parameters (all of them) to mark.
    """
    params = (
        params_or_module.parameters()
        if isinstance(params_or_module, torch.nn.Module)
        else params_or_module
    )
    for param in params:
        param.sequence_parallel = True  # type: ignore[attr-defined]


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, *, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This rank's part of `tensor` flattened, cut into one equal part per tensor-parallel rank.

    Args:
        tensor: The tensor (contiguous: the part is a view of its storage).
        new_buffer: Return a copy instead of a view.
        tp_group: The tensor-parallel group (None: the whole tensor, flattened).

    Raises:
        ValueError: The number of elements does not divide by the tensor-parallel size.
    """
    size = tp_size(tp_group)
    part = divide(tensor.numel(), size, "number of elements")
    data = tensor.view(-1).narrow(0, tp_rank(tp_group) * part, part)
    return data.clone() if new_buffer else data


def gather_split_1d_tensor(
    tensor: torch.Tensor, *, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The inverse of `split_tensor_into_1d_equal_chunks`.

    The ranks' parts, in rank order, as one new 1-D tensor.
    """
    size = tp_size(tp_group)
    part = tensor.contiguous().view(-1)
    gathered = torch.empty(size * part.numel(), dtype=part.dtype, device=part.device)
    if size == 1:
        return gathered.copy_(part)
    with collective("tensor-parallel all-gather (1-D parts)", group=tp_group):
        all_gather_single(gathered, part, group=tp_group)
    return gathered


SEQUENCE = "first dimension (the sequence)"


class PendingCollective:
    """An asynchronous collective; `wait` gives its result.

    It is started and waited for inside pp-state's `collective`: a lost peer is an error
    naming `operation`.
    """

    def __init__(
        self,
        operation: str,
        group: dist.ProcessGroup | None,
        start: Callable[[], Any],
        result: Callable[[], torch.Tensor],
    ) -> None:
        self.operation, self.group, self._result = operation, group, result
        with collective(operation, group=group):
            self._work = start()

    def wait(self) -> torch.Tensor:
        """Waits for the collective; its result."""
        with collective(self.operation, group=self.group):
            self._work.wait()
        return self._result()


def start_all_gather_first(
    x: torch.Tensor, group: dist.ProcessGroup, operation: str
) -> PendingCollective:
    """Starts gathering the ranks' `x` along dim 0, in rank order."""
    x = x.contiguous()
    out = torch.empty((tp_size(group) * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    return PendingCollective(
        operation, group, lambda: all_gather_single(out, x, group=group, async_op=True), lambda: out
    )


def start_reduce_scatter_first(
    x: torch.Tensor, group: dist.ProcessGroup, operation: str, *, reuse_input: bool = False
) -> PendingCollective:
    """Starts summing `x` over `group`, of which this rank keeps its part of dim 0.

    On gloo the sum is an all-reduce of which this rank keeps its part: torch 2.13's gloo
    reduce-scatter moved as much data and measured 1.3-2.4x slower (pp-optim's
    distopt_bench). It sums into `x` itself with `reuse_input`, else into a copy.

    Raises:
        ValueError: The first dimension does not divide by the group's size.
    """
    size = tp_size(group)
    part = divide(x.size(0), size, SEQUENCE)
    if dist.get_backend(group) == "gloo":
        total = x if reuse_input else x.clone(memory_format=torch.contiguous_format)
        mine = tp_rank(group) * part
        return PendingCollective(
            operation,
            group,
            lambda: dist.all_reduce(total, group=group, async_op=True),
            lambda: total.narrow(0, mine, part).contiguous(),
        )
    x = x.contiguous()
    out = torch.empty((part, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return PendingCollective(
        operation,
        group,
        lambda: reduce_scatter_single(out, x, group=group, async_op=True),
        lambda: out,
    )
