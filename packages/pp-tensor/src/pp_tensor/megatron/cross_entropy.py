"""megatron.core.tensor_parallel.cross_entropy: `vocab_parallel_cross_entropy`, Megatron's way.

A group left as None is read through this module's `get_tensor_model_parallel_group`
(patchable, as Megatron's). Megatron's label smoothing spreads the smoothing over the
vocabulary's other tokens; pp-tensor's follows torch's rule, over all of them. The two agree
when pp-tensor is given ``label_smoothing * vocab / (vocab - 1)``, which is what is passed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pp_state.parallel_state import get_tensor_model_parallel_group
from pp_tensor import cross_entropy as _pp
from pp_tensor.megatron._groups import get_tensor_model_parallel_group_if_none
from pp_tensor.utils import VocabUtility, tp_size

__all__ = ["VocabUtility", "get_tensor_model_parallel_group", "vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token cross entropy of logits split along the vocabulary (Megatron's smoothing).

    Raises:
        ValueError: `label_smoothing` outside ``[0, 1)``, or shapes that do not match.
    """
    if tp_group is None:
        tp_group = get_tensor_model_parallel_group()
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if label_smoothing:
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        vocab = vocab_parallel_logits.size(-1) * tp_size(tp_group)
        label_smoothing = label_smoothing * vocab / (vocab - 1)
    return _pp.vocab_parallel_cross_entropy(
        vocab_parallel_logits, target, tp_group=tp_group, label_smoothing=label_smoothing
    )
