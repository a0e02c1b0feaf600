"""Contract checks on every message at the cost of none extra: the header travels in-band.

With ``check_contracts`` (the default on gloo), every message starts with a frame: a fixed
header (kind, sequence number, microbatch, inline byte count, then count, dtype and shape of
each tensor) and, for a message of at most `INLINE_BYTES`, the payload itself, copied in. A
larger message sends its tensors as they are right after the frame (copying megabytes would
cost more than the frame's latency saves). Every receive posts a frame buffer of the largest
size a frame can have, so whatever a sender sends fits: gloo aborts the receiving process when
a message is larger than its posted receive (``GLOO_ENFORCE_LE`` in its tcp pair), but
completes a receive with a shorter one.

The receiver compares the header with what it asked for once the frame is in (when it waits):
on agreement it copies the payload out, or posts the receive of the tensors that follow. On
disagreement it drains what follows (sized by the header, so a count or size mismatch neither
aborts nor hangs), sends a mismatch notice back to the sender on the stream the sender next
receives on from it, and raises `P2PMismatchError`. The sender raises the same error, naming
its own operation and microbatch (found by the frame's sequence number), at its next receive
from that peer, which meets the notice instead of a message. After a mismatch the
communicators of both sides refuse further calls.

A receiver's posts never wait (the frame is checked when the receive is waited for), so a
receive may be posted before its sender has sent anything. Receives of one stream are
finished in posting order, so the tensors that follow a large frame meet the right receive.
"""

from __future__ import annotations

import ctypes
import datetime
import itertools
import struct
import time
import typing
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from pp_comm.buffers import Buffers
from pp_comm.errors import P2PError, P2PMismatchError
from pp_comm.ordering import CHANNEL_OF_SLOT, Channel, Slot
from pp_comm.payload import HEADER_LENGTH, TensorSpec, decode_header, describe, encode_specs
from pp_comm.topology import Topology
from pp_comm.transport import DATA_TAG, HEADER_TAG, Posted, Transfer, Transport, in_microbatch

__all__ = ["FRAME_HEADER_BYTES", "INLINE_BYTES", "FramedShapes", "mismatch_error"]

INLINE_BYTES = 64 * 1024
"""Largest payload copied into its frame; larger payloads follow the frame as they are."""
_FIELDS = 4  # kind, sequence number, microbatch, inline bytes
FRAME_HEADER_BYTES = (_FIELDS + HEADER_LENGTH) * 8
"""Bytes of a frame's header."""
_INLINE, _FOLLOWS, _NOTICE = 1, 2, 3
_NO_MICROBATCH = -(2**62)
_NOTICE_GRACE_S = 5.0  # longest a receiver waits for its notice to leave before it raises
_SPARE_FRAMES = 8  # receive frames kept for reuse
_RECORDS = 4096  # sent messages remembered, to name them when a notice comes back
_BACK: dict[Slot, Slot] = {
    "send_next": "recv_prev",
    "send_prev": "recv_next",
    "recv_prev": "send_prev",
    "recv_next": "send_next",
}
_STATIC: dict[tuple[TensorSpec, ...], bytes] = {}
_PACKED = struct.Struct("=4q")  # the fields ahead of the specs, native order as the specs


def _header(fields: tuple[int, int, int, int], static: bytes) -> torch.Tensor:
    """A frame header as bytes (built in Python: cheaper than tensor ops at this size)."""
    return torch.frombuffer(bytearray(_PACKED.pack(*fields) + static), dtype=torch.uint8)


def _described(static: bytes) -> list[TensorSpec]:
    """The specs a header's bytes describe."""
    return decode_header(torch.frombuffer(bytearray(static), dtype=torch.int64))


def _static(specs: Sequence[TensorSpec], operation: str) -> bytes:
    """The header bytes that describe `specs` (remembered: schedules repeat shapes)."""
    key = tuple(specs)
    found = _STATIC.get(key)
    if found is None:
        if len(_STATIC) >= 1024:
            _STATIC.clear()
        try:
            header = encode_specs(specs, operation)
        except ValueError as error:
            raise ValueError(f"{error} (or turn off CommConfig.check_contracts)") from None
        found = _STATIC[key] = header.numpy().tobytes()
    return found


