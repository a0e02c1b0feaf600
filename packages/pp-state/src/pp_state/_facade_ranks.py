"""Sizes, ranks and stage predicates of Megatron's ``parallel_state`` facade, with overrides.

Part of `pp_state.parallel_state`, where ported code finds these names: the tensor, pipeline,
data and context parallel sizes and ranks, the pipeline's neighbours and split rank, the
virtual pipeline size and rank, Megatron's ``set_*`` overrides of them (kept in
`pp_state.default.OVERRIDES`, cleared with the default state), and the stage predicates
(`is_pipeline_first_stage`, ...), which read the overrides as Megatron's do.
"""

from __future__ import annotations

from pp_state import default as _default
from pp_state._facade_groups import data_parallel_kind
from pp_state.default import get_default_state, has_default_state
from pp_state.stages import (
    after_split,
    at_split,
    before_split,
    checked_stage,
    first_stage,
    in_embedding_group,
    last_stage,
)

__all__ = [
    "TP_RANK",
    "TP_SIZE",
    "get_context_parallel_global_ranks",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_parallel_rank",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_split_rank",
    "get_pipeline_model_parallel_world_size",
    "get_tensor_and_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_data_parallel_rank",
    "get_tensor_and_data_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "is_pipeline_stage_after_split",
    "is_pipeline_stage_at_split",
    "is_pipeline_stage_before_split",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    "overridden",
    "set_override",
    "set_pipeline_model_parallel_rank",
    "set_pipeline_model_parallel_world_size",
    "set_tensor_model_parallel_rank",
    "set_tensor_model_parallel_world_size",
    "set_virtual_pipeline_model_parallel_rank",
    "set_virtual_pipeline_model_parallel_world_size",
]

# The keys of `pp_state.default.OVERRIDES` (the tensor-parallel ones are the expert fallback's too).
TP_SIZE, TP_RANK = "tp_world_size", "tp_rank"
_PP_SIZE, _PP_RANK = "pp_world_size", "pp_rank"
_VP_SIZE, _VP_RANK = "vp_world_size", "vp_rank"


def overridden(name: str) -> int | None:
    return _default.OVERRIDES.get(name)


def get_tensor_model_parallel_world_size() -> int:
    """Tensor-parallel size (or the value set by `set_tensor_model_parallel_world_size`)."""
    size = overridden(TP_SIZE)
    return size if size is not None else get_default_state().tensor_model_parallel_size


def get_tensor_model_parallel_rank() -> int:
    """This rank's tensor-parallel rank (or the value set by `set_tensor_model_parallel_rank`)."""
    rank = overridden(TP_RANK)
    return rank if rank is not None else get_default_state().tensor_model_parallel_rank


def get_pipeline_model_parallel_world_size() -> int:
    """Pipeline size (or the value set by `set_pipeline_model_parallel_world_size`)."""
    size = overridden(_PP_SIZE)
    return size if size is not None else get_default_state().pipeline_model_parallel_size


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage (or the value set by `set_pipeline_model_parallel_rank`)."""
    rank = overridden(_PP_RANK)
    return rank if rank is not None else get_default_state().pipeline_model_parallel_rank


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """Data-parallel size, or data x context parallel (or its optimizer-instance part)."""
    kind = data_parallel_kind(with_context_parallel, partial_data_parallel)
    return get_default_state().group_size(kind)


def get_data_parallel_rank(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """This rank's data-parallel rank, or its rank in data x context parallel (or its part)."""
    kind = data_parallel_kind(with_context_parallel, partial_data_parallel)
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


def set_override(name: str, value: int | None, *, least: int = 0) -> None:
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
    set_override(TP_SIZE, world_size, least=1)


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Override the tensor-parallel rank the getters report (None removes the override)."""
    set_override(TP_RANK, rank)


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the pipeline size the getters and stage predicates use."""
    set_override(_PP_SIZE, world_size, least=1)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Override the pipeline rank the getters and stage predicates use."""
    set_override(_PP_RANK, rank)


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Model chunks per pipeline rank, or None when not interleaving."""
    if _VP_SIZE in _default.OVERRIDES:
        return _default.OVERRIDES[_VP_SIZE]
    if not has_default_state():
        return None
    return get_default_state().virtual_pipeline_model_parallel_size


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the virtual pipeline size."""
    set_override(_VP_SIZE, world_size, least=1)
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
    set_override(_VP_RANK, rank)


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
