"""Golden data from megatron-core itself: its RankGenerator, and every group its
initialize_model_parallel creates (torch.distributed faked, so it runs on CPU in one process),
against pp-state's RankGenerator and layouts, for every factorisation of 8, 16, 32 and 64 ranks.

Skipped where megatron-core is not installed. The nox session ``megatron_oracles`` installs it
and sets PP_STATE_MEGATRON_ORACLE=1, which makes a missing megatron-core a failure, not a skip.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed

from pp_state import ParallelConfig, ParallelSizeError, RankGenerator

with warnings.catch_warnings():
    # megatron.core warns at import that Transformer Engine and Apex are absent.
    warnings.simplefilter("ignore")
    if os.environ.get("PP_STATE_MEGATRON_ORACLE") == "1":
        import megatron.core.parallel_state as megatron
    else:
        megatron = pytest.importorskip("megatron.core.parallel_state")

ORDER = "tp-cp-ep-dp-pp"
DENSE_TOKENS = ["dp-cp", "dp", "cp", "tp-pp", "tp", "pp", "tp-dp-cp", "tp-dp", "tp-cp"]
EXPERT_TOKENS = ["ep", "tp", "tp-ep", "tp-ep-pp", "dp", "pp"]
# Megatron's group_desc of each group it creates -> pp-state's kind.
KIND_OF = {
    "DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "intra_dp_cp",
    "DATA_PARALLEL_GROUP": "dp",
    "CONTEXT_PARALLEL_GROUP": "cp",
    "MODEL_PARALLEL_GROUP": "mp",
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "EMBEDDING_GROUP": "embedding",
    "POSITION_EMBEDDING_GROUP": "position_embedding",
    "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "EXPERT_TENSOR_PARALLEL_GROUP": "expt_tp",
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
    "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L0": "intra_expt_dp",
    "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1": "inter_dist_opt",
    "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt",
}


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def factorisations(world: int) -> Iterator[dict[str, int]]:
    """Every (tp, pp, cp, expert tp, ep > 1) that divides `world`, with 1 and 2 optimizer
    instances where 2 divides both data-parallel sizes."""
    for tp, pp, cp, etp, ep in itertools.product(divisors(world), repeat=5):
        if ep == 1 or world % (tp * pp * cp) or world % (etp * ep * pp):
            continue
        for instances in (1, 2):
            if (world // (tp * pp)) % instances == 0 and (
                world // (etp * ep * pp)
            ) % instances == 0:
                yield {"tp": tp, "pp": pp, "cp": cp, "etp": etp, "ep": ep, "n": instances}


@pytest.fixture
def megatron_groups(monkeypatch: pytest.MonkeyPatch) -> Callable[..., dict[str, list[list[int]]]]:
    """Run megatron's initialize_model_parallel on `world` fake ranks; return every group it
    creates, by pp-state kind, in creation order."""
    created: dict[str, list[list[int]]] = {}

    def create_group(ranks: list[int], **_: Any) -> object:
        created.setdefault(_["group_desc"], []).append(list(ranks))
        return object()

    monkeypatch.setattr(megatron, "create_group", create_group)
    monkeypatch.setattr(megatron, "_set_global_memory_buffer", lambda: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)

    def run(world: int, **kwargs: Any) -> dict[str, list[list[int]]]:
        created.clear()
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)
        try:
            megatron.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        finally:
            megatron.destroy_model_parallel()
        unknown = set(created) - set(KIND_OF)
        assert not unknown, f"megatron-core creates groups this test does not know: {unknown}"
        return {KIND_OF[desc]: groups for desc, groups in created.items()}

    return run


def expected_from_megatron(groups: dict[str, list[list[int]]], instances: int) -> dict[str, Any]:
    """What pp-state's layouts must hold, given what Megatron created."""
    expected = dict(groups)
    if instances == 1:  # Megatron reuses the whole groups and builds no inter-instance group
        expected["intra_dp_cp"] = groups["dp_cp"]
        expected["intra_expt_dp"] = groups["expt_dp"]
        expected["inter_dist_opt"] = []
    # Megatron lists an instance's ranks model-parallel group by group; torch.distributed
    # (and pp-state) order a group's members.
    expected["intra_dist_opt"] = [sorted(g) for g in groups["intra_dist_opt"]]
    return expected


def ours(world: int, config: ParallelConfig) -> dict[str, Any]:
    layout: dict[str, Any] = dict(config.layout(world).items())
    layout.update(config.expert_layout(world).items())
    return layout


def megatron_arguments(c: dict[str, int], order: str) -> dict[str, Any]:
    return {
        "tensor_model_parallel_size": c["tp"],
        "pipeline_model_parallel_size": c["pp"],
        "context_parallel_size": c["cp"],
        "expert_model_parallel_size": c["ep"],
        "expert_tensor_parallel_size": c["etp"],
        "num_distributed_optimizer_instances": c["n"],
        "order": order,
    }


