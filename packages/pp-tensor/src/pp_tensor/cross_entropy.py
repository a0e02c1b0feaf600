"""Cross entropy over logits whose vocabulary dimension is split over tensor parallelism.

No rank ever holds the full logits: the softmax is assembled from three per-token sums over
the group (the maximum logit, the sum of exponentials, the target's logit, and, for label
smoothing, the sum of logits), in fp32. The loss and its gradient equal
``torch.nn.functional.cross_entropy(full_logits, target, reduction="none",
label_smoothing=...)`` on the gathered logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pp_state.collectives import collective
from pp_tensor.utils import VocabUtility, tp_rank, tp_size

__all__ = ["vocab_parallel_cross_entropy"]

Group = dist.ProcessGroup | None


def _all_reduce(tensor: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType) -> None:
    if tp_size(group) > 1:
        with collective("vocab-parallel cross entropy", group=group):
            dist.all_reduce(tensor, op=op, group=group)


def _target_logit_and_mask(
    shifted: torch.Tensor, target: torch.Tensor, group: Group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's share of each target's logit, the local target ids and the outside mask."""
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        shifted.size(-1), tp_rank(group), tp_size(group)
    )
    outside = (target < start) | (target >= end)
    local_target = (target - start).masked_fill(outside, 0)
    predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    return predicted.masked_fill(outside, 0.0), local_target, outside


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: Group,
        label_smoothing: float,
    ) -> torch.Tensor:
        # `float()` may return `logits` itself: every step below makes a new tensor.
        logits32 = logits.float()
        maximum = logits32.amax(dim=-1)
        _all_reduce(maximum, group, dist.ReduceOp.MAX)
        shifted = logits32 - maximum.unsqueeze(-1)
        predicted, local_target, outside = _target_logit_and_mask(shifted, target, group)
        sums = torch.stack([predicted, shifted.sum(dim=-1)])
        softmax = shifted.exp_()
        sums = torch.cat([sums, softmax.sum(dim=-1).unsqueeze(0)])
        # One all-reduce for the three per-token sums.
        _all_reduce(sums, group, dist.ReduceOp.SUM)
        predicted, shifted_sum, exp_sum = sums.unbind(0)
        log_exp_sum = exp_sum.log()
        loss = log_exp_sum - predicted
        vocab_size = logits.size(-1) * tp_size(group)
        if label_smoothing > 0:
            # torch's rule: (1 - e) * nll + e * mean over the vocabulary of -log p.
            mean_nll = log_exp_sum - shifted_sum / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * mean_nll
        softmax.div_(exp_sum.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing, ctx.vocab_size, ctx.dtype = label_smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        # d loss / d logit = softmax - (1 - e) * one_hot(target) - e / vocab_size.
        grad = softmax
        inside = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), inside * -(1.0 - ctx.label_smoothing))
        if ctx.label_smoothing > 0:
            grad.sub_(ctx.label_smoothing / ctx.vocab_size)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: Group,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross entropy of logits split along the vocabulary over `tp_group`.

    Args:
        vocab_parallel_logits: ``[..., vocab / tp]``: this rank's contiguous slice of the
            vocabulary (rank r holds ids ``[r * vocab / tp, (r + 1) * vocab / tp)``); any float
            dtype, computed in fp32.
        target: ``[...]`` int64 global token ids (not range-checked: that would cost a sync).
        tp_group: The tensor-parallel group (None: the logits are the whole vocabulary).
        label_smoothing: torch's label smoothing, in ``[0, 1)``.

    Returns:
        The fp32 loss of each token, shaped like `target`.

    Raises:
        ValueError: `target`'s shape is not the logits' without the last dimension, or
            `label_smoothing` is outside ``[0, 1)``.
    """
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match logits shape "
            f"{tuple(vocab_parallel_logits.shape)} without its last (vocabulary) dimension"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    loss: torch.Tensor = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        vocab_parallel_logits, target, tp_group, label_smoothing
    )
    return loss
