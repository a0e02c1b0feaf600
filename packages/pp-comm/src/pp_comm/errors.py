"""Errors that say which rank, peer, operation and microbatch a transfer failed in."""

from __future__ import annotations

from collections.abc import Sequence

from pp_comm.payload import TensorSpec

__all__ = ["P2PError", "P2PMismatchError", "P2PTimeoutError"]


class P2PError(RuntimeError):
    """A transfer between pipeline stages failed.

    Attributes:
        rank: Global rank that raised.
        peer: Global rank of the other side.
        operation: The communicator operation, such as "send_forward_recv_backward".
        microbatch: The microbatch the caller named, or None.
    """

    def __init__(
        self, message: str, *, rank: int, peer: int, operation: str, microbatch: int | None
    ) -> None:
        """Stores the context next to the message."""
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.operation = operation
        self.microbatch = microbatch


class P2PTimeoutError(P2PError, TimeoutError):
    """A send or receive did not complete within the communicator's timeout."""


class P2PMismatchError(P2PError):
    """The two sides disagree on the count, shape or dtype of a message.

    Raised on both sides: by the receiver, and by the sender, once the receiver's notice
    (default checks, at the sender's next receive from that peer) or expectation (debug
    mode, in the call) has arrived. The message was drained whole, so neither side is left
    waiting.

    Attributes:
        expected: What the receiving side asked for (a None shape: any shape).
        sent: What the sending side sent.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        peer: int,
        operation: str,
        microbatch: int | None,
        expected: Sequence[TensorSpec] = (),
        sent: Sequence[TensorSpec] = (),
    ) -> None:
        """Stores the context and both sides' specs next to the message."""
        super().__init__(message, rank=rank, peer=peer, operation=operation, microbatch=microbatch)
        self.expected = tuple(expected)
        self.sent = tuple(sent)
