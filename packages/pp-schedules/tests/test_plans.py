"""Plans as data: placement, text form (ours and torch's), written exchanges, and bad plans."""

from __future__ import annotations

import json

import pytest

from pp_schedules import Costs, Placement, Plan, PlanError, parse_schedule
from pp_schedules.planning import (
    format_plan,
    format_schedule,
    lowered_actions,
    parse_plan,
    plan,
    simulate,
    validate,
)
from pp_schedules.planning._validation import sends_delivered
from pp_schedules.runtime import MeasuredSpan, chrome_trace, summary


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("factor", [1, 2])
def test_plans_carry_their_placement_and_v_runs_where_valid(pp: int, factor: int) -> None:
    m = pp * factor
    looped = plan("gpipe", pp_size=pp, num_microbatches=m, vp_size=2)
    v = plan("gpipe", pp_size=pp, num_microbatches=m, vp_size=2, placement="v")
    assert looped.placement == Placement.looped(pp, 2)
    assert v.placement == Placement.v_shape(pp)
    report = validate(v)
    assert report.placement == v.placement
    # The turn of the V (stage p-1 to stage p) stays on the last rank: no transfer there.
    last = lowered_actions(report.steps)[pp - 1]
    assert not [
        a for a in last if a.kind in ("SEND_F", "RECV_F") and a.chunk == 1 and a.kind == "RECV_F"
    ]
    # Both placements do the same work; the simulator times either.
    costs = Costs(forward=1.0, backward=2.0)
    assert simulate(report, costs).makespan >= 6 * m
    assert simulate(validate(looped), costs).makespan >= 6 * m


def test_interleaving_on_the_v_placement_is_refused_with_the_grid() -> None:
    with pytest.raises(
        PlanError, match=r"the plan deadlocks: rank 0 waits at step 5 \(RECV_F1.1\)"
    ):
        validate(plan("interleaved_1f1b", pp_size=2, num_microbatches=4, vp_size=2, placement="v"))


def test_text_form_round_trips_with_placement_and_exchanges() -> None:
    original = plan("interleaved_1f1b", pp_size=2, num_microbatches=4, vp_size=2)
    text = format_schedule(original)
    assert text.startswith("placement: looped\nrank 0: F0 F1 F0.1 F1.1 F2 B0.1")
    assert parse_schedule(text) == original
    report = validate(original)
    written = Plan(original.actions, original.placement, tuple(map(tuple, report.steps)))
    again = parse_schedule(format_schedule(written))
    assert again.steps is not None
    assert [[str(s) for s in rank] for rank in again.steps] == [
        [str(s) for s in rank] for rank in report.steps
    ]


