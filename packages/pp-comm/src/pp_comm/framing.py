"""Contract checks on every message at the cost of none extra: the header travels in-band.

With ``check_contracts`` (the default on gloo), every message starts with a frame: a fixed
header (kind, sequence number, microbatch, inline byte count, then count, dtype and shape of
each tensor) and, for a message of at most `INLINE_BYTES`, the payload itself, copied in. A
larger message sends its tensors as they are after the frame (copying megabytes would cost
more than the frame's latency saves), each under a *sized tag*: a data tag that names the
tensor's byte size. Every receive posts a frame buffer of the largest size a frame can have,
so whatever a sender sends fits: gloo aborts the receiving process when a message is larger
than its posted receive (``GLOO_ENFORCE_LE`` in its tcp pair), but completes a receive with a
shorter one.

The receiver knows the size of what it asked for, so it posts the receives of a large
message's tensors together with the frame's, under their sized tags: the data flows without
waiting for the frame to be read. A tensor meets only a receive of exactly its own size (a
sized tag carries nothing else), so a sender that sends more than was asked for cannot abort
the receiver: its tensors wait under other tags. Tensors too large for a tag (over
`SIZED_TAG_BYTES`) follow their frame under the plain data tag, and the receiver posts their
receive once the frame is read (one more round trip).

The receiver compares the header with what it asked for once the frame is in (when it
waits), as bytes against the header worked out once per distinct list of specs: on agreement
it copies an inline payload out, or waits for the tensors that follow. On disagreement it
drains what the sender sent after the frame (sized by the header, so a count or size
mismatch neither aborts nor hangs), sends a mismatch notice back to the sender on the stream
the sender next receives on from it, and raises `P2PMismatchError`. The sender raises the
same error, naming its own operation and microbatch (found by the frame's sequence number),
at its next receive from that peer, which meets the notice instead of a message. After a
mismatch the communicators of both sides refuse further calls (receives posted for the
mismatched message may stay pending).

A receiver's posts never wait (the frame is checked when the receive is waited for), so a
receive may be posted before its sender has sent anything. Receives of one stream are
finished in posting order, so the tensors that follow a frame meet the right receive.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import itertools
import struct
import time
import typing
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from pp_comm.buffers import Buffers
from pp_comm.config import CommConfig
from pp_comm.errors import P2PError, P2PMismatchError
from pp_comm.ordering import CHANNEL_OF_SLOT, Channel, Slot
from pp_comm.payload import HEADER_LENGTH, TensorSpec, decode_header, describe, encode_specs
from pp_comm.topology import Topology
from pp_comm.transport import DATA_TAG, HEADER_TAG, Posted, Transfer, Transport, in_microbatch

__all__ = [
    "FRAME_HEADER_BYTES",
    "INLINE_BYTES",
    "SIZED_TAG_BYTES",
    "FrameBuffers",
    "FramedShapes",
    "frame_buffers",
    "mismatch_error",
]

INLINE_BYTES = 64 * 1024
"""Largest payload copied into its frame; larger payloads follow the frame as they are."""
_FIELDS = 4  # kind, sequence number, microbatch, inline bytes
FRAME_HEADER_BYTES = (_FIELDS + HEADER_LENGTH) * 8
"""Bytes of a frame's header."""
_SIZED_BASE = 8  # above the transport's tags (data, headers, expectations: 0 to 5)
SIZED_TAG_BYTES = (2**31 - 2 - _SIZED_BASE) // 2
"""Largest tensor (in bytes) that travels under a sized tag (gloo tags are 31-bit)."""
_INLINE, _FOLLOWS, _NOTICE, _SIZED = 1, 2, 3, 4
_NO_MICROBATCH = -(2**62)
_NOTICE_GRACE_S = 5.0  # longest a receiver waits for its notice to leave before it raises
_SPARE_FRAMES = 8  # receive frames kept for reuse
_RECORDS = 4096  # sent messages remembered, to name them when a notice comes back
_CACHED = 1024  # signatures remembered (schedules repeat a few shapes)
_BACK: dict[Slot, Slot] = {
    "send_next": "recv_prev",
    "send_prev": "recv_next",
    "recv_prev": "send_prev",
    "recv_next": "send_next",
}
_PACKED = struct.Struct("=4q")  # the fields ahead of the specs, native order as the specs
_Record: typing.TypeAlias = tuple[int, str, "int | None", Sequence[TensorSpec]]


