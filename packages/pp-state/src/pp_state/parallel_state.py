"""Megatron's ``parallel_state`` names over the default `ParallelState`, for porting code.

``from pp_state import parallel_state as mpu`` gives ``mpu.initialize_model_parallel(...)``,
``mpu.get_pipeline_model_parallel_rank()`` and the other familiar calls. They read the
process-wide default state that `initialize_model_parallel` sets once; new code should pass a
`ParallelState` (or just the groups it needs) instead.

Errors carry Megatron's types too: sizes that do not fit raise `ParallelSizeError` (a
ValueError and a RuntimeError), a getter before initialisation `NotInitializedError` (a
RuntimeError and an AssertionError, with a hint), initialising twice `AlreadyInitializedError`.
`initialize_model_parallel` returns None, as Megatron's does.

Other differences from Megatron: `destroy_model_parallel` resets everything, overrides included,
and a new default state starts without overrides; `is_pipeline_stage_at_split` is False when
there is no split; expert, hierarchical-context and distributed-optimizer-instance groups do
not exist here.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from pp_state import default as _default
from pp_state.default import (
    get_default_state,
    has_default_state,
    reset_default_state,
    set_default_state,
)
from pp_state.errors import AlreadyInitializedError
from pp_state.layout import DEFAULT_ORDER, GroupKind
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
    "destroy_model_parallel",
    "get_context_parallel_global_ranks",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_embedding_group",
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


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    *,
    pipeline_model_parallel_split_rank: int | None = None,
    context_parallel_size: int = 1,
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
        virtual_pipeline_model_parallel_size: Model chunks per pipeline rank (interleaved
            schedule), or None.
        pipeline_model_parallel_split_rank: First decoder stage of an encoder-decoder model.
        context_parallel_size: cp.
        distributed_timeout_minutes: Timeout of every created group.
        order: Axis order, fastest-varying first (Megatron's default "tp-cp-ep-dp-pp" is the
            same layout as the default here).
        backend: Backend of the groups; None takes the default group's.

    Returns None, as Megatron's does; `get_parallel_state` hands out the state (or build one
    with `ParallelState.create`, which returns it).

    Raises:
        AlreadyInitializedError: Already initialised (call `destroy_model_parallel` first).
        DistributedNotInitializedError: torch.distributed is not initialised.
        ParallelSizeError: Sizes that do not fit the world; the message names the numbers.
        (Each is also the RuntimeError or AssertionError Megatron raises, and a size error a
        ValueError.)
    """
    if has_default_state():
        raise AlreadyInitializedError(
            "model parallel is already initialized; call destroy_model_parallel() first"
        )
    config = ParallelConfig(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_split_rank=pipeline_model_parallel_split_rank,
        context_parallel_size=context_parallel_size,
        order=order,
        timeout=datetime.timedelta(minutes=distributed_timeout_minutes),
        backend=backend,
    )
    state = ParallelState.create(config)
    set_default_state(state)
    if virtual_pipeline_model_parallel_size is not None:
        _default._OVERRIDES[_VP_RANK] = 0  # Megatron starts at chunk 0


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


def _group(kind: GroupKind, check_initialized: bool) -> dist.ProcessGroup | None:
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


def get_data_parallel_group(
    with_context_parallel: bool = False, check_initialized: bool = True
) -> dist.ProcessGroup | None:
    """This rank's data-parallel group, or data x context parallel."""
    return _group("dp_cp" if with_context_parallel else "dp", check_initialized)


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


# ------------------------------------------------------------------------------ sizes and ranks
def _overridden(name: str) -> int | None:
    return _default._OVERRIDES.get(name)


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


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Data-parallel size, or data x context parallel."""
    return get_default_state().group_size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """This rank's data-parallel rank, or its rank in data x context parallel."""
    return get_default_state().group_rank("dp_cp" if with_context_parallel else "dp")


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
        _default._OVERRIDES.pop(name, None)
    else:
        _default._OVERRIDES[name] = value


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
    if _VP_SIZE in _default._OVERRIDES:
        return _default._OVERRIDES[_VP_SIZE]
    if not has_default_state():
        return None
    return get_default_state().virtual_pipeline_model_parallel_size


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the virtual pipeline size."""
    _set(_VP_SIZE, world_size, least=1)
    if world_size is None:  # an explicit "not interleaving", unlike removing the override
        _default._OVERRIDES[_VP_SIZE] = None


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The model chunk last set with `set_virtual_pipeline_model_parallel_rank`, or None.

    The stage predicates do not read it: pass ``vp_stage`` to them.
    """
    return _default._OVERRIDES.get(_VP_RANK)


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
