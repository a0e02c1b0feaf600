"""What an exchange carries: `P2PMessage`, and the payload types of the nine operations."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeAlias

import torch

from pp_comm.ordering import SLOTS, Channel, Slot
from pp_comm.payload import ShapesArg

__all__ = ["SEND_SLOTS", "DTypesArg", "P2PMessage", "Payload", "Received"]

Payload: TypeAlias = torch.Tensor | Sequence[torch.Tensor] | None
"""What a send takes: one tensor, a list of tensors (the encoder-decoder split sends two), or
None for nothing."""
Received: TypeAlias = torch.Tensor | list[torch.Tensor] | None
"""What a receive gives: one tensor when one shape was asked for, a list for a list, or None
when this stage has no peer in that direction."""
DTypesArg: TypeAlias = torch.dtype | Sequence[torch.dtype] | None
"""One dtype for every received tensor, one per tensor, or None for the pipeline's dtype."""

SEND_SLOTS: frozenset[Slot] = frozenset(("send_next", "send_prev"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class P2PMessage:
    """One message of an exchange: tensors sent to a neighbour, or tensors received from one.

    Messages on the same link are matched in posting order: the n-th message one stage sends
    on a slot (and channel) is the n-th the neighbour receives on the matching slot
    (``send_next`` with ``recv_prev``, ``send_prev`` with ``recv_next``), however either side
    groups its messages into calls.

    Raises:
        ValueError: An unknown slot, a send without tensors or with receive fields, or a
            receive with tensors.
        TypeError: `tensors` is not a sequence of tensors, or `microbatch` not an int.
    """

    slot: Slot
    """Where the message goes or comes from: "send_next", "send_prev", "recv_prev" or
    "recv_next"."""

    tensors: Sequence[torch.Tensor] = ()
    """A send's tensors (one message may carry several); empty for a receive."""

    shapes: ShapesArg = None
    """A receive's shape, or a list of shapes (one per tensor); None (or None entries) for
    shapes learned from the sender with ``variable_seq_lengths`` or ``debug``."""

    dtypes: DTypesArg = None
    """A receive's dtype, or one per tensor; the config's ``pipeline_dtype`` when None."""

    requires_grad: bool | None = None
    """Whether a receive's floating-point tensors require grad; the config's when None."""

    microbatch: int | None = None
    """The microbatch the message belongs to, named in errors about it."""

    channel: Channel | None = None
    """The stream of the link the message travels in: "forward" (activations) or
    "backward" (gradients); by default the slot's (``send_next`` / ``recv_prev``: forward).
    Streams pair up separately, so a link may carry activations of one model chunk and
    gradients of another (a V placement) without their order mattering. Both sides must
    name the same channel."""

    def __post_init__(self) -> None:
        """Checks the message is a well-formed send or receive."""
        if self.slot not in SLOTS:
            raise ValueError(
                f"P2PMessage slot must be one of {', '.join(SLOTS)}; got {self.slot!r}"
            )
        tensors: object = self.tensors
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise TypeError(
                f"P2PMessage tensors is a sequence of tensors (wrap a single tensor in a "
                f"list); got {type(tensors).__name__}"
            )
        if self.microbatch is not None and (
            not isinstance(self.microbatch, int) or isinstance(self.microbatch, bool)
        ):
            raise TypeError(
                f"P2PMessage microbatch must be an int or None, got {self.microbatch!r}"
            )
        if self.channel is not None and self.channel not in ("forward", "backward"):
            raise ValueError(
                f"P2PMessage channel must be 'forward', 'backward' or None; got {self.channel!r}"
            )
        if self.sends:
            self._check_send()
        elif self.tensors:
            raise ValueError(
                f"a {self.slot} message receives into new tensors: give it shapes (and "
                f"dtypes), not {len(self.tensors)} tensor(s)"
            )

    def _check_send(self) -> None:
        if not self.tensors:
            raise ValueError(f"a {self.slot} message needs at least one tensor to send")
        for tensor in self.tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"a {self.slot} message can only send tensors, got {type(tensor).__name__}"
                )
        given = [
            name
            for name in ("shapes", "dtypes", "requires_grad")
            if getattr(self, name) is not None
        ]
        if given:
            raise ValueError(
                f"a {self.slot} message sends its tensors as they are; {', '.join(given)} "
                "describe what a receive gets"
            )

    @property
    def sends(self) -> bool:
        """Whether this message is a send (else a receive)."""
        return self.slot in SEND_SLOTS