@dataclasses.dataclass(frozen=True)
class FrameBuffers:
    """What pp-comm holds for transfers beyond the tensors themselves: its contract frames.

    A memory model of the pipeline (pp-schedules' ``TransferBuffers``) takes these figures.
    All 0 where no frames are used (NCCL, contracts off, variable shapes, scatter-gather).

    Attributes:
        receive_frame_bytes: Each posted receive holds a frame this large (any frame fits
            in it) until the receive is waited for.
        send_header_bytes: A send of at most `inline_bytes` is copied into a frame of its
            bytes plus these; a larger one travels as it is, behind a header kept in host
            memory outside torch's allocator.
        inline_bytes: The largest payload copied into a frame.
        spare_frames: Frames kept for reuse: received ones (once read), and sent ones of each
            size (a sent frame is reused once its send is complete).
    """

    receive_frame_bytes: int = 0
    send_header_bytes: int = 0
    inline_bytes: int = 0
    spare_frames: int = 0


def frame_buffers(
    config: CommConfig, transport: str = "gloo", *, scatter_gather: bool = False
) -> FrameBuffers:
    """The frames a communicator with `config` over `transport` keeps (see `FrameBuffers`).

    Args:
        config: The communicator's configuration.
        transport: "gloo" (frames carry the contracts) or "nccl" (no frames).
        scatter_gather: Tensors travel in 1/tp shares (scatter-gather at tp > 1: no frames).

    Raises:
        ValueError: An unknown transport.
    """
    if transport not in ("gloo", "nccl"):
        raise ValueError(f"transport {transport!r} is unknown; valid: gloo, nccl")
    framed = config.check_contracts and not config.exchanges_shapes
    if transport != "gloo" or not framed or scatter_gather:
        return FrameBuffers()
    return FrameBuffers(
        receive_frame_bytes=FRAME_HEADER_BYTES + INLINE_BYTES,
        send_header_bytes=FRAME_HEADER_BYTES,
        inline_bytes=INLINE_BYTES,
        spare_frames=_SPARE_FRAMES,
    )


def _sized_tag(nbytes: int) -> int:
    """The data tag of a tensor of `nbytes` bytes that follows its frame (even: forward)."""
    return _SIZED_BASE + 2 * nbytes


class _Signature:
    """What frames need to know of one list of specs, worked out once per distinct list.

    Attributes:
        specs: The specs.
        static: Their header's bytes (what a frame carries after its fields).
        sizes: Bytes of each tensor (empty while a shape is unknown).
        nbytes: Bytes of the whole message.
        kind: How it travels: inline, its tensors under sized tags, or under the data tag.
        tags: Each tensor's sized tag.
    """

    __slots__ = ("kind", "nbytes", "sizes", "specs", "static", "tags")

    def __init__(self, specs: tuple[TensorSpec, ...], operation: str) -> None:
        try:
            header = encode_specs(specs, operation)
        except ValueError as error:
            raise ValueError(f"{error} (or turn off CommConfig.check_contracts)") from None
        self.specs = specs
        self.static = header.numpy().tobytes()
        known = all(spec.shape is not None for spec in specs)
        self.sizes = tuple(s.numel * s.dtype.itemsize for s in specs) if known else ()
        self.nbytes = sum(self.sizes)
        self.tags = tuple(_sized_tag(size) for size in self.sizes)
        self.kind = (
            _INLINE
            if self.nbytes <= INLINE_BYTES
            else _SIZED
            if max(self.sizes) <= SIZED_TAG_BYTES
            else _FOLLOWS
        )


