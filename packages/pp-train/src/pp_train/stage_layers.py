"""Which transformer layers each model chunk builds, from the layer count of every stage.

A run's split of the model is one tuple, ``layer_counts``: the transformer layers of each
virtual pipeline stage, in pipeline order (stage 0 first). The embedding always belongs to
stage 0 and the output layer and loss to the last stage, so either end may hold no layer
(``(0, 2, 2, 0)`` is Megatron's layout ``E|tt|tt|L``); a stage in between holds at least one.
Stage ``s`` holds the global layers ``[sum(counts[:s]), sum(counts[:s + 1]))``; which
(rank, chunk) holds stage ``s`` is the `Placement`'s answer.

`get_num_layers_to_build` and `get_transformer_layer_offset` are Megatron's functions of the
same names, reading these counts instead of a transformer config.
"""

from __future__ import annotations

from collections.abc import Sequence

from pp_state import Placement

__all__ = [
    "check_layer_counts",
    "chunk_layer_range",
    "even_layer_counts",
    "get_num_layers_to_build",
    "get_transformer_layer_offset",
]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def even_layer_counts(num_layers: int, pp_size: int, vp_size: int = 1) -> tuple[int, ...]:
    """The counts of an even split: ``num_layers`` over ``pp_size * vp_size`` stages.

    Raises:
        ValueError: The layers do not divide over the stages; the message lists the stage
            numbers that would.
    """
    stages = pp_size * vp_size
    if stages < 1 or num_layers % stages:
        fits = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise ValueError(
            f"{num_layers} layers do not split evenly over pipeline size {pp_size} x virtual "
            f"size {vp_size} = {stages} virtual stages; use a number of stages among {fits}"
        )
    return (num_layers // stages,) * stages


def check_layer_counts(
    counts: Sequence[int], placement: Placement, *, num_layers: int | None = None
) -> tuple[int, ...]:
    """`counts` as a tuple, checked against the placement's stages and the model's layers.

    Args:
        counts: Transformer layers of each virtual stage, in pipeline order.
        placement: Which (rank, chunk) holds each stage; it fixes the number of stages.
        num_layers: The model's layers; the counts must add up to it when given.

    Raises:
        TypeError: A count is not an int.
        ValueError: The number of counts is not the placement's number of stages, a count is
            negative, a stage between the first and the last holds no layer, or the counts do
            not add up to `num_layers`.
    """
    counts = tuple(counts)
    bad = [count for count in counts if not _is_int(count)]
    if bad:
        raise TypeError(f"layer counts must be ints, got {bad[0]!r} in {counts}")
    stages = placement.num_stages
    if len(counts) != stages:
        raise ValueError(
            f"{len(counts)} layer counts {counts} for {stages} virtual stages "
            f"({placement.pp_size} ranks x {placement.vp_size} chunks); give one per stage"
        )
    for stage, count in enumerate(counts):
        if count < 0:
            raise ValueError(f"stage {stage} of {stages} has {count} layers; a count is >= 0")
        if count == 0 and 0 < stage < stages - 1:
            raise ValueError(
                f"stage {stage} of {stages} holds nothing (layer counts {counts}): a stage "
                "between the first (embedding) and the last (output layer) needs a layer"
            )
    if num_layers is not None and sum(counts) != num_layers:
        raise ValueError(
            f"layer counts {counts} add up to {sum(counts)} layers, but the model has "
            f"{num_layers}; the counts must add up to the number of layers"
        )
    return counts


def chunk_layer_range(
    counts: Sequence[int], placement: Placement, *, pp_rank: int, vp_stage: int = 0
) -> range:
    """The global layers that chunk `vp_stage` of pipeline rank `pp_rank` holds.

    Raises:
        ValueError: The counts do not fit the placement (see `check_layer_counts`), or the
            rank or chunk is out of range.
    """
    counts = check_layer_counts(counts, placement)
    stage = placement.stage(pp_rank, vp_stage)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def get_num_layers_to_build(
    counts: Sequence[int], placement: Placement, *, pp_rank: int, vp_stage: int = 0
) -> int:
    """Megatron's function: how many transformer layers the chunk builds (0 is possible).

    Args:
        counts: Transformer layers of each virtual stage (the run's ``layer_counts``).
        placement: Which (rank, chunk) holds each stage.
        pp_rank: The pipeline rank.
        vp_stage: The chunk on that rank.
    """
    return len(chunk_layer_range(counts, placement, pp_rank=pp_rank, vp_stage=vp_stage))


def get_transformer_layer_offset(
    counts: Sequence[int], placement: Placement, *, pp_rank: int, vp_stage: int = 0
) -> int:
    """Megatron's function: the global index of the chunk's first layer (its layers' offset).

    Args as `get_num_layers_to_build`'s. A chunk without layers gets the index its first
    layer would have had.
    """
    return chunk_layer_range(counts, placement, pp_rank=pp_rank, vp_stage=vp_stage).start
