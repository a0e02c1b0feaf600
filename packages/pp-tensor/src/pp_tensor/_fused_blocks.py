"""One block of context-parallel attention through torch's fused CPU attention kernel.

`pp_tensor.context_parallel` runs a block here on the CPU when no document mask applies: the
kernel returns the block's log-sum-exp, which the ring's and the all-gather's merges need, and
its backward takes the final output and log-sum-exp, so a block's gradients use the final
probabilities; it never materialises a score matrix. Queries come grouped, [batch, kv heads,
group, length, dim] (grouped-query attention); keys and values, [batch, kv heads, length, dim],
are repeated for each query head of their group.
"""

from __future__ import annotations

import torch

__all__ = ["fused_block_backward", "fused_block_forward"]

_FUSED_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def fused_block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of grouped `q` over one block of keys, and its log-sum-exp.

    `causal`: query i sees keys 0 .. i (a rank's own block); else every key.
    """
    batch, kv_heads, group, length, dim = q.shape
    out, lse = _FUSED_FORWARD(
        q.reshape(batch, kv_heads * group, length, dim), k.repeat_interleave(group, 1),
        v.repeat_interleave(group, 1), 0.0, causal, scale=scale,
    )  # fmt: skip
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def fused_block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's dq, and dk, dv of its keys, by torch's fused kernel.

    `grads` holds the output's gradient, the final log-sum-exp and the final output (rows of
    `q`), so the block's probabilities are the final ones.
    """
    grad_out, lse, out = grads
    batch, kv_heads, group, _, dim = q.shape

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch, kv_heads * group, *x.shape[3:]).contiguous()

    grad_q, grad_k, grad_v = _FUSED_BACKWARD(
        heads(grad_out), heads(q), k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
        heads(out), heads(lse), 0.0, causal, scale=scale,
    )  # fmt: skip
    keys = (batch, kv_heads, group, k.shape[2], dim)
    return grad_q.reshape(q.shape), grad_k.reshape(keys).sum(2), grad_v.reshape(keys).sum(2)
