"""The communication of tensor and sequence parallelism, as differentiable functions.

Each function is one collective in the forward pass and its conjugate in the backward pass
(an all-reduce's conjugate is the identity, an all-gather's a split, a reduce-scatter's an
all-gather). "Last dimension" splits are the hidden/vocabulary splits of tensor parallelism;
"first dimension" splits are the sequence splits of sequence parallelism (activations are
[sequence, batch, hidden]).

With ``tp_group=None`` (or a group of one rank) every function returns its input: there is
no collective at all. Collectives run on gloo (CPU tensors) and NCCL (CUDA tensors); a lost
peer raises pp-state's `CollectiveError` naming the operation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pp_state.collectives import collective
from pp_tensor.utils import divide, tp_rank, tp_size

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]

Group = dist.ProcessGroup | None
Op = Callable[[torch.Tensor, Group], torch.Tensor]

# torch 2.13 renamed the single-tensor collectives and deprecated the old names, which older
# torch releases (this package allows >= 2.2) have alone.
_all_gather_single: Callable[..., Any] = getattr(
    dist, "all_gather_single", dist.all_gather_into_tensor
)
_reduce_scatter_single: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of `x` over `group`, into a new tensor (the input may be needed elsewhere)."""
    if tp_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    with collective("tensor-parallel all-reduce", group=group):
        dist.all_reduce(out, group=group)
    return out


_LAST, _FIRST = "last dimension", "first dimension (the sequence)"


def _own_part(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's contiguous part of `x` along `dim` (0 or -1)."""
    size = tp_size(group)
    if size == 1:
        return x
    part = divide(x.size(dim), size, _FIRST if dim == 0 else _LAST)
    return x.narrow(dim, tp_rank(group) * part, part).contiguous()


def _all_gather_first(x: torch.Tensor, group: Group, operation: str) -> torch.Tensor:
    """The ranks' `x` concatenated along dim 0, in rank order."""
    x = x.contiguous()
    out = torch.empty((tp_size(group) * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    with collective(operation, group=group):
        _all_gather_single(out, x, group=group)
    return out


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _own_part(x, group, -1)


def _split_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _own_part(x, group, 0)


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = tp_size(group)
    if size == 1:
        return x
    stacked = _all_gather_first(x, group, "tensor-parallel all-gather (last dimension)")
    # [rank * s0 + i, ..., j] -> [i, ..., rank * last + j]
    per_rank = stacked.view(size, *x.shape).movedim(0, -2)
    return per_rank.reshape(*x.shape[:-1], size * x.size(-1))


def _gather_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    if tp_size(group) == 1:
        return x
    return _all_gather_first(x, group, "sequence-parallel all-gather (first dimension)")


def _reduce_scatter_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = tp_size(group)
    if size == 1:
        return x
    part = divide(x.size(0), size, _FIRST)
    if dist.get_backend(group) == "gloo":
        # torch 2.13's gloo reduce-scatter moved as much data as its all-reduce and measured
        # 1.3-2.4x slower (pp-optim's distopt_bench); keeping this rank's slice of the
        # all-reduced sum gives the same numbers.
        return _all_reduce(x, group).narrow(0, tp_rank(group) * part, part).contiguous()
    x = x.contiguous()
    out = torch.empty((part, *x.shape[1:]), dtype=x.dtype, device=x.device)
    with collective("sequence-parallel reduce-scatter (first dimension)", group=group):
        _reduce_scatter_single(out, x, group=group)
    return out


def _identity(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x


class _Mapping(torch.autograd.Function):
    """One collective forward and its conjugate backward, both given as functions."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Group, forward_op: Op, backward_op: Op
    ) -> torch.Tensor:
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.backward_op(grad, ctx.group), None, None, None


def _map(x: torch.Tensor, group: Group, forward_op: Op, backward_op: Op) -> torch.Tensor:
    if group is None:  # no tensor parallelism: no collective, no autograd node
        return x
    # torch leaves Function.apply unannotated.
    out: torch.Tensor = _Mapping.apply(x, group, forward_op, backward_op)  # type: ignore[no-untyped-call]
    return out


def copy_to_tensor_model_parallel_region(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over `tp_group` (Megatron's f).

    Put before a column-parallel layer: each rank's partial input gradient is summed.
    """
    return _map(x, tp_group, _identity, _all_reduce)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """All-reduce (sum) forward over `tp_group`; identity backward (Megatron's g).

    Put after a row-parallel layer: the partial outputs are summed.
    """
    return _map(x, tp_group, _all_reduce, _identity)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """Keeps this rank's part of the last dimension; backward all-gathers the last dimension.

    Raises:
        ValueError: The last dimension does not divide by the tensor-parallel size.
    """
    return _map(x, tp_group, _split_last, _gather_last)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """All-gathers the last dimension (rank order); backward keeps this rank's part."""
    return _map(x, tp_group, _gather_last, _split_last)


def scatter_to_sequence_parallel_region(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """Keeps this rank's part of the first dimension; backward all-gathers the first dimension.

    Raises:
        ValueError: The first dimension does not divide by the tensor-parallel size.
    """
    return _map(x, tp_group, _split_first, _gather_first)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, *, tp_group: Group, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gathers the first dimension (rank order); the backward depends on what follows.

    Args:
        x: This rank's part of the sequence.
        tp_group: The tensor-parallel group (None: identity).
        tensor_parallel_output_grad: True when the gathered tensor feeds a tensor-parallel
            layer, so every rank's gradient of it is partial: the backward reduce-scatters the
            first dimension. False when every rank computes the same full gradient: the
            backward keeps this rank's part.
    """
    backward = _reduce_scatter_first if tensor_parallel_output_grad else _split_first
    return _map(x, tp_group, _gather_first, backward)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, *, tp_group: Group) -> torch.Tensor:
    """Reduce-scatter (sum) along the first dimension; backward all-gathers the first dimension.

    Raises:
        ValueError: The first dimension does not divide by the tensor-parallel size.
    """
    return _map(x, tp_group, _reduce_scatter_first, _gather_first)
