"""ParallelState on real gloo process groups: 4 and 8 CPU ranks."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from pp_state import KINDS, ParallelConfig, ParallelState, StateDestroyedError, rank_layout
from pp_testing import DistributedTestError, requires_gpus, run_distributed

TIMEOUT = datetime.timedelta(seconds=20)


def _reach_of_every_group(config: ParallelConfig) -> dict[str, object]:
    """Build the state, then probe each of this rank's groups with real collectives."""
    state = ParallelState.create(config)
    world, rank = dist.get_world_size(), dist.get_rank()
    report: dict[str, object] = {}
    for kind in KINDS:
        if not state.in_group(kind):
            report[kind] = None
            continue
        group = state.group(kind)
        # Who does a collective over this group reach? One-hot per rank, summed.
        reach = torch.zeros(world)
        reach[rank] = 1.0
        dist.all_reduce(reach, group=group)
        # In which order do the members sit? Gather global ranks by group rank.
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, torch.tensor([rank]), group=group)
        report[kind] = {
            "torch_ranks": dist.get_process_group_ranks(group),
            "reached": [r for r in range(world) if reach[r].item() == 1.0],
            "by_group_rank": [int(t.item()) for t in gathered],
            "state_ranks": state.group_ranks(kind),
            "group_rank": state.group_rank(kind),
            "torch_group_rank": dist.get_rank(group),
        }
    state.destroy()
    return report


CONFIGS = [
    pytest.param(
        4,
        ParallelConfig(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, timeout=TIMEOUT
        ),
        id="w4-tp2-pp2",
    ),
    pytest.param(4, ParallelConfig(pipeline_model_parallel_size=4, timeout=TIMEOUT), id="w4-pp4"),
    pytest.param(4, ParallelConfig(context_parallel_size=2, timeout=TIMEOUT), id="w4-cp2"),
    pytest.param(
        8,
        ParallelConfig(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            context_parallel_size=2,
            timeout=TIMEOUT,
        ),
        id="w8-tp2-pp2-cp2",
    ),
    pytest.param(
        8,
        ParallelConfig(
            pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=2, timeout=TIMEOUT
        ),
        id="w8-pp4-split2",
    ),
    pytest.param(
        8,
        ParallelConfig(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            order="pp-dp-tp",
            timeout=TIMEOUT,
        ),
        id="w8-tp2-pp2-order-pp-dp-tp",
    ),
]


@pytest.mark.parametrize(("world", "config"), CONFIGS)
def test_every_group_holds_exactly_the_layout_ranks_and_reaches_only_them(
    world: int, config: ParallelConfig
) -> None:
    reports = run_distributed(_reach_of_every_group, world, config, timeout=120)
    layout = config.layout(world)
    for rank, report in enumerate(reports):
        for kind in KINDS:
            expected = next((g for g in layout[kind] if rank in g), None)
            if expected is None:
                assert report[kind] is None, (rank, kind)
                continue
            probe = report[kind]
            assert probe["torch_ranks"] == expected, (rank, kind)
            assert probe["reached"] == sorted(expected), (rank, kind)
            assert probe["by_group_rank"] == expected, (rank, kind)
            assert probe["state_ranks"] == expected
            assert probe["group_rank"] == probe["torch_group_rank"] == expected.index(rank)


def _describe(config: ParallelConfig) -> dict[str, object]:
    state = ParallelState.create(config)
    vp = state.virtual_pipeline_model_parallel_size
    stages = range(vp) if vp else [None]
    described = {
        "sizes": (state.tensor_model_parallel_size, state.pipeline_model_parallel_size,
                  state.data_parallel_size, state.context_parallel_size, vp),
        "ranks": (state.tensor_model_parallel_rank, state.pipeline_model_parallel_rank,
                  state.data_parallel_rank, state.context_parallel_rank),
        "neighbours": (state.pipeline_prev_rank, state.pipeline_next_rank),
        "ends": (state.pipeline_first_rank, state.pipeline_last_rank),
        "src": {kind: state.src_rank(kind) for kind in ("tp", "dp", "pp", "dp_cp")},
        "first": state.is_pipeline_first_stage(),
        "last": state.is_pipeline_last_stage(),
        "first_by_chunk": [state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=s) for s in stages],
        "last_by_chunk": [state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=s) for s in stages],
        "embedding": state.is_rank_in_embedding_group(),
        "embedding_by_chunk": [state.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=s) for s in stages],
        "position_embedding": state.is_rank_in_position_embedding_group(),
        "before_split": state.is_pipeline_stage_before_split(),
        "after_split": state.is_pipeline_stage_after_split(),
        "at_split": state.is_pipeline_stage_at_split(),
        "embedding_ranks": state.embedding_ranks,
    }  # fmt: skip
    state.destroy()
    return described