class _Sent:
    """What a send was, to name it when its receiver reports a mismatch."""

    __slots__ = ("microbatch", "operation", "sequence", "specs")

    def __init__(
        self, sequence: int, operation: str, microbatch: int | None, specs: Sequence[TensorSpec]
    ) -> None:
        self.sequence = sequence
        self.operation = operation
        self.microbatch = microbatch
        self.specs = specs


class _FramedReceive:
    """A receive's work: the frame, then (once checked) the tensors that follow it, if any.

    Looks like a `torch.distributed.Work` to `Transport.wait`; raises `P2PMismatchError`
    from `wait` when the frame disagrees with the receive.
    """

    def __init__(self, finish: Callable[[datetime.timedelta], list[Posted]]) -> None:
        self._finish: Callable[[datetime.timedelta], list[Posted]] | None = finish
        self._following: list[Posted] = []
        self.queue: list[_FramedReceive] = []
        self._done = False

    def finish(self, timeout: datetime.timedelta) -> None:
        """Wait for the frame, check it, and post what follows (once)."""
        finish, self._finish = self._finish, None
        if finish is not None:
            if self in self.queue:
                self.queue.remove(self)
            self._following = finish(timeout)

    def wait(self, timeout: datetime.timedelta) -> bool:
        """Finish the receives posted earlier on the stream, then this one."""
        while self.queue and self.queue[0] is not self:
            self.queue[0].finish(timeout)
        self.finish(timeout)
        for work, _ in self._following:
            work.wait(timeout)
        self._done = True
        return True

    def is_completed(self) -> bool:
        """Whether `wait` has returned (the frame is checked only when waited for)."""
        return self._done


