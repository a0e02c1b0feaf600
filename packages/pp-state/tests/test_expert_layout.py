"""Expert-parallel layouts and RankGenerator, pure: structure for every factorisation, exact cases, errors."""

from __future__ import annotations

import itertools

import pytest

from pp_state import (
    EXPERT_KINDS,
    ExpertGroupKind,
    GroupKind,
    ParallelSizeAssertionError,
    ParallelSizeError,
    RankGenerator,
    expert_rank_layout,
    rank_layout,
)


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def expert_factorisations(world: int) -> list[dict[str, int]]:
    """Every valid (tp, pp, cp, expert tp, ep > 1) on `world` ranks, with 1 and 2 optimizer
    instances where 2 divides both data-parallel sizes."""
    found = []
    for tp, pp, cp, etp, ep in itertools.product(divisors(world), repeat=5):
        if ep == 1 or world % (tp * pp * cp) or world % (etp * ep * pp):
            continue
        dp_cp, expert_dp = world // (tp * pp), world // (etp * ep * pp)
        for instances in (1, 2):
            if dp_cp % instances == 0 and expert_dp % instances == 0:
                found.append(
                    {
                        "world": world,
                        "tp": tp,
                        "pp": pp,
                        "cp": cp,
                        "etp": etp,
                        "ep": ep,
                        "n": instances,
                    }
                )
    return found


def layouts(
    c: dict[str, int], order: str = "tp-cp-ep-dp-pp"
) -> tuple[dict[GroupKind, list[list[int]]], dict[ExpertGroupKind, list[list[int]]]]:
    dense = rank_layout(
        c["world"],
        tensor_model_parallel_size=c["tp"],
        pipeline_model_parallel_size=c["pp"],
        context_parallel_size=c["cp"],
        order=order,
    )
    expert = expert_rank_layout(
        c["world"],
        tensor_model_parallel_size=c["tp"],
        pipeline_model_parallel_size=c["pp"],
        context_parallel_size=c["cp"],
        expert_model_parallel_size=c["ep"],
        expert_tensor_parallel_size=c["etp"],
        num_distributed_optimizer_instances=c["n"],
        order=order,
    )
    return dense, expert


def check_structure(c: dict[str, int]) -> None:
    world, tp, pp, etp, ep, n = (c[k] for k in ("world", "tp", "pp", "etp", "ep", "n"))
    dp_cp, expert_dp = world // (tp * pp), world // (etp * ep * pp)
    dense, expert = layouts(c)
    assert tuple(expert) == EXPERT_KINDS
    sizes: dict[ExpertGroupKind, int] = {
        "intra_dp_cp": dp_cp // n, "ep": ep, "expt_tp": etp, "tp_ep": etp * ep,
        "tp_ep_pp": etp * ep * pp, "expt_dp": expert_dp, "intra_expt_dp": expert_dp // n,
        "inter_dist_opt": n, "intra_dist_opt": world // n,
    }  # fmt: skip
    where: dict[str, dict[int, set[int]]] = {}
    for kind, size in sizes.items():
        groups = expert[kind]
        if kind == "inter_dist_opt" and n == 1:
            assert groups == []  # Megatron builds no inter-instance group for one instance
            continue
        # A partition of all ranks into groups of the right size, each in ascending order
        # (torch.distributed orders a group's members).
        assert sorted(r for g in groups for r in g) == list(range(world)), (c, kind)
        assert all(len(g) == size and g == sorted(g) for g in groups), (c, kind)
        where[kind] = {r: set(g) for g in groups for r in g}
    for dense_kind in ("pp", "tp", "dp_cp"):
        where[dense_kind] = {r: set(g) for g in dense[dense_kind] for r in g}
    for rank in range(world):
        mine = {kind: groups[rank] for kind, groups in where.items()}
        # The expert grid is orthogonal: expert tp, ep, expert dp and pp meet in one rank.
        for a, b in itertools.combinations(("expt_tp", "ep", "expt_dp", "pp"), 2):
            assert mine[a] & mine[b] == {rank}, (c, a, b)
        assert mine["expt_tp"] | mine["ep"] <= mine["tp_ep"]
        assert mine["tp_ep"] | mine["pp"] <= mine["tp_ep_pp"]
        # The dense pipelines are the expert ones; with expert tp = tp, so are the tp groups.
        if etp == tp:
            assert mine["expt_tp"] == mine["tp"]
        # An optimizer instance holds its runs of data-parallel ranks, dense and expert.
        assert mine["intra_expt_dp"] <= mine["expt_dp"] & mine["intra_dist_opt"]
        assert mine["intra_dp_cp"] <= mine["dp_cp"] & mine["intra_dist_opt"]
        if n > 1:
            assert mine["inter_dist_opt"] <= mine["expt_dp"]
            assert mine["inter_dist_opt"] & mine["intra_dist_opt"] == {rank}
            assert mine["inter_dist_opt"] & mine["intra_expt_dp"] == {rank}


