"""Debug mode's contract checks: a message whose count, dtype or shape differs from what its
receiver asked for raises `P2PMismatchError` on both sides, naming ranks, operation,
microbatch and both specs; nothing is left pending."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator, P2PMessage, P2PMismatchError
from pp_testing import run_distributed

pytestmark = pytest.mark.reliability

TIMEOUT = datetime.timedelta(seconds=20)


def _comm(batched: bool = True, debug: bool = True, checks: bool = True) -> P2PCommunicator:
    config = CommConfig(
        batch_p2p_comm=batched, debug=debug, check_contracts=checks, timeout=TIMEOUT
    )
    return P2PCommunicator(dist.group.WORLD, config=config)


def _report(error: P2PMismatchError) -> tuple[object, ...]:
    return (
        str(error),
        error.rank,
        error.peer,
        error.operation,
        error.microbatch,
        [str(spec) for spec in error.expected],
        [str(spec) for spec in error.sent],
    )


def _single_op(batched: bool) -> tuple[object, ...]:
    comm = _comm(batched)
    try:
        if comm.is_first_stage:
            comm.send_forward(torch.ones(3, 4), microbatch=5)
        else:
            comm.recv_forward((2, 4), microbatch=5)
    except P2PMismatchError as error:
        return _report(error)
    return ("no error",)


@pytest.mark.parametrize("batched", [True, False])
def test_a_shape_mismatch_raises_on_both_sides(batched: bool) -> None:
    sender, receiver = run_distributed(_single_op, 2, batched, timeout=60)
    assert sender == (
        "rank 0 (stage 0) in send_forward (microbatch 5): sent a float32 tensor of shape (3, 4) "
        "to rank 1 (stage 1), but it expected a float32 tensor of shape (2, 4)",
        0,
        1,
        "send_forward",
        5,
        ["float32 tensor of shape (2, 4)"],
        ["float32 tensor of shape (3, 4)"],
    )
    assert receiver == (
        "rank 1 (stage 1) in recv_forward (microbatch 5): expected a float32 tensor of shape (2, 4) "
        "from rank 0 (stage 0), but it sent a float32 tensor of shape (3, 4)",
        1,
        0,
        "recv_forward",
        5,
        ["float32 tensor of shape (2, 4)"],
        ["float32 tensor of shape (3, 4)"],
    )


def _combined(batched: bool, sent: torch.Tensor, shape: tuple[int, ...]) -> list[object]:
    """1F1B steady state: stage 0 sends activations and receives gradients in one call, stage 1
    the converse; the gradient is right, the activation is not. Then the link still works."""
    comm = _comm(batched)
    seen: list[object] = []
    try:
        if comm.is_first_stage:
            comm.send_forward_recv_backward(sent, (2,), microbatch=3)
        else:
            comm.send_backward_recv_forward(torch.ones(2), shape, microbatch=3)
    except P2PMismatchError as error:
        seen.append(_report(error))
    if comm.is_first_stage:
        comm.send_forward(torch.full((2,), 7.0))
    else:
        received = comm.recv_forward((2,))
        assert isinstance(received, torch.Tensor)
        seen.append(received.tolist())
    return seen


COMBINED = [
    (  # dtype: same bytes per element, another meaning
        torch.ones(4, dtype=torch.int32),
        "an int32 tensor of shape (4,)",
        "a float32 tensor of shape (4,)",
    ),
    (  # numel: without the check, gloo aborts the receiving process
        torch.ones(6),
        "a float32 tensor of shape (6,)",
        "a float32 tensor of shape (4,)",
    ),
]


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize(("sent", "sent_text", "expected_text"), COMBINED, ids=["dtype", "numel"])
def test_a_mismatch_inside_a_combined_operation_raises_on_both_sides(
    batched: bool, sent: torch.Tensor, sent_text: str, expected_text: str
) -> None:
    sender, receiver = run_distributed(_combined, 2, batched, sent, (4,), timeout=60)
    expected = [expected_text.split(" ", 1)[1]]
    specs = (expected, [sent_text.split(" ", 1)[1]])
    operation = "send_forward_recv_backward"
    assert sender == [
        (
            f"rank 0 (stage 0) in {operation} (microbatch 3): sent {sent_text} to rank 1 "
            f"(stage 1), but it expected {expected_text}",
            *(0, 1, operation, 3, *specs),
        )
    ]
    operation = "send_backward_recv_forward"
    assert receiver == [
        (
            f"rank 1 (stage 1) in {operation} (microbatch 3): expected {expected_text} from "
            f"rank 0 (stage 0), but it sent {sent_text}",
            *(1, 0, operation, 3, *specs),
        ),
        [7.0, 7.0],  # drained whole: the next message pairs up
    ]


def _count_mismatch() -> str:
    comm = _comm()
    try:
        if comm.is_first_stage:
            comm.send_forward([torch.ones(2), torch.ones(1)])
        else:
            comm.recv_forward((2,))
    except P2PMismatchError as error:
        return str(error)
    return "no error"


def test_a_tensor_count_mismatch_raises_on_both_sides() -> None:
    sender, receiver = run_distributed(_count_mismatch, 2, timeout=60)
    both = "[float32 tensor of shape (2,), float32 tensor of shape (1,)]"
    assert sender.endswith(
        f"sent {both} to rank 1 (stage 1), but it expected a float32 tensor of shape (2,)"
    )
    assert receiver.endswith(f"but it sent {both}")


def _async_sender() -> str:
    """An overlapped send learns of the mismatch when its handle completes the sends."""
    comm = _comm()
    try:
        if comm.is_first_stage:
            message = P2PMessage(slot="send_next", tensors=[torch.ones(3)], microbatch=9)
            _, handle = comm.exchange([message], operation="step 1", async_op=True)
            handle.wait_send()
        else:
            comm.recv_forward((2,), microbatch=0)
    except P2PMismatchError as error:
        return str(error)
    return "no error"


def test_an_overlapped_sender_raises_when_it_waits_for_its_sends() -> None:
    sender, receiver = run_distributed(_async_sender, 2, timeout=60)
    assert sender == (
        "rank 0 (stage 0) in step 1 (microbatch 9): sent a float32 tensor of shape (3,) to "
        "rank 1 (stage 1), but it expected a float32 tensor of shape (2,)"
    )
    assert receiver.endswith("but it sent a float32 tensor of shape (3,)")


def _unchecked() -> list[object]:
    comm = _comm(debug=False, checks=False)
    if comm.is_first_stage:
        comm.send_forward(torch.arange(12.0).reshape(3, 4))
        return []
    received = comm.recv_forward((4, 3))
    assert isinstance(received, torch.Tensor)
    return received.tolist()


def test_without_checks_a_same_size_shape_mismatch_goes_unnoticed() -> None:
    _, received = run_distributed(_unchecked, 2, timeout=60)
    assert received == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]


def _steady(batched: bool) -> list[float]:
    comm = _comm(batched)
    seen = []
    for step in range(40):
        shape = (2, 3) if step % 10 < 5 else (4,)
        if comm.is_first_stage:
            grad = comm.send_forward_recv_backward(
                torch.full(shape, float(step)), shape, microbatch=step
            )
            assert isinstance(grad, torch.Tensor)
            assert grad.shape == shape
            seen.append(grad.sum().item())
        else:
            x = comm.recv_forward(shape, microbatch=step)
            assert isinstance(x, torch.Tensor)
            comm.send_backward(-x, microbatch=step)
            seen.append(x.sum().item())
    return seen


@pytest.mark.parametrize("batched", [True, False])
def test_a_long_run_of_matching_transfers_stays_correct(batched: bool) -> None:
    first, second = run_distributed(_steady, 2, batched, timeout=60)
    sizes = [6 if step % 10 < 5 else 4 for step in range(40)]
    assert second == [float(step * n) for step, n in enumerate(sizes)]
    assert first == [-v for v in second]
