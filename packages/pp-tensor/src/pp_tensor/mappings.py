"""The communication of tensor and sequence parallelism, as differentiable functions.

Each function is one collective in the forward pass and its conjugate in the backward pass
(an all-reduce's conjugate is the identity, an all-gather's a split, a reduce-scatter's an
all-gather, an all-to-all's the reverse all-to-all). "Last dimension" splits are the
hidden/vocabulary splits of tensor parallelism; "first dimension" splits are the sequence
splits of sequence parallelism (activations are [sequence, batch, hidden]).

With ``tp_group=None`` (or a group of one rank) every function returns its input: there is
no collective at all. Collectives run on gloo (CPU tensors) and NCCL (CUDA tensors); a lost
peer raises pp-state's `CollectiveError` naming the operation.

The autograd functions carry Megatron's names (``CopyToModelParallelRegion``, ...), forward
arguments, ``ctx`` fields and ``symbolic`` methods, so code written against Megatron's classes
(`pp_tensor.megatron.mappings` exposes them) runs on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pp_state.collectives import collective
from pp_tensor.utils import (
    SEQUENCE,
    divide,
    start_all_gather_first,
    start_reduce_scatter_first,
    tp_rank,
    tp_size,
)

__all__ = [
    "AllGatherFromTensorParallelRegion",
    "AllToAll",
    "CopyToModelParallelRegion",
    "GatherFromModelParallelRegion",
    "GatherFromSequenceParallelRegion",
    "ReduceFromModelParallelRegion",
    "ReduceScatterToSequenceParallelRegion",
    "ReduceScatterToTensorParallelRegion",
    "ScatterToModelParallelRegion",
    "ScatterToSequenceParallelRegion",
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_to_all",
    "all_to_all_hp2sp",
    "all_to_all_sp2hp",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]

Group = dist.ProcessGroup | None
Sizes = Sequence[int] | None

_LAST, _FIRST = "last dimension", SEQUENCE


def _reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of `x` over `group`, into a new tensor (the input may be needed elsewhere)."""
    if tp_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    with collective("tensor-parallel all-reduce", group=group):
        dist.all_reduce(out, group=group)
    return out


