"""Per-stage costs: uneven layouts are timed stage by stage, through the plan's placement."""

from __future__ import annotations

import pytest

from pp_schedules import Costs, StageCosts
from pp_schedules.planning import choose_schedule, plan, simulate, validate

LAYER = Costs(forward=1.0, backward=2.0)


def _makespan(name: str, counts: tuple[int, ...], m: int) -> float:
    report = validate(plan(name, pp_size=len(counts), num_microbatches=m))
    return simulate(report, StageCosts.from_layers(counts, layer=LAYER)).makespan


@pytest.mark.parametrize(
    ("name", "m", "counts", "expected"),
    [
        # GPipe, 2 microbatches. (3, 1): rank 0 forwards 0-3, 3-6; rank 1 forwards 3-4, 6-7
        # and backwards 7-9, 9-11; rank 0 backwards 9-15, 15-21.
        ("gpipe", 2, (3, 1), 21.0),
        # Even: (m + p - 1) slots of F + B = 6.
        ("gpipe", 2, (2, 2), 18.0),
        # 1F1B, 4 microbatches. (3, 1): rank 0 never waits after its first forward and runs
        # 4 x (3 + 6); rank 1's steps fit in its gaps.
        ("1f1b", 4, (3, 1), 36.0),
        ("1f1b", 4, (2, 2), 30.0),
        # Three stages, the middle heavy. Forwards: rank 0 0-1, 1-2; rank 1 1-3, 3-5; rank 2
        # 3-4, 5-6. Backwards: rank 2 6-8, 8-10; rank 1 8-12, 12-16; rank 0 12-14, 16-18.
        ("gpipe", 2, (1, 2, 1), 18.0),
    ],
)
def test_makespans_of_uneven_counts_match_the_hand_computed_ones(
    name: str, m: int, counts: tuple[int, ...], expected: float
) -> None:
    assert _makespan(name, counts, m) == pytest.approx(expected)


def test_the_same_cost_on_every_stage_times_like_costs() -> None:
    report = validate(plan("interleaved_1f1b", pp_size=4, num_microbatches=8, vp_size=2))
    costs = Costs(forward=1.0, backward=2.0, transfer=0.25, exchange=0.1)
    uniform = simulate(report, StageCosts.from_stages([costs] * 8))
    assert uniform.makespan == pytest.approx(simulate(report, costs).makespan)
    assert uniform.spans == simulate(report, costs).spans


def test_a_stage_is_found_through_the_placement() -> None:
    # On the V placement with 2 ranks, stage 3 (the last) is chunk 1 of rank 0.
    report = validate(plan("zbv", pp_size=2, num_microbatches=4, vp_size=2, placement="v"))
    costs = StageCosts(forward=(1.0, 1.0, 1.0, 5.0), backward=(2.0, 2.0, 2.0, 2.0))
    result = simulate(report, costs)
    forwards = {
        (span.rank, span.action.chunk): span.end - span.start
        for spans in result.spans
        for span in spans
        if span.action.kind == "F"
    }
    assert forwards == {(0, 0): 1.0, (0, 1): 5.0, (1, 0): 1.0, (1, 1): 1.0}
    halves = {
        (span.action.kind, span.rank, span.action.chunk): span.end - span.start
        for spans in result.spans
        for span in spans
        if span.action.kind in "IW"
    }
    assert set(halves.values()) == {1.0}


def test_embedding_and_loss_weigh_on_the_first_and_last_stage() -> None:
    costs = StageCosts.from_layers(
        (0, 2, 2, 1),
        layer=Costs(forward=1.0, backward=2.0, transfer=0.5),
        embedding=Costs(forward=0.5, backward=1.0),
        loss=Costs(forward=3.0, backward=4.0, backward_input=1.0, backward_weight=3.0),
    )
    assert costs.forward == (0.5, 2.0, 2.0, 4.0)
    assert costs.backward == (1.0, 4.0, 4.0, 6.0)
    assert costs.backward_input == (0.5, 2.0, 2.0, 2.0)
    assert costs.backward_weight == (0.5, 2.0, 2.0, 4.0)
    assert (costs.transfer, costs.of("W", 3), costs.of("B", 0)) == (0.5, 4.0, 1.0)


def test_an_uneven_timeline_draws_heavier_stages_longer() -> None:
    report = validate(plan("gpipe", pp_size=2, num_microbatches=2))
    result = simulate(report, StageCosts.from_layers((3, 1), layer=LAYER))
    # Makespan 21: one cell per time unit; rank 0's steps are three times rank 1's.
    assert result.timeline(width=21).splitlines() == [
        "rank 0 |000111...aaaaaabbbbbb| bubble 14%",
        "rank 1 |...0..1aabb..........| bubble 71%",
    ]


def test_choose_schedule_takes_stage_costs() -> None:
    costs = StageCosts.from_layers((1, 2, 2, 3), layer=LAYER)
    choice = choose_schedule(pp_size=2, num_microbatches=4, vp_size=2, costs=costs)
    assert choice.stage_costs == costs
    assert choice.costs is None
    report = validate(choice.plan)
    assert choice.chosen.makespan == pytest.approx(simulate(report, costs).makespan)
    assert plan("auto", pp_size=2, num_microbatches=4, vp_size=2, costs=costs).placement


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: StageCosts(forward=(1.0, 1.0), backward=(2.0,)), "one forward, backward"),
        (lambda: StageCosts(forward=(), backward=()), "one forward, backward"),
        (lambda: StageCosts(forward=(1.0,), backward=(-2.0,)), "must not be negative"),
        (lambda: StageCosts.from_layers((2, -1), layer=LAYER), r"none below 0, got \(2, -1\)"),
        (
            lambda: StageCosts.from_stages([LAYER, Costs(transfer=1.0)]),
            "same transfer and exchange",
        ),
        (
            lambda: simulate(
                validate(plan("1f1b", pp_size=2, num_microbatches=2)),
                StageCosts.from_layers((1, 1, 1), layer=LAYER),
            ),
            "cover 3 virtual stages, but the plan has 2",
        ),
        (
            lambda: choose_schedule(
                pp_size=2, num_microbatches=4, costs=StageCosts.from_layers((1,), layer=LAYER)
            ),
            "cover 1 virtual stages, but 2 ranks x 1 chunks make 2",
        ),
    ],
)
def test_bad_stage_costs_are_refused(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()  # type: ignore[operator]
