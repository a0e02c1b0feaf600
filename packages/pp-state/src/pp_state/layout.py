"""Which global ranks form each process group: pure arithmetic, no torch.

Ranks are laid out on a grid with one axis per parallel dimension. The order string names the
axes from fastest-varying to slowest (Megatron's convention): with ``"tp-cp-dp-pp"`` ranks
0 and 1 differ in their tensor-parallel coordinate, and the pipeline coordinate has the largest
stride. A group of kind ``"tp_dp"`` holds the ranks that share every coordinate except tp and
dp; inside it, ranks are ordered by those two coordinates, the one earlier in the order string
varying fastest. This is exactly what Megatron's ``initialize_model_parallel`` builds.

Expert parallelism (mixture-of-experts layers) lays the same ranks out a second time, as
Megatron does: tensor parallel becomes the expert tensor-parallel size, ``ep`` the expert
model-parallel size, ``dp`` what remains (world // (expert tp * ep * pp)), the pipeline stays
and context parallel is 1. `expert_rank_layout` returns those groups; `RankGenerator` is
Megatron's class of that name over the same arithmetic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal, get_args

from pp_state.errors import ParallelSizeAssertionError, ParallelSizeError
from pp_state.numbers import check_int, divisors

__all__ = [
    "ALL_KINDS",
    "AXES",
    "DEFAULT_ORDER",
    "EXPERT_KINDS",
    "KINDS",
    "AnyGroupKind",
    "ExpertGroupKind",
    "GroupKind",
    "RankGenerator",
    "check_split_rank",
    "expert_rank_layout",
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

ExpertGroupKind = Literal[
    "intra_dp_cp",
    "ep",
    "expt_tp",
    "tp_ep",
    "tp_ep_pp",
    "expt_dp",
    "intra_expt_dp",
    "inter_dist_opt",
    "intra_dist_opt",
]
EXPERT_KINDS: tuple[ExpertGroupKind, ...] = get_args(ExpertGroupKind)
"""Every group kind `expert_rank_layout` returns, in the order groups are created. The names
are those of Megatron's ``ProcessGroupCollection``."""

AnyGroupKind = GroupKind | ExpertGroupKind
ALL_KINDS: tuple[AnyGroupKind, ...] = (*KINDS, *EXPERT_KINDS)
"""The kinds of `rank_layout` and then those of `expert_rank_layout`."""

AXES: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
"""Tokens an order string may hold. ``ep`` (expert model parallel) lays out only the expert
groups: the dense layout has an ep axis of size 1."""

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
"""Megatron's default order. The dense groups have an ep axis of size 1, so their layout is
that of "tp-cp-dp-pp"; the expert groups put expert model parallel between cp and dp."""

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

# The expert groups: spans over the expert layout's axes (its tp is the expert tp size).
_EXPERT_SPANS: Mapping[ExpertGroupKind, frozenset[str]] = {
    "ep": frozenset({"ep"}),
    "expt_tp": frozenset({"tp"}),
    "tp_ep": frozenset({"tp", "ep"}),
    "tp_ep_pp": frozenset({"tp", "ep", "pp"}),
    "expt_dp": frozenset({"dp"}),
}

_ARGUMENT_OF_AXIS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "dp": "the data-parallel size (world size // (tp * pp * cp))",
}
_EXPERT_ARGUMENT_OF_AXIS = {
    **_ARGUMENT_OF_AXIS,
    "tp": "expert_tensor_parallel_size",
    "dp": "the expert data-parallel size (world size // (expert tp * ep * pp))",
}


def _data_parallel_size(world_size: int, tp: int, pp: int, cp: int) -> int:
    check_int("world_size", world_size, 1)
    check_int("tensor_model_parallel_size", tp, 1)
    check_int("pipeline_model_parallel_size", pp, 1)
    check_int("context_parallel_size", cp, 1)
    model_size = tp * pp * cp
    if world_size % model_size:
        raise ParallelSizeError(
            f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x "
            f"context ({cp}) parallel size = {model_size}; the product of these sizes must "
            f"divide {world_size}: one of {divisors(world_size)}"
        )
    return world_size // model_size


