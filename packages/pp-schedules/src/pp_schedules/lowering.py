"""Lowering: insert the transfers a compute plan needs, grouped into exchanges.

Virtual stage ``chunk * pp_size + rank`` holds chunk ``chunk`` of rank ``rank``. A forward on
any virtual stage but the first receives its input from the stage before (``RECV_F``, placed
just before it) and, on any but the last, sends its output on (``SEND_F``, just after it).
Backwards mirror this with ``RECV_B`` / ``SEND_B``. The transfers between two compute steps of
a rank form one *exchange*, posted together and completed together (Megatron's combined calls,
such as ``send_forward_recv_backward``), which is how the executor runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from pp_schedules.actions import Action

__all__ = ["Exchange", "Message", "Step", "lower", "lowered_actions", "peer_of"]

Channel = Literal["forward", "backward"]


@dataclasses.dataclass(frozen=True)
class Message:
    """One transfer of one exchange.

    Attributes:
        action: The SEND_* or RECV_* action; its microbatch and chunk name the compute step
            that produces (for a send) or consumes (for a receive) the tensor.
        peer: The other rank.
        peer_chunk: The chunk of the compute step on the other side.
        channel: "forward" (activations) or "backward" (gradients).
    """

    action: Action
    peer: int
    peer_chunk: int
    channel: Channel

    @property
    def is_send(self) -> bool:
        """Whether this rank sends."""
        return self.action.kind.startswith("SEND")

    def key(self, rank: int) -> tuple[str, int, int, int]:
        """The tensor, named alike on both sides: channel, microbatch, sender and receiver chunk."""
        if self.is_send:
            return (self.channel, self.action.microbatch, self.action.chunk, self.peer_chunk)
        return (self.channel, self.action.microbatch, self.peer_chunk, self.action.chunk)


@dataclasses.dataclass(frozen=True)
class Exchange:
    """The transfers posted together between two compute steps of one rank."""

    messages: tuple[Message, ...]


@dataclasses.dataclass(frozen=True)
class Step:
    """A compute action or an exchange, in a rank's execution order."""

    compute: Action | None = None
    exchange: Exchange | None = None

    def __str__(self) -> str:
        """The compute action, or the exchange's actions joined by '+'."""
        if self.compute is not None:
            return str(self.compute)
        assert self.exchange is not None
        return "+".join(str(m.action) for m in self.exchange.messages)


def peer_of(rank: int, chunk: int, pp_size: int, step: int) -> tuple[int, int] | None:
    """The (rank, chunk) `step` virtual stages away (+1 next, -1 previous); None before 0."""
    virtual = chunk * pp_size + rank + step
    if virtual < 0:
        return None
    return virtual % pp_size, virtual // pp_size


def _incoming(action: Action, rank: int, pp_size: int, vp_size: int) -> Message | None:
    last_virtual = pp_size * vp_size - 1
    virtual = action.chunk * pp_size + rank
    if action.kind == "F" and virtual > 0:
        peer = peer_of(rank, action.chunk, pp_size, -1)
        assert peer is not None
        return Message(
            Action("RECV_F", action.microbatch, action.chunk), peer[0], peer[1], "forward"
        )
    if action.kind == "B" and virtual < last_virtual:
        peer = peer_of(rank, action.chunk, pp_size, +1)
        assert peer is not None
        return Message(
            Action("RECV_B", action.microbatch, action.chunk), peer[0], peer[1], "backward"
        )
    return None


def _outgoing(action: Action, rank: int, pp_size: int, vp_size: int) -> Message | None:
    last_virtual = pp_size * vp_size - 1
    virtual = action.chunk * pp_size + rank
    if action.kind == "F" and virtual < last_virtual:
        peer = peer_of(rank, action.chunk, pp_size, +1)
        assert peer is not None
        return Message(
            Action("SEND_F", action.microbatch, action.chunk), peer[0], peer[1], "forward"
        )
    if action.kind == "B" and virtual > 0:
        peer = peer_of(rank, action.chunk, pp_size, -1)
        assert peer is not None
        return Message(
            Action("SEND_B", action.microbatch, action.chunk), peer[0], peer[1], "backward"
        )
    return None


def lower(plan: Sequence[Sequence[Action]], *, vp_size: int = 1) -> list[list[Step]]:
    """Each rank's compute actions with the exchanges they need, in execution order.

    Args:
        plan: One list of compute actions per rank (see `pp_schedules.plan`).
        vp_size: Model chunks per rank.

    Returns:
        For each rank, its steps: compute actions, and between them at most one exchange
        holding the previous compute's send and the next compute's receive.

    Raises:
        ValueError: The plan holds a non-compute action or a chunk outside ``range(vp_size)``.
    """
    pp_size = len(plan)
    lowered: list[list[Step]] = []
    for rank, actions in enumerate(plan):
        steps: list[Step] = []
        pending: list[Message] = []
        for action in actions:
            if not action.is_compute:
                raise ValueError(f"rank {rank}: lower() takes compute actions only, got {action}")
            if not 0 <= action.chunk < vp_size:
                raise ValueError(
                    f"rank {rank}: {action} names chunk {action.chunk}, but vp_size is {vp_size}"
                )
            incoming = _incoming(action, rank, pp_size, vp_size)
            if incoming is not None:
                pending.append(incoming)
            if pending:
                steps.append(Step(exchange=Exchange(tuple(pending))))
            steps.append(Step(compute=action))
            outgoing = _outgoing(action, rank, pp_size, vp_size)
            pending = [outgoing] if outgoing is not None else []
        if pending:
            steps.append(Step(exchange=Exchange(tuple(pending))))
        lowered.append(steps)
    return lowered


def lowered_actions(steps: Sequence[Sequence[Step]]) -> list[list[Action]]:
    """The lowered plan as flat action lists (compute and SEND/RECV), e.g. for golden files."""
    flat: list[list[Action]] = []
    for rank_steps in steps:
        actions: list[Action] = []
        for step in rank_steps:
            if step.compute is not None:
                actions.append(step.compute)
            else:
                assert step.exchange is not None
                actions.extend(m.action for m in step.exchange.messages)
        flat.append(actions)
    return flat