def _own_part(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's contiguous part of `x` along `dim` (0 or -1)."""
    size = tp_size(group)
    if size == 1:
        return x
    part = divide(x.size(dim), size, _FIRST if dim == 0 else _LAST)
    return x.narrow(dim, tp_rank(group) * part, part).contiguous()


def _split_along_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _own_part(x, group, -1)


def _check_sizes(sizes: Sequence[int], group: Group, what: str) -> list[int]:
    sizes = [int(size) for size in sizes]
    if len(sizes) != tp_size(group) or any(size < 0 for size in sizes):
        raise ValueError(
            f"{what} must hold one size >= 0 per tensor-parallel rank "
            f"({tp_size(group)}), got {sizes}"
        )
    return sizes


def _split_along_first_dim(x: torch.Tensor, group: Group, sizes: Sizes = None) -> torch.Tensor:
    if sizes is None:
        return _own_part(x, group, 0)
    sizes = _check_sizes(sizes, group, "split sizes")
    if sum(sizes) != x.size(0):
        raise ValueError(f"split sizes {sizes} do not add up to the first dimension {x.size(0)}")
    rank = tp_rank(group)
    return x.narrow(0, sum(sizes[:rank]), sizes[rank]).contiguous()


def _gather_along_first_dim(x: torch.Tensor, group: Group, sizes: Sizes = None) -> torch.Tensor:
    """The ranks' `x` concatenated along dim 0 in rank order (`sizes`: their first dims)."""
    size = tp_size(group)
    if size == 1:
        return x
    assert group is not None
    rows = x.size(0)
    if sizes is not None:
        sizes = _check_sizes(sizes, group, "output_split_sizes")
        if sizes[tp_rank(group)] != rows:
            raise ValueError(
                f"output_split_sizes {sizes} give tensor-parallel rank {tp_rank(group)} "
                f"{sizes[tp_rank(group)]} rows, but its input has {rows}"
            )
        rows = max(sizes)  # every rank sends `rows`; the padding is dropped after
        x = torch.cat([x, x.new_zeros((rows - x.size(0), *x.shape[1:]))]) if rows > x.size(0) else x
    out = start_all_gather_first(x, group, "sequence-parallel all-gather (first dimension)").wait()
    if sizes is None:
        return out
    return torch.cat([out.narrow(0, r * rows, n) for r, n in enumerate(sizes)])


def _reduce_scatter_along_first_dim(
    x: torch.Tensor, group: Group, sizes: Sizes = None
) -> torch.Tensor:
    """The sum over `group`, of which this rank keeps its part of dim 0 (`sizes`: the parts)."""
    size = tp_size(group)
    if size == 1:
        return x
    assert group is not None
    if sizes is not None:  # uneven parts: this rank's part of the all-reduced sum
        return _split_along_first_dim(_reduce(x, group), group, sizes)
    operation = "sequence-parallel reduce-scatter (first dimension)"
    return start_reduce_scatter_first(x, group, operation).wait()


def _gather_along_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = tp_size(group)
    if size == 1:
        return x
    stacked = _gather_along_first_dim(x, group)
    # [rank * s0 + i, ..., j] -> [i, ..., rank * last + j]
    per_rank = stacked.view(size, *x.shape).movedim(0, -2)
    return per_rank.reshape(*x.shape[:-1], size * x.size(-1))


def _reduce_scatter_along_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum over `group`, of which this rank keeps its part of the last dimension."""
    size = tp_size(group)
    if size == 1:
        return x
    part = divide(x.size(-1), size, _LAST)
    # [..., r * part + j] -> [r, ..., j]: the ranks' parts stacked along the first dimension.
    stacked = x.reshape(-1, size, part).transpose(0, 1).contiguous()
    mine = _reduce_scatter_along_first_dim(stacked.view(-1, part), group)
    return mine.view(*x.shape[:-1], part)


class CopyToModelParallelRegion(torch.autograd.Function):
    """Identity forward; the gradient is all-reduced over the group."""

    @staticmethod
    def symbolic(graph: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """For tracing: what the forward gives."""
        return input_

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """The forward collective."""
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The conjugate collective on the gradient."""
        return _reduce(grad_output, ctx.group), None


class ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def symbolic(graph: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """For tracing: what the forward gives."""
        return _reduce(input_, group)

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """The forward collective."""
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The conjugate collective on the gradient."""
        return grad_output, None


class ScatterToModelParallelRegion(torch.autograd.Function):
    """This rank's part of the last dimension; the gradient is all-gathered."""

    @staticmethod
    def symbolic(graph: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """For tracing: what the forward gives."""
        return _split_along_last_dim(input_, group)

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """The forward collective."""
        ctx.group = group
        return _split_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The conjugate collective on the gradient."""
        return _gather_along_last_dim(grad_output, ctx.group), None


class GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather of the last dimension; the gradient keeps this rank's part."""

    @staticmethod
    def symbolic(graph: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """For tracing: what the forward gives."""
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """The forward collective."""
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The conjugate collective on the gradient."""
        return _split_along_last_dim(grad_output, ctx.group), None


class ScatterToSequenceParallelRegion(torch.autograd.Function):
    """This rank's part of the first dimension; the gradient is all-gathered."""

    @staticmethod
    def symbolic(graph: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """For tracing: what the forward gives."""
        return _split_along_first_dim(input_, group)

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """The forward collective."""
        ctx.group = group
        return _split_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The conjugate collective on the gradient."""
        return _gather_along_first_dim(grad_output, ctx.group), None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather of the first dimension; the gradient is reduce-scattered or split."""

    @staticmethod
    def symbolic(  # noqa: PLR0917 - Megatron's signature
        graph: Any,
        input_: torch.Tensor,
        group: Group,
        tensor_parallel_output_grad: bool = True,
        output_split_sizes: Sizes = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        """For tracing: what the forward gives."""
        return _gather_along_first_dim(input_, group, output_split_sizes)

    @staticmethod
    def forward(  # noqa: PLR0917 - Megatron's signature
        ctx: Any,
        input_: torch.Tensor,
        group: Group,
        tensor_parallel_output_grad: bool = True,
        output_split_sizes: Sizes = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        """The forward collective."""
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.use_global_buffer = use_global_buffer
        return _gather_along_first_dim(input_, group, output_split_sizes)

    @staticmethod
    def backward(
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None]:
        """The conjugate collective on the gradient."""
        if ctx.tensor_parallel_output_grad:
            grad = _reduce_scatter_along_first_dim(grad_output, ctx.group, ctx.output_split_sizes)
        else:
            grad = _split_along_first_dim(grad_output, ctx.group, ctx.output_split_sizes)
        return grad, None, None, None, None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter of the first dimension; the gradient is all-gathered."""

    @staticmethod
    def symbolic(
        graph: Any,
        input_: torch.Tensor,
        group: Group,
        input_split_sizes: Sizes = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        """For tracing: what the forward gives."""
        return _reduce_scatter_along_first_dim(input_, group, input_split_sizes)

    @staticmethod
    def forward(
        ctx: Any,
        input_: torch.Tensor,
        group: Group,
        input_split_sizes: Sizes = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        """The forward collective."""
        ctx.group = group
        ctx.input_split_sizes = input_split_sizes
        ctx.use_global_buffer = use_global_buffer
        return _reduce_scatter_along_first_dim(input_, group, input_split_sizes)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        """The conjugate collective on the gradient."""
        grad = _gather_along_first_dim(grad_output, ctx.group, ctx.input_split_sizes)
        return grad, None, None, None


class AllGatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather of the last dimension; the gradient is reduce-scattered along it."""

    @staticmethod
    def symbolic(graph: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """For tracing: what the forward gives."""
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """The forward collective."""
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The conjugate collective on the gradient."""
        return _reduce_scatter_along_last_dim(grad_output, ctx.group), None


class ReduceScatterToTensorParallelRegion(torch.autograd.Function):
    """Reduce-scatter of the last dimension; the gradient is all-gathered along it."""

    @staticmethod
    def symbolic(graph: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """For tracing: what the forward gives."""
        return _reduce_scatter_along_last_dim(input_, group)

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        """The forward collective."""
        ctx.group = group
        return _reduce_scatter_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The conjugate collective on the gradient."""
        return _gather_along_last_dim(grad_output, ctx.group), None


def _exchange(
    x: torch.Tensor, group: Group, output_sizes: Sizes, input_sizes: Sizes
) -> torch.Tensor:
    """One all-to-all of the first dimension: part r of `x` goes to rank r."""
    x = x.contiguous()
    rows = x.size(0) if output_sizes is None else sum(output_sizes)
    out = x.new_empty((rows, *x.shape[1:]))
    with collective("tensor-parallel all-to-all", group=group):
        dist.all_to_all_single(
            out,
            x,
            output_split_sizes=None if output_sizes is None else list(output_sizes),
            input_split_sizes=None if input_sizes is None else list(input_sizes),
            group=group,
        )
    return out


class AllToAll(torch.autograd.Function):
    """All-to-all of the first dimension; the gradient goes back by the reverse all-to-all."""

    @staticmethod
    def forward(  # noqa: PLR0917 - Megatron's signature
        ctx: Any,
        group: Group,
        input: torch.Tensor,
        output_split_sizes: Sizes,
        input_split_sizes: Sizes,
        use_nccl_stream: bool = False,
    ) -> torch.Tensor:
        """The forward collective."""
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        ctx.use_nccl_stream = use_nccl_stream  # Megatron's side stream: one stream here
        if tp_size(group) == 1:
            return input
        return _exchange(input, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(
        ctx: Any, *grad_output: torch.Tensor
    ) -> tuple[None, torch.Tensor, None, None, None]:
        """The conjugate collective on the gradient."""
        (grad,) = grad_output
        reverse = all_to_all(ctx.group, grad, ctx.input_split_sizes, ctx.output_split_sizes)
        return None, reverse, None, None, None


def _apply(function: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    # torch leaves Function.apply unannotated.
    out: torch.Tensor = function.apply(*args)  # type: ignore[no-untyped-call]
    return out


def _map(
    function: type[torch.autograd.Function], x: torch.Tensor, group: Group, *args: Any
) -> torch.Tensor:
    if group is None:  # no tensor parallelism: no collective, no autograd node
        return x
    return _apply(function, x, group, *args)


def copy_to_tensor_model_parallel_region(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over `tp_group` (Megatron's f).

    Put before a column-parallel layer: each rank's partial input gradient is summed.
    """
    return _map(CopyToModelParallelRegion, x, tp_group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """All-reduce (sum) forward over `tp_group`; identity backward (Megatron's g).

    Put after a row-parallel layer: the partial outputs are summed.
    """
    return _map(ReduceFromModelParallelRegion, x, tp_group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """Keeps this rank's part of the last dimension; backward all-gathers the last dimension.

    Raises:
        ValueError: The last dimension does not divide by the tensor-parallel size.
    """
    return _map(ScatterToModelParallelRegion, x, tp_group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """All-gathers the last dimension (rank order); backward keeps this rank's part."""
    return _map(GatherFromModelParallelRegion, x, tp_group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """Keeps this rank's part of the first dimension; backward all-gathers the first dimension.

    Raises:
        ValueError: The first dimension does not divide by the tensor-parallel size.
    """
    return _map(ScatterToSequenceParallelRegion, x, tp_group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor,
    *,
    tp_group: Group,
    tensor_parallel_output_grad: bool = True,
    output_split_sizes: Sizes = None,
) -> torch.Tensor:
    """All-gathers the first dimension (rank order); the backward depends on what follows.

    Args:
        x: This rank's part of the sequence.
        tp_group: The tensor-parallel group (None: identity).
        tensor_parallel_output_grad: True when the gathered tensor feeds a tensor-parallel
            layer, so every rank's gradient of it is partial: the backward reduce-scatters the
            first dimension. False when every rank computes the same full gradient: the
            backward keeps this rank's part.
        output_split_sizes: The ranks' first dimensions when they differ (None: equal).

    Raises:
        ValueError: `output_split_sizes` does not hold one size per rank, or not this rank's.
    """
    return _map(
        GatherFromSequenceParallelRegion,
        x,
        tp_group,
        tensor_parallel_output_grad,
        output_split_sizes,
    )


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, *, tp_group: Group, input_split_sizes: Sizes = None
) -> torch.Tensor:
    """Reduce-scatter (sum) along the first dimension; backward all-gathers the first dimension.

    Args:
        x: This rank's partial sum, whole along the first dimension.
        tp_group: The tensor-parallel group (None: identity).
        input_split_sizes: The ranks' parts of the first dimension when they differ (None:
            equal parts).

    Raises:
        ValueError: The first dimension does not divide by the tensor-parallel size, or the
            sizes given do not add up to it.
    """
    return _map(ReduceScatterToSequenceParallelRegion, x, tp_group, input_split_sizes)


def all_gather_last_dim_from_tensor_parallel_region(
    x: torch.Tensor, *, tp_group: Group
) -> torch.Tensor:
    """All-gathers the last dimension; backward reduce-scatters it.

    Every rank's gradient of the gathered tensor is partial.
    """
    return _map(AllGatherFromTensorParallelRegion, x, tp_group)


def reduce_scatter_last_dim_to_tensor_parallel_region(
    x: torch.Tensor, *, tp_group: Group
) -> torch.Tensor:
    """Sums `x` over `tp_group`, keeping this rank's part of the last dimension.

    The backward all-gathers the last dimension.

    Raises:
        ValueError: The last dimension does not divide by the tensor-parallel size.
    """
    return _map(ReduceScatterToTensorParallelRegion, x, tp_group)


def all_to_all(
    group: Group,
    input_: torch.Tensor,
    output_split_sizes_: Sizes = None,
    input_split_sizes: Sizes = None,
) -> torch.Tensor:
    """Rank r's part i of the first dimension becomes rank i's part r (gloo and NCCL).

    Args:
        group: The group (None: identity).
        input_: The tensor whose first dimension is cut into one part per rank.
        output_split_sizes_: The sizes of the parts received (None: equal parts).
        input_split_sizes: The sizes of the parts sent (None: equal parts).
    """
    if group is None:
        return input_
    return _apply(AllToAll, group, input_, output_split_sizes_, input_split_sizes)


def all_to_all_sp2hp(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """``[tokens / tp, hidden]`` (a sequence part) to ``[tokens, hidden / tp]`` (a hidden part).

    Any leading dimensions are flattened into tokens first.

    Raises:
        ValueError: The hidden size does not divide by the tensor-parallel size.
    """
    size = tp_size(tp_group)
    part = divide(x.size(-1), size, _LAST)
    rows = x.reshape(-1, x.size(-1))
    # The hidden parts stacked along the tokens: part r goes to rank r.
    stacked = torch.cat(torch.split(rows, part, dim=1), dim=0)
    return all_to_all(tp_group, stacked)


def all_to_all_hp2sp(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """``[tokens, hidden / tp]`` (a hidden part) to ``[tokens / tp, hidden]`` (a sequence part).

    Raises:
        ValueError: The tokens do not divide by the tensor-parallel size.
    """
    size = tp_size(tp_group)
    rows = x.reshape(-1, x.size(-1))
    divide(rows.size(0), size, "number of tokens")
    exchanged = all_to_all(tp_group, rows)
    # Rank r's tokens from every rank's hidden part, laid side by side.
    return torch.cat(torch.split(exchanged, rows.size(0) // size, dim=0), dim=-1)