def parse_order(
    order: str, sizes: Mapping[str, int], *, names: Mapping[str, str] | None = None
) -> list[str]:
    """Split an order string into axis tokens, fastest-varying first.

    Axes the string leaves out are appended (slowest) when their size is 1.

    Args:
        order: Tokens joined by "-", such as "tp-cp-dp-pp" or Megatron's "tp-cp-ep-dp-pp".
        sizes: Size of each axis in `AXES` that is above 1 (missing means 1).
        names: What to call each axis's size in an error (the argument that sets it).

    Returns:
        All of `AXES`, in layout order.

    Raises:
        TypeError: `order` is not a string.
        ValueError: A token is unknown or repeated.
        ParallelSizeError: An axis of size above 1 is left out (a ValueError, and the
            RuntimeError Megatron raises).
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
                name = (names or _ARGUMENT_OF_AXIS)[axis]
                raise ParallelSizeError(
                    f"order {order!r} leaves out {axis!r}, but {name} is {size}; add "
                    f"{axis!r} to the order (for instance {DEFAULT_ORDER!r})"
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
    offsets = [
        sum(c * strides[axis] for c, axis in zip(coords, inner, strict=True))
        for coords in _mixed_radix([sizes[axis] for axis in inner])
    ]
    return [
        [base + offset for offset in offsets]
        for base in (
            sum(c * strides[axis] for c, axis in zip(coords, outer, strict=True))
            for coords in _mixed_radix([sizes[axis] for axis in outer])
        )
    ]


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


def _expert_data_parallel_size(world_size: int, etp: int, ep: int, pp: int) -> int:
    product = etp * ep * pp
    if world_size % product:
        if world_size % (etp * pp) == 0:
            choices = (
                f"with expert tensor {etp} and pipeline {pp}, expert_model_parallel_size must "
                f"divide {world_size // (etp * pp)}: one of {divisors(world_size // (etp * pp))}"
            )
        else:
            choices = f"the product of these sizes must divide {world_size}: one of "
            choices += str(divisors(world_size))
        raise ParallelSizeError(
            f"world size {world_size} is not divisible by expert tensor ({etp}) x expert model "
            f"({ep}) x pipeline ({pp}) parallel size = {product}; {choices}"
        )
    return world_size // product


def _check_instances(instances: int, dp_cp: int, expert_dp: int) -> None:
    if dp_cp % instances or expert_dp % instances:
        raise ParallelSizeAssertionError(
            f"num_distributed_optimizer_instances {instances} must divide both the data x "
            f"context parallel size ({dp_cp}) and the expert data-parallel size ({expert_dp}); "
            f"use one of {divisors(math.gcd(dp_cp, expert_dp))}"
        )


def _check_same_pipelines(
    order: str,
    dense: tuple[list[str], Mapping[str, int]],
    expert: tuple[list[str], Mapping[str, int]],
) -> None:
    """Megatron's two conditions for the dense and expert layouts to share pipelines."""
    (dense_axes, dense_sizes), (expert_axes, expert_sizes) = dense, expert
    given = [token.strip().lower() for token in order.split("-")]
    dp, expert_dp = dense_sizes["dp"], expert_sizes["dp"]
    if dense_sizes["pp"] > 1 and given[-1] != "pp" and dp != expert_dp:
        raise ParallelSizeAssertionError(
            f"order {order!r} does not end with 'pp', so the expert data-parallel size "
            f"({expert_dp}) must equal the data-parallel size ({dp}): expert tensor x expert "
            f"model parallel must be tensor x context parallel = "
            f"{dense_sizes['tp'] * dense_sizes['cp']}, or put 'pp' last in the order"
        )
    pipelines = _orthogonal_groups(dense_axes, dense_sizes, frozenset({"pp"}))
    expert_pipelines = _orthogonal_groups(expert_axes, expert_sizes, frozenset({"pp"}))
    if pipelines != expert_pipelines:
        raise ParallelSizeAssertionError(
            f"with order {order!r} the expert layout's pipelines {expert_pipelines[:2]}... "
            f"differ from the dense layout's {pipelines[:2]}...; the axes before 'pp' must "
            "hold as many ranks in both, or put 'pp' last in the order"
        )


