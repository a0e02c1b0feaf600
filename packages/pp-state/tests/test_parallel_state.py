"""The Megatron-compatible facade over the set-once default state."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_state import (
    GroupKind,
    NotInitializedError,
    ParallelConfig,
    ParallelSizeError,
    ParallelState,
    expert_rank_layout,
    rank_layout,
    reset_default_state,
    set_default_state,
)
from pp_state import parallel_state as mpu
from pp_testing import run_distributed


@pytest.fixture(autouse=True)
def _fresh_default_state() -> Iterator[None]:
    reset_default_state()
    yield
    reset_default_state()


def _group_getters(state: ParallelState) -> list[tuple[Callable[[], object], GroupKind]]:
    getters: list[tuple[Callable[[], object], GroupKind]] = [
        (mpu.get_tensor_model_parallel_group, "tp"),
        (mpu.get_pipeline_model_parallel_group, "pp"),
        (mpu.get_data_parallel_group, "dp"),
        (lambda: mpu.get_data_parallel_group(with_context_parallel=True), "dp_cp"),
        (mpu.get_context_parallel_group, "cp"),
        (mpu.get_model_parallel_group, "mp"),
        (mpu.get_embedding_group, "embedding"),
        (mpu.get_tensor_and_data_parallel_group, "tp_dp"),
        (lambda: mpu.get_tensor_and_data_parallel_group(with_context_parallel=True), "tp_dp_cp"),
        (mpu.get_tensor_and_context_parallel_group, "tp_cp"),
    ]
    if state.in_group("position_embedding"):
        getters.append((mpu.get_position_embedding_group, "position_embedding"))
    return getters


def _ported_megatron_code() -> dict[str, object]:
    """What code written against megatron.core.parallel_state would do."""
    returned = mpu.initialize_model_parallel(  # type: ignore[func-returns-value]
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        distributed_timeout_minutes=0.5,
    )
    state = mpu.get_parallel_state()
    seen: dict[str, object] = {
        "initialized": (mpu.model_parallel_is_initialized(), mpu.is_initialized()),
        "returns_none": returned is None,
        "sizes": (
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_pipeline_model_parallel_world_size(),
            mpu.get_data_parallel_world_size(),
            mpu.get_data_parallel_world_size(with_context_parallel=True),
            mpu.get_context_parallel_world_size(),
            mpu.get_virtual_pipeline_model_parallel_world_size(),
        ),
        "ranks": (
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_data_parallel_rank(),
            mpu.get_context_parallel_rank(),
            mpu.get_virtual_pipeline_model_parallel_rank(),
        ),
        "pipeline": (
            mpu.get_pipeline_model_parallel_first_rank(),
            mpu.get_pipeline_model_parallel_last_rank(),
            mpu.get_pipeline_model_parallel_prev_rank(),
            mpu.get_pipeline_model_parallel_next_rank(),
        ),
        "src": (mpu.get_tensor_model_parallel_src_rank(), mpu.get_data_parallel_src_rank()),
        "cp_ranks": mpu.get_context_parallel_global_ranks(),
        "split": mpu.get_pipeline_model_parallel_split_rank(),
        "groups": all(getter() is state.group(kind) for getter, kind in _group_getters(state)),
    }
    # As in Megatron, a virtual stage must be named when interleaving; the stored virtual
    # rank is for the caller's own bookkeeping.
    chunks = []
    for chunk in range(2):
        mpu.set_virtual_pipeline_model_parallel_rank(chunk)
        chunks.append(
            (
                mpu.get_virtual_pipeline_model_parallel_rank(),
                mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=chunk),
                mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=chunk),
                mpu.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=chunk),
            )
        )
    seen["chunks"] = chunks
    try:
        mpu.is_pipeline_first_stage(ignore_virtual=False)
    except ValueError as error:
        seen["unnamed_chunk"] = str(error)
    seen["explicit_chunk"] = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
    seen["physical"] = (mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage())
    # The embedding group reaches exactly the first and last stage of the pipeline.
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=mpu.get_embedding_group())
    seen["embedding_sum"] = value.item()
    # Overrides, as Megatron's tests use them: neighbours follow the overridden rank.
    mpu.set_pipeline_model_parallel_rank(1)
    seen["overridden_neighbours"] = (
        mpu.get_pipeline_model_parallel_next_rank(),
        mpu.get_pipeline_model_parallel_prev_rank(),
        mpu.is_pipeline_last_stage(),
    )
    mpu.set_pipeline_model_parallel_rank(0)
    mpu.set_pipeline_model_parallel_world_size(1)
    seen["overridden"] = (
        mpu.get_pipeline_model_parallel_rank(),
        mpu.is_pipeline_first_stage(),
        mpu.is_pipeline_last_stage(),
        mpu.get_pipeline_model_parallel_last_rank(),
    )
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    except AssertionError as error:  # Megatron asserts; ours is a RuntimeError as well
        seen["twice"] = (str(error), isinstance(error, RuntimeError))
    state_before = mpu.get_parallel_state()
    mpu.destroy_model_parallel()
    seen["after_destroy"] = (
        mpu.model_parallel_is_initialized(),
        mpu.get_virtual_pipeline_model_parallel_rank(),
        state_before.destroyed,
    )
    try:
        mpu.get_pipeline_model_parallel_rank()
    except NotInitializedError as error:
        seen["getter_after_destroy"] = str(error)
    # Initialise again after destroying: a new default, and no override survives.
    mpu.set_pipeline_model_parallel_rank(3)
    mpu.initialize_model_parallel(
        pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=1
    )
    again = mpu.get_parallel_state()
    seen["again"] = (
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_pipeline_model_parallel_rank(),
        again.data_parallel_size,
        mpu.is_pipeline_stage_at_split(),
        mpu.get_virtual_pipeline_model_parallel_rank(),
    )
    try:
        mpu.is_pipeline_stage_before_split(4)
    except ValueError as error:
        seen["bad_stage"] = str(error)
    mpu.destroy_model_parallel()
    return seen


def test_ported_megatron_code_runs_on_the_facade() -> None:
    for rank, seen in enumerate(run_distributed(_ported_megatron_code, 8, timeout=120)):
        tp_rank, dp_rank, pp_rank = rank % 2, (rank // 2) % 2, rank // 4
        assert seen["initialized"] == (True, True)
        assert seen["returns_none"] is True
        assert seen["sizes"] == (2, 2, 2, 2, 1, 2)
        assert seen["ranks"] == (tp_rank, pp_rank, dp_rank, 0, 0)
        assert seen["pipeline"] == (rank % 4, rank % 4 + 4, (rank + 4) % 8, (rank + 4) % 8)
        assert seen["src"] == (rank - tp_rank, rank - 2 * dp_rank)
        assert seen["cp_ranks"] == [rank]
        assert seen["split"] is None
        assert seen["groups"] is True
        first, last = pp_rank == 0, pp_rank == 1
        assert seen["chunks"] == [(0, first, False, first), (1, False, last, last)]
        assert "interleaved over 2 virtual stages: pass vp_stage (one of [0, 1])" in str(
            seen["unnamed_chunk"]
        )
        assert seen["explicit_chunk"] is last
        assert seen["physical"] == (first, last)
        assert seen["embedding_sum"] == float(rank % 4 + rank % 4 + 4)
        # Overridden to pipeline rank 1 of 2: next and prev are both stage 0 of this pipeline.
        assert seen["overridden_neighbours"] == (rank % 4, rank % 4, True)
        assert seen["overridden"] == (0, True, True, rank % 4)
        assert "already initialized; call destroy_model_parallel() first" in str(seen["twice"])
        assert seen["twice"][1] is True
        assert seen["after_destroy"] == (False, None, True)
        assert "not initialized: call pp_state.initialize_model_parallel" in str(
            seen["getter_after_destroy"]
        )
        # pp 4 on 8 ranks, split at stage 1: stage 0 is the last encoder stage.
        assert seen["again"] == (4, rank // 2, 2, rank // 2 == 0, None)
        assert "pipeline rank 4 is outside the pipeline; valid: [0, 1, 2, 3]" in str(
            seen["bad_stage"]
        )


@pytest.mark.parametrize(
    "getter",
    [
        mpu.get_tensor_model_parallel_group,
        mpu.get_pipeline_model_parallel_rank,
        mpu.get_data_parallel_world_size,
        mpu.get_embedding_group,
        mpu.is_pipeline_first_stage,
        mpu.get_pipeline_model_parallel_next_rank,
        mpu.get_parallel_state,
        mpu.get_expert_model_parallel_group,
        mpu.get_expert_tensor_and_model_parallel_world_size,
        mpu.get_expert_data_parallel_rank,
        mpu.get_intra_distributed_optimizer_instance_group,
        mpu.get_inter_distributed_optimizer_instance_group,
    ],
)
def test_a_getter_before_initialisation_says_what_to_call(getter: object) -> None:
    assert callable(getter)
    with pytest.raises(
        NotInitializedError,
        match=r"not initialized: call pp_state.initialize_model_parallel\(...\)",
    ):
        getter()


def test_unchecked_group_getters_return_none_before_initialisation() -> None:
    assert mpu.get_tensor_model_parallel_group(check_initialized=False) is None
    assert mpu.get_data_parallel_group(with_context_parallel=True, check_initialized=False) is None
    assert not mpu.model_parallel_is_initialized()
    assert mpu.get_virtual_pipeline_model_parallel_world_size() is None


def test_overrides_work_without_groups_and_reset_clears_them() -> None:
    mpu.set_tensor_model_parallel_world_size(4)
    mpu.set_tensor_model_parallel_rank(3)
    mpu.set_pipeline_model_parallel_world_size(2)
    mpu.set_pipeline_model_parallel_rank(1)
    mpu.set_virtual_pipeline_model_parallel_world_size(2)
    mpu.set_virtual_pipeline_model_parallel_rank(1)
    assert mpu.get_tensor_model_parallel_world_size() == 4
    assert mpu.get_tensor_model_parallel_rank() == 3
    assert mpu.is_pipeline_last_stage()
    with pytest.raises(ValueError, match="pass vp_stage"):
        mpu.is_pipeline_last_stage(ignore_virtual=False)
    assert not mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0)
    assert not mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0)
    assert mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
    with pytest.raises(ValueError, match="expected an int of at least 0, or None; got -1"):
        mpu.set_pipeline_model_parallel_rank(-1)
    with pytest.raises(ValueError, match="expected an int of at least 1, or None; got 0"):
        mpu.set_tensor_model_parallel_world_size(0)
    mpu.set_virtual_pipeline_model_parallel_world_size(None)
    assert mpu.get_virtual_pipeline_model_parallel_world_size() is None
    reset_default_state()
    assert mpu.get_virtual_pipeline_model_parallel_rank() is None
    with pytest.raises(NotInitializedError):
        mpu.get_tensor_model_parallel_world_size()


def test_initialize_refuses_bad_sizes_before_touching_torch_distributed() -> None:
    with pytest.raises(ValueError, match="needs pipeline_model_parallel_size of 2 or more, got 1"):
        mpu.initialize_model_parallel(virtual_pipeline_model_parallel_size=2)
    # Megatron raises RuntimeError here; ported tests that expect it pass too.
    with pytest.raises(RuntimeError, match="needs pipeline_model_parallel_size of 2 or more"):
        mpu.initialize_model_parallel(virtual_pipeline_model_parallel_size=2)
    assert not mpu.model_parallel_is_initialized()


def test_initialize_before_init_process_group_is_megatrons_assertion() -> None:
    with pytest.raises(AssertionError, match=r"torch\.distributed is not initialised"):
        mpu.initialize_model_parallel()
    with pytest.raises(RuntimeError, match=r"call torch\.distributed\.init_process_group"):
        mpu.initialize_model_parallel()
    assert not mpu.model_parallel_is_initialized()


def test_getters_before_initialization_are_assertions_too() -> None:
    reset_default_state()
    with pytest.raises(AssertionError, match="model parallel state is not initialized"):
        mpu.get_tensor_model_parallel_world_size()


def _indivisible_world() -> tuple[bool, bool, str]:
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    except ParallelSizeError as error:
        return isinstance(error, ValueError), isinstance(error, RuntimeError), str(error)
    raise AssertionError("2 ranks cannot hold tp 2 x pp 2")


def test_a_world_the_sizes_do_not_divide_is_a_value_and_a_runtime_error() -> None:
    for result in run_distributed(_indivisible_world, 2, timeout=60):
        assert result[:2] == (True, True)
        assert result[2].startswith("world size 2 is not divisible by tensor (2) x pipeline (2)")


def test_set_default_state_refuses_non_states() -> None:
    with pytest.raises(TypeError, match="expected a ParallelState, got ParallelConfig"):
        set_default_state(ParallelConfig())  # type: ignore[arg-type]


def _context_parallel_facade() -> tuple[object, ...]:
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    seen = (
        mpu.get_context_parallel_world_size(),
        mpu.get_context_parallel_rank(),
        mpu.get_context_parallel_global_ranks(),
        mpu.get_data_parallel_world_size(),
        mpu.get_data_parallel_world_size(with_context_parallel=True),
        mpu.get_data_parallel_rank(with_context_parallel=True),
        mpu.get_data_parallel_src_rank(with_context_parallel=True),
        mpu.get_tensor_and_data_parallel_world_size(with_context_parallel=True),
        mpu.get_tensor_and_context_parallel_world_size(),
        mpu.get_tensor_and_context_parallel_rank(),
        mpu.get_tensor_and_data_parallel_rank(),
    )
    mpu.destroy_model_parallel()
    return seen


def test_context_parallel_getters() -> None:
    # 8 ranks, tp 2, cp 2, dp 2, order tp-cp-dp-pp: cp partners are 2 apart, dp partners 4.
    for rank, seen in enumerate(run_distributed(_context_parallel_facade, 8, timeout=120)):
        tp_rank, cp_rank, dp_rank = rank % 2, (rank // 2) % 2, rank // 4
        assert seen == (
            2, cp_rank, [rank - 2 * cp_rank, rank - 2 * cp_rank + 2],
            2, 4, cp_rank + 2 * dp_rank, tp_rank,
            8, 4, tp_rank + 2 * cp_rank, tp_rank + 2 * dp_rank,
        )  # fmt: skip


def _set_once() -> tuple[str, bool, bool]:
    first = ParallelState.create(ParallelConfig(tensor_model_parallel_size=2))
    set_default_state(first)
    second = ParallelState.create(ParallelConfig(tensor_model_parallel_size=2))
    try:
        set_default_state(second)
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    reset_default_state(destroy=False)
    kept_alive = not first.destroyed
    set_default_state(second)
    reset_default_state()
    return refused, kept_alive, second.destroyed


def test_the_default_is_set_once_and_reset_may_keep_the_groups() -> None:
    for refused, kept_alive, destroyed in run_distributed(_set_once, 2, timeout=60):
        assert "already set (model parallel is initialized)" in refused
        assert kept_alive
        assert destroyed


# ----------------------------------------------------------------------------- expert parallel
EXPERT_CONFIGS: list[dict[str, Any]] = [
    # Expert tp = tp (the default); one optimizer instance.
    {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2},
    # Expert tp 1 != tp 2, and two distributed-optimizer instances.
    {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2,
     "expert_tensor_parallel_size": 1, "num_distributed_optimizer_instances": 2},
]  # fmt: skip


def _expert_getters() -> dict[str, dist.ProcessGroup | None]:
    groups = {
        "ep": mpu.get_expert_model_parallel_group(),
        "expt_tp": mpu.get_expert_tensor_parallel_group(),
        "tp_ep": mpu.get_expert_tensor_and_model_parallel_group(),
        "tp_ep_pp": mpu.get_expert_tensor_model_pipeline_parallel_group(),
        "expt_dp": mpu.get_expert_data_parallel_group(),
        "intra_expt_dp": mpu.get_expert_data_parallel_group(partial_expert_data_parallel=True),
        "intra_dp_cp": mpu.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True
        ),
        "intra_dist_opt": mpu.get_intra_distributed_optimizer_instance_group(),
    }
    if mpu.get_parallel_state().num_distributed_optimizer_instances > 1:
        groups["inter_dist_opt"] = mpu.get_inter_distributed_optimizer_instance_group()
    return groups


def _reach(group: dist.ProcessGroup | None) -> tuple[list[int], float]:
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=group)
    return dist.get_process_group_ranks(group), value.item()


def _expert_facts() -> dict[str, object]:
    state = mpu.get_parallel_state()
    groups = _expert_getters()
    seen: dict[str, object] = {
        "reach": {kind: _reach(group) for kind, group in groups.items()},
        "same_groups": all(group is state.group(kind) for kind, group in groups.items()),  # type: ignore[arg-type]
        "sizes": (
            mpu.get_expert_model_parallel_world_size(),
            mpu.get_expert_tensor_parallel_world_size(),
            mpu.get_expert_tensor_and_model_parallel_world_size(),
            mpu.get_expert_data_parallel_world_size(),
            mpu.get_expert_data_parallel_world_size(partial_expert_data_parallel=True),
            mpu.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True),
        ),
        "ranks": (
            mpu.get_expert_model_parallel_rank(),
            mpu.get_expert_tensor_parallel_rank(),
            mpu.get_expert_tensor_and_model_parallel_rank(),
            mpu.get_expert_data_parallel_rank(),
            mpu.get_expert_data_parallel_rank(partial_expert_data_parallel=True),
            mpu.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True),
            mpu.get_expert_model_parallel_src_rank(),
        ),
        "native": (
            state.expert_model_parallel_size, state.expert_tensor_parallel_size,
            state.expert_data_parallel_size, state.num_distributed_optimizer_instances,
            state.expert_model_parallel_rank, state.expert_tensor_parallel_rank,
            state.expert_data_parallel_rank,
        ),
        "layout": state.expert_layout,
    }  # fmt: skip
    with pytest.warns(DeprecationWarning, match="use get_expert_data_parallel_group"):
        seen["deprecated"] = mpu.get_data_modulo_expert_parallel_group() is groups["expt_dp"]
    try:
        mpu.get_inter_distributed_optimizer_instance_group()
    except NotInitializedError as error:  # one instance: Megatron asserts, as here
        seen["no_inter"] = (
            str(error),
            mpu.get_inter_distributed_optimizer_instance_group(check_initialized=False),
        )
    try:
        mpu.get_data_parallel_group(partial_data_parallel=True)
    except AssertionError as error:
        seen["partial_without_cp"] = (str(error), isinstance(error, ValueError))
    # Overrides, then back to the groups' answers.
    mpu.set_expert_model_parallel_world_size(7)
    mpu.set_expert_model_parallel_rank(5)
    mpu.set_expert_tensor_parallel_world_size(3)
    mpu.set_expert_tensor_parallel_rank(2)
    seen["overridden"] = (
        mpu.get_expert_model_parallel_world_size(), mpu.get_expert_model_parallel_rank(),
        mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_tensor_parallel_rank(),
    )  # fmt: skip
    for setter in (mpu.set_expert_model_parallel_world_size, mpu.set_expert_model_parallel_rank,
                   mpu.set_expert_tensor_parallel_world_size, mpu.set_expert_tensor_parallel_rank):  # fmt: skip
        setter(None)
    seen["restored"] = (
        mpu.get_expert_model_parallel_world_size(),
        mpu.get_expert_model_parallel_rank(),
    )
    dp_cp_ag, expert_ag = mpu.create_all_gather_groups(for_expert_parallelism=True)
    seen["all_gather"] = (
        _reach(dp_cp_ag), _reach(expert_ag), dp_cp_ag is not state.group("dp_cp"),
        mpu.create_all_gather_groups()[1],
    )  # fmt: skip
    return seen


def _groups_created() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _expert_parallel_on_the_facade() -> dict[str, object]:
    refused = []
    before = _groups_created()
    bad_sizes: list[dict[str, Any]] = [
        {"expert_model_parallel_size": 3},
        {"tensor_model_parallel_size": 2, "num_distributed_optimizer_instances": 3},
    ]
    for bad in bad_sizes:
        try:
            mpu.initialize_model_parallel(**bad)
        except ParallelSizeError as error:
            refused.append((str(error), isinstance(error, RuntimeError)))
    report: dict[str, object] = {
        "refused": refused,
        "nothing_created": _groups_created() == before and not mpu.model_parallel_is_initialized(),
        "configs": [],
    }
    for config in EXPERT_CONFIGS:
        mpu.initialize_model_parallel(distributed_timeout_minutes=0.5, **config)
        report["configs"].append(_expert_facts())  # type: ignore[attr-defined]
        mpu.destroy_model_parallel()
    report["after_destroy"] = (
        mpu.get_expert_model_parallel_group(check_initialized=False),
        mpu.get_expert_tensor_parallel_group(check_initialized=False),
        _groups_created() == before,  # the all-gather copies were destroyed too
    )
    try:
        mpu.get_expert_data_parallel_world_size()
    except NotInitializedError as error:
        report["getter_after_destroy"] = str(error)
    return report


DENSE_DP_CP = rank_layout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)["dp_cp"]


def test_expert_parallel_groups_on_eight_ranks() -> None:
    reports = run_distributed(_expert_parallel_on_the_facade, 8, timeout=180)
    expected_layouts = [expert_rank_layout(8, **config) for config in EXPERT_CONFIGS]
    # The two layouts, by hand (order tp-cp-ep-dp-pp).
    first, second = expected_layouts
    assert first["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert first["expt_dp"] == [[r] for r in range(8)]
    assert second["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert second["expt_dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert second["inter_dist_opt"] == second["expt_dp"]
    assert second["intra_dist_opt"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for rank, report in enumerate(reports):
        assert report["nothing_created"] is True
        (ep_error, ep_runtime), (instances_error, _) = report["refused"]
        assert ep_runtime is True
        assert "world size 8 is not divisible by expert tensor (1) x expert model (3)" in ep_error
        assert "num_distributed_optimizer_instances 3 must divide both" in instances_error
        for expected, seen in zip(expected_layouts, report["configs"], strict=True):
            assert seen["layout"] == expected
            mine = {
                kind: next(g for g in groups if rank in g)
                for kind, groups in expected.items()
                if groups
            }
            for kind, (ranks, total) in seen["reach"].items():
                assert ranks == mine[kind], (rank, kind)
                assert total == float(sum(mine[kind])), (rank, kind)
            assert seen["same_groups"] is True
            ep, etp, expert_dp = len(mine["ep"]), len(mine["expt_tp"]), len(mine["expt_dp"])
            assert seen["sizes"] == (
                ep,
                etp,
                len(mine["tp_ep"]),
                expert_dp,
                len(mine["intra_expt_dp"]),
                len(mine["intra_dp_cp"]),
            )
            assert seen["ranks"] == (
                mine["ep"].index(rank), mine["expt_tp"].index(rank), mine["tp_ep"].index(rank),
                mine["expt_dp"].index(rank), mine["intra_expt_dp"].index(rank),
                mine["intra_dp_cp"].index(rank), mine["ep"][0],
            )  # fmt: skip
            instances = len(expected["intra_dist_opt"])
            assert seen["native"] == (
                ep, etp, expert_dp, instances, mine["ep"].index(rank), mine["expt_tp"].index(rank),
                mine["expt_dp"].index(rank),
            )  # fmt: skip
            assert seen["deprecated"] is True
            if instances == 1:
                message, unchecked = seen["no_inter"]
                assert "exists with num_distributed_optimizer_instances of 2 or more" in message
                assert unchecked is None
            assert (
                "partial_data_parallel=True needs with_context_parallel=True"
                in seen["partial_without_cp"][0]
            )
            assert seen["partial_without_cp"][1] is True
            assert seen["overridden"] == (7, 5, 3, 2)
            assert seen["restored"] == (ep, mine["ep"].index(rank))
            dp_cp_reach, expert_reach, distinct, no_expert = seen["all_gather"]
            dp_cp = next(g for g in DENSE_DP_CP if rank in g)
            assert dp_cp_reach == (dp_cp, float(sum(dp_cp)))
            assert expert_reach == (mine["expt_dp"], float(sum(mine["expt_dp"])))
            assert distinct is True
            assert no_expert is None
        assert report["after_destroy"] == (None, None, True)
        assert "not initialized" in report["getter_after_destroy"]


def test_expert_tensor_parallel_falls_back_to_the_tensor_parallel_override() -> None:
    # Before initialisation Megatron answers the expert tp size and rank from the tp overrides.
    mpu.set_tensor_model_parallel_world_size(4)
    mpu.set_tensor_model_parallel_rank(1)
    assert mpu.get_expert_tensor_parallel_world_size() == 4
    assert mpu.get_expert_tensor_parallel_rank() == 1
    mpu.set_expert_tensor_parallel_world_size(2)
    assert mpu.get_expert_tensor_parallel_world_size() == 2
    mpu.set_expert_model_parallel_world_size(8)
    assert mpu.get_expert_model_parallel_world_size() == 8
    with pytest.raises(NotInitializedError):
        mpu.get_expert_model_parallel_rank()
    with pytest.raises(ValueError, match="expected an int of at least 1, or None; got 0"):
        mpu.set_expert_model_parallel_world_size(0)


def test_create_all_gather_groups_before_initialisation_is_megatrons_runtime_error() -> None:
    with pytest.raises(
        RuntimeError, match=r"not initialized: call pp_state.initialize_model_parallel"
    ):
        mpu.create_all_gather_groups(for_expert_parallelism=True)


def test_rank_generator_is_on_the_facade() -> None:
    generator = mpu.RankGenerator(tp=2, ep=2, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert generator.get_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert generator.get_ranks("tp-ep-pp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