# ----------------------------------------------------------------------------- every factorisation
@pytest.mark.parametrize("world", [8, 16, 32, 64])
def test_expert_groups_partition_the_ranks_orthogonally_for_every_factorisation(
    world: int,
) -> None:
    configs = expert_factorisations(world)
    assert configs
    for config in configs:
        check_structure(config)


@pytest.mark.parametrize("world", [8, 16, 32, 64])
def test_without_experts_the_expert_groups_are_the_dense_ones(world: int) -> None:
    # ep 1, expert tp = tp: what Megatron builds then equals the dense groups.
    for tp, pp, cp in itertools.product(divisors(world), repeat=3):
        if world % (tp * pp * cp):
            continue
        c = {"world": world, "tp": tp, "pp": pp, "cp": cp, "etp": tp, "ep": 1, "n": 1}
        dense, expert = layouts(c)
        assert expert["ep"] == [[r] for r in range(world)]
        assert expert["expt_tp"] == expert["tp_ep"] == dense["tp"]
        assert expert["tp_ep_pp"] == dense["mp"]
        assert expert["expt_dp"] == expert["intra_expt_dp"] == dense["dp_cp"]
        assert expert["intra_dp_cp"] == dense["dp_cp"]
        assert expert["intra_dist_opt"] == [list(range(world))]


# ----------------------------------------------------------------------------- exact cases
def test_eight_ranks_tp2_pp2_ep2_exactly() -> None:
    # Checked against megatron-core 0.16.1 (test_megatron_oracle.py does it for all cases).
    expert = expert_rank_layout(
        8,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
    )
    assert expert == {
        "intra_dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "expt_tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "tp_ep_pp": [list(range(8))],
        "expt_dp": [[r] for r in range(8)],
        "intra_expt_dp": [[r] for r in range(8)],
        "inter_dist_opt": [],
        "intra_dist_opt": [list(range(8))],
    }


