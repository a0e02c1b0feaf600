"""No silent hang, no silent mismatch: failures name the rank, peer, operation and microbatch."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator, P2PError, P2PTimeoutError
from pp_testing import DistributedTestError, run_distributed

pytestmark = pytest.mark.reliability


def _lost_receive(batched: bool) -> dict[str, object]:
    config = CommConfig(batch_p2p_comm=batched, timeout=datetime.timedelta(seconds=1.5))
    comm = P2PCommunicator(dist.group.WORLD, config=config)
    if comm.stage != 2:
        time.sleep(4)  # stay alive but never send: stage 2 must time out, not see a dead peer
        return {}
    try:
        comm.recv_forward((4, 2, 8), microbatch=7)
    except P2PTimeoutError as error:
        broken = ""
        try:
            comm.recv_forward((4, 2, 8))
        except ValueError as again:
            broken = str(again)
        return {
            "message": str(error),
            "fields": (error.rank, error.peer, error.operation, error.microbatch),
            "broken": broken,
        }
    return {"message": "no error"}


@pytest.mark.parametrize("batched", [True, False])
def test_a_receive_that_never_completes_times_out_with_its_context(batched: bool) -> None:
    report = run_distributed(_lost_receive, 4, batched, timeout=60)[2]
    message = str(report["message"])
    assert "rank 2 (stage 2 of 4) timed out after 1.5 s in recv_forward (microbatch 7)" in message
    assert "receiving from rank 1 (stage 1) a float32 tensor of shape (4, 2, 8)" in message
    assert report["fields"] == (2, 1, "recv_forward", 7)
    # A communicator with transfers left pending refuses further use.
    assert "broken by an earlier failure" in str(report["broken"])


def _peer_dies() -> None:
    comm = P2PCommunicator(
        dist.group.WORLD, config=CommConfig(timeout=datetime.timedelta(seconds=20))
    )
    # Both ranks finish building the communicator (gloo connects its groups while they are
    # created) before rank 1 leaves; otherwise rank 0 may fail inside construction instead.
    dist.barrier()
    if comm.stage == 1:
        import os

        os._exit(0)  # dies without sending
    try:
        comm.recv_backward((3,), microbatch=0)
    except P2PError as error:
        # Surface the report through the harness, which shows each rank's traceback.
        raise AssertionError(f"REPORT {type(error).__name__}: {error}") from None


def test_a_dead_peer_is_reported_as_a_failure_naming_it() -> None:
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_peer_dies, 2, timeout=60)
    assert caught.value.failures[1].status == "exited with code 0"
    report = caught.value.failures[0].detail
    assert (
        "REPORT P2PError: rank 0 (stage 0 of 2) failed in recv_backward (microbatch 0): "
        "receiving from rank 1 (stage 1) a float32 tensor of shape (3,). Cause:" in report
    )


def _bad_calls() -> list[str]:
    comm = P2PCommunicator(
        dist.group.WORLD, config=CommConfig(timeout=datetime.timedelta(seconds=20))
    )
    errors = []
    attempts: list[Callable[[], object]] = [
        lambda: comm.recv_forward(None, is_first_stage=False),
        lambda: comm.send_forward([torch.ones(1), "x"], is_last_stage=False),  # type: ignore[list-item]
        lambda: comm.recv_forward([(2,), (3,)], is_first_stage=False, dtypes=[torch.float32]),
    ]
    for attempt in attempts:
        try:
            attempt()
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    return errors


def test_bad_calls_fail_before_anything_is_posted() -> None:
    for errors in run_distributed(_bad_calls, 2, timeout=60):
        assert errors == [
            "recv_forward: receiving needs tensor_shapes, unless the communicator is configured with "
            "variable_seq_lengths=True",
            "send_forward: can only send tensors, got str",
            "recv_forward: 1 dtypes for 2 tensors; give one dtype or one per tensor",
        ]


def _one_stage() -> list[object]:
    comm = P2PCommunicator(dist.group.WORLD)
    seen: list[object] = [
        comm.recv_forward((2,)),
        comm.recv_backward((2,)),
        comm.next_rank,
        comm.prev_rank,
    ]
    try:
        comm.send_forward_recv_forward(torch.ones(2), True, (2,))
    except ValueError as error:
        seen.append(str(error))
    return seen


def test_a_one_stage_pipeline_has_no_peer() -> None:
    (seen,) = run_distributed(_one_stage, 1)
    assert seen == [
        None,
        None,
        0,
        0,
        "rank 0: send_forward_recv_forward on a pipeline of 1 stage: there is no peer",
    ]


def _not_a_member() -> str:
    group = dist.new_group([0, 1])
    # gloo connects a new group's members without a barrier: one that left at once could
    # close its connections while the other is still connecting.
    dist.barrier()
    if dist.get_rank() != 2:
        return ""
    try:
        P2PCommunicator(group)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_rank_outside_the_group_is_refused() -> None:
    assert (
        run_distributed(_not_a_member, 3)[2] == "rank 2 is not a member of the pipeline group given"
    )


def _int_and_bool_payloads(variable: bool) -> list[object]:
    config = CommConfig(variable_seq_lengths=variable, timeout=datetime.timedelta(seconds=20))
    comm = P2PCommunicator(dist.group.WORLD, config=config)
    if comm.is_first_stage:
        comm.send_forward([torch.arange(6).reshape(2, 3), torch.tensor([True, False])])
        return []
    shapes = None if variable else [(2, 3), (2,)]
    received = comm.recv_forward(
        [None, None] if variable else shapes, dtypes=[torch.int64, torch.bool]
    )
    assert isinstance(received, list)
    return [t.tolist() for t in received] + [t.requires_grad for t in received]


@pytest.mark.parametrize("variable", [False, True])
def test_integer_and_bool_payloads_arrive_without_requiring_grad(variable: bool) -> None:
    _, received = run_distributed(_int_and_bool_payloads, 2, variable)
    assert received == [[[0, 1, 2], [3, 4, 5]], [True, False], False, False]


def _count_differs() -> str:
    config = CommConfig(variable_seq_lengths=True, timeout=datetime.timedelta(seconds=20))
    comm = P2PCommunicator(dist.group.WORLD, config=config)
    if comm.is_first_stage:
        comm.send_forward([torch.ones(2), torch.ones(3)])
        return ""
    try:
        comm.recv_forward(None, microbatch=4)
    except ValueError as error:
        return str(error)
    return "no error"


def test_variable_shapes_refuse_a_different_tensor_count() -> None:
    _, message = run_distributed(_count_differs, 2)
    assert (
        message
        == "rank 1 (stage 1) in recv_forward (microbatch 4): asked for 1 tensor(s), but rank 0 sent 2"
    )


def _peer_gone_before_posting() -> None:
    comm = P2PCommunicator(
        dist.group.WORLD, config=CommConfig(timeout=datetime.timedelta(seconds=20))
    )
    # Both ranks finish building the communicator (gloo connects its groups while they are
    # created) before rank 1 leaves; otherwise rank 0 may fail inside construction instead.
    dist.barrier()
    if comm.stage == 1:
        import os

        os._exit(0)
    time.sleep(2)  # rank 1 is gone before anything is posted
    try:
        comm.send_forward(torch.ones(4), microbatch=2)
        comm.recv_backward((4,), microbatch=2)
    except P2PError as error:
        raise AssertionError(f"REPORT {type(error).__name__}: {error}") from None


def test_a_peer_gone_before_posting_is_reported_with_context() -> None:
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_peer_gone_before_posting, 2, timeout=60)
    report = caught.value.failures[0].detail
    assert "REPORT P2PError: rank 0 (stage 0 of 2) failed in " in report
    assert "rank 1 (stage 1)" in report


def _asymmetric_groups() -> list[float]:
    # Ranks 0 and 1 form a two-stage pipeline inside a world of 3, and rank 0 holds an extra
    # group the others do not: building the communicator must not depend on such counts.
    pipeline = dist.new_group([0, 1])
    if dist.get_rank() == 0:
        dist.new_group([0], use_local_synchronization=True)
    dist.barrier()  # every group is connected before rank 2 leaves (see _not_a_member)
    if dist.get_rank() == 2:
        return []
    comm = P2PCommunicator(pipeline, config=CommConfig(timeout=datetime.timedelta(seconds=20)))
    s = comm.stage
    from_prev, from_next = comm.send_forward_backward_recv_forward_backward(
        torch.full((2,), 10.0 + s), torch.full((2,), -10.0 - s), True, True, (2,)
    )
    assert isinstance(from_prev, torch.Tensor)
    assert isinstance(from_next, torch.Tensor)
    return [from_prev[0].item(), from_next[0].item()]


def test_two_stages_inside_a_larger_world_with_uneven_groups() -> None:
    first, second, _ = run_distributed(_asymmetric_groups, 3, timeout=60)
    assert first == [11.0, -11.0]
    assert second == [10.0, -10.0]
