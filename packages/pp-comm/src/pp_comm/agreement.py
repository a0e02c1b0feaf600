"""How the two sides of a transfer agree on shapes, and so when each receive can be posted.

Receivers name shapes up front (`FixedShapes`), or a header says them (`ShapeHeaders`).

With ``variable_seq_lengths`` or ``debug``, every message is preceded by a fixed-size header
(count, dtype and shape of each tensor). Headers are posted the same way as the data (so the
shape exchange cannot deadlock where the data would not; Megatron-LM issue 5100 came from a
shape exchange that ignored the posting mode) under their own tag (see `pp_comm.transport`).
With ``debug``, each receiver also sends back what it asked for (an expectation, under its
own tag), so the sender can raise too. Nobody waits for an expectation before posting: the
sender completes it with its send, which cannot finish before its receiver has posted anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import Protocol

from pp_comm.buffers import Buffers
from pp_comm.config import CommConfig
from pp_comm.errors import P2PMismatchError
from pp_comm.framing import FramedShapes, mismatch_error
from pp_comm.ordering import Slot
from pp_comm.payload import (
    HEADER_LENGTH,
    TensorSpec,
    decode_header,
    encode_header,
    encode_specs,
)
from pp_comm.transport import (
    DATA_TAG,
    EXPECTATION_TAG,
    HEADER_TAG,
    Posted,
    Transfer,
    Transport,
    in_microbatch,
)

__all__ = ["FixedShapes", "ShapeAgreement", "ShapeHeaders", "shape_agreement"]

_HEADER_SPECS = (TensorSpec((HEADER_LENGTH,), torch.int64),)
# An expectation travels against its message: from the receiver back to the sender.
_BACK: dict[Slot, Slot] = {
    "send_next": "recv_next",
    "send_prev": "recv_prev",
    "recv_prev": "send_prev",
    "recv_next": "send_next",
}


class ShapeAgreement(Protocol):
    """Settles each receive's shapes, then posts the data of a call."""

    checks: bool
    """Whether `mismatch` can find anything (else callers skip it)."""

    def post(self, transfers: list[Transfer], operation: str, deadline: float) -> list[Posted]:
        """Post the call's transfers (and headers); return every work still to wait for."""

    def mismatch(self, transfers: list[Transfer], operation: str) -> Exception | None:
        """The error to raise once the messages are in, if they are not what was asked for."""

    def sent_mismatch(self, transfers: list[Transfer], operation: str) -> Exception | None:
        """The error to raise once the sends are complete, if a receiver asked for other."""


class FixedShapes:
    """Receivers name every shape; nothing travels ahead of the data."""

    checks = False

    def __init__(self, transport: Transport, buffers: Buffers) -> None:
        """Post through `transport` into buffers from `buffers`."""
        self._transport = transport
        self._buffers = buffers

    def post(self, transfers: list[Transfer], operation: str, deadline: float) -> list[Posted]:
        """Receives get the shapes they asked for; everything is posted at once.

        Raises:
            ValueError: A receive did not name a shape (before anything is posted).
        """
        self._buffers.fill(transfers, operation)
        return self._transport.post(transfers, tag=DATA_TAG, operation=operation)

    def mismatch(self, transfers: list[Transfer], operation: str) -> Exception | None:
        """Nothing to compare: the receiver's shapes are used as they are."""
        return None

    def sent_mismatch(self, transfers: list[Transfer], operation: str) -> Exception | None:
        """Nothing to compare: no expectation travels."""
        return None


