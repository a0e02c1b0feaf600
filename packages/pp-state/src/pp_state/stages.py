"""Pipeline-stage predicates as pure functions of a rank's coordinates.

`ParallelState` and the Megatron-compatible facade both answer through these, so the facade's
overrides (``set_pipeline_model_parallel_rank`` and friends) get the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence

from pp_state.numbers import is_int
from pp_state.placement import Placement

__all__ = [
    "after_split",
    "at_split",
    "before_split",
    "checked_stage",
    "first_stage",
    "in_embedding_group",
    "last_stage",
    "resolve_vp_stage",
]


def resolve_vp_stage(
    vp_size: int | None, *, ignore_virtual: bool, vp_stage: int | None
) -> int | None:
    """The virtual stage a predicate must test, or None when virtual stages do not matter.

    Raises:
        ValueError: `vp_stage` is out of range, or missing while interleaving with
            `ignore_virtual` False.
    """
    if vp_stage is not None:
        valid = range(vp_size or 1)
        if not is_int(vp_stage) or vp_stage not in valid:
            raise ValueError(f"vp_stage {vp_stage!r} is not a virtual stage; valid: {list(valid)}")
    if ignore_virtual or vp_size is None:
        return None
    if vp_stage is None:
        raise ValueError(
            f"the pipeline is interleaved over {vp_size} virtual stages: pass vp_stage "
            f"(one of {list(range(vp_size))}) or ignore_virtual=True"
        )
    return vp_stage


def _placement(pp_size: int, vp_size: int | None, placement: Placement | None) -> Placement:
    if placement is None:
        return Placement.looped(pp_size, vp_size or 1)
    if (placement.pp_size, placement.vp_size) != (pp_size, vp_size or 1):
        raise ValueError(
            f"the placement covers {placement.pp_size} ranks x {placement.vp_size} chunks, but "
            f"the pipeline has {pp_size} x {vp_size or 1}"
        )
    return placement


def first_stage(
    pp_rank: int,
    vp_size: int | None,
    *,
    ignore_virtual: bool,
    vp_stage: int | None,
    pp_size: int | None = None,
    placement: Placement | None = None,
) -> bool:
    """Whether pipeline rank `pp_rank` (in virtual stage `vp_stage`) holds the first stage.

    The placement (looped by default, as Megatron's) says which (rank, chunk) that is.
    """
    chunk = resolve_vp_stage(vp_size, ignore_virtual=ignore_virtual, vp_stage=vp_stage)
    where = _placement(pp_size or pp_rank + 1, vp_size, placement)
    if chunk is None:
        return where.holds_first(pp_rank)
    return where.is_first(pp_rank, chunk)


def last_stage(
    pp_rank: int,
    pp_size: int,
    vp_size: int | None,
    *,
    ignore_virtual: bool,
    vp_stage: int | None,
    placement: Placement | None = None,
) -> bool:
    """Whether pipeline rank `pp_rank` (in virtual stage `vp_stage`) holds the last stage."""
    chunk = resolve_vp_stage(vp_size, ignore_virtual=ignore_virtual, vp_stage=vp_stage)
    where = _placement(pp_size, vp_size, placement)
    if chunk is None:
        return where.holds_last(pp_rank)
    return where.is_last(pp_rank, chunk)


def checked_stage(stage: int, pp_size: int) -> int:
    """`stage`, after checking it is a pipeline stage.

    Raises:
        ValueError: It is not in 0 .. pp_size-1.
    """
    if not is_int(stage) or not 0 <= stage < pp_size:
        raise ValueError(
            f"pipeline rank {stage!r} is outside the pipeline; valid: {list(range(pp_size))}"
        )
    return stage


def before_split(stage: int, pp_size: int, split_rank: int | None) -> bool:
    """Whether `stage` is an encoder stage (every stage is, without a split)."""
    return pp_size == 1 or split_rank is None or stage < split_rank


def after_split(stage: int, pp_size: int, split_rank: int | None) -> bool:
    """Whether `stage` is a decoder stage (every stage is, without a split)."""
    return pp_size == 1 or split_rank is None or stage >= split_rank


def at_split(stage: int, pp_size: int, split_rank: int | None) -> bool:
    """Whether `stage` is the last encoder stage, followed by the decoder's first.

    False without a split (Megatron answers True there, for every stage).
    """
    if split_rank is None or stage + 1 >= pp_size:
        return False
    return before_split(stage, pp_size, split_rank) and after_split(stage + 1, pp_size, split_rank)


def in_embedding_group(
    rank: int,
    embedding_ranks: Sequence[int],
    *,
    pp_rank: int,
    pp_size: int,
    vp_size: int | None,
    ignore_virtual: bool,
    vp_stage: int | None,
) -> bool:
    """Whether global `rank` holds a word-embedding copy in virtual stage `vp_stage`.

    The first member of the group holds it only in the first virtual stage and the last
    member only in the last one, unless `ignore_virtual`.
    """
    resolve_vp_stage(vp_size, ignore_virtual=True, vp_stage=vp_stage)
    if rank not in embedding_ranks:
        return False
    if ignore_virtual:
        return True
    if rank == embedding_ranks[0]:
        return first_stage(pp_rank, vp_size, ignore_virtual=False, vp_stage=vp_stage)
    if rank == embedding_ranks[-1]:
        return last_stage(pp_rank, pp_size, vp_size, ignore_virtual=False, vp_stage=vp_stage)
    return True
