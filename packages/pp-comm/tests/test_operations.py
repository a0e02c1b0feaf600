"""Megatron's nine operations on real gloo pipelines of 2, 3, 4 and 8 stages."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator, Received, ShapesArg
from pp_testing import run_distributed

TIMEOUT = datetime.timedelta(seconds=30)


class Pipeline:
    """Builds payloads whose values say who sent them, in which step, for which microbatch."""

    def __init__(self, comm: P2PCommunicator, *, listed: bool, variable: bool) -> None:
        self.comm = comm
        self.listed = listed
        self.variable = variable
        self.problems: list[str] = []

    def payload(self, src: int, step: int) -> torch.Tensor | list[torch.Tensor]:
        # With variable shapes every sender and step has its own length.
        rows = 2 + (src + step if self.variable else 0)
        value = float(src * 100 + step)
        first = torch.full((rows, 3), value)
        if not self.listed:
            return first
        return [first, torch.full((rows + 1,), -value, dtype=torch.float64)]

    def shapes(self) -> ShapesArg:
        if self.variable:
            return [None, None] if self.listed else None
        return [(2, 3), (3,)] if self.listed else (2, 3)

    def dtypes(self) -> list[torch.dtype] | None:
        return [torch.float32, torch.float64] if self.listed else None

    def check(self, name: str, got: Received, src: int | None, step: int) -> None:
        if src is None:
            if got is not None:
                self.problems.append(f"{name}: expected nothing, got {got!r}")
            return
        if got is None:
            self.problems.append(f"{name}: expected data from stage {src}, got None")
            return
        expected = self.payload(src, step)
        got_list = got if isinstance(got, list) else [got]
        expected_list = expected if isinstance(expected, list) else [expected]
        if isinstance(got, list) != self.listed:
            self.problems.append(f"{name}: single/list form differs from the request")
        for g, e in zip(got_list, expected_list, strict=True):
            if g.shape != e.shape or g.dtype != e.dtype or not torch.equal(g.detach(), e):
                self.problems.append(
                    f"{name}: from stage {src} step {step}: got {g.shape} {g.dtype} {g.flatten()[:1]}"
                )
            if not g.requires_grad:
                self.problems.append(f"{name}: received tensor does not require grad")


def _every_operation(batched: bool, listed: bool, variable: bool) -> list[str]:
    config = CommConfig(batch_p2p_comm=batched, variable_seq_lengths=variable, timeout=TIMEOUT)
    comm = P2PCommunicator(dist.group.WORLD, config=config)
    p = Pipeline(comm, listed=listed, variable=variable)
    s, n = comm.stage, comm.num_stages
    shapes, dtypes = p.shapes(), p.dtypes()

    # 1. A forward pass: recv_forward then send_forward, stage after stage.
    x = comm.recv_forward(shapes, dtypes=dtypes)
    p.check("recv_forward", x, None if s == 0 else s - 1, 1)
    comm.send_forward(p.payload(s, 1))  # a no-op on the last stage

    # 2. A backward pass: recv_backward then send_backward, last stage first.
    g = comm.recv_backward(shapes, dtypes=dtypes)
    p.check("recv_backward", g, None if s == n - 1 else s + 1, 2)
    comm.send_backward(p.payload(s, 2))  # a no-op on the first stage

    # 3. 1F1B steady state between pairs of stages, then the pairs shifted by one, so every
    #    edge carries both calls; at the ends they are no-ops returning None.
    for shift, step in ((0, 3), (1, 5)):
        if (s - shift) % 2 == 0:
            got = comm.send_forward_recv_backward(p.payload(s, step), shapes, dtypes=dtypes)
            sender = s + 1 if s + 1 < n else None
            p.check("send_forward_recv_backward", got, sender, step + 1)
        else:
            got = comm.send_backward_recv_forward(p.payload(s, step + 1), shapes, dtypes=dtypes)
            sender = s - 1 if s >= 1 else None
            p.check("send_backward_recv_forward", got, sender, step)

    _ring_operations(comm, p, shapes, dtypes)
    comm.destroy()
    return p.problems


def _ring_operations(
    comm: P2PCommunicator, p: Pipeline, shapes: ShapesArg, dtypes: list[torch.dtype] | None
) -> None:
    """The calls whose ring wraps around (the last stage feeds the first), then overlap."""
    s, n = comm.stage, comm.num_stages
    prev, nxt = (s - 1) % n, (s + 1) % n
    # 4. The interleaved schedule's ring: the last stage feeds the first.
    got = comm.send_forward_recv_forward(p.payload(s, 7), True, shapes, dtypes=dtypes)
    p.check("send_forward_recv_forward", got, prev, 7)
    got = comm.send_backward_recv_backward(p.payload(s, 8), True, shapes, dtypes=dtypes)
    p.check("send_backward_recv_backward", got, nxt, 8)

    # 5. Both directions at once, around the ring.
    from_prev, from_next = comm.send_forward_backward_recv_forward_backward(
        p.payload(s, 9),
        p.payload(s, 10),
        True,
        True,
        shapes,
        dtypes=dtypes,
    )
    p.check("send_forward_backward_recv_forward_backward (forward)", from_prev, prev, 9)
    p.check("send_forward_backward_recv_forward_backward (backward)", from_next, nxt, 10)

    # 6. Overlap: post, do other work, then wait.
    received, handle = comm.send_forward_recv_forward(
        p.payload(s, 11),
        True,
        shapes,
        overlap_p2p_comm=True,
        dtypes=dtypes,
    )
    handle.wait()
    if not handle.is_completed():
        p.problems.append("handle not completed after wait")
    p.check("send_forward_recv_forward (overlapped)", received, prev, 11)
    received, handle = comm.send_backward_recv_backward(
        p.payload(s, 12),
        True,
        shapes,
        overlap_p2p_comm=True,
        dtypes=dtypes,
    )
    handle.wait()
    p.check("send_backward_recv_backward (overlapped)", received, nxt, 12)


CASES = [
    *[
        pytest.param(w, b, False, False, id=f"pp{w}-{'batched' if b else 'unbatched'}")
        for w in (2, 3, 4, 8)
        for b in (True, False)
    ],
    *[
        pytest.param(w, b, True, True, id=f"pp{w}-{'batched' if b else 'unbatched'}-lists-variable")
        for w in (2, 3, 4)
        for b in (True, False)
    ],
    pytest.param(8, True, False, True, id="pp8-batched-variable"),
    pytest.param(4, False, True, False, id="pp4-unbatched-lists"),
]


@pytest.mark.parametrize(("world", "batched", "listed", "variable"), CASES)
def test_every_operation_delivers_exactly_what_was_sent(
    world: int, batched: bool, listed: bool, variable: bool
) -> None:
    for rank, problems in enumerate(
        run_distributed(_every_operation, world, batched, listed, variable, timeout=120)
    ):
        assert problems == [], f"rank {rank}: {problems}"


def _two_stage_directions(batched: bool) -> tuple[list[float], list[int]]:
    """Activations and gradients between the same two ranks, at once and of the same size."""
    comm = P2PCommunicator(
        dist.group.WORLD, config=CommConfig(batch_p2p_comm=batched, timeout=TIMEOUT)
    )
    s = comm.stage
    activation = torch.full((4,), float(10 + s))
    gradient = torch.full((4,), float(-10 - s))
    # Megatron's crossed-tensor case: both messages from rank s go to the same peer, and in
    # the batched order each rank posts its gradient first, so matching by order alone
    # would hand the gradient to the receive meant for the activation.
    from_prev, from_next = comm.send_forward_backward_recv_forward_backward(
        activation, gradient, True, True, (4,)
    )
    assert isinstance(from_prev, torch.Tensor)
    assert isinstance(from_next, torch.Tensor)
    values = [from_prev[0].item(), from_next[0].item()]
    comm.destroy()
    return values, [comm.prev_rank, comm.next_rank]


@pytest.mark.parametrize("batched", [True, False])
def test_two_stages_never_cross_activations_and_gradients(batched: bool) -> None:
    (values0, peers0), (values1, peers1) = run_distributed(_two_stage_directions, 2, batched)
    assert peers0 == [1, 1]
    assert peers1 == [0, 0]
    # Activations arrive as activations (+), gradients as gradients (-).
    assert values0 == [11.0, -11.0]
    assert values1 == [10.0, -10.0]


def _ends_are_no_ops() -> list[object]:
    comm = P2PCommunicator(dist.group.WORLD, config=CommConfig(timeout=TIMEOUT))
    seen: list[object] = []
    if comm.is_first_stage:
        seen.append(comm.recv_forward((2,)))
        seen.append(comm.send_backward_recv_forward(torch.ones(2), (2,)))
        comm.send_backward(torch.ones(2))
    if comm.is_last_stage:
        seen.append(comm.recv_backward((2,)))
        seen.append(comm.send_forward_recv_backward(torch.ones(2), (2,)))
        comm.send_forward(torch.ones(2))
    # The wrap is explicit: is_first_stage=False lets stage 0 receive from the last stage.
    if comm.is_last_stage:
        comm.send_forward(torch.full((2,), 5.0), is_last_stage=False)
    if comm.is_first_stage:
        wrapped = comm.recv_forward((2,), is_first_stage=False)
        assert isinstance(wrapped, torch.Tensor)
        seen.append(wrapped.tolist())
    comm.destroy()
    return seen


def test_calls_past_the_ends_are_no_ops_unless_the_ring_wraps() -> None:
    first, middle, last = run_distributed(_ends_are_no_ops, 3)
    assert first == [None, None, [5.0, 5.0]]
    assert middle == []
    assert last == [None, None]


def _requires_grad_and_dtype() -> list[object]:
    config = CommConfig(timeout=TIMEOUT, pipeline_dtype=torch.bfloat16, recv_requires_grad=False)
    comm = P2PCommunicator(dist.group.WORLD, config=config)
    seen: list[object] = []
    if comm.is_first_stage:
        comm.send_forward(torch.ones(3, dtype=torch.bfloat16))
        comm.send_forward(torch.ones(3, dtype=torch.bfloat16))
    else:
        plain = comm.recv_forward((3,))
        graded, _, _ = comm.communicate(recv_prev=True, tensor_shapes=(3,), requires_grad=True)
        assert isinstance(plain, torch.Tensor)
        assert isinstance(graded, torch.Tensor)
        seen = [plain.dtype, plain.requires_grad, graded.requires_grad]
    comm.destroy()
    return seen


def test_pipeline_dtype_and_requires_grad_follow_the_config_and_the_call() -> None:
    _, seen = run_distributed(_requires_grad_and_dtype, 2)
    assert seen == [torch.bfloat16, False, True]


def _megatron_spelling() -> list[object]:
    """Every receiving operation with Megatron's ``tensor_shape=`` keyword, on two stages."""
    comm = P2PCommunicator(dist.group.WORLD, config=CommConfig(timeout=TIMEOUT))
    s = comm.stage
    mine = torch.full((2, 3), float(s + 1))
    seen: list[object] = []

    def note(got: object) -> None:
        if isinstance(got, (list, tuple)):
            seen.append([t.tolist() for t in got])  # a list of shapes gives lists
        else:
            seen.append(got.tolist() if isinstance(got, torch.Tensor) else got)

    if s == 0:
        comm.send_forward(mine)
        note(comm.recv_backward(tensor_shape=(2, 3)))
        note(comm.send_forward_recv_backward(mine, tensor_shape=(2, 3)))
    else:
        note(comm.recv_forward(tensor_shape=(2, 3)))
        comm.send_backward(mine)
        note(comm.send_backward_recv_forward(mine, tensor_shape=(2, 3)))
    note(comm.send_forward_recv_forward(mine, recv_prev=True, tensor_shape=(2, 3)))
    received, handle = comm.send_backward_recv_backward(
        mine, recv_next=True, tensor_shape=(2, 3), overlap_p2p_comm=True
    )
    handle.wait()
    note(received)
    from_prev, from_next = comm.send_forward_backward_recv_forward_backward(
        mine, mine, True, True, tensor_shape=[(2, 3)]
    )
    note(from_prev)
    note(from_next)
    comm.destroy()
    return seen