class FramedShapes:
    """Receivers name every shape; a frame ahead of (or around) every message checks it."""

    checks = False  # the frames check themselves, while they are waited for

    def __init__(self, transport: Transport, buffers: Buffers, device: torch.device) -> None:
        """Post through `transport` into buffers from `buffers`; frames live on `device`."""
        self._transport = transport
        self._buffers = buffers
        self._device = device
        self._sequence = itertools.count()
        self._sent: list[_Sent | None] = [None] * _RECORDS  # a ring, by sequence number
        # Receive frames already read, reused: a fresh one per receive costs page faults.
        self._spare: list[torch.Tensor] = []
        self._streams: dict[tuple[int, Slot, Channel], list[_FramedReceive]] = {}

    def post(self, transfers: list[Transfer], operation: str, deadline: float) -> list[Posted]:
        """Post every frame, and the tensors of large sends; nothing waits.

        Raises:
            ValueError: A receive did not name a shape, or a message cannot be described by
                a header (a dtype other than those of `pp_comm.payload`, over `MAX_TENSORS`
                tensors or `MAX_DIMS` dimensions); raised before anything is posted.
        """
        self._buffers.fill(transfers, operation)
        follow = []
        for transfer in transfers:  # each travels as its frame first
            if transfer.sends:
                frame, inline = self._send_frame(transfer, operation)
                if not inline:
                    follow.append(transfer)
            else:
                _static(transfer.requested, operation)  # can it be checked? (else ValueError)
                frame = self._spare.pop() if self._spare else _receive_frame()
            transfer.wire = [frame]
        posted = self._transport.post(transfers, tag=HEADER_TAG, operation=operation)
        for index, (work, carried) in enumerate(posted):
            transfer = carried[0]
            if not transfer.sends:  # looks like a Work to whoever waits for it
                receive = self._receive(transfer, work, transfer.wire[0], operation)
                posted[index] = (typing.cast(dist.Work, receive), carried)
        for transfer in follow:  # a posted send holds on to its frame
            transfer.wire = transfer.tensors
        return posted + self._transport.post(follow, tag=DATA_TAG, operation=operation)

    def mismatch(self, transfers: list[Transfer], operation: str) -> Exception | None:
        """Nothing left to compare: frames are checked while they are waited for."""
        return None

    def sent_mismatch(self, transfers: list[Transfer], operation: str) -> Exception | None:
        """Nothing to compare: a sender learns of a mismatch at its next receive."""
        return None

    def _send_frame(self, transfer: Transfer, operation: str) -> tuple[torch.Tensor, bool]:
        """The frame of a send, and whether its payload is inside it."""
        tensors = transfer.tensors
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        inline = nbytes <= INLINE_BYTES
        sequence = next(self._sequence)
        self._sent[sequence % _RECORDS] = _Sent(
            sequence, operation, transfer.microbatch, transfer.specs
        )
        microbatch = _NO_MICROBATCH if transfer.microbatch is None else transfer.microbatch
        fields = (_INLINE if inline else _FOLLOWS, sequence, microbatch, nbytes if inline else 0)
        header = _PACKED.pack(*fields) + _static(transfer.specs, operation)
        if not inline:
            return torch.frombuffer(bytearray(header), dtype=torch.uint8), False
        # Plain memory copies: a frame is a few KB, and tensor ops would cost more than the
        # bytes (the tensors are contiguous and on the CPU: frames are used on gloo only).
        frame = torch.empty(FRAME_HEADER_BYTES + nbytes, dtype=torch.uint8)
        address = frame.data_ptr()
        ctypes.memmove(address, header, FRAME_HEADER_BYTES)
        address += FRAME_HEADER_BYTES
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            ctypes.memmove(address, tensor.data_ptr(), size)
            address += size
        return frame, True

    def _receive(
        self, transfer: Transfer, work: dist.Work, frame: torch.Tensor, operation: str
    ) -> _FramedReceive:
        """The work of a receive: its frame's, then its check, then what follows."""

        def finish(timeout: datetime.timedelta) -> list[Posted]:
            self._transport.wait([(work, (transfer,))], operation, _deadline(timeout))
            return self._check(transfer, frame, operation, timeout)

        receive = _FramedReceive(finish)
        key = (transfer.peer, transfer.slot, transfer.channel)
        receive.queue = self._streams.setdefault(key, [])
        receive.queue.append(receive)
        return receive

    def _check(
        self, transfer: Transfer, frame: torch.Tensor, operation: str, timeout: datetime.timedelta
    ) -> list[Posted]:
        """Unpack an agreeing frame (or post what follows it); raise on any disagreement.

        Raises:
            P2PMismatchError: The frame is a notice (this side sent other than asked for), or
                its message is not what this receive asked for (drained, the sender told).
        """
        transfer.wire = transfer.tensors
        head = frame.numpy()
        fields: tuple[int, int, int, int] = _PACKED.unpack_from(head.data)
        kind, described = fields[0], head[_PACKED.size : FRAME_HEADER_BYTES].tobytes()
        if kind == _NOTICE:
            raise self._noticed(transfer, fields, described, operation)
        if described == _static(transfer.requested, operation):
            if kind == _INLINE:
                _unpack(transfer.tensors, frame)
            if len(self._spare) < _SPARE_FRAMES:
                self._spare.append(frame)
            if kind == _INLINE:
                return []
            return self._transport.post([transfer], tag=DATA_TAG, operation=operation)
        sent = _described(described)
        if kind == _FOLLOWS:  # drain it, so that the stream stays in step
            wire = [torch.empty(s.shape or (), dtype=s.dtype, device=self._device) for s in sent]
            drain = Transfer(transfer.slot, transfer.peer, wire, channel=transfer.channel)
            drain.microbatch = transfer.microbatch
            posted = self._transport.post([drain], tag=DATA_TAG, operation=operation)
            self._transport.wait(posted, operation, _deadline(timeout))
        self._notify(transfer, fields, operation, timeout)
        self._transport.broken = f"{operation} received a mismatched message"
        topology = self._transport.topology
        raise mismatch_error(topology, transfer, operation, transfer.requested, sent, sender=False)

    def _notify(
        self,
        transfer: Transfer,
        fields: tuple[int, int, int, int],
        operation: str,
        timeout: datetime.timedelta,
    ) -> None:
        """Send the sender a notice of what was expected, where its next receive meets it.

        Waits until the sender has taken it, for `_NOTICE_GRACE_S` at most: raising sooner
        could end this process before the notice has left.
        """
        back = _BACK[transfer.slot]
        notice = (_NOTICE, fields[1], fields[2], 0)
        wire = _header(notice, _static(transfer.requested, operation))
        message = Transfer(back, transfer.peer, [wire], channel=CHANNEL_OF_SLOT[back])
        message.microbatch = transfer.microbatch
        grace = min(timeout.total_seconds(), _NOTICE_GRACE_S)
        try:
            posted = self._transport.post([message], tag=HEADER_TAG, operation=operation)
            self._transport.wait(posted, operation, time.monotonic() + grace)
        except P2PError:
            pass  # the sender will time out at its next receive instead

    def _noticed(
        self, transfer: Transfer, fields: tuple[int, int, int, int], head: bytes, operation: str
    ) -> P2PMismatchError:
        """The sender's error, from a notice that met one of its receives."""
        self._transport.broken = f"{operation} received a mismatch notice"
        record = self._sent[fields[1] % _RECORDS]
        if record is not None and record.sequence != fields[1]:
            record = None
        microbatch = None if fields[2] == _NO_MICROBATCH else fields[2]
        if record is None:  # long forgotten: name what is known
            record = _Sent(fields[1], f"a send before {operation}", microbatch, ())
        expected = _described(head)
        sent = Transfer(_BACK[transfer.slot], transfer.peer, [], specs=record.specs)
        sent.microbatch = record.microbatch
        topology = self._transport.topology
        error = mismatch_error(
            topology, sent, record.operation, expected, record.specs, sender=True
        )
        error.args = (
            f"{error.args[0]} (reported to {operation}{in_microbatch(transfer.microbatch)})",
        )
        return error


