"""Each context-parallel rank's part of a batch, as Megatron's ``get_batch_on_this_cp_rank``.

Under context parallelism (``--context-parallel-size``) every rank of a context-parallel group
reads the same microbatch and keeps its part of the sequence: the sequence is cut into
``2 * cp`` equal chunks and rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r``
(`pp_tensor.split_for_context_parallel`), so that under a causal mask every rank has the same
work. Tokens, labels, the loss mask and position ids are split that way; ``document_ids`` (the
document of each token, for attention that stays inside packed documents) are kept whole,
since a rank's queries meet keys from the whole sequence, as Megatron keeps the key dimension
of its attention mask whole. Without position ids in the batch, the global positions of the
rank's tokens are added, so position embeddings see where each token really is.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from pp_tensor import context_parallel_positions, split_for_context_parallel

__all__ = ["WHOLE_SEQUENCE_KEYS", "get_batch_on_this_cp_rank"]

WHOLE_SEQUENCE_KEYS = ("document_ids",)
"""Batch entries every context-parallel rank keeps whole."""


def get_batch_on_this_cp_rank(
    batch: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """This context-parallel rank's part of `batch` (every tensor ``[batch, seq, ...]``).

    Args:
        batch: A microbatch: ``tokens`` and any other ``[batch, seq, ...]`` tensors
            (``labels``, ``loss_mask``, ``position_ids``, ``document_ids``).
        group: The context-parallel group; None, or a group of one: `batch` as it is (a
            new dict).

    Returns:
        The same keys, each sequence split to this rank's two chunks, ``document_ids`` whole,
        and ``position_ids`` (the global positions of the kept tokens, ``[batch, seq / cp]``)
        added when the batch had none.

    Raises:
        ValueError: The batch has no ``tokens``, a tensor's second dimension is not the
            tokens' sequence length, or that length does not split into ``2 * cp`` equal
            chunks (the message names the lengths that would).
    """
    size = 1 if group is None else dist.get_world_size(group)
    if "tokens" not in batch:
        raise ValueError(f"the batch has no 'tokens'; it has {sorted(batch)}")
    if size == 1:
        return dict(batch)
    rank = dist.get_rank(group)
    tokens = batch["tokens"]
    length = tokens.shape[1]
    for key, tensor in batch.items():
        if tensor.dim() < 2 or tensor.shape[1] != length:
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(tensor.shape)}, but every entry must be "
                f"[batch, seq, ...] with the tokens' sequence length {length}"
            )
    parts = {
        key: split_for_context_parallel(tensor, size, rank) for key, tensor in batch.items()
        if key not in WHOLE_SEQUENCE_KEYS
    }  # fmt: skip
    parts.update((key, batch[key]) for key in WHOLE_SEQUENCE_KEYS if key in batch)
    if "position_ids" not in parts:
        positions = context_parallel_positions(length, size, rank, device=tokens.device)
        parts["position_ids"] = positions.expand(tokens.shape[0], -1)
    return parts
