"""Contract checks by default (frames, see `pp_comm.framing`): a message whose count, dtype or
shape differs from what its receiver asked for raises `P2PMismatchError` on both sides, naming
ranks, operation, microbatch and both specs (the sender at its next receive from that peer);
matching messages, inline or following their frame, arrive intact and in order."""

from __future__ import annotations

import datetime
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from pp_comm import (
    CommConfig,
    FrameBuffers,
    P2PCommunicator,
    P2PMessage,
    P2PMismatchError,
    frame_buffers,
    framing,
)
from pp_comm.framing import FRAME_HEADER_BYTES, INLINE_BYTES
from pp_testing import run_distributed

TIMEOUT = datetime.timedelta(seconds=20)
LARGE = INLINE_BYTES // 4 + 1  # float32 elements of a payload too large to travel inline


def _comm(batched: bool = True) -> P2PCommunicator:
    config = CommConfig(batch_p2p_comm=batched, timeout=TIMEOUT)
    return P2PCommunicator(dist.group.WORLD, config=config)


def _mismatch(
    batched: bool, sent: list[torch.Tensor], shape: tuple[int, ...], sized_tags: bool = True
) -> list[object]:
    """Stage 0 sends `sent` (microbatch 5), stage 1 asks for one float32 tensor of `shape`;
    stage 0 then waits for the gradient of microbatch 5. Then both refuse further calls."""
    if not sized_tags:
        _without_sized_tags()
    comm = _comm(batched)
    seen: list[object] = []
    try:
        if comm.is_first_stage:
            comm.send_forward(sent, microbatch=5)
            comm.recv_backward((2,), microbatch=5)
        else:
            comm.recv_forward(shape, microbatch=5)
    except P2PMismatchError as error:
        seen.append(str(error))
        seen.append((error.rank, error.peer, error.operation, error.microbatch))
        seen.append(([str(s) for s in error.expected], [str(s) for s in error.sent]))
    try:
        comm.send_forward(torch.ones(2)) if comm.is_first_stage else comm.recv_forward((2,))
    except ValueError as error:
        seen.append(str(error).split(";")[0])
    return seen


CASES = {
    "shape": ([torch.ones(3, 4)], (2, 4), "a float32 tensor of shape (3, 4)"),
    "dtype": ([torch.ones(4, dtype=torch.int32)], (4,), "an int32 tensor of shape (4,)"),
    "numel": ([torch.ones(6)], (4,), "a float32 tensor of shape (6,)"),
    "count": (
        [torch.ones(4), torch.ones(1)],
        (4,),
        "[float32 tensor of shape (4,), float32 tensor of shape (1,)]",
    ),
    "large": ([torch.ones(LARGE)], (4,), f"a float32 tensor of shape ({LARGE},)"),
    # The receiver posts large receives with the frame, under tags naming their sizes.
    "larger large": (
        [torch.ones(2 * LARGE)],
        (LARGE,),
        f"a float32 tensor of shape ({2 * LARGE},)",
    ),
    "smaller large": ([torch.ones(LARGE)], (2 * LARGE,), f"a float32 tensor of shape ({LARGE},)"),
    "large shape": ([torch.ones(LARGE, 2)], (2, LARGE), f"a float32 tensor of shape ({LARGE}, 2)"),
    "inline for large": ([torch.ones(4)], (LARGE,), "a float32 tensor of shape (4,)"),
    "large count": (
        [torch.ones(LARGE), torch.ones(LARGE)],
        (LARGE,),
        f"[float32 tensor of shape ({LARGE},), float32 tensor of shape ({LARGE},)]",
    ),
}


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("batched", "sized_tags"),
    [(True, True), (False, True), (True, False)],
    ids=["batched", "unbatched", "data tag"],
)
@pytest.mark.parametrize("case", list(CASES))
def test_a_mismatch_raises_on_both_sides_naming_both_specs(
    batched: bool, sized_tags: bool, case: str
) -> None:
    """numel, count, large, larger large, large count: without frames (or, for the large
    receives posted with their frames, without sized tags) gloo aborts the receiving process."""
    sent, shape, sent_text = CASES[case]
    expected_text = f"a float32 tensor of shape {shape}"
    sender, receiver = run_distributed(_mismatch, 2, batched, sent, shape, sized_tags, timeout=60)
    sent_specs = [f"{str(t.dtype)[6:]} tensor of shape {tuple(t.shape)}" for t in sent]
    specs = ([expected_text.removeprefix("a ")], sent_specs)
    assert sender == [
        f"rank 0 (stage 0) in send_forward (microbatch 5): sent {sent_text} to rank 1 "
        f"(stage 1), but it expected {expected_text} (reported to recv_backward (microbatch 5))",
        (0, 1, "send_forward", 5),
        specs,
        "rank 0: send_forward on a communicator broken by an earlier failure (recv_backward "
        "received a mismatch notice)",
    ]
    assert receiver == [
        f"rank 1 (stage 1) in recv_forward (microbatch 5): expected {expected_text} from "
        f"rank 0 (stage 0), but it sent {sent_text}",
        (1, 0, "recv_forward", 5),
        specs,
        "rank 1: recv_forward on a communicator broken by an earlier failure (recv_forward "
        "received a mismatched message)",
    ]


