"""Megatron's ``parallel_state`` names over the default `ParallelState`, for porting code.

``from pp_state import parallel_state as mpu`` gives ``mpu.initialize_model_parallel(...)``,
``mpu.get_pipeline_model_parallel_rank()`` and the other familiar calls. They read the
process-wide default state that `initialize_model_parallel` sets once; new code should pass a
`ParallelState` (or just the groups it needs) instead.

Errors carry Megatron's types too: sizes that do not fit raise `ParallelSizeError` (a
ValueError and a RuntimeError), a getter before initialisation `NotInitializedError` (a
RuntimeError and an AssertionError, with a hint), initialising twice `AlreadyInitializedError`.
`initialize_model_parallel` returns None, as Megatron's does. Megatron's module globals
(``_DATA_PARALLEL_GROUP``, ``_PIPELINE_GLOBAL_RANKS``, ...) read the default state's groups.

Other differences from Megatron: `destroy_model_parallel` resets everything, overrides included,
and a new default state starts without overrides; `is_pipeline_stage_at_split` is False when
there is no split; hierarchical-context, gloo and all-gather-at-initialisation groups do not
exist here (`create_all_gather_groups` makes all-gather groups afterwards).
"""

from __future__ import annotations

import datetime
from typing import Any

from pp_state._facade_experts import (
    get_data_modulo_expert_parallel_group,
    get_expert_data_parallel_group,
    get_expert_data_parallel_rank,
    get_expert_data_parallel_world_size,
    get_expert_model_parallel_group,
    get_expert_model_parallel_rank,
    get_expert_model_parallel_src_rank,
    get_expert_model_parallel_world_size,
    get_expert_tensor_and_model_parallel_group,
    get_expert_tensor_and_model_parallel_rank,
    get_expert_tensor_and_model_parallel_world_size,
    get_expert_tensor_model_pipeline_parallel_group,
    get_expert_tensor_parallel_group,
    get_expert_tensor_parallel_rank,
    get_expert_tensor_parallel_world_size,
    get_inter_distributed_optimizer_instance_group,
    get_intra_distributed_optimizer_instance_group,
    set_expert_model_parallel_rank,
    set_expert_model_parallel_world_size,
    set_expert_tensor_parallel_rank,
    set_expert_tensor_parallel_world_size,
)
from pp_state._facade_groups import (
    create_all_gather_groups,
    get_amax_reduction_group,
    get_context_parallel_group,
    get_data_parallel_group,
    get_embedding_group,
    get_model_parallel_group,
    get_pipeline_model_parallel_group,
    get_position_embedding_group,
    get_tensor_and_context_parallel_group,
    get_tensor_and_data_parallel_group,
    get_tensor_model_parallel_group,
)
from pp_state._facade_ranks import (
    get_context_parallel_global_ranks,
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_data_parallel_rank,
    get_data_parallel_src_rank,
    get_data_parallel_world_size,
    get_pipeline_model_parallel_first_rank,
    get_pipeline_model_parallel_last_rank,
    get_pipeline_model_parallel_next_rank,
    get_pipeline_model_parallel_prev_rank,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_split_rank,
    get_pipeline_model_parallel_world_size,
    get_tensor_and_context_parallel_rank,
    get_tensor_and_context_parallel_world_size,
    get_tensor_and_data_parallel_rank,
    get_tensor_and_data_parallel_world_size,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    get_virtual_pipeline_model_parallel_rank,
    get_virtual_pipeline_model_parallel_world_size,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    is_pipeline_stage_after_split,
    is_pipeline_stage_at_split,
    is_pipeline_stage_before_split,
    is_rank_in_embedding_group,
    is_rank_in_position_embedding_group,
    set_pipeline_model_parallel_rank,
    set_pipeline_model_parallel_world_size,
    set_tensor_model_parallel_rank,
    set_tensor_model_parallel_world_size,
    set_virtual_pipeline_model_parallel_rank,
    set_virtual_pipeline_model_parallel_world_size,
)
from pp_state.default import (
    get_default_state,
    has_default_state,
    reset_default_state,
    set_default_state,
)
from pp_state.errors import AlreadyInitializedError
from pp_state.layout import DEFAULT_ORDER, RankGenerator
from pp_state.megatron_globals import megatron_global
from pp_state.state import ParallelConfig, ParallelState