def test_sixteen_ranks_with_two_optimizer_instances_exactly() -> None:
    expert = expert_rank_layout(
        16,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        num_distributed_optimizer_instances=2,
    )
    assert expert["ep"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert expert["expt_tp"] == [[r] for r in range(16)]
    assert expert["tp_ep_pp"] == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert expert["expt_dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    runs = [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10], [12, 14], [9, 11], [13, 15]]
    assert expert["intra_expt_dp"] == expert["intra_dp_cp"] == runs
    assert expert["inter_dist_opt"] == [
        [0, 4], [2, 6], [1, 5], [3, 7], [8, 12], [10, 14], [9, 13], [11, 15]
    ]  # fmt: skip
    # Megatron lists [0, 1, 8, 9, 2, 3, 10, 11]; torch.distributed sorts a group's members.
    assert expert["intra_dist_opt"] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_expert_tensor_parallel_defaults_to_tensor_parallel() -> None:
    assert expert_rank_layout(
        8, tensor_model_parallel_size=2, expert_model_parallel_size=2
    ) == expert_rank_layout(
        8, tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2
    )


def test_an_order_without_pp_last_works_when_the_data_parallel_sizes_agree() -> None:
    expert = expert_rank_layout(
        8,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        order="tp-ep-pp-dp",
    )
    assert expert["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert expert["expt_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


# ----------------------------------------------------------------------------- RankGenerator
@pytest.mark.parametrize("world", [8, 16, 24, 64])
def test_rank_generator_gives_the_dense_layout_for_every_token(world: int) -> None:
    tokens = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "dp_cp": "dp-cp", "mp": "tp-pp",
              "tp_dp": "tp-dp", "tp_dp_cp": "tp-dp-cp", "tp_cp": "tp-cp"}  # fmt: skip
    for tp, pp, cp in itertools.product(divisors(world), repeat=3):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        dense = rank_layout(
            world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
        )  # fmt: skip
        for kind, token in tokens.items():
            assert generator.get_ranks(token) == dense[kind], (tp, pp, cp, kind)  # type: ignore[index]


def test_rank_generator_gives_the_expert_layout() -> None:
    for c in expert_factorisations(32):
        world, pp, etp, ep = (c[k] for k in ("world", "pp", "etp", "ep"))
        _, expert = layouts(c)
        generator = RankGenerator(
            tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp"
        )
        tokens: dict[ExpertGroupKind, str] = {"ep": "ep", "expt_tp": "tp", "tp_ep": "tp-ep",
                                              "tp_ep_pp": "tp-ep-pp", "expt_dp": "dp"}  # fmt: skip
        for kind, token in tokens.items():
            assert generator.get_ranks(token) == expert[kind], (c, kind)


def test_rank_generator_attributes_offset_and_mask_follow_megatron() -> None:
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="TP-dp-pp", rank_offset=8)
    assert generator.world_size == 8
    assert generator.order == "tp-dp-pp-ep-cp"  # left-out tokens appended as Megatron does
    assert generator.ordered_size == [2, 2, 2, 1, 1]
    assert generator.name_to_size == {"tp": 2, "pp": 2, "dp": 2, "ep": 1, "cp": 1}
    assert generator.get_mask("tp-dp-pp", "pp-tp") == [True, False, True]
    assert generator.get_ranks("tp") == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert generator.get_ranks("dp-tp") == generator.get_ranks("tp-dp") == [
        [8, 9, 10, 11], [12, 13, 14, 15]
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"ep": 2, "cp": 2}, ParallelSizeAssertionError, r"ep 2 and cp 2 are both above 1"),
        ({"ep": 2, "order": "tp-dp-pp"}, ParallelSizeError, r"order 'tp-dp-pp' leaves out 'ep', but the ep size is 2"),
        ({"tp": 0}, ValueError, r"tp must be 1 or more, got 0"),
        ({"rank_offset": -1}, ValueError, r"rank_offset must be an int of 0 or more, got -1"),
        ({"order": "tp-xp"}, ValueError, r"unknown token 'xp'"),
    ],
)  # fmt: skip
def test_rank_generator_refuses_bad_input(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    arguments: dict[str, object] = {
        "tp": 1,
        "ep": 1,
        "dp": 2,
        "pp": 1,
        "cp": 1,
        "order": "tp-cp-ep-dp-pp",
    }
    with pytest.raises(error, match=message):
        RankGenerator(**{**arguments, **kwargs})  # type: ignore[arg-type]


def test_rank_generator_refuses_a_token_the_order_lacks() -> None:
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    with pytest.raises(ValueError, match=r"token 'xp' \(of 'tp-xp'\) is not in the order"):
        generator.get_ranks("tp-xp")


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "megatron", "message"),
    [
        ({"world_size": 8, "expert_model_parallel_size": 3}, RuntimeError,
         r"world size 8 is not divisible by expert tensor \(1\) x expert model \(3\) x pipeline \(1\) "
         r"parallel size = 3; with expert tensor 1 and pipeline 1, expert_model_parallel_size must "
         r"divide 8: one of \[1, 2, 4, 8\]"),
        ({"world_size": 8, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2,
          "expert_tensor_parallel_size": 4}, RuntimeError,
         r"expert tensor \(4\) x expert model \(2\) x pipeline \(2\) parallel size = 16; with expert "
         r"tensor 4 and pipeline 2, expert_model_parallel_size must divide 1: one of \[1\]"),
        ({"world_size": 8, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 3},
         RuntimeError, r"parallel size = 6; the product of these sizes must divide 8: one of \[1, 2, 4, 8\]"),
        ({"world_size": 8, "tensor_model_parallel_size": 2, "num_distributed_optimizer_instances": 3},
         AssertionError, r"num_distributed_optimizer_instances 3 must divide both the data x context "
         r"parallel size \(4\) and the expert data-parallel size \(4\); use one of \[1, 2, 4\]"),
        ({"world_size": 8, "expert_model_parallel_size": 4, "num_distributed_optimizer_instances": 4},
         AssertionError, r"instances 4 must divide both .* \(8\) and the expert data-parallel size \(2\); "
         r"use one of \[1, 2\]"),
        ({"world_size": 8, "expert_model_parallel_size": 2, "order": "tp-cp-dp-pp"}, RuntimeError,
         r"order 'tp-cp-dp-pp' leaves out 'ep', but expert_model_parallel_size is 2; add 'ep' to the "
         r"order \(for instance 'tp-cp-ep-dp-pp'\)"),
        ({"world_size": 8, "tensor_model_parallel_size": 1, "expert_tensor_parallel_size": 2,
          "order": "dp-ep"}, RuntimeError,
         r"order 'dp-ep' leaves out 'tp', but expert_tensor_parallel_size is 2"),
        ({"world_size": 8, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2,
          "order": "tp-pp-ep-dp"}, AssertionError,
         r"order 'tp-pp-ep-dp' does not end with 'pp', so the expert data-parallel size \(2\) must "
         r"equal the data-parallel size \(4\): expert tensor x expert model parallel must be tensor x "
         r"context parallel = 1, or put 'pp' last"),
        ({"world_size": 8, "tensor_model_parallel_size": 2, "context_parallel_size": 2,
          "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 4,
          "expert_tensor_parallel_size": 1, "order": "tp-pp-cp-ep-dp"}, AssertionError,
         r"the expert layout's pipelines \[\[0, 1\], \[2, 3\]\]... differ from the dense layout's "
         r"\[\[0, 2\], \[1, 3\]\]..."),
        ({"world_size": 8, "expert_model_parallel_size": 0}, ValueError,
         r"expert_model_parallel_size must be 1 or more, got 0"),
        ({"world_size": 8, "expert_tensor_parallel_size": -1}, ValueError,
         r"expert_tensor_parallel_size must be 1 or more, got -1"),
        ({"world_size": 8, "num_distributed_optimizer_instances": 0}, ValueError,
         r"num_distributed_optimizer_instances must be 1 or more, got 0"),
    ],
)  # fmt: skip
def test_bad_expert_sizes_name_the_numbers_and_the_choices(
    kwargs: dict[str, object], megatron: type[Exception], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        expert_rank_layout(**kwargs)  # type: ignore[arg-type]
    # Ported Megatron code catches what Megatron raises; sizes are ParallelSizeErrors.
    assert isinstance(caught.value, megatron)
    if megatron is not ValueError:
        assert isinstance(caught.value, ParallelSizeError)


def test_expert_sizes_must_be_ints() -> None:
    with pytest.raises(TypeError, match="expert_model_parallel_size must be an int"):
        expert_rank_layout(8, expert_model_parallel_size=2.0)  # type: ignore[arg-type]
