"""rank_layout against Megatron's golden layouts, an independent model of its rule, and the rules."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pp_state import AXES, KINDS, GroupKind, group_containing, rank_layout

GOLDEN = json.loads((Path(__file__).parent / "data" / "megatron_groups.json").read_text())[
    "configs"
]
CORE_TOKENS = ("tp", "cp", "dp", "pp")
SPANS: dict[GroupKind, set[str]] = {
    "tp": {"tp"},
    "pp": {"pp"},
    "dp": {"dp"},
    "cp": {"cp"},
    "dp_cp": {"dp", "cp"},
    "mp": {"tp", "pp"},
    "tp_dp": {"tp", "dp"},
    "tp_dp_cp": {"tp", "dp", "cp"},
    "tp_cp": {"tp", "cp"},
}


def factorisations(max_world: int) -> list[tuple[int, int, int, int]]:
    """Every (world, tp, pp, cp) with tp*pp*cp dividing world."""
    found = []
    for world in range(1, max_world + 1):
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        for tp, pp, cp in itertools.product(divisors, repeat=3):
            if world % (tp * pp * cp) == 0:
                found.append((world, tp, pp, cp))
    return found


ALL_UP_TO_64 = factorisations(64)


def megatron_model(
    world: int, sizes: dict[str, int], order: list[str], span: set[str]
) -> list[list[int]]:
    """Megatron's masked orthogonal rank groups, written the way its RankGenerator computes them:
    decompose a group index and an in-group index over prefix-product strides."""

    def prefix_products(values: list[int]) -> list[int]:
        out = [1]
        for value in values:
            out.append(out[-1] * value)
        return out

    def decompose(index: int, shape: list[int]) -> list[int]:
        strides = prefix_products(shape)
        return [(index // stride) % size for size, stride in zip(shape, strides, strict=False)]

    shape = [sizes[token] for token in order]
    global_strides = prefix_products(shape)
    masked = [i for i, token in enumerate(order) if token in span]
    unmasked = [i for i, token in enumerate(order) if token not in span]
    masked_shape = [shape[i] for i in masked]
    unmasked_shape = [shape[i] for i in unmasked]
    group_size = math.prod(masked_shape)
    groups = []
    for group_index in range(world // group_size):
        outer = decompose(group_index, unmasked_shape)
        base = sum(c * global_strides[i] for c, i in zip(outer, unmasked, strict=True))
        groups.append(
            [
                base
                + sum(
                    c * global_strides[i]
                    for c, i in zip(decompose(r, masked_shape), masked, strict=True)
                )
                for r in range(group_size)
            ]
        )
    return groups


def full_order(order: str, sizes: dict[str, int]) -> list[str]:
    tokens = order.split("-")
    return tokens + [axis for axis in AXES if axis not in tokens]


# ----------------------------------------------------------------------------- golden data
def test_golden_file_covers_every_factorisation_up_to_8() -> None:
    covered = {(c["world_size"], c["tp"], c["pp"], c["cp"]) for c in GOLDEN}
    assert covered == set(factorisations(8))


@pytest.mark.parametrize(
    "config", GOLDEN, ids=lambda c: f"w{c['world_size']}-tp{c['tp']}-pp{c['pp']}-cp{c['cp']}"
)
def test_equals_megatron_golden_layout_exactly(config: dict[str, object]) -> None:
    got = rank_layout(
        config["world_size"],  # type: ignore[arg-type]
        tensor_model_parallel_size=config["tp"],  # type: ignore[arg-type]
        pipeline_model_parallel_size=config["pp"],  # type: ignore[arg-type]
        context_parallel_size=config["cp"],  # type: ignore[arg-type]
        order=config["order"],  # type: ignore[arg-type]
    )
    assert set(got) == set(KINDS)
    # Same groups, same creation order, same rank order inside each group.
    assert got == config["groups"]


# ----------------------------------------------------------------------------- larger worlds, other orders
@pytest.mark.parametrize("world", [w for w in range(1, 65) if w > 8])
def test_equals_megatron_rule_for_every_factorisation_up_to_64(world: int) -> None:
    for _, tp, pp, cp in (f for f in ALL_UP_TO_64 if f[0] == world):
        sizes = {"tp": tp, "pp": pp, "cp": cp, "dp": world // (tp * pp * cp), "ep": 1}
        got = rank_layout(
            world,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
        )
        order = full_order("tp-cp-dp-pp", sizes)
        for kind, span in SPANS.items():
            assert got[kind] == megatron_model(world, sizes, order, span), (world, tp, pp, cp, kind)


ORDERS = ["-".join(p) for p in itertools.permutations(CORE_TOKENS)]


@pytest.mark.parametrize("order", [*ORDERS, "tp-cp-ep-dp-pp", "pp-ep-tp-dp-cp"])
@pytest.mark.parametrize("world", [8, 12, 16, 24])
def test_equals_megatron_rule_for_every_order(order: str, world: int) -> None:
    for _, tp, pp, cp in (f for f in ALL_UP_TO_64 if f[0] == world):
        sizes = {"tp": tp, "pp": pp, "cp": cp, "dp": world // (tp * pp * cp), "ep": 1}
        got = rank_layout(
            world,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            order=order,
        )
        for kind, span in SPANS.items():
            assert got[kind] == megatron_model(world, sizes, full_order(order, sizes), span)


def test_size_one_axes_may_be_left_out_of_the_order() -> None:
    # Megatron appends missing tokens of size 1.
    assert rank_layout(8, tensor_model_parallel_size=2, order="tp-dp") == rank_layout(
        8, tensor_model_parallel_size=2
    )
    assert rank_layout(4, order="dp") == rank_layout(4)


def test_order_tokens_are_case_and_space_insensitive() -> None:
    assert rank_layout(8, tensor_model_parallel_size=2, order=" TP - cp-dp-PP") == rank_layout(
        8, tensor_model_parallel_size=2
    )


# ----------------------------------------------------------------------------- rules
@pytest.mark.parametrize("world", range(1, 65))
def test_group_rules_for_every_factorisation_up_to_64(world: int) -> None:
    for _, tp, pp, cp in (f for f in ALL_UP_TO_64 if f[0] == world):
        check_rules(world, tp, pp, cp)


def check_rules(world: int, tp: int, pp: int, cp: int) -> None:
    dp = world // (tp * pp * cp)
    layout = rank_layout(
        world,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
    )
    expected_size: dict[GroupKind, int] = {
        "tp": tp, "pp": pp, "dp": dp, "cp": cp, "dp_cp": dp * cp, "mp": tp * pp,
        "tp_dp": tp * dp, "tp_dp_cp": tp * dp * cp, "tp_cp": tp * cp,
    }  # fmt: skip
    where: dict[GroupKind, dict[int, list[int]]] = {}
    for kind, size in expected_size.items():
        groups = layout[kind]
        # A partition of all ranks into groups of the right size.
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        assert all(len(g) == size for g in groups), kind
        where[kind] = {r: g for g in groups for r in g}
    assert len(layout["embedding"]) == len(layout["position_embedding"]) == len(layout["pp"])
    for stages, embedding, position in zip(
        layout["pp"], layout["embedding"], layout["position_embedding"], strict=True
    ):
        # First and last pipeline stage share the word embedding; the first holds positions.
        assert embedding == sorted({stages[0], stages[-1]})
        assert position == [stages[0]]
    for rank in range(world):
        mine = {kind: where[kind][rank] for kind in expected_size}
        # Default order tp-cp-dp-pp: strides 1, tp, tp*cp and tp*cp*dp.
        tp_base = rank - rank % tp
        assert mine["tp"] == list(range(tp_base, tp_base + tp))
        cp_base = rank - ((rank // tp) % cp) * tp
        assert mine["cp"] == [cp_base + i * tp for i in range(cp)]
        dp_base = rank - ((rank // (tp * cp)) % dp) * tp * cp
        assert mine["dp"] == [dp_base + i * tp * cp for i in range(dp)]
        assert mine["pp"] == [rank % (world // pp) + s * (world // pp) for s in range(pp)]
        # Orthogonality: a tp group and a pp group meet in one rank; composite groups are
        # unions of their parts.
        assert set(mine["tp"]) & set(mine["pp"]) == {rank}
        assert set(mine["tp"]) | set(mine["pp"]) <= set(mine["mp"])
        assert set(mine["dp"]) | set(mine["cp"]) <= set(mine["dp_cp"])
        assert set(mine["tp_dp"]) | set(mine["tp_cp"]) <= set(mine["tp_dp_cp"])


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
def test_split_rank_joins_embedding_and_position_embedding_groups(pp: int) -> None:
    for world in (pp, 2 * pp, 4 * pp):
        for split in range(1, pp):
            layout = rank_layout(
                world, pipeline_model_parallel_size=pp, pipeline_model_parallel_split_rank=split
            )
            for stages, embedding, position in zip(
                layout["pp"], layout["embedding"], layout["position_embedding"], strict=True
            ):
                first, at_split, last = stages[0], stages[split], stages[-1]
                if at_split == last:  # split at the last stage: no rank twice
                    assert embedding == [first, last]
                else:
                    assert embedding == [first, at_split, last]
                assert position == [first, at_split]
                assert len(set(embedding)) == len(embedding)


def test_split_rank_with_tensor_parallel_follows_pipeline_groups() -> None:
    layout = rank_layout(
        16,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=4,
        pipeline_model_parallel_split_rank=2,
    )
    assert layout["pp"][0] == [0, 4, 8, 12]
    assert layout["embedding"][0] == [0, 8, 12]
    assert layout["position_embedding"][0] == [0, 8]


def test_result_is_a_fresh_copy() -> None:
    first = rank_layout(4, tensor_model_parallel_size=2)
    first["tp"][0].append(99)
    assert rank_layout(4, tensor_model_parallel_size=2)["tp"][0] == [0, 1]


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"world_size": 6, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            r"world size 6 is not divisible by tensor \(2\) x pipeline \(2\) x context \(1\) parallel "
            r"size = 4; the product of these sizes must divide 6: one of \[1, 2, 3, 6\]",
        ),
        (
            {"world_size": 8, "context_parallel_size": 3},
            r"world size 8 .* = 3; .* one of \[1, 2, 4, 8\]",
        ),
        ({"world_size": 0}, "world_size must be 1 or more, got 0"),
        (
            {"world_size": 4, "tensor_model_parallel_size": 0},
            "tensor_model_parallel_size must be 1 or more, got 0",
        ),
        (
            {"world_size": 4, "pipeline_model_parallel_size": -2},
            "pipeline_model_parallel_size must be 1 or more, got -2",
        ),
        (
            {"world_size": 8, "order": "tp-xp-dp-pp"},
            r"order 'tp-xp-dp-pp' has unknown token 'xp'; valid tokens: tp, cp, ep, dp, pp",
        ),
        ({"world_size": 8, "order": "tp-dp-tp-pp"}, r"order 'tp-dp-tp-pp' repeats 'tp'"),
        (
            {"world_size": 8, "pipeline_model_parallel_size": 2, "order": "tp-cp-dp"},
            r"order 'tp-cp-dp' leaves out 'pp', but pipeline_model_parallel_size is 2; add 'pp'",
        ),
        (
            {"world_size": 8, "tensor_model_parallel_size": 8, "order": "cp-dp-pp"},
            r"leaves out 'tp', but tensor_model_parallel_size is 8",
        ),
        (
            {"world_size": 8, "order": "tp-cp-pp"},
            r"leaves out 'dp', but the data-parallel size .* is 8",
        ),
        ({"world_size": 8, "order": ""}, r"unknown token ''"),
        (
            {
                "world_size": 8,
                "pipeline_model_parallel_size": 4,
                "pipeline_model_parallel_split_rank": 4,
            },
            r"split_rank 4 is outside the pipeline of 4 stages: the decoder's first stage must be one of \[1, 2, 3\]",
        ),
        (
            {
                "world_size": 8,
                "pipeline_model_parallel_size": 4,
                "pipeline_model_parallel_split_rank": 0,
            },
            r"split_rank 0 is outside the pipeline of 4 stages",
        ),
        (
            {"world_size": 8, "pipeline_model_parallel_split_rank": 1},
            r"split_rank 1 needs a pipeline to split, but pipeline_model_parallel_size is 1",
        ),
    ],
)
def test_bad_input_names_the_numbers_and_the_choices(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        rank_layout(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"world_size": 4.0},
        {"world_size": 4, "tensor_model_parallel_size": True},
        {"world_size": 4, "order": ["tp", "dp"]},
        {
            "world_size": 4,
            "pipeline_model_parallel_size": 2,
            "pipeline_model_parallel_split_rank": "1",
        },
    ],
)
def test_wrong_types_are_type_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(TypeError):
        rank_layout(**kwargs)  # type: ignore[arg-type]


def test_group_containing_refuses_a_rank_in_no_group() -> None:
    with pytest.raises(ValueError, match="rank 9 is in none of the groups"):
        group_containing([[0, 1], [2, 3]], 9)


def test_layout_imports_no_torch() -> None:
    code = (
        "import sys; from pp_state import rank_layout, expert_rank_layout, RankGenerator; "
        "assert rank_layout(8, tensor_model_parallel_size=2)['tp'] == [[0, 1], [2, 3], [4, 5], [6, 7]]; "
        "assert expert_rank_layout(8, expert_model_parallel_size=2)['ep'][0] == [0, 1]; "
        "assert RankGenerator(1, 2, 4, 1, 1, 'tp-cp-ep-dp-pp').get_ranks('ep')[0] == [0, 1]; "
        "assert 'torch' not in sys.modules, 'rank_layout pulled in torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
