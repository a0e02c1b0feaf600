"""Zero-bubble plans: ZB-H1 and ZB-V are valid, short and lean; split backwards are checked."""

from __future__ import annotations

import pytest

from pp_schedules import Costs, PlanError
from pp_schedules.planning import (
    Action,
    format_plan,
    lower,
    lowered_actions,
    parse_plan,
    plan,
    simulate,
    validate,
)

UNIT = Costs(forward=1, backward=2)  # F = I = W = 1 per chunk step


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("times", [1, 2, 3])
def test_zb_h1_is_short_and_holds_no_more_than_1f1b(pp: int, times: int) -> None:
    m = times * pp
    report = validate(plan("zb_h1", pp_size=pp, num_microbatches=m))
    assert simulate(report, UNIT).makespan <= 3 * m + 1.5 * (pp - 1)
    one_f_one_b = validate(plan("1f1b", pp_size=pp, num_microbatches=m))
    assert max(report.peak_in_flight) <= max(one_f_one_b.peak_in_flight)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("times", [1, 2, 3])
def test_zbv_is_short_and_holds_no_more_than_1f1b_in_half_chunks(pp: int, times: int) -> None:
    m = times * pp
    report = validate(plan("zbv", pp_size=pp, num_microbatches=m, vp_size=2))
    assert report.placement is not None
    assert report.placement.name == "v"
    bound = 6 * m + (pp - 1) if m >= 2 * pp else 6 * m + 2 * (pp - 1)
    assert simulate(report, UNIT).makespan <= bound
    one_f_one_b = validate(plan("1f1b", pp_size=pp, num_microbatches=m))
    assert max(report.peak_in_flight) <= 2 * max(one_f_one_b.peak_in_flight)


@pytest.mark.parametrize(("m", "ratio"), [(8, 0.82), (16, 0.89)])
def test_zb_h1_takes_the_textbook_share_of_1f1b(m: int, ratio: float) -> None:
    costs = Costs(forward=10, backward=20, backward_input=10, backward_weight=10)
    zb = simulate(validate(plan("zb_h1", pp_size=4, num_microbatches=m)), costs).makespan
    base = simulate(validate(plan("1f1b", pp_size=4, num_microbatches=m)), costs).makespan
    assert zb / base == pytest.approx(ratio, abs=0.005)


def test_split_backwards_lower_to_gradient_transfers_for_i_only() -> None:
    steps = lower(parse_plan(["F0 I0 W0", "F0 I0 W0"]))
    assert format_plan(lowered_actions(steps)) == [
        "F0 SEND_F0 RECV_B0 I0 W0",
        "RECV_F0 F0 I0 SEND_B0 W0",
    ]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["F0 W0 I0", "F0 I0 W0"], r"rank 0 step 1: W0 runs before I0"),
        (["I0 F0 W0", "F0 I0 W0"], r"rank 0 step 0: I0 runs before its forward"),
        (["F0 I0 B0", "F0 B0"], r"rank 0 step 2: B0 splits a backward that also runs whole"),
        (["F0 I0", "F0 B0"], r"rank 0 never runs W0"),
    ],
)
def test_split_backwards_out_of_order_are_refused(lines: list[str], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        validate(parse_plan(lines), num_microbatches=1)


def test_an_i_before_the_next_stages_i_deadlocks() -> None:
    # Rank 0's I0 waits for rank 1's I0, which comes after F1, which waits for rank 0's F1.
    with pytest.raises(
        PlanError, match=r"the plan deadlocks: rank 0 waits at step 1 \(SEND_F0\+RECV_B0\)"
    ):
        validate(parse_plan(["F0 I0 F1 W0 I1 W1", "F0 F1 I0 W0 I1 W1"]), num_microbatches=2)


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("zbv", {"vp_size": 1}, r"zbv runs two model chunks per rank in a V, but vp_size is 1"),
        ("zb_h1", {"vp_size": 2}, r"zb_h1 runs one model chunk per rank, but vp_size is 2"),
        ("zb_h1", {"num_microbatches": 3}, r"at least pp_size microbatches, got pp_size 4 and 3"),
        ("zbv", {"vp_size": 2, "placement": "looped"}, r"zbv runs on the V placement"),
    ],
)
def test_zero_bubble_refusals_name_the_rule(
    name: str, arguments: dict[str, object], message: str
) -> None:
    given: dict[str, object] = {"pp_size": 4, "num_microbatches": 8, **arguments}
    with pytest.raises(ValueError, match=message):
        plan(name, **given)  # type: ignore[arg-type]


def test_zero_bubble_timelines_draw_w_as_capitals() -> None:
    report = validate(plan("zb_h1", pp_size=2, num_microbatches=2))
    drawn = simulate(report, UNIT).timeline(width=7)
    assert drawn.splitlines()[1].startswith("rank 1 |.0a1bAB|")
    forward_only = plan("zbv", pp_size=2, num_microbatches=2, vp_size=2, forward_only=True)
    assert all(a.kind == "F" for rank in forward_only for a in rank)
    validate(forward_only, forward_only=True)
    assert Action("W", 0).is_compute
