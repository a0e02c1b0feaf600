"""Lowering: insert the transfers a compute plan needs, grouped into exchanges.

Which rank and chunk hold the stage before and after each compute step comes from the plan's
`pp_state.Placement` (looped by default). A forward on any virtual stage but the first receives
its input from the stage before (``RECV_F``, placed just before it) and, on any but the last,
sends its output on (``SEND_F``, just after it); backwards (``B``, or the input-gradient half
``I`` of a split one) mirror this with ``RECV_B`` / ``SEND_B``; a weight-gradient step ``W``
moves nothing. When the neighbouring stage sits on the same rank (the turn of a V), the tensor is
handed over in memory and no transfer is written.

The transfers between two compute steps of a rank form one *exchange*, posted together as one
pp-comm call and completed together (Megatron's combined calls, such as
``send_forward_recv_backward``). A plan may also carry its own exchanges (see
`pp_schedules.parse_schedule`); then they are taken as written and `validate` checks them.

With ``prefetch=k`` each receive is posted k exchanges earlier on its rank than the one just
before its step (at the earliest, in the rank's first exchange), keeping the order of
receives. A posted receive holds up nothing on gloo, whose transfers complete independently,
and there a send moves its data only once the peer has posted the receive: a receive posted
only when it is needed costs a round trip more than one posted a compute step ahead.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Literal

from pp_schedules.planning._actions import Action
from pp_state.placement import Placement

__all__ = [
    "Exchange",
    "Message",
    "Step",
    "incoming_message",
    "lower",
    "lowered_actions",
    "outgoing_message",
    "placement_of",
    "post_receives_early",
]

Channel = Literal["forward", "backward"]
Slot = Literal["send_next", "recv_prev", "send_prev", "recv_next"]

# Megatron's names for an exchange, by what it sends and receives (pp-comm's operations).
_OPERATIONS: dict[frozenset[str], str] = {
    frozenset({"SEND_F"}): "send_forward",
    frozenset({"SEND_B"}): "send_backward",
    frozenset({"RECV_F"}): "recv_forward",
    frozenset({"RECV_B"}): "recv_backward",
    frozenset({"SEND_F", "RECV_B"}): "send_forward_recv_backward",
    frozenset({"SEND_B", "RECV_F"}): "send_backward_recv_forward",
    frozenset({"SEND_F", "RECV_F"}): "send_forward_recv_forward",
    frozenset({"SEND_B", "RECV_B"}): "send_backward_recv_backward",
    frozenset(
        {"SEND_F", "SEND_B", "RECV_F", "RECV_B"}
    ): "send_forward_backward_recv_forward_backward",
}


@dataclasses.dataclass(frozen=True)
class Message:
    """One transfer of one exchange.

    Attributes:
        action: The SEND_* or RECV_* action; its microbatch and chunk name the compute step
            that produces (for a send) or consumes (for a receive) the tensor.
        peer: The other rank.
        peer_chunk: The chunk of the compute step on the other side.
        channel: "forward" (activations) or "backward" (gradients).
        slot: The pp-comm slot it travels in: ``send_next`` / ``recv_prev`` towards the next
            rank of the ring, ``send_prev`` / ``recv_next`` towards the previous one. With two
            ranks both neighbours are one rank; there activations use the first pair and
            gradients the second, so they travel on separate channels.
    """

    action: Action
    peer: int
    peer_chunk: int
    channel: Channel
    slot: Slot

    @functools.cached_property
    def is_send(self) -> bool:
        """Whether this rank sends (asked for every message at every step: kept)."""
        return self.action.kind.startswith("SEND")

    def key(self, rank: int) -> tuple[str, int, int, int]:
        """The tensor, named alike on both sides: channel, microbatch, sender and receiver chunk."""
        del rank  # the key is the same on both sides by construction
        if self.is_send:
            return (self.channel, self.action.microbatch, self.action.chunk, self.peer_chunk)
        return (self.channel, self.action.microbatch, self.peer_chunk, self.action.chunk)

    @property
    def link_channel(self) -> str:
        """The stream of the link it travels in (transfers pair up per link and stream).

        Activations and gradients travel in separate streams (pp-comm's message channel), so
        a link that carries both in one direction (the V placement beyond two ranks) keeps
        them apart.
        """
        return self.channel


@dataclasses.dataclass(frozen=True)
class Exchange:
    """The transfers posted together between two compute steps of one rank."""

    messages: tuple[Message, ...]

    @property
    def operation(self) -> str:
        """Megatron's name for it (``send_forward_recv_backward``, ...), or "exchange"."""
        kinds = frozenset(m.action.kind for m in self.messages)
        simple = len({m.action.kind for m in self.messages}) == len(self.messages)
        return _OPERATIONS.get(kinds, "exchange") if simple else "exchange"


@dataclasses.dataclass(frozen=True)
class Step:
    """A compute action or an exchange, in a rank's execution order.

    Attributes:
        compute: The compute action, or None for an exchange.
        exchange: The exchange, or None for a compute action.
        overlap: This compute step (a backward) runs together with the compute step just
            before it (a forward on another chunk): the two are one F&B step (DualPipeV),
            with no exchange between them.
    """

    compute: Action | None = None
    exchange: Exchange | None = None
    overlap: bool = False

    def __str__(self) -> str:
        """The compute action, or the exchange's actions joined by '+'."""
        if self.compute is not None:
            return str(self.compute)
        assert self.exchange is not None
        return "+".join(str(m.action) for m in self.exchange.messages)


def placement_of(
    plan: Sequence[Sequence[Action]], vp_size: int | None, placement: Placement | None
) -> Placement:
    """The placement a plan runs with: given, carried by the plan, or looped.

    Raises:
        ValueError: The placement does not match the plan's ranks or `vp_size`.
    """
    chosen = placement or getattr(plan, "placement", None)
    if chosen is None:
        return Placement.looped(max(len(plan), 1), vp_size or 1)
    if chosen.pp_size != len(plan) or (vp_size is not None and chosen.vp_size != vp_size):
        raise ValueError(
            f"the placement covers {chosen.pp_size} ranks x {chosen.vp_size} chunks, but the "
            f"plan has {len(plan)} ranks and vp_size is {vp_size}"
        )
    return chosen


def _slot(rank: int, peer: int, pp_size: int, channel: Channel, sending: bool) -> Slot:
    """The pp-comm slot for a transfer between `rank` and its neighbour `peer`."""
    if pp_size == 2:
        # Activations leave towards "next" and arrive from "prev"; gradients the other way.
        towards_next = (channel == "forward") == sending
    elif peer in ((rank + 1) % pp_size, (rank - 1) % pp_size):
        towards_next = peer == (rank + 1) % pp_size
    else:
        raise ValueError(
            f"rank {rank} and rank {peer} are not neighbours in a ring of {pp_size}: the "
            "placement must put consecutive stages on the same or neighbouring ranks"
        )
    if sending:
        return "send_next" if towards_next else "send_prev"
    return "recv_next" if towards_next else "recv_prev"


def _message(kind: str, action: Action, rank: int, peer: tuple[int, int], pp: int) -> Message:
    channel: Channel = "forward" if kind.endswith("F") else "backward"
    slot = _slot(rank, peer[0], pp, channel, kind.startswith("SEND"))
    moved = Action(kind, action.microbatch, action.chunk)  # type: ignore[arg-type]
    return Message(moved, peer[0], peer[1], channel, slot)


def incoming_message(action: Action, rank: int, placement: Placement) -> Message | None:
    """The receive compute step `action` of `rank` needs; None if none or handed over locally.

    A forward receives activations, a backward (``B``, or its input half ``I``) gradients; a
    weight-gradient step ``W`` receives nothing.
    """
    if action.kind == "W":
        return None
    step = -1 if action.kind == "F" else +1
    peer = placement.neighbour(rank, action.chunk, step)
    if peer is None or peer[0] == rank:
        return None
    kind = "RECV_F" if action.kind == "F" else "RECV_B"
    return _message(kind, action, rank, peer, placement.pp_size)


def outgoing_message(action: Action, rank: int, placement: Placement) -> Message | None:
    """The send that follows compute step `action` of `rank`; None if none or local (or W)."""
    if action.kind == "W":
        return None
    step = +1 if action.kind == "F" else -1
    peer = placement.neighbour(rank, action.chunk, step)
    if peer is None or peer[0] == rank:
        return None
    kind = "SEND_F" if action.kind == "F" else "SEND_B"
    return _message(kind, action, rank, peer, placement.pp_size)


def message_for(action: Action, rank: int, placement: Placement) -> Message:
    """The message a written SEND_*/RECV_* action of `rank` stands for.

    Raises:
        ValueError: The action moves nothing there (the first stage receives no activations,
            a hand-over within the rank needs no transfer).
    """
    compute = Action("F" if action.kind.endswith("F") else "B", action.microbatch, action.chunk)
    if action.kind.startswith("SEND"):
        message = outgoing_message(compute, rank, placement)
    else:
        message = incoming_message(compute, rank, placement)
    if message is None:
        stage = placement.stage(rank, action.chunk)
        raise ValueError(
            f"rank {rank}: {action} moves nothing: stage {stage} has no peer on another rank "
            f"in that direction (placement {placement})"
        )
    return message


def _check_chunk(action: Action, rank: int, vp_size: int) -> None:
    if not action.is_compute:
        raise ValueError(f"rank {rank}: lower() takes compute actions only, got {action}")
    if not 0 <= action.chunk < vp_size:
        raise ValueError(
            f"rank {rank}: {action} names chunk {action.chunk}, but vp_size is {vp_size}"
        )


def lower(
    plan: Sequence[Sequence[Action]],
    *,
    vp_size: int | None = None,
    placement: Placement | None = None,
    prefetch: int = 0,
) -> list[list[Step]]:
    """Each rank's compute actions with the exchanges they need, in execution order.

    Args:
        plan: One list of compute actions per rank (see `pp_schedules.plan`); a `Plan` that
            carries its own exchanges gives them back as written.
        vp_size: Model chunks per rank (the placement's, or 1, by default).
        placement: Which stage each (rank, chunk) holds; the plan's, or looped.
        prefetch: Post each receive this many exchanges early (`post_receives_early`); a
            plan's own exchanges are kept as written.

    Returns:
        For each rank, its steps: compute actions, and between them at most one exchange
        holding the previous compute's send and the next compute's receive.

    Raises:
        ValueError: The plan holds a non-compute action, a chunk outside ``range(vp_size)``,
            the placement puts consecutive stages on ranks that are not neighbours, or
            `prefetch` is negative.
    """
    if prefetch < 0:
        raise ValueError(f"prefetch must be 0 (receives where needed) or more, got {prefetch}")
    written = getattr(plan, "steps", None)
    if written is not None:
        return [list(rank_steps) for rank_steps in written]
    where = placement_of(plan, vp_size, placement)
    overlapped = getattr(plan, "overlapped", None)
    lowered: list[list[Step]] = []
    for rank, actions in enumerate(plan):
        for action in actions:
            _check_chunk(action, rank, where.vp_size)
        incoming = _Messages(incoming_message, rank, where)
        outgoing = _Messages(outgoing_message, rank, where)
        pairs = frozenset(overlapped[rank]) if overlapped is not None else frozenset()
        lowered.append(_interleave(actions, incoming.of(actions), outgoing.of(actions), pairs))
    return post_receives_early(lowered, prefetch) if prefetch else lowered


class _Messages:
    """One rank's receives (or sends) of its compute steps, the peer looked up once a chunk.

    Which peer, chunk, channel and slot a step's message has depends on its kind and chunk
    only; each message is then that template with the step's microbatch.
    """

    def __init__(
        self,
        find: Callable[[Action, int, Placement], Message | None],
        rank: int,
        placement: Placement,
    ) -> None:
        self.find, self.rank, self.placement = find, rank, placement
        self.templates: dict[tuple[str, int], Message | None] = {}

    def of(self, actions: Sequence[Action]) -> list[Message | None]:
        """The message of each action (None where it moves nothing)."""
        found: list[Message | None] = []
        for action in actions:
            kind = "B" if action.kind == "I" else action.kind  # I moves what B moves
            key = (kind, action.chunk)
            if key not in self.templates:
                probe = Action(kind, 0, action.chunk)
                self.templates[key] = self.find(probe, self.rank, self.placement)
            template = self.templates[key]
            if template is None:
                found.append(None)
                continue
            moved = Action(template.action.kind, action.microbatch, action.chunk)
            found.append(
                Message(moved, template.peer, template.peer_chunk, template.channel, template.slot)
            )
        return found


def post_receives_early(steps: Sequence[Sequence[Step]], by: int) -> list[list[Step]]:
    """Each rank's steps with every receive moved `by` exchanges earlier on its rank.

    Receives keep their order (transfers meet in posting order per link); those of a rank's
    first `by` exchanges go into its first. Sends stay where they are; an exchange left
    empty is dropped. Every compute step still finds its receives posted before it.
    """
    moved: list[list[Step]] = []
    for rank_steps in steps:
        exchanges = [i for i, step in enumerate(rank_steps) if step.exchange is not None]
        receives = [
            tuple(m for m in rank_steps[i].exchange.messages if not m.is_send)  # type: ignore[union-attr]
            for i in exchanges
        ]
        # Exchange j posts the receives of exchange j + by (the first, those of 0 .. by).
        posted_at = {
            i: (receives[: by + 1] if j == 0 else receives[j + by : j + by + 1])
            for j, i in enumerate(exchanges)
        }
        result: list[Step] = []
        for index, step in enumerate(rank_steps):
            if step.exchange is None:
                result.append(step)
                continue
            sends = tuple(m for m in step.exchange.messages if m.is_send)
            messages = sends + tuple(m for group in posted_at[index] for m in group)
            if messages:
                result.append(Step(exchange=Exchange(messages)))
        moved.append(result)
    return moved


def _interleave(
    actions: Sequence[Action],
    incoming: Sequence[Message | None],
    outgoing: Sequence[Message | None],
    pairs: frozenset[int] = frozenset(),
) -> list[Step]:
    """A rank's computes, each after an exchange of the last one's send and its own receive.

    An F&B step (index ``k`` in `pairs`: actions ``k`` and ``k + 1``) is one group: the
    exchange before it receives what both halves use, the one after it sends what both make.
    """
    steps: list[Step] = []
    sends: list[Message | None] = []
    k = 0
    while k < len(actions):
        group = [k, k + 1] if k in pairs else [k]
        messages = tuple(m for m in [*sends, *(incoming[i] for i in group)] if m is not None)
        if messages:
            steps.append(Step(exchange=Exchange(messages)))
        steps += [Step(compute=actions[i], overlap=i != group[0]) for i in group]
        sends = [outgoing[i] for i in group]
        k = group[-1] + 1
    last = tuple(m for m in sends if m is not None)
    if last:
        steps.append(Step(exchange=Exchange(last)))
    return steps


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