def test_sizes_ranks_neighbours_and_predicates_with_virtual_stages() -> None:
    config = ParallelConfig(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3,
        timeout=TIMEOUT,
    )  # fmt: skip
    described = run_distributed(_describe, 8, config, timeout=120)
    # Default order tp-cp-dp-pp on 8 ranks: tp pairs (0,1),(2,3)..., pipelines 4 apart, dp 2.
    for rank, d in enumerate(described):
        tp_rank, pp_rank, dp_rank = rank % 2, rank // 4, (rank // 2) % 2
        assert d["sizes"] == (2, 2, 2, 1, 3)
        assert d["ranks"] == (tp_rank, pp_rank, dp_rank, 0)
        other = rank + 4 if pp_rank == 0 else rank - 4
        assert d["neighbours"] == (other, other)  # a ring of two
        assert d["ends"] == (rank % 4, rank % 4 + 4)
        assert d["src"] == {
            "tp": rank - tp_rank,
            "dp": rank - 2 * dp_rank,
            "pp": rank % 4,
            "dp_cp": rank - 2 * dp_rank,
        }
        assert d["first"] is (pp_rank == 0)
        assert d["last"] is (pp_rank == 1)
        assert d["first_by_chunk"] == [pp_rank == 0, False, False]
        assert d["last_by_chunk"] == [False, False, pp_rank == 1]
        # Both stages hold the embedding, the first in chunk 0 only, the last in chunk 2 only.
        assert d["embedding"] is True
        assert d["embedding_by_chunk"] == (
            [True, False, False] if pp_rank == 0 else [False, False, True]
        )
        assert d["position_embedding"] is (pp_rank == 0)
        assert (d["before_split"], d["after_split"], d["at_split"]) == (True, True, False)


def test_ring_neighbours_and_split_predicates_on_a_four_stage_pipeline() -> None:
    config = ParallelConfig(
        pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=2, timeout=TIMEOUT
    )
    described = run_distributed(_describe, 8, config, timeout=120)
    for rank, d in enumerate(described):
        stage, column = rank // 2, rank % 2
        assert d["neighbours"] == (((stage - 1) % 4) * 2 + column, ((stage + 1) % 4) * 2 + column)
        assert d["embedding_ranks"] == [column, 4 + column, 6 + column]
        assert d["embedding"] is (stage in (0, 2, 3))
        assert d["embedding_by_chunk"] == [stage in (0, 2, 3)]
        assert d["position_embedding"] is (stage in (0, 2))
        assert (d["before_split"], d["after_split"], d["at_split"]) == (
            stage < 2,
            stage >= 2,
            stage == 1,
        )


def _misuse(config: ParallelConfig) -> list[str]:
    state = ParallelState.create(config)
    messages = []
    attempts: list[Callable[[], object]] = [
        lambda: state.is_pipeline_first_stage(ignore_virtual=False),
        lambda: state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=2),
        lambda: state.group("xx"),  # type: ignore[arg-type]
        lambda: state.is_pipeline_stage_before_split(4),
    ]
    if not state.in_group("embedding"):
        attempts.append(lambda: state.group("embedding"))
    for attempt in attempts:
        try:
            attempt()
        except ValueError as error:
            messages.append(str(error))
    tp_group = state.group("tp")
    state.destroy()
    state.destroy()  # twice is harmless
    after: list[Callable[[], object]] = [
        lambda: state.group("tp"),
        lambda: state.pipeline_next_rank,
        state.is_pipeline_last_stage,
    ]
    for attempt in after:
        try:
            attempt()
        except StateDestroyedError as error:
            messages.append(str(error))
    # torch.distributed no longer knows the group; the world group still works.
    try:
        dist.get_process_group_ranks(tp_group)
        messages.append("destroyed group still registered")
    except (KeyError, RuntimeError, ValueError):
        pass
    world = torch.ones(1)
    dist.all_reduce(world)
    messages.append(f"world {world.item():g}")
    return messages


