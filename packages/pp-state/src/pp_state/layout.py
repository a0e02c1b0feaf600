"""Which global ranks form each process group: pure arithmetic, no torch.

Ranks are laid out on a grid with one axis per parallel dimension. The order string names the
axes from fastest-varying to slowest (Megatron's convention): with ``"tp-cp-dp-pp"`` ranks
0 and 1 differ in their tensor-parallel coordinate, and the pipeline coordinate has the largest
stride. A group of kind ``"tp_dp"`` holds the ranks that share every coordinate except tp and
dp; inside it, ranks are ordered by those two coordinates, the one earlier in the order string
varying fastest. This is exactly what Megatron's ``initialize_model_parallel`` builds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal, get_args

from pp_state.errors import ParallelSizeError

__all__ = [
    "AXES",
    "DEFAULT_ORDER",
    "KINDS",
    "GroupKind",
    "check_split_rank",
    "find_group",
    "group_containing",
    "parse_order",
    "rank_layout",
]

GroupKind = Literal[
    "tp",
    "pp",
    "dp",
    "dp_cp",
    "cp",
    "mp",
    "tp_dp",
    "tp_dp_cp",
    "tp_cp",
    "embedding",
    "position_embedding",
]
KINDS: tuple[GroupKind, ...] = get_args(GroupKind)
"""Every group kind `rank_layout` returns, in the order groups are created."""

AXES: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
"""Tokens an order string may hold. ``ep`` (expert parallel) is accepted for Megatron's default
order string and always has size 1 here."""

DEFAULT_ORDER = "tp-cp-dp-pp"

# The grid axes each orthogonal group kind spans.
_SPANS: Mapping[str, frozenset[str]] = {
    "tp": frozenset({"tp"}),
    "pp": frozenset({"pp"}),
    "dp": frozenset({"dp"}),
    "dp_cp": frozenset({"dp", "cp"}),
    "cp": frozenset({"cp"}),
    "mp": frozenset({"tp", "pp"}),
    "tp_dp": frozenset({"tp", "dp"}),
    "tp_dp_cp": frozenset({"tp", "dp", "cp"}),
    "tp_cp": frozenset({"tp", "cp"}),
}

_ARGUMENT_OF_AXIS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "dp": "the data-parallel size (world size // (tp * pp * cp))",
}


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be 1 or more, got {value}")


def _data_parallel_size(world_size: int, tp: int, pp: int, cp: int) -> int:
    _check_positive("world_size", world_size)
    _check_positive("tensor_model_parallel_size", tp)
    _check_positive("pipeline_model_parallel_size", pp)
    _check_positive("context_parallel_size", cp)
    model_size = tp * pp * cp
    if world_size % model_size:
        raise ParallelSizeError(
            f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x "
            f"context ({cp}) parallel size = {model_size}; the product of these sizes must "
            f"divide {world_size}: one of {_divisors(world_size)}"
        )
    return world_size // model_size


def parse_order(order: str, sizes: Mapping[str, int]) -> list[str]:
    """Split an order string into axis tokens, fastest-varying first.

    Axes the string leaves out are appended (slowest) when their size is 1.

    Args:
        order: Tokens joined by "-", such as "tp-cp-dp-pp" or Megatron's "tp-cp-ep-dp-pp".
        sizes: Size of each axis in `AXES` that is above 1 (missing means 1).

    Returns:
        All of `AXES`, in layout order.

    Raises:
        TypeError: `order` is not a string.
        ValueError: A token is unknown or repeated, or an axis of size above 1 is left out.
    """
    if not isinstance(order, str):
        raise TypeError(f"order must be a string such as {DEFAULT_ORDER!r}, got {order!r}")
    tokens = [token.strip().lower() for token in order.split("-")]
    valid = ", ".join(AXES)
    for token in tokens:
        if token not in AXES:
            raise ValueError(f"order {order!r} has unknown token {token!r}; valid tokens: {valid}")
        if tokens.count(token) > 1:
            raise ValueError(
                f"order {order!r} repeats {token!r}; name each of {valid} at most once"
            )
    for axis in AXES:
        if axis not in tokens:
            size = sizes.get(axis, 1)
            if size > 1:
                raise ValueError(
                    f"order {order!r} leaves out {axis!r}, but {_ARGUMENT_OF_AXIS[axis]} is "
                    f"{size}; add {axis!r} to the order (for instance {DEFAULT_ORDER!r})"
                )
            tokens.append(axis)
    return tokens


def _mixed_radix(sizes: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every coordinate tuple over `sizes`, the first coordinate varying fastest."""
    for reversed_coords in itertools.product(*(range(size) for size in reversed(sizes))):
        yield tuple(reversed(reversed_coords))


