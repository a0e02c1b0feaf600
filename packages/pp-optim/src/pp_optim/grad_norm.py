"""Gradient norm, clipping and zero counting over the model-parallel group.

Every rank of a model-parallel group holds part of one model. The norm of that model's gradient
is assembled from each rank's share, counting every gradient element once: a parameter that every
tensor-parallel rank holds whole (a bias, a LayerNorm weight) is counted on tensor-parallel rank 0
only, and the output-layer copy of a word embedding tied across pipeline stages (marked
``shared``) is left to the first stage. Clipping itself then scales every gradient, duplicates
included, so all copies stay equal.

Which parameters are tensor-parallel duplicates is pp-state's
`param_is_not_tensor_parallel_duplicate` (re-exported here).

A parameter's gradient is its ``grad``, or, when that is None, the ``main_grad`` a contiguous
grad buffer keeps for it.

Where a model's gradient is also sharded over data parallelism (`DistributedOptimizer`), each
statistic is reduced over several groups in turn (data parallel, then model parallel): every
function here takes one group or a sequence of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from pp_state.collectives import collective
from pp_state.collectives import collective_device as group_device
from pp_state.params import param_is_not_tensor_parallel_duplicate

__all__ = [
    "StatsGroups",
    "all_reduce_over",
    "clip_grad_by_total_norm",
    "clip_grad_norm",
    "count_zeros",
    "get_grad_norm",
    "grads_for_norm",
    "param_is_not_shared",
    "param_is_not_tensor_parallel_duplicate",
]


StatsGroups = dist.ProcessGroup | Sequence[dist.ProcessGroup] | None
"""The ranks a statistic is reduced over: one group, several in turn, or None for this rank."""


def _as_groups(groups: StatsGroups) -> list[dist.ProcessGroup]:
    if groups is None:
        return []
    if isinstance(groups, dist.ProcessGroup):
        return [groups]
    return list(groups)


def all_reduce_over(
    tensor: torch.Tensor, groups: StatsGroups, *, op: dist.ReduceOp.RedOpType, operation: str
) -> None:
    """All-reduces `tensor` in place over each group of `groups` in turn.

    A sum (or max) over data parallel and then over model parallel is the sum (max) over
    every rank of both: each group's ranks see the same partial result.

    Args:
        tensor: The statistic, on the device the groups' backend needs.
        groups: One group, several, or None (nothing is reduced).
        op: The reduction.
        operation: What the reduction is for, named in a failure's error.
    """
    for group in _as_groups(groups):
        with collective(operation, group=group):
            dist.all_reduce(tensor, op=op, group=group)


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for a parameter marked ``shared`` (a tied copy whose gradient is counted elsewhere)."""
    return not getattr(param, "shared", False)


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    if param.grad is not None:
        return param.grad
    main_grad = getattr(param, "main_grad", None)
    return main_grad if isinstance(main_grad, torch.Tensor) else None


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [grad for grad in map(_grad_of, params) if grad is not None]


def grads_for_norm(
    params: Iterable[torch.Tensor], *, tensor_parallel_rank: int = 0
) -> list[torch.Tensor]:
    """The gradients that count toward the model's norm on this rank.

    Args:
        params: Parameters of this rank's part of the model.
        tensor_parallel_rank: This rank's position in its tensor-parallel group.

    Returns:
        Gradients of the parameters that have one, are not ``shared`` and are not a
        tensor-parallel duplicate held by another rank.
    """
    return [
        grad
        for param in params
        if param_is_not_shared(param)
        and param_is_not_tensor_parallel_duplicate(param, tp_group=tensor_parallel_rank)
        and (grad := _grad_of(param)) is not None
    ]


def collective_device(tensors: Sequence[torch.Tensor], group: StatsGroups) -> torch.device:
    """Where a small statistic is reduced: beside the gradients, or on the GPU NCCL needs."""
    if tensors:
        return tensors[0].device
    groups = _as_groups(group)
    return group_device(groups[0]) if groups else torch.device("cpu")


def _check_norm_type(norm_type: float) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type must be a number or math.inf, got {norm_type!r}")
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be > 0 (2.0 for L2, math.inf for max), got {norm_type}")
    return float(norm_type)


def get_grad_norm(
    grads: Sequence[torch.Tensor],
    norm_type: float = 2.0,
    *,
    group: StatsGroups,
) -> float:
    """The `norm_type`-norm of gradients spread over the ranks of `group`, computed in float32.

    Args:
        grads: This rank's share (see `grads_for_norm`).
        norm_type: p of the p-norm; ``math.inf`` for the largest absolute value.
        group: The ranks holding the other shares (the model-parallel group; several groups
            are reduced over in turn), or None for this rank's gradients alone.

    Returns:
        The norm; inf or nan when a gradient holds one.

    Raises:
        ValueError: `norm_type` is not positive.
    """
    p = _check_norm_type(norm_type)
    device = collective_device(grads, group)
    total = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        norms = torch.stack(
            [
                norm.to(device)
                for norm in torch._foreach_norm([g.detach().float() for g in grads], p)
            ]
        )
        total += norms.max() if p == math.inf else norms.pow(p).sum()
    op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM
    all_reduce_over(total, group, op=op, operation="gradient norm all-reduce")
    return float(total.item()) if p == math.inf else float(total.item() ** (1.0 / p))


def clip_grad_by_total_norm(
    params: Iterable[torch.Tensor], max_norm: float, total_norm: float
) -> None:
    """Scales every gradient of `params` by ``max_norm / (total_norm + 1e-6)`` when that is < 1.

    A nan total norm clips nothing (the comparison is false), as in Megatron.
    """
    grads = _grads(params)
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if grads and clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: StatsGroups,
    tensor_parallel_rank: int = 0,
) -> float:
    """Clips the gradients of a model split over `group` to a total norm of `max_norm`.

    Like ``torch.nn.utils.clip_grad_norm_``, but the norm is that of the whole model: shares
    are summed over `group`, duplicates counted once (see the module docstring).

    Args:
        params: This rank's parameters.
        max_norm: Largest allowed total norm, > 0.
        norm_type: p of the p-norm; ``math.inf`` for the largest absolute value.
        group: The model-parallel group, or None for this rank's gradients alone.
        tensor_parallel_rank: This rank's position in its tensor-parallel group.

    Returns:
        The total norm before clipping.

    Raises:
        ValueError: `max_norm` or `norm_type` is not positive.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    params = list(params)
    total = get_grad_norm(
        grads_for_norm(params, tensor_parallel_rank=tensor_parallel_rank), norm_type, group=group
    )
    clip_grad_by_total_norm(params, max_norm, total)
    return total


def count_zeros(
    params: Iterable[torch.Tensor],
    *,
    group: StatsGroups,
    tensor_parallel_rank: int = 0,
) -> int:
    """Zero gradient elements of the model split over `group`, duplicates counted once.

    Args:
        params: This rank's parameters.
        group: The model-parallel group, or None for this rank alone.
        tensor_parallel_rank: This rank's position in its tensor-parallel group.

    Returns:
        The number of gradient elements equal to zero in the whole model.
    """
    grads = grads_for_norm(params, tensor_parallel_rank=tensor_parallel_rank)
    device = collective_device(grads, group)
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for grad in grads:
        total += grad.numel() - torch.count_nonzero(grad.detach()).to(device)
    all_reduce_over(total, group, op=dist.ReduceOp.SUM, operation="zero-gradient count all-reduce")
    return int(total.item())