def config_of(c: dict[str, int], order: str) -> ParallelConfig:
    arguments = megatron_arguments(c, order)
    return ParallelConfig(**arguments)


# ----------------------------------------------------------------------------- RankGenerator
def assert_same_generator(arguments: dict[str, Any], tokens: list[str]) -> None:
    theirs, mine = megatron.RankGenerator(**arguments), RankGenerator(**arguments)
    assert (mine.order, mine.ordered_size, mine.world_size) == (
        theirs.order, theirs.ordered_size, theirs.world_size
    ), arguments  # fmt: skip
    for token in tokens:
        assert mine.get_mask(mine.order, token) == theirs.get_mask(theirs.order, token)
        assert mine.get_ranks(token) == theirs.get_ranks(token), (arguments, token)


@pytest.mark.parametrize("world", [8, 16, 32, 64])
def test_rank_generators_equal_megatrons_for_every_factorisation(world: int) -> None:
    dense, expert = set(), set()
    for c in factorisations(world):
        dense.add((c["tp"], c["pp"], c["cp"]))
        expert.add((c["etp"], c["ep"], c["pp"]))
    for tp, pp, cp in sorted(dense):
        arguments = {"tp": tp, "ep": 1, "dp": world // (tp * pp * cp), "pp": pp, "cp": cp}
        assert_same_generator({**arguments, "order": ORDER}, DENSE_TOKENS)
    for etp, ep, pp in sorted(expert):
        arguments = {"tp": etp, "ep": ep, "dp": world // (etp * ep * pp), "pp": pp, "cp": 1}
        assert_same_generator({**arguments, "order": ORDER}, EXPERT_TOKENS)
        assert_same_generator({**arguments, "order": ORDER, "rank_offset": world}, ["ep"])


def test_rank_generators_equal_megatrons_for_every_order() -> None:
    for tokens in itertools.permutations(["tp", "cp", "ep", "dp", "pp"]):
        order = "-".join(tokens)
        assert_same_generator(
            {"tp": 2, "ep": 1, "dp": 2, "pp": 2, "cp": 2, "order": order}, DENSE_TOKENS
        )
        assert_same_generator(
            {"tp": 2, "ep": 2, "dp": 2, "pp": 2, "cp": 1, "order": order}, EXPERT_TOKENS
        )


def test_left_out_tokens_are_appended_as_megatron_does() -> None:
    assert_same_generator(
        {"tp": 2, "ep": 1, "dp": 4, "pp": 1, "cp": 1, "order": "dp-tp"}, ["tp", "dp"]
    )


# ----------------------------------------------------------------------------- initialize_model_parallel
@pytest.mark.parametrize("world", [8, 16, 32, 64])
def test_every_group_equals_megatrons_for_every_factorisation(
    world: int, megatron_groups: Callable[..., dict[str, list[list[int]]]]
) -> None:
    checked = 0
    for c in factorisations(world):
        groups = megatron_groups(world, **megatron_arguments(c, ORDER))
        # Same groups, same group order, same rank order inside each group.
        assert ours(world, config_of(c, ORDER)) == expected_from_megatron(groups, c["n"]), c
        checked += 1
    assert checked > 0


ORDERS = ["tp-cp-ep-dp-pp", "tp-ep-cp-dp-pp", "ep-tp-cp-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-cp-ep-dp",
          "pp-tp-cp-ep-dp", "dp-ep-cp-tp-pp"]  # fmt: skip


@pytest.mark.parametrize("world", [8, 12, 16])
def test_other_orders_and_bad_sizes_succeed_or_fail_as_in_megatron(
    world: int, megatron_groups: Callable[..., dict[str, list[list[int]]]]
) -> None:
    """Sizes that need not fit (3 does not divide 8), instances 1 to 4, orders with pp last
    and not: each fails in Megatron exactly when here, with an error of Megatron's type."""
    sizes = [1, 2, 3, 4]
    outcomes = {"ok": 0, "refused": 0}
    for tp, pp, cp, etp, ep, n in itertools.product(sizes, repeat=6):
        if tp * pp * cp > world or etp * ep * pp > world:
            continue
        for order in ORDERS:
            c = {"tp": tp, "pp": pp, "cp": cp, "etp": etp, "ep": ep, "n": n}
            try:
                groups = megatron_groups(world, **megatron_arguments(c, order))
            except (RuntimeError, AssertionError) as error:
                with pytest.raises(type(error)) as caught:
                    ours(world, config_of(c, order))
                assert isinstance(caught.value, ParallelSizeError), (c, order, caught.value)
                outcomes["refused"] += 1
                continue
            assert ours(world, config_of(c, order)) == expected_from_megatron(groups, n), (c, order)
            outcomes["ok"] += 1
    assert outcomes["ok"] > 0
    assert outcomes["refused"] > 0