def _receive_frame() -> torch.Tensor:
    """A buffer that any frame fits in (gloo aborts on a message larger than its receive)."""
    return torch.empty(FRAME_HEADER_BYTES + INLINE_BYTES, dtype=torch.uint8)


def _deadline(timeout: datetime.timedelta) -> float:
    return time.monotonic() + timeout.total_seconds()


def _unpack(buffers: Sequence[torch.Tensor], frame: torch.Tensor) -> None:
    """Copy an inline payload out of its frame into the receive's buffers."""
    address = frame.data_ptr() + FRAME_HEADER_BYTES
    for buffer in buffers:  # new contiguous CPU tensors, of the sizes the header agreed on
        nbytes = buffer.numel() * buffer.element_size()
        ctypes.memmove(buffer.data_ptr(), address, nbytes)
        address += nbytes


def mismatch_error(
    topology: Topology,
    transfer: Transfer,
    operation: str,
    expected: Sequence[TensorSpec],
    sent: Sequence[TensorSpec],
    *,
    sender: bool,
) -> P2PMismatchError:
    """The error of the side that sent (`sender`) or received `transfer`."""
    peer = f"rank {transfer.peer} (stage {topology.stage_of(transfer.peer)})"
    if sender:
        text = f"sent {describe(sent)} to {peer}, but it expected {describe(expected)}"
    else:
        text = f"expected {describe(expected)} from {peer}, but it sent {describe(sent)}"
    where = f"rank {topology.rank} (stage {topology.stage}) in {operation}"
    return P2PMismatchError(
        f"{where}{in_microbatch(transfer.microbatch)}: {text}",
        rank=topology.rank,
        peer=transfer.peer,
        operation=operation,
        microbatch=transfer.microbatch,
        expected=expected,
        sent=sent,
    )