def test_megatron_tensor_shape_keyword_delivers_the_tensors() -> None:
    first, second = run_distributed(_megatron_spelling, 2)
    twos, ones = [[2.0] * 3] * 2, [[1.0] * 3] * 2
    # Stage 0 gets stage 1's values and the other way round.
    assert first == [twos, twos, twos, twos, [twos], [twos]]
    assert second == [ones, ones, ones, ones, [ones], [ones]]


def _both_spellings() -> list[str]:
    config = CommConfig(timeout=TIMEOUT)
    comm = P2PCommunicator(dist.group.WORLD, config=config)
    x = torch.ones(2)
    calls: list[Callable[[], object]] = [
        lambda: comm.recv_forward((2,), tensor_shape=(2,)),
        lambda: comm.recv_backward((2,), tensor_shape=(2,)),
        lambda: comm.send_forward_recv_backward(x, (2,), tensor_shape=(2,)),
        lambda: comm.send_backward_recv_forward(x, tensor_shapes=(2,), tensor_shape=(2,)),
        lambda: comm.send_forward_recv_forward(x, True, (2,), tensor_shape=(2,)),
        lambda: comm.send_backward_recv_backward(x, True, (2,), tensor_shape=(2,)),
        lambda: comm.send_forward_backward_recv_forward_backward(
            x, x, True, True, (2,), tensor_shape=(2,)
        ),
        comm.recv_forward,
        # Megatron's old module functions took a config after the shape: refused, not read
        # as is_first_stage=True (which would skip the receive) or as overlap_p2p_comm.
        lambda: comm.recv_forward((2,), cast(Any, config)),
        lambda: comm.send_forward_recv_forward(x, True, (2,), cast(Any, config)),
    ]
    messages = []
    for call in calls:
        with pytest.raises(TypeError) as caught:
            call()
        messages.append(str(caught.value))
    # Nothing was posted: the communicator still works.
    comm.send_forward_recv_forward(x * comm.stage, True, tensor_shape=(2,))
    comm.destroy()
    return messages


def test_both_spellings_of_the_shapes_or_a_config_as_a_flag_are_refused_before_posting() -> None:
    for messages in run_distributed(_both_spellings, 2):
        *both, neither, config_as_stage, config_as_overlap = messages
        assert "recv_forward(): is_first_stage must be a bool or None, got a CommConfig" in (
            config_as_stage
        )
        assert "overlap_p2p_comm must be a bool or None" in config_as_overlap
        for message in both:
            assert "got both tensor_shapes and tensor_shape" in message
        assert both[0].startswith("recv_forward()")
        assert both[-1].startswith("send_forward_backward_recv_forward_backward()")
        assert "needs the shapes to receive" in neither