def test_torch_action_strings_give_chunks_through_the_stages_each_rank_uses() -> None:
    v = parse_schedule("0F0 3F0 3B0 0B0\n1F0 2F0 2B0 1B0")
    assert v.placement.name == "v"
    assert format_plan(v) == ["F0 F0.1 B0.1 B0", "F0 F0.1 B0.1 B0"]
    validate(v)
    one = parse_schedule("# torch's 1F1B\n0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1")
    assert one.placement == Placement.looped(2)
    assert validate(one).peak_in_flight == [2, 1]
    # torch's zero-bubble strings: I (input gradient) and W (weight gradient).
    split = parse_schedule("0F0 1F0 1I0 0I0 1W0 0W0\n")
    assert format_plan(split) == ["F0 F0.1 I0.1 I0 W0.1 W0"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("F0 X1 B0\nF0 B0", r"line 1 \(rank 0\): 'X1' is not an action"),
        ("rank 0: F0 B0\nrank 2: F0 B0", r"name ranks \[0, 2\]"),
        ("placement: zigzag\nF0 B0\nF0 B0", "neither a name"),
        ("placement: 0 0 | 1 2\nF0 F0.1 B0.1 B0\nF0 F0.1 B0.1 B0", "stage 0 is held twice"),
        ("F0 F0+SEND_F0 B0\nF0 B0", r"joins a compute step to an exchange"),
        ("0F0 0B0\n2F0 2B0", r"do not form a placement"),
        ("F0 SEND_F0 B0\nRECV_F0 F0 B0 SEND_B0 SEND_F0", r"line 2: rank 1: SEND_F0 moves nothing"),
    ],
)
def test_plan_text_that_does_not_parse_names_the_line_and_token(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_schedule(text)


ONE_F_ONE_B = """\
rank 0: F0 SEND_F0 F1 SEND_F1+RECV_B0 B0 RECV_B1 B1
rank 1: RECV_F0 F0 B0 SEND_B0+RECV_F1 F1 B1 SEND_B1
"""

EDITS = {
    # The send of F1 leaves as its own exchange, then the receive of B0 in another.
    "split": ONE_F_ONE_B.replace("SEND_F1+RECV_B0", "SEND_F1 RECV_B0"),
    # Rank 0 receives B1's gradient together with B0's.
    "merged": ONE_F_ONE_B.replace("SEND_F1+RECV_B0 B0 RECV_B1", "SEND_F1+RECV_B0+RECV_B1 B0"),
    # Rank 1 sends B0's gradient late, after F1.
    "moved": ONE_F_ONE_B.replace("B0 SEND_B0+RECV_F1 F1 B1", "B0 RECV_F1 F1 SEND_B0 B1"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edited_exchanges_validate_as_written(edit: str) -> None:
    written = parse_schedule(EDITS[edit])
    report = validate(written)
    assert [" ".join(map(str, rank)) + "\n" for rank in report.steps] != [
        " ".join(map(str, rank)) + "\n" for rank in validate(parse_schedule(ONE_F_ONE_B)).steps
    ]
    assert format_schedule(written).endswith(
        "\n".join("rank " + line.split("rank ", 1)[1] for line in EDITS[edit].splitlines()) + "\n"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ONE_F_ONE_B.replace(" RECV_B1 B1", " B1"), r"rank 0 never runs RECV_B1"),
        (ONE_F_ONE_B.replace("F0 SEND_F0 F1", "SEND_F0 F0 F1"), r"SEND_F0 must come after"),
        (
            ONE_F_ONE_B.replace(
                "B0 SEND_B0+RECV_F1 F1 B1 SEND_B1", "B0 RECV_F1 F1 B1 SEND_B1 SEND_B0"
            ),
            r"would deliver the gradients of microbatch 1 \(chunk 0 -> chunk 0\) where the gradients of microbatch 0",
        ),
        (
            ONE_F_ONE_B.replace("B0 RECV_B1 B1", "B0 RECV_B1 RECV_B1 B1"),
            r"not needed here or written twice",
        ),
    ],
)
def test_written_exchanges_that_miss_or_misplace_a_transfer_are_refused(
    text: str, message: str
) -> None:
    with pytest.raises(PlanError, match=message) as caught:
        validate(parse_schedule(text))
    assert "rank 0:" in str(caught.value)


def test_swapped_transfers_and_deadlocks_in_written_plans_are_refused() -> None:
    swapped = ONE_F_ONE_B.replace(
        "rank 1: RECV_F0 F0 B0 SEND_B0+RECV_F1 F1 B1 SEND_B1",
        "rank 1: RECV_F0+RECV_F1 F0 B0 SEND_B0 F1 B1 SEND_B1",
    )
    validate(parse_schedule(swapped))  # both arrive in order: fine
    crossed = "rank 0: F0 SEND_F0 F1 SEND_F1 RECV_B1 RECV_B0 B0 B1\nrank 1: RECV_F0 RECV_F1 F0 F1 B0 SEND_B0 B1 SEND_B1\n"
    with pytest.raises(
        PlanError,
        match=r"would deliver the gradients of microbatch 0 .* where the gradients of microbatch 1",
    ):
        validate(parse_schedule(crossed))
    stuck = "rank 0: F0 RECV_B0 B0 SEND_F0\nrank 1: RECV_F0 F0 B0 SEND_B0\n"
    with pytest.raises(PlanError, match=r"the plan deadlocks: rank 0 waits at step 1 \(RECV_B0\)"):
        validate(parse_schedule(stuck))


def test_hand_overs_within_a_rank_must_come_in_order() -> None:
    with pytest.raises(
        PlanError, match=r"F0.1 needs what F0 hands over on the same rank \(stages 1 -> 2\)"
    ):
        validate(Plan.of(parse_plan(["F0 F0.1 B0.1 B0", "F0.1 F0 B0.1 B0"]), Placement.v_shape(2)))


def test_sends_are_known_delivered_once_the_peer_answers() -> None:
    report = validate(plan("1f1b", pp_size=3, num_microbatches=3))
    # Rank 0's sends of F0 and F1 (steps 1 and 3) are known to have arrived once the gradient
    # of B0, which rank 1 sent after receiving both, is in: B0 (step 6) waits for it.
    assert sends_delivered(report.steps)[0] == {6: [1, 3], 8: [5]}


def test_exchange_cost_adds_to_every_exchange() -> None:
    report = validate(plan("1f1b", pp_size=2, num_microbatches=2))
    free = simulate(report, Costs())
    costly = simulate(report, Costs(exchange=0.25))
    assert costly.makespan > free.makespan
    with pytest.raises(ValueError, match="exchange=-1"):
        Costs(exchange=-1.0)


def test_chrome_trace_puts_measured_and_simulated_tracks_side_by_side() -> None:
    report = validate(plan("1f1b", pp_size=2, num_microbatches=1))
    simulated = simulate(report, Costs(forward=10.0, backward=20.0))
    measured = [
        [
            MeasuredSpan(0, "F0", "F", 0, 0, 100.0, 100.01),
            MeasuredSpan(0, "B0", "B", 0, 0, 100.05, 100.07),
        ],
        [
            MeasuredSpan(1, "F0", "F", 0, 0, 100.012, 100.022),
            MeasuredSpan(1, "B0", "B", 0, 0, 100.022, 100.042),
        ],
    ]
    trace = json.loads(chrome_trace(measured, simulated))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in spans} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"measured", "simulated"}
    first = next(e for e in spans if e["pid"] == 0 and e["name"] == "F0" and e["tid"] == 0)
    assert first["ts"] == 0.0
    assert first["dur"] == pytest.approx(10_000.0)
    line = summary(measured, simulated)
    assert line.startswith("measured makespan 70.0 ms")
    assert "simulated 60.0 ms" in line
    assert "measured/simulated 1.17" in line
