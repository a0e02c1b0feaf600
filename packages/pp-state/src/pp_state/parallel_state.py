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
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from pp_state import default as _default
from pp_state.default import (
    get_default_state,
    has_default_state,
    reset_default_state,
    set_default_state,
)
from pp_state.errors import AlreadyInitializedError, InvalidArgumentError
from pp_state.layout import DEFAULT_ORDER, AnyGroupKind, RankGenerator
from pp_state.megatron_globals import amax_reduction_kind, megatron_global
from pp_state.stages import (
    after_split,
    at_split,
    before_split,
    checked_stage,
    first_stage,
    in_embedding_group,
    last_stage,
)
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

_TP_SIZE, _TP_RANK = "tp_world_size", "tp_rank"
_PP_SIZE, _PP_RANK = "pp_world_size", "pp_rank"
_VP_SIZE, _VP_RANK = "vp_world_size", "vp_rank"
_EP_SIZE, _EP_RANK = "ep_world_size", "ep_rank"
_ETP_SIZE, _ETP_RANK = "etp_world_size", "etp_rank"


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
        _default.OVERRIDES[_VP_RANK] = 0  # Megatron starts at chunk 0


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


def _group(kind: AnyGroupKind, check_initialized: bool) -> dist.ProcessGroup | None:
    if not check_initialized and not has_default_state():
        return None
    return get_default_state().group(kind)


# ------------------------------------------------------------------------------ groups
def get_tensor_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's tensor-parallel group (None if not initialised and not checked)."""
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's pipeline group."""
    return _group("pp", check_initialized)


def _data_parallel_kind(with_context_parallel: bool, partial_data_parallel: bool) -> AnyGroupKind:
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
    kind = _data_parallel_kind(with_context_parallel, partial_data_parallel)
    return _group(kind, check_initialized)


def get_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's context-parallel group."""
    return _group("cp", check_initialized)


def get_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's model-parallel (tensor x pipeline) group."""
    return _group("mp", check_initialized)


def get_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The group of stages holding a word-embedding copy (first, split, last)."""
    return _group("embedding", check_initialized)


def get_position_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The group of stages holding a position-embedding copy (first, split)."""
    return _group("position_embedding", check_initialized)


def get_tensor_and_data_parallel_group(
    with_context_parallel: bool = False, check_initialized: bool = True
) -> dist.ProcessGroup | None:
    """This rank's tensor x data (x context) parallel group."""
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_tensor_and_context_parallel_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """This rank's tensor x context parallel group."""
    return _group("tp_cp", check_initialized)


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


def __getattr__(name: str) -> Any:
    """Megatron's group globals (``_DATA_PARALLEL_GROUP``, ``_PIPELINE_GLOBAL_RANKS``, ...).

    Each reads this rank's group (or global ranks) in the default state, None without one;
    see `pp_state.megatron_globals`.
    """
    return megatron_global(name)


# ------------------------------------------------------------------------------ sizes and ranks
def _overridden(name: str) -> int | None:
    return _default.OVERRIDES.get(name)


def get_tensor_model_parallel_world_size() -> int:
    """Tensor-parallel size (or the value set by `set_tensor_model_parallel_world_size`)."""
    size = _overridden(_TP_SIZE)
    return size if size is not None else get_default_state().tensor_model_parallel_size


def get_tensor_model_parallel_rank() -> int:
    """This rank's tensor-parallel rank (or the value set by `set_tensor_model_parallel_rank`)."""
    rank = _overridden(_TP_RANK)
    return rank if rank is not None else get_default_state().tensor_model_parallel_rank


def get_pipeline_model_parallel_world_size() -> int:
    """Pipeline size (or the value set by `set_pipeline_model_parallel_world_size`)."""
    size = _overridden(_PP_SIZE)
    return size if size is not None else get_default_state().pipeline_model_parallel_size


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage (or the value set by `set_pipeline_model_parallel_rank`)."""
    rank = _overridden(_PP_RANK)
    return rank if rank is not None else get_default_state().pipeline_model_parallel_rank


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """Data-parallel size, or data x context parallel (or its optimizer-instance part)."""
    kind = _data_parallel_kind(with_context_parallel, partial_data_parallel)
    return get_default_state().group_size(kind)


def get_data_parallel_rank(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """This rank's data-parallel rank, or its rank in data x context parallel (or its part)."""
    kind = _data_parallel_kind(with_context_parallel, partial_data_parallel)
    return get_default_state().group_rank(kind)


def get_context_parallel_world_size() -> int:
    """Context-parallel size."""
    return get_default_state().context_parallel_size