def _combined() -> list[object]:
    """1F1B steady state: the activation is right, the gradient has the wrong dtype; the
    receiving stage 0 raises in the call, stage 1 at its next receive from stage 0."""
    comm = _comm()
    try:
        if comm.is_first_stage:
            comm.send_forward_recv_backward(torch.ones(2), (2,), microbatch=3)
        else:
            comm.send_backward_recv_forward(torch.ones(2, dtype=torch.float64), (2,), microbatch=3)
            comm.recv_forward((2,), microbatch=4)
    except P2PMismatchError as error:
        return [str(error), error.operation, error.microbatch]
    return ["no error"]


@pytest.mark.reliability
def test_a_mismatch_inside_a_combined_operation_raises_on_both_sides() -> None:
    first, second = run_distributed(_combined, 2, timeout=60)
    assert first == [
        "rank 0 (stage 0) in send_forward_recv_backward (microbatch 3): expected a float32 "
        "tensor of shape (2,) from rank 1 (stage 1), but it sent a float64 tensor of shape (2,)",
        "send_forward_recv_backward",
        3,
    ]
    assert second == [
        "rank 1 (stage 1) in send_backward_recv_forward (microbatch 3): sent a float64 tensor "
        "of shape (2,) to rank 0 (stage 0), but it expected a float32 tensor of shape (2,) "
        "(reported to recv_forward (microbatch 4))",
        "send_backward_recv_forward",
        3,
    ]


def _without_sized_tags() -> None:
    """Make every large tensor too large for a sized tag (it follows its frame, data tag)."""
    framing.SIZED_TAG_BYTES = 0
    framing._forget_signatures()


def _mixed(sized_tags: bool = True) -> list[list[float]]:
    """Large and inline messages on one stream, waited for out of order, of every dtype kind."""
    if not sized_tags:
        _without_sized_tags()
    comm = _comm()
    values = [torch.arange(float(LARGE)), torch.arange(5.0), torch.arange(float(LARGE)) * 2]
    mask = torch.tensor([True, False, True])
    if comm.is_first_stage:
        messages = [P2PMessage(slot="send_next", tensors=[v]) for v in values]
        messages.append(P2PMessage(slot="send_next", tensors=[mask, torch.arange(3)]))
        comm.exchange(messages[:2])
        comm.exchange(messages[2:])
        return []
    shapes = [(LARGE,), (5,), (LARGE,)]
    receives = [P2PMessage(slot="recv_prev", shapes=shape) for shape in shapes]
    receives.append(
        P2PMessage(slot="recv_prev", shapes=[(3,), (3,)], dtypes=[torch.bool, torch.int64])
    )
    received, handle = comm.exchange(receives, async_op=True)
    handle.wait_recv(messages=[2])  # finishes the receives posted before it first
    handle.wait()
    tensors = [t for message in received if message is not None for t in message]
    assert [t.dtype for t in tensors[3:]] == [torch.bool, torch.int64]
    return [[float(t[0]), float(t[-1]), float(t.sum())] for t in tensors]


