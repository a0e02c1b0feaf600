"""The validator accepts every generated plan and refuses broken ones, drawing the grid."""

from __future__ import annotations

import pytest

from pp_schedules import PlanError, parse_schedule
from pp_schedules.planning import (
    Action,
    Step,
    format_plan,
    lower,
    lowered_actions,
    parse_plan,
    plan,
    validate,
)


def configurations(max_pp: int, max_m: int) -> list[tuple[str, int, int, int, int | None]]:
    found: list[tuple[str, int, int, int, int | None]] = []
    for pp in range(1, max_pp + 1):
        for m in range(1, max_m + 1):
            found += [("gpipe", pp, m, 1, None), ("1f1b", pp, m, 1, None)]
            if pp == 1:
                found.append(("no_pipelining", pp, m, 1, None))
            for vp in (2, 3):
                for group in range(pp, m + 1) if pp > 1 else []:
                    remainder = m % group
                    if remainder == 0 or remainder >= pp:
                        found.append(("interleaved_1f1b", pp, m, vp, group))
    return found


@pytest.mark.parametrize("pp", range(1, 9))
def test_every_generated_plan_validates(pp: int) -> None:
    for name, pp_size, m, vp, group in configurations(8, 12):
        if pp_size != pp:
            continue
        for forward_only in (False, True):
            actions = plan(
                name, pp_size=pp, num_microbatches=m, vp_size=vp,
                microbatch_group_size_per_vp_stage=group, forward_only=forward_only,
            )  # fmt: skip
            report = validate(actions, num_microbatches=m, vp_size=vp, forward_only=forward_only)
            assert len(report.steps) == pp


@pytest.mark.parametrize(("pp", "m"), [(2, 1), (4, 8), (8, 3), (8, 16)])
def test_one_f_one_b_holds_at_most_pp_minus_rank_microbatches(pp: int, m: int) -> None:
    report = validate(plan("1f1b", pp_size=pp, num_microbatches=m), num_microbatches=m)
    assert report.peak_in_flight == [min(pp - rank, m) for rank in range(pp)]
    gpipe = validate(plan("gpipe", pp_size=pp, num_microbatches=m), num_microbatches=m)
    assert gpipe.peak_in_flight == [m] * pp


def test_lowering_puts_transfers_next_to_their_compute() -> None:
    steps = lower(plan("1f1b", pp_size=3, num_microbatches=2))
    assert format_plan(lowered_actions(steps)) == [
        "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1",
        "RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1 RECV_B0 B0 SEND_B0 RECV_B1 B1 SEND_B1",
        "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1",
    ]
    # Transfers between two compute steps form one exchange (Megatron's combined calls).
    assert [str(step) for step in steps[1]][4:7] == ["SEND_F1+RECV_B0", "B0", "SEND_B0+RECV_B1"]


def test_prefetch_posts_each_receive_one_exchange_earlier() -> None:
    steps = lower(plan("1f1b", pp_size=3, num_microbatches=2), prefetch=1)
    assert format_plan(lowered_actions(steps)) == [
        "F0 SEND_F0 RECV_B0 F1 SEND_F1 RECV_B1 B0 B1",
        "RECV_F0 RECV_F1 F0 SEND_F0 RECV_B0 F1 SEND_F1 RECV_B1 B0 SEND_B0 B1 SEND_B1",
        "RECV_F0 RECV_F1 F0 B0 SEND_B0 F1 B1 SEND_B1",
    ]
    # The sends stay where they were; an exchange left empty is gone.
    assert [str(step) for step in steps[1]][:4] == [
        "RECV_F0+RECV_F1",
        "F0",
        "SEND_F0+RECV_B0",
        "F1",
    ]


def _transfers(steps: list[Step], receives: bool) -> list[Action]:
    return [
        message.action
        for step in steps
        if step.exchange
        for message in step.exchange.messages
        if message.is_send != receives
    ]


def _computes_before_receives(steps: list[Step]) -> dict[Action, int]:
    """For each receive, how many compute steps its rank runs before posting it."""
    found: dict[Action, int] = {}
    computes = 0
    for step in steps:
        computes += step.compute is not None
        for message in step.exchange.messages if step.exchange else ():
            if not message.is_send:
                found[message.action] = computes
    return found