def test_misuse_raises_clear_errors_and_destroy_is_final() -> None:
    config = ParallelConfig(
        pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, timeout=TIMEOUT
    )
    messages = run_distributed(_misuse, 4, config, timeout=60)
    for rank, rank_messages in enumerate(messages):
        assert (
            "interleaved over 2 virtual stages: pass vp_stage (one of [0, 1])" in rank_messages[0]
        )
        assert "vp_stage 2 is not a virtual stage; valid: [0, 1]" in rank_messages[1]
        assert "unknown group kind 'xx'; valid kinds: tp, pp, dp" in rank_messages[2]
        assert "pipeline rank 4 is outside the pipeline; valid: [0, 1, 2, 3]" in rank_messages[3]
        if rank in (1, 2):
            assert (
                f"rank {rank} is in no embedding group: its pipeline's embedding ranks are [0, 3]"
                in rank_messages[4]
            )
        assert rank_messages[-4:-1] == ["this ParallelState was destroyed; create a new one"] * 3
        assert rank_messages[-1] == "world 4"


def _create_while_the_last_rank_lags() -> tuple[float, float]:
    """Rank 3 lags after each group rank 0 is not in; when does each rank finish?"""
    created: list[float] = []
    real_new_group = dist.new_group

    def slow(ranks: list[int], **kwargs: object) -> dist.ProcessGroup:
        group: dist.ProcessGroup = real_new_group(ranks, **kwargs)  # type: ignore[arg-type]
        if dist.get_rank() == 3 and 0 not in ranks:
            time.sleep(0.2)  # still busy with a group rank 0 need not wait for
        created.append(time.time())
        return group

    dist.new_group = slow  # type: ignore[assignment]
    try:
        state = ParallelState.create(
            ParallelConfig(
                tensor_model_parallel_size=2, pipeline_model_parallel_size=2, timeout=TIMEOUT
            )
        )
    finally:
        dist.new_group = real_new_group
    returned = time.time()
    state.destroy()
    return returned, created[-1]


def test_create_returns_on_no_rank_before_every_rank_has_every_group() -> None:
    """gloo lets a member's new_group return while a peer is still connecting to the group;
    a rank that destroyed its groups then would break that peer. create waits for all."""
    results = run_distributed(_create_while_the_last_rank_lags, 4, timeout=60)
    last_group_created = max(created for _, created in results)
    for rank, (returned, _) in enumerate(results):
        assert returned >= last_group_created, (rank, returned, last_group_created)


def _world_does_not_fit() -> None:
    ParallelState.create(
        ParallelConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2)
    )


def test_a_world_that_does_not_fit_fails_on_every_rank_with_the_numbers() -> None:
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_world_does_not_fit, 4, timeout=60)
    for failure in caught.value.failures:
        assert failure.status == "raised"
        assert (
            "world size 4 is not divisible by tensor (4) x pipeline (2) x context (1) parallel size = 8"
            in failure.detail
        )


def _groups_are_shared_when_ranks_coincide(config: ParallelConfig) -> tuple[bool, bool, int]:
    state = ParallelState.create(config)
    shared = (state.group("dp") is state.group("dp_cp"), state.group("tp") is state.group("tp_cp"))
    distinct = len({id(state.group(kind)) for kind in KINDS if state.in_group(kind)})
    state.destroy()
    return shared[0], shared[1], distinct


