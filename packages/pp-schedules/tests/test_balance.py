"""The balancer picks the layers per virtual stage with the smallest simulated makespan."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pp_schedules import Costs, StageCosts
from pp_schedules.planning import (
    LayerBalance,
    balance_layers,
    balanced_counts,
    even_counts,
    plan,
    simulate,
    validate,
)

LAYER = Costs(forward=1.0, backward=2.0)
HEAVY_LOSS = Costs(forward=3.0, backward=6.0)


@pytest.mark.parametrize(
    ("num_layers", "pp", "vp", "placement"),
    [(8, 4, 1, "looped"), (16, 4, 2, "looped"), (16, 2, 2, "v"), (6, 1, 1, "looped")],
)
def test_layers_that_divide_with_free_embedding_and_loss_split_evenly(
    num_layers: int, pp: int, vp: int, placement: str
) -> None:
    counts = balanced_counts(num_layers, pp, vp_size=vp, layer_cost=LAYER, placement=placement)
    assert counts == (num_layers // (pp * vp),) * (pp * vp)


def test_a_heavy_loss_moves_layers_off_the_last_stage() -> None:
    result = balance_layers(8, 4, layer_cost=LAYER, loss_cost=HEAVY_LOSS)
    assert result.counts[-1] < 2
    assert sum(result.counts) == 8
    assert result.makespan < result.even_makespan
    assert result.even == (2, 2, 2, 2)


def test_a_heavy_embedding_moves_layers_off_the_first_stage() -> None:
    counts = balanced_counts(12, 4, layer_cost=LAYER, embedding_cost=HEAVY_LOSS)
    assert counts[0] < 3
    assert sum(counts) == 12


def _balance(
    num_layers: int, pp: int, vp: int, embedding: Costs | None, loss: Costs | None
) -> tuple[LayerBalance, Callable[[tuple[int, ...]], float]]:
    """The balancer's choice, and the simulated makespan of any split on the same plan."""
    result = balance_layers(
        num_layers, pp, vp_size=vp, layer_cost=LAYER, embedding_cost=embedding, loss_cost=loss
    )
    report = validate(
        plan(result.schedule, pp_size=pp, num_microbatches=result.num_microbatches, vp_size=vp)
    )

    def time(counts: tuple[int, ...]) -> float:
        costs = StageCosts.from_layers(counts, layer=LAYER, embedding=embedding, loss=loss)
        return simulate(report, costs).makespan

    return result, time


@pytest.mark.parametrize(
    ("num_layers", "pp", "vp", "embedding", "loss"),
    [
        (61, 8, 1, LAYER, HEAVY_LOSS),
        (61, 8, 1, None, None),
        (30, 4, 2, None, HEAVY_LOSS),
        (6, 4, 1, None, Costs(forward=2.0, backward=4.0)),
        (7, 2, 1, HEAVY_LOSS, HEAVY_LOSS),
    ],
)
def test_the_choice_is_never_slower_than_the_near_even_split(
    num_layers: int, pp: int, vp: int, embedding: Costs | None, loss: Costs | None
) -> None:
    result, time = _balance(num_layers, pp, vp, embedding, loss)
    assert sum(result.counts) == num_layers
    assert len(result.counts) == pp * vp
    assert min(result.counts[1:-1], default=1) >= 1
    assert result.makespan <= result.even_makespan
    assert result.even == even_counts(num_layers, pp * vp)
    # The makespan reported is the simulator's for that split.
    assert time(result.counts) == pytest.approx(result.makespan)
    assert min(result.tried.values()) == pytest.approx(result.makespan)


def test_six_layers_with_a_heavy_loss_on_four_ranks() -> None:
    result = balance_layers(6, 4, layer_cost=LAYER, loss_cost=Costs(forward=2.0, backward=4.0))
    # The loss costs two layers: stages of 2, 2, 2 and (0 layers + loss) are all equal.
    assert result.counts == (2, 2, 2, 0)
    assert (result.makespan, result.even_makespan) == (66.0, 87.0)
    table = result.table(limit=2).splitlines()
    assert table[1].startswith("* 2, 2, 2, 0")
    assert table[-1].startswith("  2, 2, 1, 1")
    assert table[-1].endswith("near-even")


def test_ties_go_to_the_most_even_split_then_to_the_smaller_counts() -> None:
    # GPipe, 2 microbatches. (2, 1): rank 0's last backward runs 11-15 after rank 1's end
    # at 9; (1, 2): rank 1's backwards run 5-13, rank 0's last 13-15. Both take 15.
    result = balance_layers(3, 2, layer_cost=LAYER, schedule="gpipe", num_microbatches=2)
    assert result.tried[(2, 1)] == result.tried[(1, 2)] == 15.0
    assert result.counts == (1, 2)
    # One microbatch through GPipe takes the sum of all stages whatever the split: the
    # even split wins on evenness alone.
    assert balanced_counts(4, 2, layer_cost=LAYER, schedule="gpipe", num_microbatches=1) == (2, 2)


def test_fewer_layers_than_stages_leave_only_the_ends_empty() -> None:
    # 3 layers on 5 stages: the near-even split (1, 1, 1, 0, 0) empties a middle stage.
    result = balance_layers(3, 5, layer_cost=LAYER)
    assert result.counts == (0, 1, 1, 1, 0)
    assert result.even == (1, 1, 1, 0, 0)
    assert result.even_makespan != result.even_makespan  # NaN: not a layout
    assert "near-even" not in result.table()


def test_near_even_counts_put_the_extra_layers_first() -> None:
    assert even_counts(6, 4) == (2, 2, 1, 1)
    assert even_counts(61, 8) == (8, 8, 8, 8, 8, 7, 7, 7)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((2, 8), ValueError, "2 layers cannot fill 8 virtual stages: each of the 6 middle"),
        ((2.5, 2), TypeError, "num_layers must be an int, got 2.5"),
        ((-1, 1), ValueError, "num_layers must be 0 or more, got -1"),
    ],
)
def test_impossible_splits_are_refused(
    args: tuple[object, int], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        balance_layers(*args)  # type: ignore[arg-type]


def _all_splits(num_layers: int, num_stages: int) -> list[tuple[int, ...]]:
    """Every split with middle stages holding at least one layer (brute force)."""
    if num_stages == 1:
        return [(num_layers,)]
    splits = []
    for first in range(num_layers + 1):
        for rest in _all_splits(num_layers - first, num_stages - 1):
            middle = (first, *rest)[1:-1]
            if min(middle, default=1) >= 1:
                splits.append((first, *rest))
    return splits


@pytest.mark.parametrize(
    ("num_layers", "pp", "vp", "embedding", "loss"),
    [
        (7, 3, 1, LAYER, HEAVY_LOSS),
        (6, 4, 1, None, Costs(forward=2.0, backward=4.0)),
        (9, 4, 1, HEAVY_LOSS, LAYER),
        (7, 2, 2, None, HEAVY_LOSS),
    ],
)
def test_the_search_finds_the_fastest_of_all_splits(
    num_layers: int, pp: int, vp: int, embedding: Costs | None, loss: Costs | None
) -> None:
    result, time = _balance(num_layers, pp, vp, embedding, loss)
    best = min(time(split) for split in _all_splits(num_layers, pp * vp))
    assert result.makespan == pytest.approx(best)