@pytest.mark.parametrize("sized_tags", [True, False], ids=["sized tags", "data tag"])
def test_inline_and_following_payloads_arrive_in_order(sized_tags: bool) -> None:
    """Large tensors travel under sized tags (their receives posted with the frame), or,
    beyond `SIZED_TAG_BYTES`, under the data tag once the frame is read."""
    _, received = run_distributed(_mixed, 2, sized_tags, timeout=60)
    total = float(LARGE * (LARGE - 1) / 2)
    assert received == [
        [0.0, LARGE - 1.0, total],
        [0.0, 4.0, 10.0],
        [0.0, 2.0 * (LARGE - 1), 2 * total],
        [1.0, 1.0, 2.0],
        [0.0, 2.0, 3.0],
    ]


def _unframeable() -> str:
    comm = _comm()
    try:
        if comm.is_first_stage:
            comm.send_forward(torch.ones(2, dtype=torch.complex64))
        else:
            comm.recv_forward((2,), dtypes=torch.complex64)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_dtype_a_header_cannot_describe_is_refused_before_posting() -> None:
    sender, receiver = run_distributed(_unframeable, 2, timeout=60)
    for operation, text in (("send_forward", sender), ("recv_forward", receiver)):
        assert text.startswith(f"{operation}: dtype torch.complex64 cannot travel; use one of")
        assert text.endswith("(or turn off CommConfig.check_contracts)")


def _late_receiver() -> list[list[float]]:
    """Stage 0 posts three same-size sends before any is waited for; stage 1 receives late."""
    comm = _comm()
    if comm.is_first_stage:
        handles = [
            comm.exchange(
                [P2PMessage(slot="send_next", tensors=[torch.full((5,), float(i))])],
                async_op=True,
            )[1]
            for i in range(3)
        ]
        for handle in handles:
            handle.wait()
        return []
    time.sleep(0.5)  # the sends are still pending in gloo, their frames unread
    received = comm.exchange([P2PMessage(slot="recv_prev", shapes=(5,)) for _ in range(3)])[0]
    return [message[0].tolist() for message in received if message is not None]


def test_a_frame_is_not_reused_while_its_send_is_pending() -> None:
    """Send frames are reused, but only once their send is complete."""
    _, received = run_distributed(_late_receiver, 2, timeout=60)
    assert received == [[float(i)] * 5 for i in range(3)]


# ------------------------------------------------------------------ what frames cost
def _allocated_sizes(step: Callable[[], object]) -> list[int]:
    """The sizes of the storages `step` allocates (torch.profiler's allocator events)."""
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            step()
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return [e["args"]["Bytes"] for e in events if e.get("name") == "[memory]"
            and e["args"]["Bytes"] > 0]  # fmt: skip


def _framed_transfer() -> list[int]:
    comm = _comm()
    frames = comm.frames
    payload = torch.randn(1000)  # 4,000 bytes: copied into its frame
    if comm.stage == 0:
        sizes = _allocated_sizes(lambda: comm.send_forward(payload))
        expected = frames.send_header_bytes + payload.nbytes
    else:
        sizes = _allocated_sizes(lambda: comm.recv_forward(tensor_shapes=[(1000,)]))
        expected = frames.receive_frame_bytes
    comm.destroy()
    return [expected, *sizes]


def test_the_frames_a_communicator_describes_are_the_ones_it_allocates() -> None:
    """pp-comm's `frames` are what a memory model takes: checked against torch.profiler."""
    for stage, (expected, *sizes) in enumerate(run_distributed(_framed_transfer, 2, timeout=60)):
        assert expected in sizes, (stage, expected, sizes)
        if stage == 1:  # the receive's buffer as well, then the frame
            assert 1000 * 4 in sizes


def test_frame_buffers_follow_the_transport_and_the_contract_checks() -> None:
    framed = frame_buffers(CommConfig())
    assert framed == FrameBuffers(
        receive_frame_bytes=FRAME_HEADER_BYTES + INLINE_BYTES,
        send_header_bytes=FRAME_HEADER_BYTES,
        inline_bytes=INLINE_BYTES,
        spare_frames=8,
    )
    bare = FrameBuffers()
    assert frame_buffers(CommConfig(), "nccl") == bare
    assert frame_buffers(CommConfig(check_contracts=False)) == bare
    assert frame_buffers(CommConfig(variable_seq_lengths=True)) == bare
    assert frame_buffers(CommConfig(), scatter_gather=True) == bare
    with pytest.raises(ValueError, match="transport 'mpi' is unknown; valid: gloo, nccl"):
        frame_buffers(CommConfig(), "mpi")