def test_kinds_with_identical_ranks_share_one_process_group() -> None:
    config = ParallelConfig(tensor_model_parallel_size=2, timeout=TIMEOUT)
    for dp_shared, tp_shared, distinct in run_distributed(
        _groups_are_shared_when_ranks_coincide, 4, config
    ):
        # cp == 1: dp == dp_cp and tp == tp_cp; pp == 1: pp, embedding and position embedding
        # are the rank alone; tp_dp == tp_dp_cp == mp... is not: mp == tp here.
        assert dp_shared
        assert tp_shared
        assert (
            distinct == 4
        )  # {tp,tp_cp,mp}, {dp,dp_cp}, {pp,embedding,position_embedding}, {tp_dp,tp_dp_cp}


def test_create_needs_torch_distributed() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
        ParallelState.create(ParallelConfig())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"virtual_pipeline_model_parallel_size": 2}, ValueError,
         r"virtual_pipeline_model_parallel_size 2 needs pipeline_model_parallel_size of 2 or more, got 1"),
        ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 0}, ValueError,
         "virtual_pipeline_model_parallel_size must be 1 or more, got 0"),
        ({"tensor_model_parallel_size": 0}, ValueError, "tensor_model_parallel_size must be 1 or more, got 0"),
        ({"context_parallel_size": 2.0}, TypeError, "context_parallel_size must be an int"),
        ({"pipeline_model_parallel_size": 2, "order": "tp-dp"}, ValueError, "leaves out 'pp'"),
        ({"pipeline_model_parallel_size": 4, "pipeline_model_parallel_split_rank": 7}, ValueError,
         r"split_rank 7 is outside the pipeline of 4 stages: the decoder's first stage must be one of \[1, 2, 3\]"),
        ({"timeout": datetime.timedelta(0)}, ValueError, "timeout must be positive, got 0:00:00"),
        ({"timeout": 30}, TypeError, "timeout must be a datetime.timedelta, got 30"),
        ({"backend": 1}, TypeError, "backend must be a name such as 'gloo' or 'nccl', or None; got 1"),
        ({"expert_model_parallel_size": 0}, ValueError, "expert_model_parallel_size must be 1 or more, got 0"),
        ({"expert_tensor_parallel_size": 0}, ValueError, "expert_tensor_parallel_size must be 1 or more, got 0"),
        ({"num_distributed_optimizer_instances": -1}, ValueError,
         "num_distributed_optimizer_instances must be 1 or more, got -1"),
        ({"expert_model_parallel_size": 2.0}, TypeError, "expert_model_parallel_size must be an int"),
        ({"expert_model_parallel_size": 2, "order": "tp-cp-dp-pp"}, RuntimeError,
         r"order 'tp-cp-dp-pp' leaves out 'ep', but expert_model_parallel_size is 2; add 'ep'"),
        ({"expert_tensor_parallel_size": 2, "order": "dp-pp"}, ValueError,
         r"order 'dp-pp' leaves out 'tp', but expert_tensor_parallel_size is 2"),
    ],
)  # fmt: skip
def test_config_refuses_bad_input_up_front(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        ParallelConfig(**kwargs)  # type: ignore[arg-type]


def test_config_is_frozen_and_keyword_only() -> None:
    config = ParallelConfig(tensor_model_parallel_size=2)
    with pytest.raises(AttributeError):
        config.tensor_model_parallel_size = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        ParallelConfig(2)  # type: ignore[call-arg]
    assert config.layout(4) == rank_layout(4, tensor_model_parallel_size=2)


def _nccl_groups_reach(config: ParallelConfig) -> dict[str, object]:
    torch.set_default_device("cuda")
    return _reach_of_every_group(config)


@requires_gpus(4)
def test_nccl_groups_hold_exactly_the_layout_ranks() -> None:
    config = ParallelConfig(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, timeout=TIMEOUT
    )
    reports = run_distributed(_nccl_groups_reach, 4, config, backend="nccl", timeout=180)
    layout = config.layout(4)
    for rank, report in enumerate(reports):
        for kind in KINDS:
            expected = next((g for g in layout[kind] if rank in g), None)
            assert (report[kind] or {}).get("reached") == (sorted(expected) if expected else None)
