"""`P2PHandle`: the transfers of one call in flight."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pp_comm.transport import Posted, Transfer, Transport

__all__ = ["P2PHandle"]


class P2PHandle:
    """Transfers in flight; `wait_recv`, `wait_send` and `wait` complete some or all.

    Made by `P2PCommunicator.exchange` and `communicate`.
    """

    __slots__ = (
        "_check",
        "_deadline",
        "_gather",
        "_gathered",
        "_operation",
        "_pending",
        "_received",
        "_transfers",
        "_transport",
    )

    def __init__(
        self,
        transport: Transport | None,
        posted: list[Posted],
        transfers: Sequence[Transfer],
        *,
        operation: str,
        deadline: float = 0.0,
        gather: Callable[[Sequence[Transfer]], None] | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Hold `posted` works until waited.

        `gather` rebuilds scattered receives, if any; `check` raises, once the sends are
        complete, if a receiver asked for other than was sent (debug mode).
        """
        self._transport = transport
        self._pending = posted
        self._transfers = transfers
        self._operation = operation
        self._deadline = deadline
        self._gather = gather
        self._check = check
        self._received = not posted
        self._gathered: set[int] = set()  # ids of receives already gathered

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this call sends or receives into (what it keeps alive until done)."""
        return [t for transfer in self._transfers for t in transfer.wire]

    def is_completed(self) -> bool:
        """Whether `wait` would return at once.

        With scatter-gather, received tensors are whole only after `wait` or `wait_recv` has
        gathered them, so this stays False until then. On gloo a send reports completion only
        once waited.
        """
        if not self._pending:
            return True
        if self._gather is not None and not self._received:
            return False
        return all(work.is_completed() for work, _ in self._pending)

    def wait_recv(self, messages: Sequence[int] | None = None) -> None:
        """Block until the receives of the call have completed; sends may stay in flight.

        Received tensors are ready (gathered, when scattered) on return; call `wait` later to
        complete the sends. On gloo each send and receive is its own work, so only receives
        are waited for; on NCCL a batch (``batch_p2p_comm``) has one work for all its sends
        and receives, which this then waits for as a whole.

        Args:
            messages: Wait only for these receives (positions in the call's message list);
                every receive by default. A receive posted early for a later step must not
                hold up the step that needs an earlier one.

        Raises:
            P2PTimeoutError, P2PError: See `wait`.
        """
        if self._received:
            return
        wanted = None if messages is None else {id(self._transfers[index]) for index in messages}
        arriving = [
            p
            for p in self._pending
            if not all(t.sends for t in p[1])
            and (wanted is None or any(id(t) in wanted for t in p[1]))
        ]
        if arriving:
            assert self._transport is not None
            self._transport.wait(arriving, self._operation, self._deadline)
            self._pending = [p for p in self._pending if all(p is not a for a in arriving)]
        if wanted is None or all(all(t.sends for t in p[1]) for p in self._pending):
            self._finish_receives()
        else:
            self._gather_once([t for t in self._transfers if id(t) in wanted])

    def wait_send(self) -> None:
        """Block until the sends of the call have completed; receives may stay pending.

        On gloo each send is its own work, so a receive the caller needs only later keeps
        waiting; on NCCL a batch has one work for its sends and receives, which this then
        waits for as a whole (as `wait`).

        Raises:
            P2PTimeoutError, P2PError, P2PMismatchError: See `wait`.
        """
        leaving = [p for p in self._pending if all(t.sends for t in p[1])]
        if leaving:
            assert self._transport is not None
            self._transport.wait(leaving, self._operation, self._deadline)
            self._pending = [p for p in self._pending if all(p is not a for a in leaving)]
        if any(any(t.sends for t in p[1]) for p in self._pending):
            self.wait()  # a work that carries sends and receives together (an NCCL batch)
        self._check_sent()

    def wait(self) -> None:
        """Block until every transfer of the call completes (gathering scattered tensors).

        Raises:
            P2PTimeoutError: A transfer did not complete within the configured timeout (from
                when the call was made); the message names this rank, the peer, the
                operation, the microbatch and what was expected.
            P2PError: The peer failed (for instance its process died).
            P2PMismatchError: (debug) A receiver asked for another count, dtype or shape
                than this call sent it.
        """
        if self._pending:
            assert self._transport is not None
            self._transport.wait(self._pending, self._operation, self._deadline)
            self._pending = []
        if not self._received:
            self._finish_receives()
        self._check_sent()

    def _check_sent(self) -> None:
        """Run the sends' check once (its error is raised once, by the first wait)."""
        check, self._check = self._check, None
        if check is not None:
            check()

    def _finish_receives(self) -> None:
        self._received = True
        self._gather_once(self._transfers)

    def _gather_once(self, transfers: Sequence[Transfer]) -> None:
        """Rebuild the scattered receives among `transfers` not rebuilt yet."""
        if self._gather is None:
            return
        todo = [t for t in transfers if id(t) not in self._gathered]
        self._gathered.update(id(t) for t in todo)
        self._gather(todo)
