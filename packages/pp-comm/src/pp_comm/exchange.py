"""One exchange, end to end: shapes agreed, buffers allocated, transfers posted and waited."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from pp_comm.agreement import shape_agreement
from pp_comm.buffers import Buffers
from pp_comm.config import CommConfig
from pp_comm.framing import FrameBuffers, FramedShapes, frame_buffers
from pp_comm.handle import P2PHandle
from pp_comm.message import P2PMessage
from pp_comm.ordering import Slot
from pp_comm.payload import TensorSpec, normalize_specs_cached
from pp_comm.timers import NullTimers, Timers
from pp_comm.topology import Topology
from pp_comm.transport import Transfer, Transport

__all__ = ["Exchanger"]

# Megatron's timer name for each operation; other operations report under their own name.
_TIMER_NAMES = {
    "recv_forward": "forward-recv",
    "recv_backward": "backward-recv",
    "send_forward": "forward-send",
    "send_backward": "backward-send",
    "send_forward_recv_backward": "forward-send-backward-recv",
    "send_backward_recv_forward": "backward-send-forward-recv",
    "send_forward_recv_forward": "forward-send-forward-recv",
    "send_backward_recv_backward": "backward-send-backward-recv",
    "send_forward_backward_recv_forward_backward": "forward-backward-send-forward-backward-recv",
}


class Exchanger:
    """Runs exchanges for one communicator: every call, of any shape, takes this one path."""

    def __init__(
        self,
        topology: Topology,
        config: CommConfig,
        device: torch.device,
        tp_group: dist.ProcessGroup | None,
        timers: Timers,
    ) -> None:
        """Bind the transport, the shape agreement and the tensor-parallel split."""
        self.topology = topology
        self.config = config
        self.device = device
        self.transport = Transport(topology, config, device)
        self._buffers = Buffers(config, device, tp_group)
        self._agreement = shape_agreement(config, self.transport, self._buffers, device)
        # Null timers are skipped outright rather than called: this is every call's path.
        self._timers: Timers | None = None if isinstance(timers, NullTimers) else timers
        self._timeout_s = config.timeout.total_seconds()

    @property
    def frames(self) -> FrameBuffers:
        """The contract frames this exchanger keeps beyond the tensors (none without frames)."""
        if not isinstance(self._agreement, FramedShapes):
            return FrameBuffers()
        return frame_buffers(self.config, "gloo")

    def kept_frames(self) -> list[torch.Tensor]:
        """The contract frames kept for reuse now (none without frames)."""
        if not isinstance(self._agreement, FramedShapes):
            return []
        return self._agreement.kept_frames()

    # ------------------------------------------------------------------ building transfers
    def send(self, slot: Slot, tensors: Sequence[torch.Tensor], microbatch: int | None) -> Transfer:
        """A send of `tensors` (made contiguous) on `slot`."""
        wire = list(tensors)
        for tensor in wire:
            if not tensor.is_contiguous():
                wire = [t.contiguous() for t in wire]
                break
        return Transfer(slot, self.topology.peer[slot], wire, microbatch=microbatch)

    def add_send(
        self,
        transfers: list[Transfer],
        slot: Slot,
        payload: torch.Tensor | Sequence[torch.Tensor],
        microbatch: int | None,
        operation: str,
    ) -> None:
        """Append a send of `payload` (one tensor or a list; nothing for an empty list).

        Raises:
            TypeError: Something in `payload` is not a tensor.
        """
        if isinstance(payload, torch.Tensor):
            wire = [payload if payload.is_contiguous() else payload.contiguous()]
            transfers.append(Transfer(slot, self.topology.peer[slot], wire, microbatch=microbatch))
            return
        if not isinstance(payload, (list, tuple)):
            payload = list(payload)
        for tensor in payload:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{operation}: can only send tensors, got {type(tensor).__name__}")
        if payload:
            transfers.append(self.send(slot, payload, microbatch))

    def receive(
        self,
        slot: Slot,
        specs: Sequence[TensorSpec],
        requires_grad: bool | None,
        microbatch: int | None,
    ) -> Transfer:
        """A receive on `slot` of tensors as `specs` describe (shapes may be unknown)."""
        grad = self.config.recv_requires_grad if requires_grad is None else requires_grad
        return Transfer(
            slot,
            self.topology.peer[slot],
            [],
            specs=specs,
            requires_grad=grad,
            microbatch=microbatch,
        )

    def from_message(self, message: P2PMessage, operation: str) -> Transfer:
        """The transfer for one `P2PMessage`.

        Raises:
            TypeError: `message` is not a P2PMessage, or a shape is not a sequence of ints.
            ValueError: Bad shapes or dtypes.
        """
        if not isinstance(message, P2PMessage):
            raise TypeError(f"{operation}: expected P2PMessage objects, got {message!r}")
        if message.sends:
            transfer = self.send(message.slot, message.tensors, message.microbatch)
        else:
            specs, _ = normalize_specs_cached(
                message.shapes, message.dtypes, self.config.pipeline_dtype, operation=operation
            )
            transfer = self.receive(message.slot, specs, message.requires_grad, message.microbatch)
        if message.channel is not None:
            transfer.channel = message.channel
        return transfer

    # ------------------------------------------------------------------ running
    def run(self, transfers: list[Transfer], operation: str, async_op: bool) -> P2PHandle:
        """Post `transfers` as one exchange; wait for it unless `async_op`.

        Raises:
            ValueError: A pipeline of one stage, a broken communicator, or unknown shapes.
            P2PTimeoutError, P2PMismatchError, P2PError: A transfer failed or disagreed.
        """
        if not transfers:
            return P2PHandle(None, [], transfers, operation=operation)
        if self.transport.broken is not None or self.topology.size == 1:
            raise self._refusal(operation)
        timer = None
        if self._timers is not None:
            timer = self._timers(_TIMER_NAMES.get(operation, operation))
            timer.start()
        try:
            # One deadline for the whole call, shape exchange included.
            deadline = time.monotonic() + self._timeout_s
            posted = self._agreement.post(transfers, operation, deadline)
            buffers = self._buffers
            gather = buffers.gather if buffers.scatters and buffers.gathers(transfers) else None
            check = self._sent_check(transfers, operation)
            if async_op:
                handle = P2PHandle(
                    self.transport,
                    posted,
                    transfers,
                    operation=operation,
                    deadline=deadline,
                    gather=gather,
                    check=check,
                )
            else:
                self.transport.wait(posted, operation, deadline)
                if gather is not None:
                    gather(transfers)
                handle = P2PHandle(None, [], transfers, operation=operation)
            if self._agreement.checks:
                self._check_agreement(transfers, operation, handle)
                if check is not None and not async_op:
                    check()
            return handle
        finally:
            if timer is not None:
                timer.stop()

    def _check_agreement(
        self, transfers: list[Transfer], operation: str, handle: P2PHandle
    ) -> None:
        """Raise, once the messages are in, if a sender sent other than was asked for."""
        mismatch = self._agreement.mismatch(transfers, operation)
        if mismatch is not None:
            handle.wait()
            raise mismatch

    def _sent_check(self, transfers: list[Transfer], operation: str) -> Callable[[], None] | None:
        """What raises, once the sends are complete, if a receiver asked for other (debug)."""
        if not self.config.debug or all(t.expectation is None for t in transfers):
            return None
        agreement = self._agreement

        def check() -> None:
            mismatch = agreement.sent_mismatch(transfers, operation)
            if mismatch is not None:
                raise mismatch

        return check

    def _refusal(self, operation: str) -> ValueError:
        rank = self.topology.rank
        if self.transport.broken is not None:
            return ValueError(
                f"rank {rank}: {operation} on a communicator broken by an earlier failure "
                f"({self.transport.broken}); transfers may still be pending, so build a new one"
            )
        return ValueError(f"rank {rank}: {operation} on a pipeline of 1 stage: there is no peer")
