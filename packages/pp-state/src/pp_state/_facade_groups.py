"""The process groups of Megatron's ``parallel_state`` facade, read from the default state.

Part of `pp_state.parallel_state`, where ported code finds these names: the ``get_*_group``
getters of the tensor, pipeline, data, context and model parallel groups, the embedding
groups and their products, the FP8 amax group and `create_all_gather_groups`. With
``check_initialized=False`` a getter returns None before `initialize_model_parallel`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import torch.distributed as dist

from pp_state.default import get_default_state, has_default_state
from pp_state.errors import InvalidArgumentError
from pp_state.layout import AnyGroupKind
from pp_state.megatron_globals import amax_reduction_kind

__all__ = [
    "create_all_gather_groups",
    "data_parallel_kind",
    "default_group",
    "get_amax_reduction_group",
    "get_context_parallel_group",
    "get_data_parallel_group",
    "get_embedding_group",
    "get_model_parallel_group",
    "get_pipeline_model_parallel_group",
    "get_position_embedding_group",
    "get_tensor_and_context_parallel_group",
    "get_tensor_and_data_parallel_group",
    "get_tensor_model_parallel_group",
]


def default_group(kind: AnyGroupKind, check_initialized: bool) -> dist.ProcessGroup | None:
    if not check_initialized and not has_default_state():
        return None
    return get_default_state().group(kind)


def get_tensor_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's tensor-parallel group (None if not initialised and not checked)."""
    return default_group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's pipeline group."""
    return default_group("pp", check_initialized)


def data_parallel_kind(with_context_parallel: bool, partial_data_parallel: bool) -> AnyGroupKind:
    if not partial_data_parallel:
        return "dp_cp" if with_context_parallel else "dp"
    if not with_context_parallel:
        raise InvalidArgumentError(
            "partial_data_parallel=True needs with_context_parallel=True: the distributed "
            "optimizer's instances shard over data x context parallel ranks"
        )
    return "intra_dp_cp"


def get_data_parallel_group(
    with_context_parallel: bool = False,
    check_initialized: bool = True,
    *,
    partial_data_parallel: bool = False,
) -> dist.ProcessGroup | None:
    """This rank's data-parallel group, or data x context parallel.

    With ``partial_data_parallel=True`` (and `with_context_parallel`), the part of it one
    distributed-optimizer instance shards over.
    """
    kind = data_parallel_kind(with_context_parallel, partial_data_parallel)
    return default_group(kind, check_initialized)


def get_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's context-parallel group."""
    return default_group("cp", check_initialized)


def get_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's model-parallel (tensor x pipeline) group."""
    return default_group("mp", check_initialized)


def get_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The group of stages holding a word-embedding copy (first, split, last)."""
    return default_group("embedding", check_initialized)


def get_position_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The group of stages holding a position-embedding copy (first, split)."""
    return default_group("position_embedding", check_initialized)


def get_tensor_and_data_parallel_group(
    with_context_parallel: bool = False, check_initialized: bool = True
) -> dist.ProcessGroup | None:
    """This rank's tensor x data (x context) parallel group."""
    return default_group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_tensor_and_context_parallel_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """This rank's tensor x context parallel group."""
    return default_group("tp_cp", check_initialized)


def get_amax_reduction_group(
    with_context_parallel: bool = False, tp_only_amax_red: bool = False
) -> dist.ProcessGroup:
    """The group FP8 amax values are reduced over, by Megatron's rule.

    Tensor x data parallel, or tensor x data x context parallel with `with_context_parallel`;
    with `tp_only_amax_red`, tensor parallel, or tensor x context parallel.

    Raises:
        NotInitializedError: Before `initialize_model_parallel` (Megatron asserts).
    """
    kind = amax_reduction_kind(
        with_context_parallel=with_context_parallel, tp_only_amax_red=tp_only_amax_red
    )
    return get_default_state().group(kind)


def create_all_gather_groups(
    for_expert_parallelism: bool = False,
    timeout: datetime.timedelta | None = None,
    nccl_comm_cfgs: Mapping[str, object] | None = None,
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """New groups with the ranks of the data x context (and expert data) parallel groups.

    A collective call on every rank. Collectives on a second communicator over the same ranks
    let an all-gather progress beside a reduce-scatter. The groups are destroyed with the
    default state (`destroy_model_parallel`).

    Args:
        for_expert_parallelism: Also copy the expert data-parallel groups (when ep > 1).
        timeout: Of the new groups; None takes the state's.
        nccl_comm_cfgs: Megatron's per-group NCCL options; pp-state sets none, so only None
            or an empty mapping is accepted.

    Returns:
        ``(dp_cp_ag_group, expt_dp_ag_group)``: this rank's new groups; the second is None
        unless `for_expert_parallelism` and ep > 1.

    Raises:
        NotInitializedError: Before `initialize_model_parallel` (a RuntimeError, as Megatron's).
        ValueError: `nccl_comm_cfgs` holds options.
    """
    state = get_default_state()
    if nccl_comm_cfgs:
        raise ValueError(
            f"nccl_comm_cfgs {dict(nccl_comm_cfgs)!r}: pp-state sets no NCCL communicator "
            "options; pass None"
        )
    dp_cp = state.copy_groups("dp_cp", timeout=timeout)
    expert = None
    if for_expert_parallelism and state.expert_model_parallel_size > 1:
        expert = state.copy_groups("expt_dp", timeout=timeout)
    return dp_cp, expert