def _split(groups: Sequence[Sequence[int]], parts: int, *, strided: bool) -> list[list[int]]:
    """Each group cut into `parts` runs of consecutive members.

    Strided: the transpose instead, member j of every run together.
    """
    result: list[list[int]] = []
    for group in groups:
        size = len(group) // parts
        if strided:
            result.extend(list(group[j::size]) for j in range(size))
        else:
            result.extend(list(group[i * size : (i + 1) * size]) for i in range(parts))
    return result


def _optimizer_instances(tp_ep_pp: Sequence[Sequence[int]], instances: int) -> list[list[int]]:
    """Consecutive expert model-parallel groups joined into one group per optimizer instance.

    Sorted, as torch.distributed orders a group's members (Megatron lists them unsorted).
    """
    per = len(tp_ep_pp) // instances
    return [
        sorted(rank for group in tp_ep_pp[i * per : (i + 1) * per] for rank in group)
        for i in range(instances)
    ]


def _instance_groups(
    dp_cp: list[list[int]], expert_dp: list[list[int]], tp_ep_pp: list[list[int]], instances: int
) -> dict[ExpertGroupKind, list[list[int]]]:
    """The groups of the distributed optimizer's instances.

    Megatron builds no inter-instance group for one instance: that kind is empty then.
    """
    return {
        "intra_dp_cp": _split(dp_cp, instances, strided=False),
        "intra_expt_dp": _split(expert_dp, instances, strided=False),
        "inter_dist_opt": _split(expert_dp, instances, strided=True) if instances > 1 else [],
        "intra_dist_opt": _optimizer_instances(tp_ep_pp, instances),
    }


def _positive_expert_sizes(ep: int, etp: int | None, instances: int, tp: int) -> int:
    check_int("expert_model_parallel_size", ep, 1)
    check_int("num_distributed_optimizer_instances", instances, 1)
    if etp is None:
        return tp
    check_int("expert_tensor_parallel_size", etp, 1)
    return etp