@pytest.mark.parametrize("prefetch", [1, 2, 5])
@pytest.mark.parametrize(
    "case",
    [
        ("1f1b", 4, 8, 1, "looped"),
        ("gpipe", 3, 5, 1, "looped"),
        ("interleaved_1f1b", 2, 6, 2, "looped"),
        ("interleaved_1f1b", 4, 8, 2, "looped"),
        ("gpipe", 4, 4, 2, "v"),
    ],
)
def test_prefetched_plans_keep_every_transfer_in_order(
    case: tuple[str, int, int, int, str], prefetch: int
) -> None:
    name, pp, m, vp, placement = case
    actions = plan(name, pp_size=pp, num_microbatches=m, vp_size=vp, placement=placement)
    where = validate(actions).steps
    early = validate(actions, prefetch=prefetch).steps
    for rank in range(pp):
        # Same receives in the same order, same sends; computes untouched.
        assert _transfers(early[rank], True) == _transfers(where[rank], True)
        assert _transfers(early[rank], False) == _transfers(where[rank], False)
        assert [s.compute for s in early[rank] if s.compute] == list(actions[rank])
        # A receive of the j-th exchange is posted where the (j - prefetch)-th was (or the
        # first), that is after as many compute steps as that exchange followed.
        exchanges = [i for i, step in enumerate(where[rank]) if step.exchange]
        computes_at = [sum(s.compute is not None for s in where[rank][:i]) for i in exchanges]
        expected = {
            message.action: computes_at[max(j - prefetch, 0)]
            for j, i in enumerate(exchanges)
            for message in where[rank][i].exchange.messages  # type: ignore[union-attr]
            if not message.is_send
        }
        assert _computes_before_receives(early[rank]) == expected


def test_prefetch_is_not_negative() -> None:
    with pytest.raises(ValueError, match="prefetch must be 0"):
        lower(plan("1f1b", pp_size=2, num_microbatches=2), prefetch=-1)


def test_a_plan_that_writes_its_exchanges_is_not_prefetched() -> None:
    steps = validate(plan("1f1b", pp_size=2, num_microbatches=3)).steps
    text = "".join(f"rank {r}: " + " ".join(map(str, row)) + "\n" for r, row in enumerate(steps))
    written = parse_schedule(text)
    assert written.steps is not None
    assert lowered_actions(validate(written, prefetch=3).steps) == lowered_actions(
        validate(written).steps
    )


def test_interleaving_wraps_the_ring_between_chunks() -> None:
    steps = lower(plan("interleaved_1f1b", pp_size=2, num_microbatches=2, vp_size=2), vp_size=2)
    last_rank_sends = [
        m for step in steps[1] if step.exchange for m in step.exchange.messages if m.is_send
    ]
    # Rank 1 chunk 0 (virtual stage 1) feeds rank 0 chunk 1 (virtual stage 2).
    assert any(
        m.action == Action("SEND_F", 0, 0) and m.peer == 0 and m.peer_chunk == 1
        for m in last_rank_sends
    )


def test_a_plan_that_deadlocks_is_refused_with_the_grid() -> None:
    broken = parse_plan(["F0 F1 B0 B1", "B0 F0 F1 B1"])
    with pytest.raises(PlanError, match="runs before its forward"):
        validate(broken, num_microbatches=2)
    # Both ranks wait for each other: rank 0 needs B0's gradient before it forwards F1, while
    # rank 1 runs F1 (needing rank 0's F1) before B0.
    cyclic = parse_plan(["F0 B0 F1 B1", "F0 F1 B0 B1"])
    with pytest.raises(PlanError) as caught:
        validate(cyclic, num_microbatches=2)
    message = str(caught.value)
    assert message.startswith(
        "the plan deadlocks: rank 0 waits at step 1 (SEND_F0+RECV_B0); rank 1 waits at step 2 (RECV_F1)"
    )
    assert "rank 0: F0" in message
    assert "[SEND_F0+RECV_B0]" in message
    assert "[RECV_F1]" in message


def test_transfers_delivered_out_of_order_are_refused() -> None:
    # Rank 1 consumes microbatch 1 before 0, but rank 0 sends 0 first: FIFO matching would
    # hand F1 the activations of microbatch 0.
    swapped = parse_plan(["F0 F1 B0 B1", "F1 F0 B0 B1"])
    with pytest.raises(
        PlanError,
        match=r"transfer 0 from rank 0 to rank 1 on the forward channel would deliver the activations of microbatch 0",
    ):
        validate(swapped, num_microbatches=2)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["F0 B0 F0 B1 F1"], r"rank 0 step 2: F0 runs twice"),
        (["F0 B0"], r"rank 0 never runs F1, B1"),
        (["F0 B0 F1 B1 F2"], r"F2 is outside 2 microbatches, 1 chunks"),
        (["F0 F1 B0 B1 SEND_F0"], r"SEND_F0 is not a compute action"),
    ],
)
def test_incomplete_plans_are_refused(lines: list[str], message: str) -> None:
    with pytest.raises(PlanError, match=message) as caught:
        validate(parse_plan(lines), num_microbatches=2)
    assert "rank 0:" in str(caught.value)


def test_forward_only_plans_have_no_backward() -> None:
    with pytest.raises(PlanError, match=r"B0 is outside .* \(forward only\)"):
        validate(parse_plan(["F0 B0"]), num_microbatches=1, forward_only=True)
