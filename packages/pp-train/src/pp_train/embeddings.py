"""Tied word embeddings and split position embeddings: where their copies are, how they sync.

A model whose output layer reuses the word embedding holds two copies of that weight in a
pipeline: one on the stage that embeds, one on the stage that computes the loss. They start
equal (`sync_shared_embeddings`) and stay equal because their gradients are summed every step
(`sum_tied_gradients`). Encoder-decoder models split at a pipeline rank hold one more copy of
the word embedding, and two of the position embedding, on the first decoder stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from pp_optim import all_reduce_grads
from pp_state import ParallelState, Placement
from pp_state.collectives import collective
from pp_train.wrappers import unwrap_model

__all__ = [
    "TiedEmbeddingSync",
    "split_position_embedding",
    "sum_tied_gradients",
    "sync_shared_embeddings",
    "tied_embedding_sync",
]

TiedEmbeddingSync = Literal["none", "local", "embedding_group"]
"""How the two copies of a tied word embedding are kept equal (see `tied_embedding_sync`)."""


def tied_embedding_sync(placement: Placement) -> TiedEmbeddingSync:
    """How the copies of a word embedding tied to the output layer are kept equal.

    The first virtual stage holds the word embedding and the last the output layer, a copy of
    it. Their gradients are summed every step so both copies see the tied weight's gradient:

    - "none": one stage holds both ends, the output layer uses the embedding itself.
    - "local": both ends are chunks of one pipeline rank (the V placement puts them on rank
      0): the two gradients are added in place on that rank.
    - "embedding_group": the first stage is on pipeline rank 0 and the last on the last
      rank (the looped placement): summed over the embedding group, as Megatron does.

    Args:
        placement: Which virtual stage each (rank, chunk) holds.

    Returns:
        One of the three answers above.

    Raises:
        ValueError: The ends are on two ranks other than the first and last pipeline rank,
            where no embedding group connects them.
    """
    if placement.num_stages == 1:
        return "none"
    first = placement.holder(0)[0]
    last = placement.holder(placement.num_stages - 1)[0]
    if first == last:
        return "local"
    if (first, last) == (0, placement.pp_size - 1):
        return "embedding_group"
    raise ValueError(
        f"placement {placement} puts the first stage on pipeline rank {first} and the last on "
        f"rank {last}; a tied word embedding is kept in sync only when both are on one rank "
        f"or on ranks 0 and {placement.pp_size - 1} (the embedding group); use the 'looped' or "
        "'v' placement, or a model without tied embeddings"
    )


def _shared_weight(chunk: torch.nn.Module) -> torch.nn.Parameter | None:
    inner = unwrap_model(chunk)
    for name in ("shared_embedding_or_output_weight", "word_embeddings_weight"):
        method = getattr(inner, name, None)
        if callable(method):
            weight = method()
            return weight if isinstance(weight, torch.nn.Parameter) else None
    return None


def _ties_output_to_embedding(chunk: torch.nn.Module) -> bool:
    # Megatron's flag; a model without it is taken to tie, as Megatron's older models did.
    return bool(getattr(unwrap_model(chunk), "share_embeddings_and_output_weights", True))


def _embedding_weights(
    chunks: Sequence[torch.nn.Module], state: ParallelState, placement: Placement
) -> list[torch.nn.Parameter]:
    """The tied word-embedding copies this rank holds: the first stage's, then the last's.

    With an encoder-decoder split, the first decoder stage's embedding is a copy too.
    """
    if placement.num_stages == 1:
        return []
    rank = state.pipeline_model_parallel_rank
    ends = [
        index
        for holds in (placement.is_first, placement.is_last)
        for index in range(len(chunks))
        if holds(rank, index)
    ]
    if rank == state.pipeline_model_parallel_split_rank:
        ends = list(dict.fromkeys([0, *ends]))  # no virtual stages with a split
    weights = [
        _shared_weight(chunks[index]) for index in ends if _ties_output_to_embedding(chunks[index])
    ]
    return [w for w in weights if w is not None]


def _main_grad(weight: torch.nn.Parameter) -> torch.Tensor | None:
    grad: torch.Tensor | None = getattr(weight, "main_grad", None)
    return weight.grad if grad is None else grad


def sum_tied_gradients(
    chunks: Sequence[torch.nn.Module], state: ParallelState, placement: Placement
) -> None:
    """Both copies of the tied embedding end with the sum of their gradients.

    Args:
        chunks: This rank's model chunks.
        state: The parallel state (its embedding group).
        placement: Which virtual stage each chunk holds.
    """
    weights = _embedding_weights(chunks, state, placement)
    if not weights:
        return
    if tied_embedding_sync(placement) == "embedding_group":
        all_reduce_grads(weights, group=state.group("embedding"))
        return
    # Both ends on this rank: add the two gradients in place, no communication.
    grads = [grad for grad in map(_main_grad, weights) if grad is not None]
    if len(grads) == len(weights) == 2:  # the embedding and its copy
        with torch.no_grad():
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])


def sync_shared_embeddings(
    chunks: Sequence[torch.nn.Module], state: ParallelState, placement: Placement
) -> None:
    """Every copy of the word (and position) embedding starts as the first stage's.

    Megatron's way: the copies outside the first stage are zeroed, then summed over the
    embedding (and position-embedding) group.

    Args:
        chunks: This rank's model chunks, just built.
        state: The parallel state (its embedding and position-embedding groups).
        placement: Which virtual stage each chunk holds.
    """
    first = state.pipeline_model_parallel_rank == 0
    weights = _embedding_weights(chunks, state, placement)
    with torch.no_grad():
        if weights and tied_embedding_sync(placement) == "local":
            if len(weights) == 2:  # the embedding and its copy
                weights[1].copy_(weights[0])
        elif weights:
            for weight in weights:
                if not first:
                    weight.zero_()
                with collective("embedding copy sync", group=state.group("embedding")):
                    dist.all_reduce(weight.data, group=state.group("embedding"))
        position = split_position_embedding(chunks, state)
        if position is not None:
            if not first:
                position.zero_()
            group = state.group("position_embedding")
            with collective("position embedding copy sync", group=group):
                dist.all_reduce(position.data, group=group)


def split_position_embedding(
    chunks: Sequence[torch.nn.Module], state: ParallelState
) -> torch.nn.Parameter | None:
    """With an encoder-decoder split, this rank's copy of the position embedding, if any.

    The first encoder and first decoder stage each hold one (``model.embedding.
    position_embeddings``, Megatron's layout); they are kept equal over the position-embedding
    group.

    Args:
        chunks: This rank's model chunks.
        state: The parallel state (split rank, position-embedding group).
    """
    if (
        state.pipeline_model_parallel_split_rank is None
        or state.pipeline_model_parallel_size == 1
        or not state.is_rank_in_position_embedding_group()
    ):
        return None
    embedding = getattr(unwrap_model(chunks[0]), "embedding", None)
    weight = getattr(getattr(embedding, "position_embeddings", None), "weight", None)
    return weight if isinstance(weight, torch.nn.Parameter) else None
