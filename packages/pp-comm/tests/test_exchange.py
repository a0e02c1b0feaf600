"""The general exchange: many messages per call, pairing by order across groupings, wait_recv."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator, P2PMessage, P2PTimeoutError
from pp_testing import run_distributed

TIMEOUT = datetime.timedelta(seconds=30)


def _config(batched: bool, shapes: str, timeout: datetime.timedelta = TIMEOUT) -> CommConfig:
    return CommConfig(
        batch_p2p_comm=batched,
        variable_seq_lengths=shapes == "variable",
        debug=shapes == "debug",
        timeout=timeout,
    )


def _values(received: list[torch.Tensor] | None) -> list[list[float]]:
    assert received is not None
    return [t.detach().tolist() for t in received]


def _several_per_slot(batched: bool, shapes: str) -> list[object]:
    comm = P2PCommunicator(dist.group.WORLD, config=_config(batched, shapes))
    s = comm.stage

    def known(length: int) -> tuple[int, ...] | None:
        return None if shapes == "variable" else (length,)

    # Two activations to the next stage, one gradient to the previous, around the ring; the
    # receives are listed before and between the sends on purpose (posting order is by slot).
    received, handle = comm.exchange(
        [
            P2PMessage(slot="recv_prev", shapes=known(1), microbatch=0),
            P2PMessage(slot="send_next", tensors=[torch.full((1,), 10.0 + s)], microbatch=0),
            P2PMessage(slot="recv_next", shapes=known(3)),
            P2PMessage(slot="send_next", tensors=[torch.full((2,), 20.0 + s)], microbatch=1),
            P2PMessage(slot="recv_prev", shapes=known(2), microbatch=1),
            P2PMessage(slot="send_prev", tensors=[torch.full((3,), -30.0 - s)]),
        ]
    )
    assert handle.is_completed()
    assert [r is None for r in received] == [False, True, False, True, False, True]
    comm.destroy()
    return [_values(r) for r in received if r is not None]


@pytest.mark.parametrize("shapes", ["fixed", "variable"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_several_messages_per_slot_arrive_in_order(batched: bool, shapes: str) -> None:
    for stage, got in enumerate(run_distributed(_several_per_slot, 3, batched, shapes)):
        prev, nxt = (stage - 1) % 3, (stage + 1) % 3
        assert got == [[[10.0 + prev]], [[-30.0 - nxt] * 3], [[20.0 + prev] * 2]]


def _grouped_differently(batched: bool, shapes: str) -> list[object]:
    comm = P2PCommunicator(dist.group.WORLD, config=_config(batched, shapes))

    def recv(slot: str, length: int, mb: int) -> P2PMessage:
        shape = None if shapes == "variable" else (length, 2)
        return P2PMessage(slot=slot, shapes=shape, microbatch=mb)  # type: ignore[arg-type]

    def send(slot: str, length: int, value: float, mb: int) -> P2PMessage:
        return P2PMessage(slot=slot, tensors=[torch.full((length, 2), value)], microbatch=mb)  # type: ignore[arg-type]

    seen: list[object] = []
    if comm.stage == 0:
        # Two activations in one call; their gradients come back in one call too.
        comm.exchange([send("send_next", 1, 1.0, 0), send("send_next", 3, 2.0, 1)])
        received, _ = comm.exchange([recv("recv_next", 4, 0), recv("recv_next", 5, 1)])
        seen = [_values(r) for r in received]
    else:
        # The same messages, one per call.
        seen.append(_values(comm.exchange([recv("recv_prev", 1, 0)])[0][0]))
        seen.append(_values(comm.exchange([recv("recv_prev", 3, 1)])[0][0]))
        comm.exchange([send("send_prev", 4, -1.0, 0)])
        comm.exchange([send("send_prev", 5, -2.0, 1)])
    comm.destroy()
    return seen


@pytest.mark.parametrize("shapes", ["fixed", "variable", "debug"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_pairing_holds_when_the_two_sides_group_messages_differently(
    batched: bool, shapes: str
) -> None:
    first, second = run_distributed(_grouped_differently, 2, batched, shapes)
    assert first == [[[[-1.0, -1.0]] * 4], [[[-2.0, -2.0]] * 5]]
    assert second == [[[[1.0, 1.0]]], [[[2.0, 2.0]] * 3]]


def _wait_recv_leaves_the_send(batched: bool) -> list[object]:
    comm = P2PCommunicator(dist.group.WORLD, config=_config(batched, "fixed"))
    facts: list[object] = []
    if comm.stage == 0:
        received, handle = comm.exchange(
            [
                P2PMessage(slot="send_next", tensors=[torch.ones(4)]),
                P2PMessage(slot="recv_next", shapes=(2,)),
            ],
            async_op=True,
        )
        handle.wait_recv()  # returns although stage 1 has not posted the receive of our send
        facts += [_values(received[1]), handle.is_completed()]
        dist.barrier()
        handle.wait()
        facts.append(handle.is_completed())
    else:
        comm.exchange([P2PMessage(slot="send_prev", tensors=[torch.full((2,), 7.0)])])
        dist.barrier()  # stage 0 passed wait_recv before this receive was posted
        facts.append(_values(comm.exchange([P2PMessage(slot="recv_prev", shapes=(4,))])[0][0]))
    comm.destroy()
    return facts


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_wait_recv_leaves_sends_in_flight_and_wait_completes_them(batched: bool) -> None:
    first, second = run_distributed(_wait_recv_leaves_the_send, 2, batched, timeout=60)
    assert first == [[[7.0, 7.0]], False, True]
    assert second == [[[1.0] * 4]]


def _wait_one_receive() -> list[object]:
    comm = P2PCommunicator(dist.group.WORLD, config=_config(False, "fixed"))
    facts: list[object] = []
    if comm.stage == 0:
        received, handle = comm.exchange(
            [
                P2PMessage(slot="recv_next", shapes=(2,), microbatch=0),
                P2PMessage(slot="recv_next", shapes=(2,), microbatch=1),
            ],
            async_op=True,
        )
        # The second receive's send is posted only after stage 1 hears from us, which
        # happens only once we got the first: waiting for both here would never return.
        handle.wait_recv([0])
        facts.append(_values(received[0]))
        comm.exchange([P2PMessage(slot="send_next", tensors=[torch.ones(1)])])
        handle.wait_recv([1])
        facts.append(_values(received[1]))
    else:
        comm.exchange([P2PMessage(slot="send_prev", tensors=[torch.zeros(2)])])
        comm.exchange([P2PMessage(slot="recv_prev", shapes=(1,))])
        comm.exchange([P2PMessage(slot="send_prev", tensors=[torch.full((2,), 2.0)])])
    comm.destroy()
    return facts


def test_wait_recv_can_wait_for_one_receive_of_a_call() -> None:
    first, _ = run_distributed(_wait_one_receive, 2, timeout=60)
    assert first == [[[0.0, 0.0]], [[2.0, 2.0]]]


def _wait_send_leaves_the_receive() -> list[object]:
    comm = P2PCommunicator(dist.group.WORLD, config=_config(False, "fixed"))
    facts: list[object] = []
    if comm.stage == 0:
        received, handle = comm.exchange(
            [
                P2PMessage(slot="send_next", tensors=[torch.ones(3)]),
                P2PMessage(slot="recv_next", shapes=(2,)),
            ],
            async_op=True,
        )
        # Stage 1 sends only after the barrier: waiting for the receive here would hang.
        handle.wait_send()
        facts.append(handle.is_completed())
        dist.barrier()
        handle.wait_recv()
        facts += [_values(received[1]), handle.is_completed()]
    else:
        got = comm.exchange([P2PMessage(slot="recv_prev", shapes=(3,))])[0][0]
        assert got is not None
        dist.barrier()
        comm.exchange([P2PMessage(slot="send_prev", tensors=[got[0][:2] * 5])])
    comm.destroy()
    return facts


def test_wait_send_leaves_receives_pending_on_gloo() -> None:
    first, _ = run_distributed(_wait_send_leaves_the_receive, 2, timeout=60)
    assert first == [False, [[5.0, 5.0]], True]


def _two_streams_one_way() -> list[object]:
    comm = P2PCommunicator(dist.group.WORLD, config=_config(False, "fixed"))
    facts: list[object] = []
    if comm.stage == 0:  # activations, then gradients of another chunk, both to stage 1
        comm.exchange(
            [
                P2PMessage(slot="send_next", tensors=[torch.full((2,), 1.0)], channel="forward"),
                P2PMessage(slot="send_next", tensors=[torch.full((3,), 2.0)], channel="backward"),
            ]
        )
    elif comm.stage == 1:  # takes them the other way round, each from its own stream
        gradients = comm.exchange([P2PMessage(slot="recv_prev", shapes=(3,), channel="backward")])
        activations = comm.exchange([P2PMessage(slot="recv_prev", shapes=(2,), channel="forward")])
        facts += [_values(gradients[0][0]), _values(activations[0][0])]
    comm.destroy()
    return facts


def test_a_link_carries_activations_and_gradients_apart() -> None:
    """A V placement beyond two stages sends both kinds the same way; each pairs on its own."""
    _, second, _ = run_distributed(_two_streams_one_way, 3, timeout=60)
    assert second == [[[2.0, 2.0, 2.0]], [[1.0, 1.0]]]


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        (
            {"slot": "sideways"},
            ValueError,
            "slot must be one of send_next, recv_prev, send_prev, recv_next; got 'sideways'",
        ),
        (
            {"slot": "recv_prev", "shapes": (2,), "channel": "both"},
            ValueError,
            "channel must be 'forward', 'backward' or None; got 'both'",
        ),
        (
            {"slot": "send_next"},
            ValueError,
            "a send_next message needs at least one tensor to send",
        ),
        (
            {"slot": "send_prev", "tensors": [torch.ones(1)], "shapes": (1,)},
            ValueError,
            "a send_prev message sends its tensors as they are; shapes describe what a receive gets",
        ),
        (
            {"slot": "recv_prev", "tensors": [torch.ones(1)]},
            ValueError,
            "a recv_prev message receives into new tensors: give it shapes",
        ),
        (
            {"slot": "send_next", "tensors": torch.ones(2)},
            TypeError,
            "wrap a single tensor in a list",
        ),
        ({"slot": "send_next", "tensors": [1.0]}, TypeError, "can only send tensors, got float"),
        (
            {"slot": "recv_next", "microbatch": "3"},
            TypeError,
            "microbatch must be an int or None, got '3'",
        ),
    ],
)
def test_bad_messages_are_refused_when_built(
    fields: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        P2PMessage(**fields)  # type: ignore[arg-type]


def _bad_exchanges() -> list[str]:
    comm = P2PCommunicator(dist.group.WORLD, config=CommConfig(timeout=TIMEOUT))
    errors = []
    for messages in (
        [P2PMessage(slot="send_next", tensors=[torch.ones(1)]), "recv_prev"],
        [P2PMessage(slot="recv_prev")],
        [P2PMessage(slot="recv_prev", shapes=[(1,), (2,)], dtypes=[torch.float32])],
    ):
        try:
            comm.exchange(messages, operation="step 3")  # type: ignore[arg-type]
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    comm.destroy()
    return errors


def test_bad_exchanges_fail_before_anything_is_posted() -> None:
    for errors in run_distributed(_bad_exchanges, 2):
        assert errors == [
            "step 3: expected P2PMessage objects, got 'recv_prev'",
            "step 3: receiving needs tensor_shapes, unless the communicator is configured with "
            "variable_seq_lengths=True",
            "step 3: 1 dtypes for 2 tensors; give one dtype or one per tensor",
        ]


def _one_message_lost(batched: bool) -> dict[str, object]:
    config = _config(batched, "fixed", timeout=datetime.timedelta(seconds=1.5))
    comm = P2PCommunicator(dist.group.WORLD, config=config)
    if comm.stage == 0:
        comm.exchange([P2PMessage(slot="send_next", tensors=[torch.ones(2)], microbatch=3)])
        time.sleep(4)  # alive, but microbatch 4 never comes
        return {}
    try:
        comm.exchange(
            [
                P2PMessage(slot="recv_prev", shapes=(2,), microbatch=3),
                P2PMessage(slot="recv_prev", shapes=(5,), microbatch=4),
            ],
            operation="step 7",
        )
    except P2PTimeoutError as error:
        return {
            "message": str(error),
            "fields": (error.rank, error.peer, error.operation, error.microbatch),
        }
    return {"message": "no error"}


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_a_lost_message_times_out_naming_its_microbatch(batched: bool) -> None:
    report = run_distributed(_one_message_lost, 2, batched, timeout=60)[1]
    assert report["fields"] == (1, 0, "step 7", 4)
    assert str(report["message"]).startswith(
        "rank 1 (stage 1 of 2) timed out after 1.5 s in step 7 (microbatch 4): "
        "receiving from rank 0 (stage 0) a float32 tensor of shape (5,). Cause:"
    )


def _stream_group_problems(comm: P2PCommunicator) -> list[str]:
    """Each stream of this rank on a two-rank group of its own (what NCCL needs)."""
    streams = comm._topology.stream_groups
    s, n = comm.stage, comm.num_stages
    neighbours = {(s + 1) % n, (s - 1) % n}
    wanted = {
        (a, b, c) for p in neighbours for a, b in ((s, p), (p, s)) for c in ("forward", "backward")
    }
    problems = [] if set(streams) == wanted else [f"streams {sorted(streams)}"]
    if len({id(g) for g in streams.values()}) != len(streams):
        problems.append("two streams share a process group")
    for (a, b, _), group in streams.items():
        if dist.get_process_group_ranks(group) != sorted((a, b)):
            problems.append(f"stream {a}->{b}: group {dist.get_process_group_ranks(group)}")
    if comm.transport != "nccl":
        problems.append(f"transport {comm.transport}")
    return problems


def _nccl_structure() -> list[str]:
    # No GPUs here: run the structure NCCL gets (coalesced batches, a two-rank process group
    # per stream, headers before data on each stream) over gloo, which can run it too, by
    # telling pp-comm that tags do not separate messages.
    import pp_comm.communicator
    import pp_comm.transport

    for module in (pp_comm.transport, pp_comm.communicator):
        module.__dict__["matches_by_tag"] = lambda device: False
    problems = []
    for batched in (True, False):
        for shapes in ("fixed", "variable", "debug"):
            comm = P2PCommunicator(dist.group.WORLD, config=_config(batched, shapes))
            s, n = comm.stage, comm.num_stages
            problems += _stream_group_problems(comm)
            known = None if shapes == "variable" else (2,)
            received, handle = comm.exchange(
                [
                    P2PMessage(slot="send_next", tensors=[torch.full((2,), 10.0 + s)]),
                    P2PMessage(slot="send_next", tensors=[torch.full((2,), 20.0 + s)]),
                    P2PMessage(slot="recv_next", shapes=known),
                    P2PMessage(slot="send_prev", tensors=[torch.full((2,), -1.0 - s)]),
                    P2PMessage(slot="recv_prev", shapes=known),
                    P2PMessage(slot="recv_prev", shapes=known),
                ],
                async_op=True,
            )
            handle.wait_recv()
            handle.wait()
            got = [_values(r)[0][0] for r in received if r is not None]
            prev, nxt = (s - 1) % n, (s + 1) % n
            if got != [-1.0 - nxt, 10.0 + prev, 20.0 + prev]:
                problems.append(f"{batched} {shapes}: {got}")
            comm.destroy()
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_the_structure_nccl_gets_delivers_in_order(world: int) -> None:
    for problems in run_distributed(_nccl_structure, world, timeout=120):
        assert problems == []