_BY_SPECS: dict[tuple[TensorSpec, ...], _Signature] = {}
# By identity too: a receive's specs are usually the very tuple `normalize_specs_cached`
# keeps, whose lookup by value would hash every spec on every call.
_BY_ID: dict[int, tuple[tuple[TensorSpec, ...], _Signature]] = {}
_BY_TENSORS: dict[tuple[tuple[torch.Size, torch.dtype], ...], _Signature] = {}


def _signature(specs: Sequence[TensorSpec], operation: str) -> _Signature:
    """The signature of a receive's specs (remembered: schedules repeat shapes).

    Raises:
        ValueError: A header cannot describe `specs`.
    """
    known = _BY_ID.get(id(specs))
    if known is not None and known[0] is specs:
        return known[1]
    key = specs if type(specs) is tuple else tuple(specs)
    found = _BY_SPECS.get(key)
    if found is None:
        if len(_BY_SPECS) >= _CACHED:
            _BY_SPECS.clear()
        found = _BY_SPECS[key] = _Signature(key, operation)
    if key is specs:  # a tuple, kept alive by the entry: its id cannot be reused meanwhile
        if len(_BY_ID) >= _CACHED:
            _BY_ID.clear()
        _BY_ID[id(key)] = (key, found)
    return found


def _forget_signatures() -> None:
    """Drop every remembered signature (tests that change `SIZED_TAG_BYTES` call it)."""
    _BY_SPECS.clear()
    _BY_ID.clear()
    _BY_TENSORS.clear()


def _sent_signature(tensors: Sequence[torch.Tensor], operation: str) -> _Signature:
    """The signature of what a send sends, looked up by shapes and dtypes (no specs built).

    Raises:
        ValueError: A header cannot describe `tensors`.
    """
    key = tuple([(t.shape, t.dtype) for t in tensors])
    found = _BY_TENSORS.get(key)
    if found is None:
        if len(_BY_TENSORS) >= _CACHED:
            _BY_TENSORS.clear()
        specs = tuple(TensorSpec(tuple(shape), dtype) for shape, dtype in key)
        found = _BY_TENSORS[key] = _signature(specs, operation)
    return found


def _header(fields: tuple[int, int, int, int], static: bytes) -> torch.Tensor:
    """A frame header as bytes (built in Python: cheaper than tensor ops at this size)."""
    return torch.frombuffer(bytearray(_PACKED.pack(*fields) + static), dtype=torch.uint8)


def _described(static: bytes) -> list[TensorSpec]:
    """The specs a header's bytes describe."""
    return decode_header(torch.frombuffer(bytearray(static), dtype=torch.int64))