def expert_rank_layout(
    world_size: int,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    num_distributed_optimizer_instances: int = 1,
    order: str = DEFAULT_ORDER,
) -> dict[ExpertGroupKind, list[list[int]]]:
    """The global ranks of the expert and distributed-optimizer groups Megatron builds.

    The expert layout is a second grid over the same ranks and `order`: tp = expert tensor
    parallel, ep, dp = world // (expert tp * ep * pp), the same pp, and cp = 1.

    Args:
        world_size: Number of ranks in the job.
        tensor_model_parallel_size: tp of the dense layers.
        pipeline_model_parallel_size: Pipeline stages, shared by dense and expert layers.
        context_parallel_size: cp of the dense layers.
        expert_model_parallel_size: Ranks the experts are spread over (ep).
        expert_tensor_parallel_size: Ranks each expert's tensors are split over; None means tp.
        num_distributed_optimizer_instances: Replicas of the distributed optimizer across the
            data-parallel ranks; each instance shards over a part of them.
        order: Axis tokens from fastest- to slowest-varying; "ep" is needed when ep > 1.

    Returns:
        For each kind in `EXPERT_KINDS` (Megatron's ``ProcessGroupCollection`` names), its
        groups as lists of global ranks in Megatron's creation order: ``ep``, ``expt_tp``,
        ``tp_ep``, ``tp_ep_pp``, ``expt_dp`` from the expert grid; ``intra_dp_cp`` and
        ``intra_expt_dp`` the runs of consecutive dp-cp / expert-dp ranks one optimizer
        instance shards over; ``inter_dist_opt`` the same position in every instance (empty
        with one instance: Megatron builds none); ``intra_dist_opt`` the ranks of one instance.

    Raises:
        TypeError: A size is not an int, or `order` is not a string.
        ValueError: A size is below 1, or the order is invalid.
        ParallelSizeError: The sizes do not fit the world or each other; the message names
            the numbers and the choices (Megatron's RuntimeError, or its AssertionError too).
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    dp = _data_parallel_size(world_size, tp, pp, cp)
    ep, instances = expert_model_parallel_size, num_distributed_optimizer_instances
    etp = _positive_expert_sizes(ep, expert_tensor_parallel_size, instances, tp)
    dense_sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    dense_axes = parse_order(order, {**dense_sizes, "ep": ep})
    expert_dp = _expert_data_parallel_size(world_size, etp, ep, pp)
    sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": expert_dp, "pp": pp}
    axes = parse_order(order, sizes, names=_EXPERT_ARGUMENT_OF_AXIS)
    _check_same_pipelines(order, (dense_axes, dense_sizes), (axes, sizes))
    _check_instances(instances, dp * cp, expert_dp)
    layout = {kind: _orthogonal_groups(axes, sizes, span) for kind, span in _EXPERT_SPANS.items()}
    dp_cp = _orthogonal_groups(dense_axes, dense_sizes, _SPANS["dp_cp"])
    layout.update(_instance_groups(dp_cp, layout["expt_dp"], layout["tp_ep_pp"], instances))
    return {kind: layout[kind] for kind in EXPERT_KINDS}


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


class RankGenerator:
    """Megatron's ``RankGenerator``: the rank groups of one grid of parallel sizes. Pure.

    ``RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp").get_ranks("tp-pp")``
    lists the model-parallel groups of 8 ranks. Megatron builds one for the dense layers and
    one for the expert layers (tp = expert tp, ep, dp = the expert data-parallel size, cp = 1).

    Attributes:
        tp, ep, dp, pp, cp: The sizes.
        rank_offset: Added to every rank `get_ranks` returns.
        world_size: The product of the sizes.
        name_to_size: Each token's size.
        order: The order string, lower-case, with the tokens it left out appended (in
            Megatron's sequence tp, pp, dp, ep, cp; each of size 1).
        ordered_size: The sizes in `order`.
    """

    def __init__(  # noqa: PLR0917 - Megatron's positional signature
        self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0
    ) -> None:
        """Check the sizes and the order.

        Raises:
            TypeError: A size is not an int, or `order` is not a string.
            ValueError: A size is below 1 (an offset below 0), or a token is unknown or repeated.
            ParallelSizeError: A token of size above 1 is left out of `order` (Megatron's
                RuntimeError); with ep and cp both above 1 also an AssertionError, as in
                Megatron (only the expert generator has ep, only the dense one cp).
        """
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        for name, size in self.name_to_size.items():
            check_int(name, size, 1)
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
            raise ValueError(f"rank_offset must be an int of 0 or more, got {rank_offset!r}")
        if ep > 1 and cp > 1:
            raise ParallelSizeAssertionError(
                f"ep {ep} and cp {cp} are both above 1: a RankGenerator lays out either the "
                "dense layers (cp, ep = 1) or the expert layers (ep, cp = 1); use two"
            )
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp
        names = {axis: f"the {axis} size" for axis in AXES}
        parse_order(order, self.name_to_size, names=names)
        given = [token.strip().lower() for token in order.split("-")]
        self.order = "-".join(given + [name for name in self.name_to_size if name not in given])
        self.ordered_size = [self.name_to_size[token] for token in self.order.split("-")]

    def get_mask(self, order: str, token: str) -> list[bool]:
        """Which tokens of `order` the hyphen-joined `token` names, as booleans.

        Raises:
            ValueError: `token` names a token `order` does not hold.
        """
        ordered = order.split("-")
        mask = [False] * len(ordered)
        for name in token.split("-"):
            if name not in ordered:
                raise ValueError(
                    f"token {name!r} (of {token!r}) is not in the order {order!r}; "
                    f"valid tokens: {', '.join(ordered)}"
                )
            mask[ordered.index(name)] = True
        return mask

    def get_ranks(self, token: str) -> list[list[int]]:
        """The groups spanning the axes `token` names ("tp", "dp-cp", "tp-ep-pp", ...).

        Returns:
            Every group, as global ranks plus `rank_offset`, in Megatron's order: a rank's
            position in its list is its rank in the group.

        Raises:
            ValueError: `token` names a token the order does not hold.
        """
        axes = self.order.split("-")
        mask = self.get_mask(self.order, token)
        span = frozenset(axis for axis, masked in zip(axes, mask, strict=True) if masked)
        groups = _orthogonal_groups(axes, self.name_to_size, span)
        return [[rank + self.rank_offset for rank in group] for group in groups]