def get_context_parallel_rank() -> int:
    """This rank's context-parallel rank."""
    return get_default_state().context_parallel_rank


def get_tensor_and_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Size of the tensor x data (x context) parallel group."""
    return get_default_state().group_size("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """This rank's position in the tensor x data (x context) parallel group."""
    return get_default_state().group_rank("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_context_parallel_world_size() -> int:
    """Size of the tensor x context parallel group."""
    return get_default_state().group_size("tp_cp")


def get_tensor_and_context_parallel_rank() -> int:
    """This rank's position in the tensor x context parallel group."""
    return get_default_state().group_rank("tp_cp")


def get_context_parallel_global_ranks() -> list[int]:
    """Global ranks of this rank's context-parallel group."""
    return get_default_state().group_ranks("cp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's group."""
    return get_default_state().src_rank("tp")


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of data-parallel rank 0 in this rank's group."""
    return get_default_state().src_rank("dp_cp" if with_context_parallel else "dp")


def _pipeline_rank_at(offset: int) -> int:
    """Global rank `offset` stages from this one, with Megatron's override-aware arithmetic."""
    ranks = get_default_state().group_ranks("pp")
    size = get_pipeline_model_parallel_world_size()
    return ranks[(get_pipeline_model_parallel_rank() + offset) % size]


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of this pipeline's first stage."""
    return get_default_state().group_ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of this pipeline's last stage (override-aware, as in Megatron)."""
    return get_default_state().group_ranks("pp")[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (the last stage's next is the first)."""
    return _pipeline_rank_at(1)


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (the first stage's previous is the last)."""
    return _pipeline_rank_at(-1)


def get_pipeline_model_parallel_split_rank() -> int | None:
    """First decoder stage of an encoder-decoder pipeline, or None."""
    return get_default_state().pipeline_model_parallel_split_rank


def _set(name: str, value: int | None, *, least: int = 0) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < least
    ):
        raise ValueError(f"expected an int of at least {least}, or None; got {value!r}")
    if value is None:
        _default.OVERRIDES.pop(name, None)
    else:
        _default.OVERRIDES[name] = value


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Override the tensor-parallel size the getters report (None removes the override)."""
    _set(_TP_SIZE, world_size, least=1)


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Override the tensor-parallel rank the getters report (None removes the override)."""
    _set(_TP_RANK, rank)


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the pipeline size the getters and stage predicates use."""
    _set(_PP_SIZE, world_size, least=1)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Override the pipeline rank the getters and stage predicates use."""
    _set(_PP_RANK, rank)


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Model chunks per pipeline rank, or None when not interleaving."""
    if _VP_SIZE in _default.OVERRIDES:
        return _default.OVERRIDES[_VP_SIZE]
    if not has_default_state():
        return None
    return get_default_state().virtual_pipeline_model_parallel_size


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the virtual pipeline size."""
    _set(_VP_SIZE, world_size, least=1)
    if world_size is None:  # an explicit "not interleaving", unlike removing the override
        _default.OVERRIDES[_VP_SIZE] = None


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The model chunk last set with `set_virtual_pipeline_model_parallel_rank`, or None.

    The stage predicates do not read it: pass ``vp_stage`` to them.
    """
    return _default.OVERRIDES.get(_VP_RANK)


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Record the model chunk being run, for ported code that reads it back.

    The stage predicates ignore it, as Megatron's do: pass ``vp_stage`` to them.
    """
    _set(_VP_RANK, rank)


# ------------------------------------------------------------------------------ predicates
def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the first stage (chunk 0 of stage 0 when not `ignore_virtual`).

    When interleaving with `ignore_virtual` False, `vp_stage` is required, as in Megatron.

    Raises:
        ValueError: `vp_stage` is missing or out of range.
    """
    return first_stage(
        get_pipeline_model_parallel_rank(),
        get_virtual_pipeline_model_parallel_world_size(),
        ignore_virtual=ignore_virtual,
        vp_stage=vp_stage,
        pp_size=get_pipeline_model_parallel_world_size(),
    )


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank runs the last stage (its last chunk when not `ignore_virtual`)."""
    return last_stage(
        get_pipeline_model_parallel_rank(),
        get_pipeline_model_parallel_world_size(),
        get_virtual_pipeline_model_parallel_world_size(),
        ignore_virtual=ignore_virtual,
        vp_stage=vp_stage,
    )


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank holds a word-embedding copy (in `vp_stage` when not `ignore_virtual`)."""
    state = get_default_state()
    return in_embedding_group(
        state.rank,
        state.embedding_ranks,
        pp_rank=get_pipeline_model_parallel_rank(),
        pp_size=get_pipeline_model_parallel_world_size(),
        vp_size=get_virtual_pipeline_model_parallel_world_size(),
        ignore_virtual=ignore_virtual,
        vp_stage=vp_stage,
    )


def is_rank_in_position_embedding_group() -> bool:
    """Whether this rank holds a position-embedding copy shared with the decoder."""
    return get_default_state().is_rank_in_position_embedding_group()


def _stage(rank: int | None) -> int:
    if rank is None:
        return get_pipeline_model_parallel_rank()
    return checked_stage(rank, get_pipeline_model_parallel_world_size())


def is_pipeline_stage_before_split(rank: int | None = None) -> bool:
    """Whether pipeline stage `rank` (this rank's by default) is an encoder stage."""
    stage = _stage(rank)
    return before_split(
        stage, get_pipeline_model_parallel_world_size(), get_pipeline_model_parallel_split_rank()
    )


def is_pipeline_stage_after_split(rank: int | None = None) -> bool:
    """Whether pipeline stage `rank` (this rank's by default) is a decoder stage."""
    stage = _stage(rank)
    return after_split(
        stage, get_pipeline_model_parallel_world_size(), get_pipeline_model_parallel_split_rank()
    )


def is_pipeline_stage_at_split() -> bool:
    """Whether this rank is the last encoder stage."""
    return at_split(
        get_pipeline_model_parallel_rank(),
        get_pipeline_model_parallel_world_size(),
        get_pipeline_model_parallel_split_rank(),
    )


# ------------------------------------------------------------------------------ experts
def _size_or_rank(name: str, read: Callable[[ParallelState], int]) -> int:
    """An override set with a ``set_expert_*`` call, else what the default state answers."""
    value = _overridden(name)
    return value if value is not None else read(get_default_state())


def get_expert_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's expert model-parallel group (the ranks its layer's experts are spread over)."""
    return _group("ep", check_initialized)


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
    _set(_EP_SIZE, world_size, least=1)


def set_expert_model_parallel_rank(rank: int | None) -> None:
    """Override the expert model-parallel rank the getter reports (None removes it)."""
    _set(_EP_RANK, rank)


def get_expert_tensor_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's expert tensor-parallel group."""
    return _group("expt_tp", check_initialized)


def _expert_tensor_parallel(
    name: str, tensor_name: str, read: Callable[[ParallelState], int]
) -> int:
    """Megatron's fallback: before initialisation, the tensor-parallel override answers."""
    value = _overridden(name)
    if value is None and not has_default_state():
        value = _overridden(tensor_name)
    return value if value is not None else read(get_default_state())


def get_expert_tensor_parallel_world_size() -> int:
    """Expert tensor-parallel size: the override, else the group's size.

    Before initialisation, the tensor-parallel size override answers, as in Megatron.
    """
    return _expert_tensor_parallel(_ETP_SIZE, _TP_SIZE, lambda state: state.group_size("expt_tp"))


def get_expert_tensor_parallel_rank() -> int:
    """This rank's expert tensor-parallel rank (the override, else the group's).

    Before initialisation, the tensor-parallel rank override answers, as in Megatron.
    """
    return _expert_tensor_parallel(_ETP_RANK, _TP_RANK, lambda state: state.group_rank("expt_tp"))


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    """Override the expert tensor-parallel size the getter reports (None removes it)."""
    _set(_ETP_SIZE, world_size, least=1)


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    """Override the expert tensor-parallel rank the getter reports (None removes it)."""
    _set(_ETP_RANK, rank)


def get_expert_tensor_and_model_parallel_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """This rank's expert tensor x expert model parallel group."""
    return _group("tp_ep", check_initialized)


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
    return _group("tp_ep_pp", check_initialized)


def _expert_data_parallel_kind(partial_expert_data_parallel: bool) -> AnyGroupKind:
    return "intra_expt_dp" if partial_expert_data_parallel else "expt_dp"


def get_expert_data_parallel_group(
    check_initialized: bool = True, partial_expert_data_parallel: bool = False
) -> dist.ProcessGroup | None:
    """This rank's expert data-parallel group (the ranks holding the same experts).

    With `partial_expert_data_parallel`, the part of it one distributed-optimizer instance
    shards over.
    """
    return _group(_expert_data_parallel_kind(partial_expert_data_parallel), check_initialized)


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
    return _group("intra_dist_opt", check_initialized)


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
        raise _default.NotInitializedError(
            "the inter distributed-optimizer instance group is not initialized: it exists "
            "with num_distributed_optimizer_instances of 2 or more, and this state has "
            f"{state.num_distributed_optimizer_instances}"
        )
    return state.group("inter_dist_opt")


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
