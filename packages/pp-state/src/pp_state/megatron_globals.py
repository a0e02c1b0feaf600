"""Megatron's ``parallel_state`` module globals, answered from the default `ParallelState`.

Code written for Megatron-LM sometimes reads ``parallel_state._TENSOR_MODEL_PARALLEL_GROUP``
or ``parallel_state._PIPELINE_GLOBAL_RANKS`` directly, or checks that they are None after
``destroy_model_parallel()``. pp-state keeps no such globals: `pp_state.parallel_state` looks
those names up here (a module ``__getattr__``), so each reads this rank's group (or its global
ranks) in the default state while one is set, and None otherwise, or where this rank is in no
group of the kind (a middle stage's embedding group), as in Megatron.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch.distributed as dist

from pp_state.default import get_default_state, has_default_state
from pp_state.layout import AnyGroupKind, GroupKind

__all__ = [
    "GROUP_GLOBALS",
    "RANK_LIST_GLOBALS",
    "amax_reduction_kind",
    "megatron_global",
]

GROUP_GLOBALS: Mapping[str, AnyGroupKind] = MappingProxyType({
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_MODEL_PARALLEL_GROUP": "mp",
    "_EMBEDDING_GROUP": "embedding",
    "_POSITION_EMBEDDING_GROUP": "position_embedding",
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "intra_dp_cp",
    "_CONTEXT_PARALLEL_GROUP": "cp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "expt_tp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "_EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "intra_expt_dp",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "inter_dist_opt",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt",
})  # fmt: skip
"""Each process-group global of Megatron's ``parallel_state`` that pp-state has -> its kind."""

RANK_LIST_GLOBALS: Mapping[str, AnyGroupKind] = MappingProxyType({
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_EMBEDDING_GLOBAL_RANKS": "embedding",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "position_embedding",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp_cp",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
})  # fmt: skip
"""Each global-rank-list global of Megatron's ``parallel_state`` -> the kind it lists."""

_AMAX_REDUCTION_KINDS: Mapping[tuple[bool, bool], GroupKind] = MappingProxyType({
    (False, False): "tp_dp",
    (False, True): "tp",
    (True, False): "tp_dp_cp",
    (True, True): "tp_cp",
})  # fmt: skip


def amax_reduction_kind(*, with_context_parallel: bool, tp_only_amax_red: bool) -> GroupKind:
    """The group FP8 amax values are reduced over, by Megatron's rule.

    Every rank that holds a shard or a replica of the same weights agrees on one scale: tensor
    x data parallel (x context parallel with `with_context_parallel`); with
    `tp_only_amax_red`, the tensor-parallel shards alone (x context parallel).
    """
    return _AMAX_REDUCTION_KINDS[bool(with_context_parallel), bool(tp_only_amax_red)]


def megatron_global(name: str) -> dist.ProcessGroup | list[int] | None:
    """The value Megatron's ``parallel_state.<name>`` would hold on this rank.

    Args:
        name: A key of `GROUP_GLOBALS` or `RANK_LIST_GLOBALS`.

    Returns:
        This rank's group (or its global ranks, a new list) of the name's kind in the default
        state; None without a live default state, or where this rank is in no such group.

    Raises:
        AttributeError: `name` is none of them (what a missing module attribute raises).
    """
    if name in GROUP_GLOBALS:
        if not has_default_state():
            return None
        return get_default_state().group_or_none(GROUP_GLOBALS[name])
    if name in RANK_LIST_GLOBALS:
        state = get_default_state() if has_default_state() else None
        kind = RANK_LIST_GLOBALS[name]
        return state.group_ranks(kind) if state is not None and state.in_group(kind) else None
    raise AttributeError(f"module 'pp_state.parallel_state' has no attribute {name!r}")
