"""NCCL's matching rules in the validator: the known patterns refused, gloo's tags accepting them."""

from __future__ import annotations

import pytest

from pp_schedules import PlanError, parse_schedule, plan, validate

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
        "posts RECV_F1 (header): both are transfer 1 from rank 0 to rank 1 on the pipeline "
        "group, which NCCL pairs by posting order alone (tags ignored)\n"
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
        "SEND_B0 of rank 1 step 5 (ranks 1 -> 0 on the pipeline group match in posting "
        "order), but rank 1 has not posted it: it waits at step 1 (F0) for a transfer that "
        "cannot complete"
    )
    assert "[RECV_B0]" in str(refused.value)
    assert "[SEND_B0]" in str(refused.value)


@pytest.mark.reliability
@pytest.mark.parametrize("pp", [3, 4, 8])
def test_receives_prefetched_ahead_of_sends_the_other_way_hang(pp: int) -> None:
    # Beyond two ranks gradients share the pipeline group with activations: a receive
    # posted an exchange early holds the batch, and the stream, until its sender gets there.
    one_f_one_b = plan("1f1b", pp_size=pp, num_microbatches=2 * pp)
    validate(one_f_one_b, prefetch=1)
    with pytest.raises(PlanError, match="the plan hangs on NCCL: rank"):
        validate(one_f_one_b, prefetch=1, transport="nccl")


@pytest.mark.reliability
def test_two_streams_on_one_link_in_different_orders_mis_pair() -> None:
    # The V placement beyond two ranks: rank 0 sends rank 1 activations (stage 0 -> 1) and
    # gradients (stage 7 -> 6) on one group, in an order rank 1 does not receive them in.
    zbv = plan("zbv", pp_size=4, num_microbatches=8, vp_size=2)
    validate(zbv)
    with pytest.raises(PlanError) as refused:
        validate(zbv, transport="nccl")
    first = str(refused.value).splitlines()[0]
    assert first.startswith("the plan mis-pairs on NCCL: rank 0 step 13 posts SEND_F6 and ")
    assert "rank 1 step 16 posts RECV_B0.1: both are transfer 6 from rank 0 to rank 1" in first


@pytest.mark.reliability
def test_an_unknown_transport_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown transport 'mpi'; valid: gloo, nccl"):
        validate(plan("1f1b", pp_size=2, num_microbatches=2), transport="mpi")


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
def test_one_chunk_schedules_pass_the_nccl_rules(name: str, pp: int) -> None:
    least = pp if name == "zb_h1" else 1  # ZB-H1 needs pp_size microbatches or more
    for m in sorted({max(m, least) for m in (1, 2, pp - 1, pp, pp + 1, 2 * pp + 3)}):
        for forward_only in (False, True):
            actions = plan(name, pp_size=pp, num_microbatches=m, forward_only=forward_only)
            gloo = validate(actions, forward_only=forward_only)
            nccl = validate(actions, forward_only=forward_only, transport="nccl")
            assert nccl.steps == gloo.steps  # the rules refuse or accept; they change nothing