__all__ = [
    "RankGenerator",
    "create_all_gather_groups",
    "destroy_model_parallel",
    "get_amax_reduction_group",
    "get_context_parallel_global_ranks",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_modulo_expert_parallel_group",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_embedding_group",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_model_parallel_group",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_src_rank",
    "get_expert_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_group",
    "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_model_pipeline_parallel_group",
    "get_expert_tensor_parallel_group",
    "get_expert_tensor_parallel_rank",
    "get_expert_tensor_parallel_world_size",
    "get_inter_distributed_optimizer_instance_group",
    "get_intra_distributed_optimizer_instance_group",
    "get_model_parallel_group",
    "get_parallel_state",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_split_rank",
    "get_pipeline_model_parallel_world_size",
    "get_position_embedding_group",
    "get_tensor_and_context_parallel_group",
    "get_tensor_and_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_data_parallel_group",
    "get_tensor_and_data_parallel_rank",
    "get_tensor_and_data_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "initialize_model_parallel",
    "is_initialized",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "is_pipeline_stage_after_split",
    "is_pipeline_stage_at_split",
    "is_pipeline_stage_before_split",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    "model_parallel_is_initialized",
    "set_expert_model_parallel_rank",
    "set_expert_model_parallel_world_size",
    "set_expert_tensor_parallel_rank",
    "set_expert_tensor_parallel_world_size",
    "set_pipeline_model_parallel_rank",
    "set_pipeline_model_parallel_world_size",
    "set_tensor_model_parallel_rank",
    "set_tensor_model_parallel_world_size",
    "set_virtual_pipeline_model_parallel_rank",
    "set_virtual_pipeline_model_parallel_world_size",
]


def _refuse_a_second_initialisation() -> None:
    if has_default_state():
        raise AlreadyInitializedError(
            "model parallel is already initialized; call destroy_model_parallel() first"
        )


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    *,
    pipeline_model_parallel_split_rank: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    distributed_timeout_minutes: float = 30,
    order: str = DEFAULT_ORDER,
    backend: str | None = None,
) -> None:
    """Create every model-parallel group and make it the default state, as Megatron does.

    Call it on every rank after ``torch.distributed.init_process_group``. Arguments after the
    first three are keyword-only: Megatron's positional order has changed between releases.

    Args:
        tensor_model_parallel_size: tp.
        pipeline_model_parallel_size: pp.
        virtual_pipeline_model_parallel_size: Model chunks per pipeline rank, or None.
        pipeline_model_parallel_split_rank: First decoder stage of an encoder-decoder model.
        context_parallel_size: cp.
        expert_model_parallel_size: ep, the ranks experts are spread over.
        num_distributed_optimizer_instances: Distributed-optimizer replicas over dp x cp.
        expert_tensor_parallel_size: Expert tp; None takes `tensor_model_parallel_size`.
        distributed_timeout_minutes: Timeout of every created group.
        order: Axis order, fastest-varying first (Megatron's default "tp-cp-ep-dp-pp").
        backend: Backend of the groups; None takes the default group's.

    Returns None, as Megatron's does; `get_parallel_state` hands out the state.

    Raises:
        AlreadyInitializedError: Already initialised (call `destroy_model_parallel` first).
        DistributedNotInitializedError: torch.distributed is not initialised.
        ParallelSizeError: Sizes that do not fit (a ValueError), before any group exists.
        Each is also the RuntimeError or AssertionError Megatron raises.
    """
    _refuse_a_second_initialisation()
    config = ParallelConfig(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_split_rank=pipeline_model_parallel_split_rank,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        order=order,
        timeout=datetime.timedelta(minutes=distributed_timeout_minutes),
        backend=backend,
    )
    state = ParallelState.create(config)
    set_default_state(state)
    if virtual_pipeline_model_parallel_size is not None:
        set_virtual_pipeline_model_parallel_rank(0)  # Megatron starts at chunk 0


def destroy_model_parallel() -> None:
    """Destroy the default state's groups and forget every override."""
    reset_default_state(destroy=True)


def model_parallel_is_initialized() -> bool:
    """Whether `initialize_model_parallel` ran (and was not destroyed since)."""
    return has_default_state()


def is_initialized() -> bool:
    """Same as `model_parallel_is_initialized` (Megatron checks the data-parallel group)."""
    return has_default_state()


def get_parallel_state() -> ParallelState:
    """The default `ParallelState`, for handing to code that takes it explicitly."""
    return get_default_state()


def __getattr__(name: str) -> Any:
    """Megatron's group globals (``_DATA_PARALLEL_GROUP``, ``_PIPELINE_GLOBAL_RANKS``, ...).

    Each reads this rank's group (or global ranks) in the default state, None without one;
    see `pp_state.megatron_globals`.
    """
    return megatron_global(name)
