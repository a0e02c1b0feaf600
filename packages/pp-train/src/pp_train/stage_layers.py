"""Megatron's layer-count queries, answered by a run's `PipelineLayerLayout`.

A run's split of the model is pp-state's `PipelineLayerLayout`: the transformer layers of each
virtual pipeline stage, in pipeline order, and the `Placement` that says which (rank, chunk)
holds each stage. The embedding belongs to stage 0 and the output layer and loss to the last
stage, so either end may hold no layer (``E|tt|tt|L``).

`get_num_layers_to_build` and `get_transformer_layer_offset` are Megatron's functions of the
same names; they read the layout instead of a transformer config and the global rank.
"""

from __future__ import annotations

from pp_state import PipelineLayerLayout

__all__ = ["get_num_layers_to_build", "get_transformer_layer_offset"]


def get_num_layers_to_build(layout: PipelineLayerLayout, *, pp_rank: int, vp_stage: int = 0) -> int:
    """Megatron's function: how many transformer layers the chunk builds (0 is possible).

    Args:
        layout: The run's layer layout (`RunLayout.layer_layout`).
        pp_rank: The pipeline rank.
        vp_stage: The chunk on that rank.
    """
    return len(layout.layers(pp_rank, vp_stage))


def get_transformer_layer_offset(
    layout: PipelineLayerLayout, *, pp_rank: int, vp_stage: int = 0
) -> int:
    """Megatron's function: the global index of the chunk's first layer (its layers' offset).

    Args as `get_num_layers_to_build`'s. A chunk without layers gets the index its first
    layer would have had.
    """
    return layout.layers(pp_rank, vp_stage).start
