"""Megatron names ported code stops at: the amax group, the module globals, ProcessGroupCollection.

Each test states what Megatron-LM (megatron-core 0.16.1) does, in our words, and checks the
facade does the same.
"""

from __future__ import annotations

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
        assert seen["pgs"]["hcp"] is None
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
    for required in (None, ["tp", "dp"], ["intra_dp_cp"]):
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
    assert repr(pgs) == "ProcessGroupCollection(tp=None, hcp=[])"
    assert [field for field in FIELD_KINDS if hasattr(pgs, field)] == ["tp", "hcp"]
