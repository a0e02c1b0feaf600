"""Posting orders are free of deadlock for every pipeline size and every combination of slots."""

from __future__ import annotations

import itertools

import pytest

from pp_comm import SLOTS, Slot, batched_order, find_deadlock, unbatched_order

EDGE_FLOWS = [(False, False), (False, True), (True, False), (True, True)]


def plans_for(flows: tuple[tuple[bool, bool], ...], post: str) -> list[list[Slot]]:
    """Per-stage slots for a ring where edge s -> s+1 carries activations and/or gradients."""
    pp = len(flows)
    slots: list[set[Slot]] = [set() for _ in range(pp)]
    for stage, (activations, gradients) in enumerate(flows):
        nxt = (stage + 1) % pp
        if activations:
            slots[stage].add("send_next")
            slots[nxt].add("recv_prev")
        if gradients:
            slots[nxt].add("send_prev")
            slots[stage].add("recv_next")
    if post == "unbatched":
        return [unbatched_order(stage, slots[stage]) for stage in range(pp)]
    return [batched_order(slots[stage]) for stage in range(pp)]


@pytest.mark.parametrize("pp", range(2, 9))
def test_unbatched_order_never_deadlocks(pp: int) -> None:
    # Every combination of traffic on every edge of the ring, ends wrapping included.
    for flows in itertools.product(EDGE_FLOWS, repeat=pp):
        plans = plans_for(flows, "unbatched")
        assert find_deadlock(plans) is None, (pp, flows, plans)


def test_the_checker_finds_a_deadlock_when_everyone_sends_first() -> None:
    # Every stage sends to the next, then receives from the previous: a cycle of waits.
    plans: list[list[Slot]] = [["send_next", "recv_prev"] for _ in range(4)]
    found = find_deadlock(plans)
    assert found is not None
    assert "stage 0 waits in send_next" in found


def test_the_checker_refuses_an_unmatched_operation() -> None:
    with pytest.raises(ValueError, match="stage 0 posts send_next but stage 1 posts no recv_prev"):
        find_deadlock([["send_next"], []])


def test_orders_keep_only_the_slots_asked_for() -> None:
    assert unbatched_order(0, {"recv_prev", "send_next"}) == ["send_next", "recv_prev"]
    assert unbatched_order(1, {"recv_prev", "send_next"}) == ["recv_prev", "send_next"]
    assert unbatched_order(3, set(SLOTS)) == ["recv_prev", "send_next", "recv_next", "send_prev"]
    # Megatron's batch order, the same on every rank.
    assert batched_order(reversed(SLOTS)) == ["send_prev", "recv_prev", "send_next", "recv_next"]