def _orthogonal_groups(
    axes: Sequence[str], sizes: Mapping[str, int], span: frozenset[str]
) -> list[list[int]]:
    strides = {}
    stride = 1
    for axis in axes:
        strides[axis] = stride
        stride *= sizes[axis]
    inner = [axis for axis in axes if axis in span]
    outer = [axis for axis in axes if axis not in span]
    groups = []
    for outer_coords in _mixed_radix([sizes[axis] for axis in outer]):
        base = sum(c * strides[axis] for c, axis in zip(outer_coords, outer, strict=True))
        groups.append(
            [
                base + sum(c * strides[axis] for c, axis in zip(coords, inner, strict=True))
                for coords in _mixed_radix([sizes[axis] for axis in inner])
            ]
        )
    return groups


def _embedding_ranks(pipeline: Sequence[int], split_rank: int | None) -> list[int]:
    stages = [0, len(pipeline) - 1] if split_rank is None else [0, split_rank, len(pipeline) - 1]
    return [pipeline[stage] for stage in sorted(set(stages))]


def _position_embedding_ranks(pipeline: Sequence[int], split_rank: int | None) -> list[int]:
    stages = [0] if split_rank is None else [0, split_rank]
    return [pipeline[stage] for stage in stages]


def check_split_rank(split_rank: int | None, pp: int) -> None:
    """Check an encoder-decoder split rank against a pipeline of `pp` stages.

    Raises:
        TypeError: It is neither an int nor None.
        ValueError: It is outside 1 .. pp-1 (so a pipeline of 1 stage has no valid split).
    """
    if split_rank is None:
        return
    if isinstance(split_rank, bool) or not isinstance(split_rank, int):
        raise TypeError(
            f"pipeline_model_parallel_split_rank must be an int or None, got {split_rank!r}"
        )
    if pp < 2:
        raise ValueError(
            f"pipeline_model_parallel_split_rank {split_rank} needs a pipeline to split, but "
            f"pipeline_model_parallel_size is {pp}; use a pipeline size of 2 or more, "
            "or no split rank"
        )
    if not 1 <= split_rank < pp:
        raise ValueError(
            f"pipeline_model_parallel_split_rank {split_rank} is outside the pipeline of {pp} "
            f"stages: the decoder's first stage must be one of {list(range(1, pp))}"
        )


def rank_layout(
    world_size: int,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    order: str = DEFAULT_ORDER,
    pipeline_model_parallel_split_rank: int | None = None,
) -> dict[GroupKind, list[list[int]]]:
    """The global ranks of every process group Megatron's ``initialize_model_parallel`` builds.

    Args:
        world_size: Number of ranks in the job.
        tensor_model_parallel_size: Ranks a layer's tensors are split over (tp).
        pipeline_model_parallel_size: Pipeline stages (pp).
        context_parallel_size: Ranks a sequence is split over (cp).
        order: Axis tokens from fastest- to slowest-varying; see `parse_order`.
        pipeline_model_parallel_split_rank: For encoder-decoder models, the pipeline stage where
            the decoder starts (1 .. pp-1); it joins the embedding and position-embedding groups.

    Returns:
        For each kind in `KINDS`, its groups as lists of global ranks, in Megatron's creation
        order; a rank's position in a list is its rank in that group. Every rank is in exactly
        one group of each kind, except the embedding kinds, one group per pipeline:
        ``embedding`` holds the first and last stage (and the split stage),
        ``position_embedding`` the first (and the split stage).

    Raises:
        TypeError: A size is not an int, or `order` is not a string.
        ValueError: A size is below 1, tp*pp*cp does not divide `world_size`, the order string
            is invalid, or the split rank is outside the pipeline.
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    dp = _data_parallel_size(world_size, tp, pp, cp)
    sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    axes = parse_order(order, sizes)
    check_split_rank(pipeline_model_parallel_split_rank, pp)
    layout: dict[GroupKind, list[list[int]]] = {}
    for kind in KINDS:
        if kind in _SPANS:
            layout[kind] = _orthogonal_groups(axes, sizes, _SPANS[kind])
    split = pipeline_model_parallel_split_rank
    layout["embedding"] = [_embedding_ranks(ranks, split) for ranks in layout["pp"]]
    layout["position_embedding"] = [
        _position_embedding_ranks(ranks, split) for ranks in layout["pp"]
    ]
    assert math.prod(sizes.values()) == world_size
    return {kind: layout[kind] for kind in KINDS}


def find_group(groups: Sequence[Sequence[int]], rank: int) -> list[int] | None:
    """The group of `groups` that holds `rank` (a copy), or None if none does."""
    for group in groups:
        if rank in group:
            return list(group)
    return None


def group_containing(groups: Sequence[Sequence[int]], rank: int) -> list[int]:
    """The one group of `groups` that holds `rank`.

    Args:
        groups: One kind's groups, as `rank_layout` returns them.
        rank: A global rank.

    Returns:
        A copy of that group's global ranks.

    Raises:
        ValueError: No group holds `rank`.
    """
    found = find_group(groups, rank)
    if found is None:
        raise ValueError(f"rank {rank} is in none of the groups {list(map(list, groups))}")
    return found