class _FramedReceive:
    """A receive's work: the frame, then (once checked) the tensors that follow it, if any.

    Looks like a `torch.distributed.Work` to `Transport.wait`; raises `P2PMismatchError`
    from `wait` when the frame disagrees with the receive.

    Attributes:
        following: The receives of the tensors after the frame: posted with the frame
            (sized tags), or once it is checked.
        queue: The framed receives of its stream not finished yet, in posting order.
    """

    __slots__ = ("_done", "_finish", "following", "queue")

    def __init__(self, finish: Callable[[datetime.timedelta], list[Posted]]) -> None:
        self._finish: Callable[[datetime.timedelta], list[Posted]] | None = finish
        self.following: list[Posted] = []
        self.queue: list[_FramedReceive] = []
        self._done = False

    def finish(self, timeout: datetime.timedelta) -> None:
        """Wait for the frame, check it, and post what follows (once)."""
        finish, self._finish = self._finish, None
        if finish is not None:
            queue = self.queue
            if queue and queue[0] is self:  # the usual order: the oldest first
                del queue[0]
            elif self in queue:
                queue.remove(self)
            self.following = finish(timeout)

    def wait(self, timeout: datetime.timedelta) -> bool:
        """Finish the receives posted earlier on the stream, then this one."""
        while self.queue and self.queue[0] is not self:
            self.queue[0].finish(timeout)
        self.finish(timeout)
        for work, _ in self.following:
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
        self._sent: list[_Record | None] = [None] * _RECORDS  # a ring, by sequence number
        # Receive frames already read, reused: a fresh one per receive costs page faults.
        self._spare: list[torch.Tensor] = []
        # Send frames by size with their sends, oldest first: reused once a send is complete
        # (a fresh one per send costs an allocation, and its memory is cold).
        self._sent_frames: dict[int, list[tuple[torch.Tensor, dist.Work]]] = {}
        self._streams: dict[tuple[int, Slot, Channel], list[_FramedReceive]] = {}

    def kept_frames(self) -> list[torch.Tensor]:
        """The frames kept for reuse now: received ones read, and sent ones by size."""
        return [*self._spare, *(frame for kept in self._sent_frames.values() for frame, _ in kept)]

    def post(self, transfers: list[Transfer], operation: str, deadline: float) -> list[Posted]:
        """Post every frame, the tensors of large sends and the receives of large receives.

        Nothing waits. A large receive's tensors are posted with its frame, under sized tags,
        unless a tensor is too large for a tag (then once its frame is read).

        Raises:
            ValueError: A receive did not name a shape, or a message cannot be described by
                a header (a dtype other than those of `pp_comm.payload`, over `MAX_TENSORS`
                tensors or `MAX_DIMS` dimensions); raised before anything is posted.
        """
        self._buffers.fill(transfers, operation)
        signatures = [
            _sent_signature(t.tensors, operation) if t.sends else _signature(t.requested, operation)
            for t in transfers
        ]
        following = self._post_large(transfers, signatures, operation)
        for transfer, signature in zip(transfers, signatures, strict=True):
            transfer.wire = [
                self._send_frame(transfer, signature, operation)
                if transfer.sends
                else self._spare.pop()
                if self._spare
                else _receive_frame()
            ]
        posted = self._transport.post(transfers, tag=HEADER_TAG, operation=operation)
        for index, (work, carried) in enumerate(posted):
            transfer = carried[0]
            if transfer.sends:
                self._keep(transfer.wire[0], work)
            else:  # looks like a Work to whoever waits for it
                signature = signatures[transfers.index(transfer)]
                receive = self._receive(transfer, work, signature, operation)
                receive.following = following.get(id(transfer), [])
                posted[index] = (typing.cast(dist.Work, receive), carried)
        for transfer in transfers:
            if transfer.sends:  # a posted send holds on to its frame
                posted += following.get(id(transfer), [])
                transfer.wire = transfer.tensors
        return posted

    def mismatch(self, transfers: list[Transfer], operation: str) -> Exception | None:
        """Nothing left to compare: frames are checked while they are waited for."""
        return None

    def sent_mismatch(self, transfers: list[Transfer], operation: str) -> Exception | None:
        """Nothing to compare: a sender learns of a mismatch at its next receive."""
        return None

    def _post_large(
        self, transfers: list[Transfer], signatures: list[_Signature], operation: str
    ) -> dict[int, list[Posted]]:
        """Post the tensors after large frames, sends first, ahead of any frame.

        Frames then never hold them up. The receives of tensors too large for a sized tag
        are left to post once their frame is read.
        """
        following: dict[int, list[Posted]] = {}
        if all(signature.kind == _INLINE for signature in signatures):
            return following
        for sends in (True, False):
            for transfer, signature in zip(transfers, signatures, strict=True):
                if transfer.sends is sends and (
                    signature.kind == _SIZED or (signature.kind == _FOLLOWS and sends)
                ):
                    following[id(transfer)] = self._post_following(transfer, signature, operation)
        return following

    def _post_following(
        self, transfer: Transfer, signature: _Signature, operation: str
    ) -> list[Posted]:
        """Post the tensors that travel after a frame: under sized tags, or the data tag."""
        if signature.kind == _SIZED:
            return self._transport.post_each(transfer, signature.tags, operation=operation)
        return self._transport.post([transfer], tag=DATA_TAG, operation=operation)

    def _send_frame(
        self, transfer: Transfer, signature: _Signature, operation: str
    ) -> torch.Tensor:
        """The frame of a send: its header, and its payload when inline."""
        kind = signature.kind
        sequence = next(self._sequence)
        self._sent[sequence % _RECORDS] = (
            sequence,
            operation,
            transfer.microbatch,
            signature.specs,
        )
        microbatch = _NO_MICROBATCH if transfer.microbatch is None else transfer.microbatch
        inline = signature.nbytes if kind == _INLINE else 0
        header = _PACKED.pack(kind, sequence, microbatch, inline) + signature.static
        if kind != _INLINE:
            return torch.frombuffer(bytearray(header), dtype=torch.uint8)
        # Plain memory copies: a frame is a few KB, and tensor ops would cost more than the
        # bytes (the tensors are contiguous and on the CPU: frames are used on gloo only).
        frame = self._send_buffer(FRAME_HEADER_BYTES + inline)
        address = frame.data_ptr()
        ctypes.memmove(address, header, FRAME_HEADER_BYTES)
        address += FRAME_HEADER_BYTES
        for tensor, size in zip(transfer.tensors, signature.sizes, strict=True):
            ctypes.memmove(address, tensor.data_ptr(), size)
            address += size
        return frame

    def _send_buffer(self, size: int) -> torch.Tensor:
        """A frame of `size` bytes to send: the oldest of that size whose send is complete."""
        kept = self._sent_frames.get(size)
        if kept and kept[0][1].is_completed():  # on gloo: once waited for
            return kept.pop(0)[0]
        return torch.empty(size, dtype=torch.uint8)

    def _keep(self, frame: torch.Tensor, work: dist.Work) -> None:
        """Remember a posted send frame for reuse (a few per size, of a few sizes)."""
        kept = self._sent_frames.get(frame.numel())
        if kept is None:
            if len(self._sent_frames) >= _SPARE_FRAMES:
                self._sent_frames.clear()
            kept = self._sent_frames[frame.numel()] = []
        if len(kept) < _SPARE_FRAMES:
            kept.append((frame, work))

    def _receive(
        self, transfer: Transfer, work: dist.Work, signature: _Signature, operation: str
    ) -> _FramedReceive:
        """The work of a receive: its frame's, then its check, then what follows."""
        frame = transfer.wire[0]

        def finish(timeout: datetime.timedelta) -> list[Posted]:
            try:
                work.wait(timeout)
            except RuntimeError as error:  # named after this receive, whoever waits for it
                raise self._transport.failure(error, (transfer,), operation, None) from error
            posted = receive.following
            return self._check(
                transfer, signature, frame, posted, operation=operation, timeout=timeout
            )

        receive = _FramedReceive(finish)
        key = (transfer.peer, transfer.slot, transfer.channel)
        receive.queue = self._streams.setdefault(key, [])
        receive.queue.append(receive)
        return receive

    def _check(
        self,
        transfer: Transfer,
        signature: _Signature,
        frame: torch.Tensor,
        posted: list[Posted],
        *,
        operation: str,
        timeout: datetime.timedelta,
    ) -> list[Posted]:
        """What is left to wait for once the frame agrees; an inline payload is copied out.

        That is `posted` (the receives posted with the frame, sized tags), or nothing.

        Raises:
            P2PMismatchError: The frame is a notice (this side sent other than asked for), or
                its message is not what this receive asked for (drained, the sender told).
        """
        transfer.wire = transfer.tensors
        head = ctypes.string_at(frame.data_ptr(), FRAME_HEADER_BYTES)
        fields: tuple[int, int, int, int] = _PACKED.unpack_from(head)
        kind = fields[0]
        if kind == _NOTICE:
            raise self._noticed(transfer, fields, head[_PACKED.size :], operation)
        if head.endswith(signature.static):  # the same specs, so the same kind
            if kind == _INLINE:
                _unpack(transfer.tensors, signature.sizes, frame)
            if len(self._spare) < _SPARE_FRAMES:
                self._spare.append(frame)
            if kind == _FOLLOWS:
                return self._post_following(transfer, signature, operation)
            return posted
        sent = _described(head[_PACKED.size :])
        self._drain(transfer, kind, sent, operation, timeout, posted=bool(posted))
        self._notify(transfer, fields, operation, timeout)
        self._transport.broken = f"{operation} received a mismatched message"
        topology = self._transport.topology
        raise mismatch_error(topology, transfer, operation, transfer.requested, sent, sender=False)

    def _drain(
        self,
        transfer: Transfer,
        kind: int,
        sent: Sequence[TensorSpec],
        operation: str,
        timeout: datetime.timedelta,
        *,
        posted: bool,
    ) -> None:
        """Receive what a mismatched frame says follows it, so that its sender completes.

        A sent tensor of the size of one this receive posted (`posted`, sized tags) lands
        there; every other one is received into a new buffer. Waits `_NOTICE_GRACE_S` at most
        (and raises nothing: the mismatch is the error to report).
        """
        if kind not in (_SIZED, _FOLLOWS):
            return
        landing = [t.numel() * t.element_size() for t in transfer.tensors] if posted else []
        wire, tags = [], []
        for spec in sent:
            size = spec.numel * spec.dtype.itemsize
            if kind == _SIZED and size in landing:
                landing.remove(size)  # it meets the receive posted for that size
                continue
            wire.append(torch.empty(spec.shape or (), dtype=spec.dtype, device=self._device))
            tags.append(_sized_tag(size))
        drain = Transfer(transfer.slot, transfer.peer, wire, channel=transfer.channel)
        drain.microbatch = transfer.microbatch
        grace = min(timeout.total_seconds(), _NOTICE_GRACE_S)
        try:
            if kind == _SIZED:
                posted_drain = self._transport.post_each(drain, tags, operation=operation)
            else:
                posted_drain = self._transport.post([drain], tag=DATA_TAG, operation=operation)
            self._transport.wait(posted_drain, operation, time.monotonic() + grace)
        except P2PError:
            pass  # the sender will time out instead of hearing of the mismatch

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
        wire = _header(notice, _signature(transfer.requested, operation).static)
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
        if record is None or record[0] != fields[1]:  # long forgotten: name what is known
            microbatch = None if fields[2] == _NO_MICROBATCH else fields[2]
            record = (fields[1], f"a send before {operation}", microbatch, ())
        _, sender_operation, sender_microbatch, specs = record
        expected = _described(head)
        sent = Transfer(_BACK[transfer.slot], transfer.peer, [], specs=specs)
        sent.microbatch = sender_microbatch
        topology = self._transport.topology
        error = mismatch_error(topology, sent, sender_operation, expected, specs, sender=True)
        error.args = (
            f"{error.args[0]} (reported to {operation}{in_microbatch(transfer.microbatch)})",
        )
        return error


def _receive_frame() -> torch.Tensor:
    """A buffer that any frame fits in (gloo aborts on a message larger than its receive)."""
    return torch.empty(FRAME_HEADER_BYTES + INLINE_BYTES, dtype=torch.uint8)


def _unpack(buffers: Sequence[torch.Tensor], sizes: Sequence[int], frame: torch.Tensor) -> None:
    """Copy an inline payload out of its frame into the receive's buffers."""
    address = frame.data_ptr() + FRAME_HEADER_BYTES
    for buffer, size in zip(buffers, sizes, strict=True):  # new contiguous CPU tensors
        ctypes.memmove(buffer.data_ptr(), address, size)
        address += size


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
