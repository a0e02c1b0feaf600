"""The expert and distributed-optimizer groups of Megatron's ``parallel_state`` facade.

Part of `pp_state.parallel_state`, where ported code finds these names: the expert model,
expert tensor, expert data parallel groups and their sizes and ranks (with Megatron's
``set_expert_*`` overrides), their products, and the distributed-optimizer instance groups.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch.distributed as dist

from pp_state._facade_groups import default_group
from pp_state._facade_ranks import TP_RANK, TP_SIZE, overridden, set_override
from pp_state.default import NotInitializedError, get_default_state, has_default_state
from pp_state.layout import AnyGroupKind
from pp_state.state import ParallelState

__all__ = [
    "get_data_modulo_expert_parallel_group",
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
    "set_expert_model_parallel_rank",
    "set_expert_model_parallel_world_size",
    "set_expert_tensor_parallel_rank",
    "set_expert_tensor_parallel_world_size",
]

_EP_SIZE, _EP_RANK = "ep_world_size", "ep_rank"
_ETP_SIZE, _ETP_RANK = "etp_world_size", "etp_rank"


def _size_or_rank(name: str, read: Callable[[ParallelState], int]) -> int:
    """An override set with a ``set_expert_*`` call, else what the default state answers."""
    value = overridden(name)
    return value if value is not None else read(get_default_state())


def get_expert_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's expert model-parallel group (the ranks its layer's experts are spread over)."""
    return default_group("ep", check_initialized)


def get_expert_model_parallel_world_size() -> int:
    """Expert model-parallel size (or the value set by `set_expert_model_parallel_world_size`)."""
    return _size_or_rank(_EP_SIZE, lambda state: state.group_size("ep"))


def get_expert_model_parallel_rank() -> int:
    """This rank's expert model-parallel rank (or the value set by the setter)."""
    return _size_or_rank(_EP_RANK, lambda state: state.group_rank("ep"))


def get_expert_model_parallel_src_rank() -> int:
    """Global rank of expert model-parallel rank 0 in this rank's group."""
    return get_default_state().src_rank("ep")


def set_expert_model_parallel_world_size(world_size: int | None) -> None:
    """Override the expert model-parallel size the getter reports (None removes it)."""
    set_override(_EP_SIZE, world_size, least=1)


def set_expert_model_parallel_rank(rank: int | None) -> None:
    """Override the expert model-parallel rank the getter reports (None removes it)."""
    set_override(_EP_RANK, rank)


def get_expert_tensor_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's expert tensor-parallel group."""
    return default_group("expt_tp", check_initialized)


def _expert_tensor_parallel(
    name: str, tensor_name: str, read: Callable[[ParallelState], int]
) -> int:
    """Megatron's fallback: before initialisation, the tensor-parallel override answers."""
    value = overridden(name)
    if value is None and not has_default_state():
        value = overridden(tensor_name)
    return value if value is not None else read(get_default_state())


def get_expert_tensor_parallel_world_size() -> int:
    """Expert tensor-parallel size: the override, else the group's size.

    Before initialisation, the tensor-parallel size override answers, as in Megatron.
    """
    return _expert_tensor_parallel(_ETP_SIZE, TP_SIZE, lambda state: state.group_size("expt_tp"))


def get_expert_tensor_parallel_rank() -> int:
    """This rank's expert tensor-parallel rank (the override, else the group's).

    Before initialisation, the tensor-parallel rank override answers, as in Megatron.
    """
    return _expert_tensor_parallel(_ETP_RANK, TP_RANK, lambda state: state.group_rank("expt_tp"))


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    """Override the expert tensor-parallel size the getter reports (None removes it)."""
    set_override(_ETP_SIZE, world_size, least=1)


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    """Override the expert tensor-parallel rank the getter reports (None removes it)."""
    set_override(_ETP_RANK, rank)


def get_expert_tensor_and_model_parallel_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """This rank's expert tensor x expert model parallel group."""
    return default_group("tp_ep", check_initialized)


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Size of the expert tensor x expert model parallel group."""
    return get_default_state().group_size("tp_ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    """This rank's position in the expert tensor x expert model parallel group."""
    return get_default_state().group_rank("tp_ep")


def get_expert_tensor_model_pipeline_parallel_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """This rank's expert tensor x expert model x pipeline parallel group."""
    return default_group("tp_ep_pp", check_initialized)


def _expert_data_parallel_kind(partial_expert_data_parallel: bool) -> AnyGroupKind:
    return "intra_expt_dp" if partial_expert_data_parallel else "expt_dp"


def get_expert_data_parallel_group(
    check_initialized: bool = True, partial_expert_data_parallel: bool = False
) -> dist.ProcessGroup | None:
    """This rank's expert data-parallel group (the ranks holding the same experts).

    With `partial_expert_data_parallel`, the part of it one distributed-optimizer instance
    shards over.
    """
    return default_group(
        _expert_data_parallel_kind(partial_expert_data_parallel), check_initialized
    )


def get_data_modulo_expert_parallel_group(
    partial_expert_data_parallel: bool = False,
) -> dist.ProcessGroup | None:
    """Deprecated name of `get_expert_data_parallel_group`; warns, as Megatron's does."""
    warnings.warn(
        "get_data_modulo_expert_parallel_group is deprecated; use get_expert_data_parallel_group",
        DeprecationWarning,
        stacklevel=2,
    )
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    """Size of the expert data-parallel group (or of its optimizer-instance part)."""
    kind = _expert_data_parallel_kind(partial_expert_data_parallel)
    return get_default_state().group_size(kind)


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    """This rank's position in the expert data-parallel group (or its optimizer-instance part)."""
    kind = _expert_data_parallel_kind(partial_expert_data_parallel)
    return get_default_state().group_rank(kind)


def get_intra_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """The ranks of this rank's distributed-optimizer instance (all ranks with one instance)."""
    return default_group("intra_dist_opt", check_initialized)


def get_inter_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """The ranks at this rank's position in every distributed-optimizer instance.

    As in Megatron, there is none with one instance: it raises, or returns None when
    `check_initialized` is False.

    Raises:
        NotInitializedError: Not initialised, or one instance (and `check_initialized`).
    """
    if not check_initialized and not (
        has_default_state() and get_default_state().in_group("inter_dist_opt")
    ):
        return None
    state = get_default_state()
    if not state.in_group("inter_dist_opt"):
        raise NotInitializedError(
            "the inter distributed-optimizer instance group is not initialized: it exists "
            "with num_distributed_optimizer_instances of 2 or more, and this state has "
            f"{state.num_distributed_optimizer_instances}"
        )
    return state.group("inter_dist_opt")
