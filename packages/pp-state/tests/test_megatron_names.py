"""Megatron names ported code stops at: the amax group, the module globals, ProcessGroupCollection.

Each test states what Megatron-LM (megatron-core 0.16.1; 0.20 for ProcessGroupCollection's
fields) does, in our words, and checks the facade does the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from pp_state import (
    NotInitializedError,
    ProcessGroupCollection,
    rank_layout,
    reset_default_state,
)
from pp_state import parallel_state as mpu
from pp_state.megatron_globals import GROUP_GLOBALS, RANK_LIST_GLOBALS
from pp_state.process_groups_config import FIELD_KINDS
from pp_testing import run_distributed

AMAX_FLAGS = [(False, False), (False, True), (True, False), (True, True)]

# megatron-core 0.20's ProcessGroupCollection fields, in its order.
MEGATRON_0_20_FIELDS = [
    "tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "hcp", "ep", "expt_tp", "tp_ep",
    "tp_ep_pp", "tp_ep_pp_with_egtp_remat", "tp_dp_cp", "dp", "dp_cp", "dp_cp_gtp_remat",
    "dp_cp_ag", "gtp_remat", "expt_gtp_remat", "expt_dp", "expt_dp_gtp_remat", "expt_dp_ag",
    "intra_dp_cp", "intra_expt_dp", "inter_dist_opt", "intra_dist_opt",
]  # fmt: skip
# At remat size 1 (always, in pp) each of these holds the very group of the field it extends.
SAME_GROUP = {
    "tp_ep_pp_with_egtp_remat": "tp_ep_pp",
    "dp_cp_gtp_remat": "dp_cp",
    "expt_dp_gtp_remat": "expt_dp",
}
# Groups pp builds none of: always None.
NEVER_BUILT = ["hcp", "dp_cp_ag", "gtp_remat", "expt_gtp_remat", "expt_dp_ag"]


@pytest.fixture(autouse=True)
def _fresh_default_state() -> Iterator[None]:
    reset_default_state()
    yield
    reset_default_state()


def _ranks(group: Any) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _globals() -> dict[str, Any]:
    """Every Megatron global the facade answers, as global ranks (picklable)."""
    seen = {name: _ranks(getattr(mpu, name)) for name in GROUP_GLOBALS}
    seen.update({name: getattr(mpu, name) for name in RANK_LIST_GLOBALS})
    return seen


def _collection(pgs: ProcessGroupCollection) -> dict[str, Any]:
    """The fields set on `pgs`, as global ranks."""
    return {name: _ranks(getattr(pgs, name)) for name in FIELD_KINDS if hasattr(pgs, name)}


def _same_groups(pgs: ProcessGroupCollection) -> dict[str, bool]:
    """Whether each remat field holds the very group object of the field it extends."""
    return {name: getattr(pgs, name) is getattr(pgs, other) for name, other in SAME_GROUP.items()}


def _amax_and_collection() -> dict[str, Any]:
    """tp 2 x cp 2 x dp 2 on 8 ranks: the amax groups, globals and collections."""
    seen: dict[str, Any] = {"before": _globals()}
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=2, context_parallel_size=2, distributed_timeout_minutes=0.5
    )
    state = mpu.get_parallel_state()
    seen["amax"] = [
        _ranks(mpu.get_amax_reduction_group(with_context_parallel=cp, tp_only_amax_red=tp_only))
        for cp, tp_only in AMAX_FLAGS
    ]
    seen["amax_is_tp_dp"] = (
        mpu.get_amax_reduction_group() is mpu.get_tensor_and_data_parallel_group()
    )
    seen["globals"] = _globals()
    seen["globals_are_the_states"] = (
        all(getattr(mpu, name) is state.group_or_none(kind) for name, kind in GROUP_GLOBALS.items())
        and mpu._DATA_PARALLEL_GROUP is mpu.get_data_parallel_group()
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    seen["pgs"] = _collection(pgs)
    seen["pgs_is_mpu"] = (
        pgs.tp is mpu.get_tensor_model_parallel_group()
        and pgs.dp_cp is mpu.get_data_parallel_group(with_context_parallel=True)
        and pgs.embd is mpu.get_embedding_group()
    )
    seen["same"] = _same_groups(pgs)
    seen["explicit"] = _collection(ProcessGroupCollection.from_parallel_state(state))
    seen["partial"] = sorted(
        _collection(ProcessGroupCollection.use_mpu_process_groups(["tp", "pp"]))
    )
    mpu.destroy_model_parallel()
    seen["after"] = _globals()
    seen["unchecked_after"] = _collection(
        ProcessGroupCollection.use_mpu_process_groups(["tp", "ep"])
    )
    return seen


def test_amax_group_globals_and_collection_follow_megatron() -> None:
    layout = rank_layout(8, tensor_model_parallel_size=2, context_parallel_size=2)
    for rank, seen in enumerate(run_distributed(_amax_and_collection, 8, timeout=120)):
        # Before initialisation and after destroy_model_parallel every global reads None.
        assert set(seen["before"].values()) == {None}
        assert set(seen["after"].values()) == {None}
        mine = {kind: next(g for g in groups if rank in g) for kind, groups in layout.items()}
        # Megatron's amax group: tensor x data parallel; with cp, x context parallel; with
        # tp_only_amax_red, tensor parallel alone (x context parallel with cp).
        assert seen["amax"] == [mine["tp_dp"], mine["tp"], mine["tp_dp_cp"], mine["tp_cp"]]
        assert seen["amax_is_tp_dp"] is True
        if rank == 0:  # order tp-cp-ep-dp-pp: rank = tp + 2 cp + 4 dp
            assert seen["amax"] == [[0, 1, 4, 5], [0, 1], list(range(8)), [0, 1, 2, 3]]
        assert seen["globals_are_the_states"] is True
        assert seen["globals"]["_TENSOR_MODEL_PARALLEL_GROUP"] == mine["tp"]
        assert seen["globals"]["_DATA_PARALLEL_GROUP_WITH_CP"] == mine["dp_cp"]
        assert seen["globals"]["_CONTEXT_PARALLEL_GLOBAL_RANKS"] == mine["cp"]
        # One optimizer instance: no inter-instance group, as Megatron leaves it None.
        assert seen["globals"]["_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP"] is None
        # use_mpu_process_groups() fills every field; hcp and inter_dist_opt are None here.
        assert set(seen["pgs"]) == set(FIELD_KINDS)
        assert all(seen["pgs"][name] is None for name in NEVER_BUILT)
        assert seen["same"] == dict.fromkeys(SAME_GROUP, True)
        assert seen["pgs"]["inter_dist_opt"] is None
        assert seen["pgs"]["tp_dp_cp"] == mine["tp_dp_cp"]
        assert seen["pgs"]["mp"] == mine["mp"]
        assert seen["pgs_is_mpu"] is True
        assert seen["explicit"] == seen["pgs"]
        assert seen["partial"] == ["pp", "tp"]  # the others are not set: hasattr is False
        # Unchecked groups after destroy_model_parallel are None, as Megatron's getters answer.
        assert seen["unchecked_after"] == {"tp": None, "ep": None}


def _embedding_globals() -> dict[str, Any]:
    """pp 4 x tp 2 on 8 ranks: the embedding globals of first, middle and last stages."""
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=4,
        distributed_timeout_minutes=0.5,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups(["embd", "pos_embd", "pp"])
    seen = {**_globals(), "pgs": _collection(pgs)}
    mpu.destroy_model_parallel()
    return seen


def test_embedding_globals_are_none_where_megatron_leaves_them_none() -> None:
    for rank, seen in enumerate(run_distributed(_embedding_globals, 8, timeout=120)):
        stage, pipeline = rank // 2, [rank % 2 + 2 * s for s in range(4)]
        assert seen["_PIPELINE_GLOBAL_RANKS"] == pipeline
        assert seen["_PIPELINE_MODEL_PARALLEL_GROUP"] == pipeline
        ends = [pipeline[0], pipeline[-1]]
        # Megatron sets the embedding globals only on the stages in the group.
        assert seen["_EMBEDDING_GLOBAL_RANKS"] == (ends if stage in (0, 3) else None)
        assert seen["_EMBEDDING_GROUP"] == (ends if stage in (0, 3) else None)
        assert seen["_POSITION_EMBEDDING_GLOBAL_RANKS"] == ([pipeline[0]] if stage == 0 else None)
        assert seen["pgs"]["embd"] == seen["_EMBEDDING_GROUP"]
        assert seen["pgs"]["pos_embd"] == seen["_POSITION_EMBEDDING_GROUP"]


@pytest.mark.reliability
def test_amax_group_before_initialisation_is_megatrons_assertion() -> None:
    for cp, tp_only in AMAX_FLAGS:
        with pytest.raises(AssertionError, match="not initialized"):
            mpu.get_amax_reduction_group(with_context_parallel=cp, tp_only_amax_red=tp_only)


def test_globals_read_none_before_initialisation_and_unknown_names_are_missing() -> None:
    assert mpu._TENSOR_MODEL_PARALLEL_GROUP is None
    assert mpu._PIPELINE_GLOBAL_RANKS is None
    assert getattr(mpu, "_NOT_A_MEGATRON_GLOBAL", "absent") == "absent"
    with pytest.raises(AttributeError, match="_GLOBAL_MEMORY_BUFFER"):
        _ = mpu._GLOBAL_MEMORY_BUFFER


@pytest.mark.reliability
def test_use_mpu_process_groups_before_initialisation() -> None:
    # Megatron's data-parallel getters assert; the others answer None unchecked.
    assert _collection(ProcessGroupCollection.use_mpu_process_groups(["tp", "embd"])) == {
        "tp": None,
        "embd": None,
    }
    unchecked = [name for name in FIELD_KINDS if name.endswith(("_remat", "_ag"))]
    unchecked.remove("dp_cp_gtp_remat")
    assert _collection(ProcessGroupCollection.use_mpu_process_groups(unchecked)) == dict.fromkeys(
        unchecked
    )
    for required in (None, ["tp", "dp"], ["intra_dp_cp"], ["gtp_remat", "dp_cp_gtp_remat"]):
        with pytest.raises(NotInitializedError) as refused:
            ProcessGroupCollection.use_mpu_process_groups(required)
        assert isinstance(refused.value, AssertionError)


@pytest.mark.reliability
def test_process_group_collection_refuses_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"Invalid process groups requested: \['gtp'\]"):
        ProcessGroupCollection.use_mpu_process_groups(["tp", "gtp"])
    with pytest.raises(ValueError, match="not the string 'tp'"):
        ProcessGroupCollection.use_mpu_process_groups("tp")
    with pytest.raises(ValueError, match="has no field 'tensor'"):
        ProcessGroupCollection(tensor=None)


def test_process_group_collection_fields_are_set_by_keyword_or_later() -> None:
    pgs = ProcessGroupCollection(tp=None)
    assert pgs.tp is None
    assert not hasattr(pgs, "pp")  # Megatron's schedules test presence with hasattr
    pgs.hcp = []
    pgs.expt_dp_ag = None
    assert repr(pgs) == "ProcessGroupCollection(tp=None, hcp=[], expt_dp_ag=None)"
    assert [field for field in FIELD_KINDS if hasattr(pgs, field)] == ["tp", "hcp", "expt_dp_ag"]
    assert ProcessGroupCollection(gtp_remat=None, dp_cp_ag=None).dp_cp_ag is None


def test_fields_are_megatron_0_20s_in_its_order() -> None:
    assert list(FIELD_KINDS) == MEGATRON_0_20_FIELDS
    assert [name for name, kind in FIELD_KINDS.items() if kind is None] == NEVER_BUILT
    assert all(FIELD_KINDS[name] == FIELD_KINDS[other] for name, other in SAME_GROUP.items())
    annotated = [field.name for field in dataclasses.fields(ProcessGroupCollection)]
    assert annotated == MEGATRON_0_20_FIELDS


def _remat_fields() -> dict[str, Any]:
    """tp 2 x ep 2 on 4 ranks (dp 2, expert tp 2, expert dp 1): both constructors' fields."""
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, distributed_timeout_minutes=0.5
    )
    seen: dict[str, Any] = {}
    for how, pgs in (
        ("mpu", ProcessGroupCollection.use_mpu_process_groups()),
        ("explicit", ProcessGroupCollection.from_parallel_state(mpu.get_parallel_state())),
    ):
        seen[how] = {"same": _same_groups(pgs), "groups": _collection(pgs), "repr": repr(pgs)}
    mpu.destroy_model_parallel()
    return seen


def test_remat_fields_hold_the_groups_they_extend_and_all_gather_fields_are_none() -> None:
    for rank, seen in enumerate(run_distributed(_remat_fields, 4, timeout=60)):
        assert seen["explicit"] == seen["mpu"]
        assert seen["mpu"]["same"] == dict.fromkeys(SAME_GROUP, True)
        groups = seen["mpu"]["groups"]
        assert list(groups) == MEGATRON_0_20_FIELDS
        assert [name for name in NEVER_BUILT if groups[name] is not None] == []
        # order tp-cp-ep-dp-pp: rank = tp + 2 dp; experts: rank = expert tp + 2 ep
        assert groups["tp_ep_pp_with_egtp_remat"] == groups["tp_ep_pp"] == [0, 1, 2, 3]
        assert groups["dp_cp_gtp_remat"] == groups["dp_cp"] == [rank % 2, rank % 2 + 2]
        assert groups["expt_dp_gtp_remat"] == groups["expt_dp"] == [rank]
        shown = seen["mpu"]["repr"]
        for part in ("tp_ep_pp_with_egtp_remat=4", "dp_cp_gtp_remat=2", "gtp_remat=None"):
            assert part in shown
