"""megatron.core.tensor_parallel.random: the RNG tracker, seeding and recomputation.

The tracker, its names and `initialize_rng_tracker` are pp-tensor's (`pp_tensor.random`).
`model_parallel_cuda_manual_seed` reads missing ranks through this module's getters
(patchable, as Megatron's). `checkpoint` and `CheckpointWithoutOutput` are pp-tensor's
(`pp_tensor.recompute`: torch's checkpoint with the tracker's states replayed), with the
tensor-parallel group of ``distribute_saved_activations`` read from the default state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pp_state.parallel_state import (
    get_expert_model_parallel_rank,
    get_expert_tensor_parallel_rank,
    get_tensor_model_parallel_rank,
)
from pp_tensor import random as _pp
from pp_tensor import recompute as _recompute
from pp_tensor.megatron._groups import get_tensor_model_parallel_group_if_none
from pp_tensor.random import (
    DATA_PARALLEL_RNG as _DATA_PARALLEL_RNG_TRACKER_NAME,
)
from pp_tensor.random import (
    EXPERT_PARALLEL_RNG as _EXPERT_PARALLEL_RNG_TRACKER_NAME,
)
from pp_tensor.random import (
    MODEL_PARALLEL_RNG as _MODEL_PARALLEL_RNG_TRACKER_NAME,
)
from pp_tensor.random import (
    CudaRNGStatesTracker,
    convert_cuda_rng_state,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    initialize_rng_tracker,
    is_graph_safe_cuda_rng_tracker,
)
from pp_tensor.recompute import CheckpointWithoutOutput, CheckpointWithoutOutputManager

__all__ = [
    "_DATA_PARALLEL_RNG_TRACKER_NAME",
    "_EXPERT_PARALLEL_RNG_TRACKER_NAME",
    "_MODEL_PARALLEL_RNG_TRACKER_NAME",
    "CheckpointWithoutOutput",
    "CheckpointWithoutOutputManager",
    "CudaRNGStatesTracker",
    "checkpoint",
    "convert_cuda_rng_state",
    "get_all_rng_states",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_model_parallel_rank",
    "get_expert_parallel_rng_tracker_name",
    "get_expert_tensor_parallel_rank",
    "get_tensor_model_parallel_rank",
    "initialize_rng_tracker",
    "is_checkpointing",
    "is_graph_safe_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
]


def model_parallel_cuda_manual_seed(  # noqa: PLR0917 - Megatron's signature
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    gtp_remat_rank: int | None = None,
    egtp_remat_rank: int | None = None,
    force_reset_rng: bool = False,
    gtp_remat_world_size: int | None = None,
    egtp_remat_world_size: int | None = None,
) -> CudaRNGStatesTracker:
    """Seeds the CUDA default generator and the tracker's three states (not the CPU one).

    `pp_tensor.random.model_parallel_cuda_manual_seed`, with missing ranks read here.
    """
    return _pp.model_parallel_cuda_manual_seed(
        seed,
        te_rng_tracker,
        inference_rng_tracker,
        use_cudagraphable_rng,
        tp_rank=get_tensor_model_parallel_rank() if tp_rank is None else tp_rank,
        ep_rank=get_expert_model_parallel_rank() if ep_rank is None else ep_rank,
        etp_rank=get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank,
        gtp_remat_rank=gtp_remat_rank,
        egtp_remat_rank=egtp_remat_rank,
        force_reset_rng=force_reset_rng,
        gtp_remat_world_size=gtp_remat_world_size,
        egtp_remat_world_size=egtp_remat_world_size,
    )


def get_all_rng_states() -> dict[str, Any]:
    """The default tracker's states by name (Megatron's: what its tracker holds)."""
    return get_cuda_rng_tracker().get_states()


def is_checkpointing() -> bool:
    """Whether a `checkpoint` block is running its forward or its recomputation now."""
    return _recompute.is_checkpointing()


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
    """``function(*args)`` recomputed in backward with every RNG state replayed."""
    group = get_tensor_model_parallel_group_if_none(None) if distribute_saved_activations else None
    return _recompute.checkpoint(function, distribute_saved_activations, *args, tp_group=group)