class ShapeHeaders:
    """A header ahead of every message says what it holds."""

    checks = True

    def __init__(
        self, config: CommConfig, transport: Transport, buffers: Buffers, device: torch.device
    ) -> None:
        """Headers travel through `transport`; received headers land on `device`."""
        self._transport = transport
        self._buffers = buffers
        self._device = device
        self._debug = config.debug

    def post(self, transfers: list[Transfer], operation: str, deadline: float) -> list[Posted]:
        """Exchange headers, then post the data as the headers say.

        Only received headers are waited for: a sender needs nothing from its receiver, so
        its header travels ahead of its data without blocking it (a send that waited here
        could deadlock a schedule whose receiver posts late). Header sends are returned to be
        completed with the data.

        Raises:
            ValueError: A message cannot be described by a header (too many tensors, dims).
            P2PTimeoutError, P2PError: A header did not arrive.
        """
        headers = [self._header_for(transfer, operation) for transfer in transfers]
        posted = self._transport.post(headers, tag=HEADER_TAG, operation=operation)
        # Posted after every header on both sides, so on NCCL (order, not tags) they agree too.
        expected = self._post_expectations(transfers, operation) if self._debug else []
        if self._transport.matches_by_tag:
            data = self._post_as_headers_arrive(transfers, headers, posted, operation, deadline)
            return expected + data
        # NCCL: each stream has its own group, so a batch holds sends only or receives only.
        # The sends' data goes out at once, behind their headers; the receives' data is
        # posted once their headers are in.
        sending = [t for t in transfers if t.sends]
        receiving = [t for t in transfers if not t.sends]
        self._buffers.fill(sending, operation)
        sent = self._transport.post(sending, tag=DATA_TAG, operation=operation)
        arriving = [p for p in posted if not all(t.sends for t in p[1])]
        self._transport.wait(arriving, operation, deadline)
        for transfer, header in zip(transfers, headers, strict=True):
            if not transfer.sends:
                transfer.specs = decode_header(header.tensors[0])
        self._buffers.fill(receiving, operation)
        in_flight = [p for p in posted if all(t.sends for t in p[1])]
        data = self._transport.post(receiving, tag=DATA_TAG, operation=operation)
        return expected + in_flight + sent + data

    def _post_expectations(self, transfers: list[Transfer], operation: str) -> list[Posted]:
        """Each receive sends back what it asked for; each send posts the receive of that.

        A posted expectation is carried by its message, so a handle completes it with that
        message (the sender's with its sends: `wait_recv` leaves it in flight) and errors
        about it name the message.
        """
        back: list[Transfer] = []
        owner: dict[int, Transfer] = {}
        for transfer in transfers:
            if transfer.sends:
                wire = [torch.empty(HEADER_LENGTH, dtype=torch.int64, device=self._device)]
                transfer.expectation = expectation = Transfer(
                    _BACK[transfer.slot], transfer.peer, wire, specs=_HEADER_SPECS
                )
            else:
                wire = [encode_specs(transfer.requested, operation).to(self._device)]
                expectation = Transfer(_BACK[transfer.slot], transfer.peer, wire)
            expectation.channel = transfer.channel
            owner[id(expectation)] = transfer
            back.append(expectation)
        posted = self._transport.post(back, tag=EXPECTATION_TAG, operation=operation)
        return [(work, (owner[id(carried[0])],)) for work, carried in posted]

    def _post_as_headers_arrive(
        self,
        transfers: list[Transfer],
        headers: list[Transfer],
        posted: list[Posted],
        operation: str,
        deadline: float,
    ) -> list[Posted]:
        """gloo: post the sends' data at once, and each receive as soon as its header is in.

        A sender may split into several calls what its receiver takes in one: waiting for
        every header before posting any data would then wait for a header the sender posts
        only once this call's data has arrived. gloo posts never block, so the order of
        posts cannot deadlock; receives are taken in the given order, which on each link is
        the order the sender posted them.
        """
        sends = [t for t in transfers if t.sends]
        self._buffers.fill(sends, operation)
        data = self._transport.post(sends, tag=DATA_TAG, operation=operation)
        work_of = {id(carried[0]): work for work, carried in posted}  # one header per work
        for transfer, header in zip(transfers, headers, strict=True):
            if transfer.sends:
                continue
            self._transport.wait([(work_of[id(header)], (header,))], operation, deadline)
            transfer.specs = decode_header(header.tensors[0])
            self._buffers.fill((transfer,), operation)
            data += self._transport.post([transfer], tag=DATA_TAG, operation=operation)
        return [p for p in posted if p[1][0].sends] + data

    def _header_for(self, transfer: Transfer, operation: str) -> Transfer:
        if transfer.sends:
            buffer = encode_header(transfer.tensors, operation).to(self._device)
        else:
            buffer = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=self._device)
        header = Transfer(
            transfer.slot,
            transfer.peer,
            [buffer],
            specs=_HEADER_SPECS,
            microbatch=transfer.microbatch,
            channel=transfer.channel,
        )
        # Errors name the message a header describes, not the header.
        header.described = transfer.specs if transfer.sends else transfer.requested
        return header

    def mismatch(self, transfers: list[Transfer], operation: str) -> Exception | None:
        """A receive whose sender sent other than asked: a different count, or (debug) specs.

        The message was received in full (as sent), so nothing is left pending and the
        communicator stays usable.
        """
        for transfer in transfers:
            if transfer.sends:
                continue
            expected, got = transfer.requested, transfer.specs
            if not self._debug:
                if len(got) != len(expected):
                    return ValueError(
                        f"{self._where(transfer, operation)}: asked for {len(expected)} "
                        f"tensor(s), but rank {transfer.peer} sent {len(got)}"
                    )
            elif not _agrees(expected, got):
                return self._mismatch_error(transfer, operation)
        return None

    def sent_mismatch(self, transfers: list[Transfer], operation: str) -> Exception | None:
        """(debug) A send whose receiver asked for a different count, dtype or shape.

        Read once the sends are complete: their expectations have arrived by then.
        """
        for transfer in transfers:
            if transfer.expectation is None:
                continue
            expected = decode_header(transfer.expectation.tensors[0])
            transfer.expectation = None  # checked once
            if not _agrees(expected, transfer.specs):
                return self._mismatch_error(transfer, operation, expected)
        return None

    def _where(self, transfer: Transfer, operation: str) -> str:
        topology = self._transport.topology
        return (
            f"rank {topology.rank} (stage {topology.stage}) in "
            f"{operation}{in_microbatch(transfer.microbatch)}"
        )

    def _mismatch_error(
        self,
        transfer: Transfer,
        operation: str,
        expected: Sequence[TensorSpec] | None = None,
    ) -> P2PMismatchError:
        """The receiver's error (`expected` None), or the sender's, given what was expected."""
        topology = self._transport.topology
        if expected is None:
            return mismatch_error(
                topology, transfer, operation, transfer.requested, transfer.specs, sender=False
            )
        return mismatch_error(topology, transfer, operation, expected, transfer.specs, sender=True)


def _agrees(expected: Sequence[TensorSpec], got: Sequence[TensorSpec]) -> bool:
    """Same count and dtypes, and the same shapes where the receiver named one."""
    return len(expected) == len(got) and all(
        (e.shape is None or e.shape == g.shape) and e.dtype == g.dtype
        for e, g in zip(expected, got, strict=True)
    )


def shape_agreement(
    config: CommConfig, transport: Transport, buffers: Buffers, device: torch.device
) -> ShapeAgreement:
    """Headers for variable shapes or debug checks, else frames or bare fixed shapes.

    Frames check contracts on gloo without scatter-gather; see `pp_comm.framing`.
    """
    if config.exchanges_shapes:
        return ShapeHeaders(config, transport, buffers, device)
    if config.check_contracts and transport.matches_by_tag and not buffers.scatters:
        return FramedShapes(transport, buffers, device)
    return FixedShapes(transport, buffers)
