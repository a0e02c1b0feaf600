"""NCCL's matching rules in the validator: the known patterns refused, gloo's tags accepting them."""

from __future__ import annotations

import pytest

from pp_schedules import Plan, PlanError, parse_schedule
from pp_schedules.planning import plan, validate
from pp_schedules.planning._nccl_rules import nccl_problem
from pp_schedules.planning._registry import schedules_for
from pp_schedules.planning._validation import Links

# Rank 0 sends two activations in two calls; rank 1 takes both in one.
_GROUPED_RECEIVES = """placement: looped
rank 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1
rank 1: RECV_F0+RECV_F1 F0 B0 SEND_B0 F1 B1 SEND_B1
"""

# Rank 1 posts RECV_F1 with RECV_F0, but rank 0 sends F1 only after it has B0 from rank 1.
_EARLY_RECEIVE = """placement: looped
rank 0: F0 SEND_F0 RECV_B0 B0 F1 SEND_F1 RECV_B1 B1
rank 1: RECV_F0+RECV_F1 F0 SEND_F0 RECV_B0 B0 SEND_B0 F1 SEND_F1 RECV_B1 B1 SEND_B1
rank 2: RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1
"""


@pytest.mark.reliability
def test_variable_shape_receives_posted_before_their_headers_mis_pair() -> None:
    grouped = parse_schedule(_GROUPED_RECEIVES)
    validate(grouped)
    validate(grouped, exchanges_shapes=True)  # gloo: headers and data have their own tags
    validate(grouped, transport="nccl")  # bare data pairs in the same order on both sides
    with pytest.raises(PlanError) as refused:
        validate(grouped, transport="nccl", exchanges_shapes=True)
    assert str(refused.value) == (
        "the plan mis-pairs on NCCL: rank 0 step 1 posts SEND_F0 (data) and rank 1 step 0 "
        "posts RECV_F1 (header): both are transfer 1 from rank 0 to rank 1 on the forward "
        "0->1 group, which NCCL pairs by posting order alone (tags ignored)\n"
        "rank 0: F0               [SEND_F0]        F1               SEND_F1          RECV_B0"
        "          B0               RECV_B1          B1\n"
        "rank 1: [RECV_F0+RECV_F1]F0               B0               SEND_B0          F1"
        "               B1               SEND_B1"
    )


@pytest.mark.reliability
def test_an_early_receive_in_a_batch_hangs() -> None:
    early = parse_schedule(_EARLY_RECEIVE)
    validate(early)
    with pytest.raises(PlanError) as refused:
        validate(early, transport="nccl")
    first = str(refused.value).splitlines()[0]
    assert first == (
        "the plan hangs on NCCL: rank 0 step 2 (RECV_B0) posts RECV_B0, which NCCL pairs with "
        "SEND_B0 of rank 1 step 5 (ranks 1 -> 0 on the backward 1->0 group match in posting "
        "order), but rank 1 has not posted it: it waits at step 1 (F0) for a transfer that "
        "cannot complete"
    )
    assert "[RECV_B0]" in str(refused.value)
    assert "[SEND_B0]" in str(refused.value)


def _shared_group_problem(actions: Plan, prefetch: int = 0) -> str:
    """The NCCL problem of a plan posted on one group for the whole pipeline, or ''."""
    steps = validate(actions, prefetch=prefetch).steps
    problem = nccl_problem(steps, Links(steps).consumer, stream_groups=False)
    return "" if problem is None else problem[0]


@pytest.mark.reliability
@pytest.mark.parametrize("pp", [3, 4, 8])
def test_receives_prefetched_ahead_of_sends_the_other_way_hang_on_a_shared_group(pp: int) -> None:
    # On one group for the pipeline, gradients share it with activations: a receive posted
    # an exchange early holds the batch, and the rank's later batches, until its sender gets
    # there. pp-comm's group per stream lets the sends go on.
    one_f_one_b = plan("1f1b", pp_size=pp, num_microbatches=2 * pp)
    assert _shared_group_problem(one_f_one_b, prefetch=1).startswith("the plan hangs on NCCL")
    validate(one_f_one_b, prefetch=1, transport="nccl")


@pytest.mark.reliability
def test_two_streams_on_one_link_in_different_orders_mis_pair_on_a_shared_group() -> None:
    # The V placement beyond two ranks: rank 0 sends rank 1 activations (stage 0 -> 1) and
    # gradients (stage 7 -> 6), in an order rank 1 does not receive them in. On one group
    # they pair with each other; pp-comm gives each stream its own group.
    zbv = plan("zbv", pp_size=4, num_microbatches=8, vp_size=2)
    first = _shared_group_problem(zbv)
    assert first.startswith("the plan mis-pairs on NCCL: rank 0 step 13 posts SEND_F6 and ")
    assert "rank 1 step 16 posts RECV_B0.1: both are transfer 6 from rank 0 to rank 1" in first
    validate(zbv, transport="nccl")


@pytest.mark.reliability
def test_an_unknown_transport_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown transport 'mpi'; valid: gloo, nccl"):
        validate(plan("1f1b", pp_size=2, num_microbatches=2), transport="mpi")


def _counts(name: str, pp: int, vp: int) -> list[int]:
    """Microbatch counts around the schedule's edges (its least, pp, a group, odd ones)."""
    least = {"zb_h1": pp, "zbv": pp, "dualpipev": 2 * pp}.get(name, 1)
    if name == "interleaved_1f1b":
        return [pp, 2 * pp, 3 * pp]
    return sorted({max(m, least) for m in (1, 2, pp - 1, pp, pp + 1, 2 * pp + 3)})


_BUILT_IN = [(name, vp) for vp in (1, 2, 3) for name, _ in schedules_for(vp)]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize(("name", "vp"), _BUILT_IN, ids=[f"{n}-vp{v}" for n, v in _BUILT_IN])
def test_every_built_in_schedule_passes_the_nccl_rules(name: str, vp: int, pp: int) -> None:
    """With and without shape headers, training and forward-only, as the executor lowers it."""
    for m in _counts(name, pp, vp):
        for forward_only in (False, True):
            actions = plan(
                name, pp_size=pp, num_microbatches=m, vp_size=vp, forward_only=forward_only
            )
            gloo = validate(actions, num_microbatches=m, forward_only=forward_only)
            for headers in (False, True):
                nccl = validate(
                    actions, num_microbatches=m, forward_only=forward_only, transport="nccl",
                    exchanges_shapes=headers,
                )  # fmt: skip
                assert nccl.steps == gloo.steps  # the rules refuse or accept; they change nothing
