"""`P2PCommunicator`: Megatron's nine send/receive operations between pipeline stages."""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, TypeAlias, overload

import torch
import torch.distributed as dist

from pp_comm.errors import P2PError, P2PMismatchError, P2PTimeoutError
from pp_comm.ordering import CHANNEL_OF_SLOT, Slot, batched_order, unbatched_order
from pp_comm.payload import (
    HEADER_LENGTH,
    ShapesArg,
    TensorSpec,
    decode_header,
    describe,
    encode_header,
    normalize_specs_cached,
)
from pp_comm.timers import NullTimers, Timers

if TYPE_CHECKING:
    from pp_state import ParallelState

__all__ = ["CommConfig", "P2PCommunicator", "P2PHandle", "Payload", "Received"]

Payload: TypeAlias = torch.Tensor | Sequence[torch.Tensor] | None
"""What a send takes: one tensor, a list of tensors (the encoder-decoder split sends two), or
None for nothing."""
Received: TypeAlias = torch.Tensor | list[torch.Tensor] | None
"""What a receive gives: one tensor when one shape was asked for, a list for a list, or None
when this stage has no peer in that direction."""

_DTypes: TypeAlias = torch.dtype | Sequence[torch.dtype] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommConfig:
    """How a communicator moves tensors; every rank of a pipeline must use the same config."""

    pipeline_dtype: torch.dtype = torch.float32
    """dtype of received tensors when a call names none (Megatron's ``pipeline_dtype``)."""

    batch_p2p_comm: bool = True
    """Post each exchange as one ``batch_isend_irecv`` (True) or as individual isend/irecv in
    a deadlock-free order (False). Both match tensors by direction at every pipeline size."""

    variable_seq_lengths: bool = False
    """Shapes travel with the data: receivers need not know them, and every message may
    differ. Costs one small extra exchange per call."""

    scatter_gather_tensors_in_pipeline: bool = False
    """Send 1/tp of each tensor and all-gather it over the tensor-parallel group after
    receiving (tensors whose size tp does not divide travel whole)."""

    debug: bool = False
    """Send each message's shape and dtype ahead of it and raise `P2PMismatchError` on the
    receiving side when they differ from what it expects."""

    timeout: datetime.timedelta = datetime.timedelta(minutes=10)
    """Longest wait for one call's transfers before `P2PTimeoutError`."""

    recv_requires_grad: bool = True
    """Received tensors require grad (activations feed the stage's backward)."""

    def __post_init__(self) -> None:
        """Checks types and the timeout.

        Raises:
            TypeError: `pipeline_dtype` is not a torch.dtype or `timeout` not a timedelta.
            ValueError: The timeout is not positive.
        """
        if not isinstance(self.pipeline_dtype, torch.dtype):
            raise TypeError(f"pipeline_dtype must be a torch.dtype, got {self.pipeline_dtype!r}")
        if not isinstance(self.timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {self.timeout!r}")
        if self.timeout <= datetime.timedelta(0):
            raise ValueError(f"timeout must be positive, got {self.timeout}")


class _Transfer:
    """One slot of one call: what goes where (a plain class: it is built on every call)."""

    __slots__ = ("_specs", "described", "peer", "slot", "tensors", "wire")

    def __init__(
        self,
        slot: Slot,
        peer: int,
        specs: Sequence[TensorSpec] | None,
        tensors: list[torch.Tensor],
        wire: list[torch.Tensor],
    ) -> None:
        self.slot = slot
        self.peer = peer
        self._specs = specs
        self.tensors = tensors  # what is sent, or the buffers received into
        self.wire = wire  # what actually travels (a 1/tp chunk when scattering)
        # What error messages name, when not the tensors themselves (a shape header).
        self.described: Sequence[TensorSpec] | None = None

    @property
    def specs(self) -> Sequence[TensorSpec]:
        """Shapes and dtypes (for a send, read off its tensors when first needed)."""
        if self._specs is None:
            self._specs = [TensorSpec(tuple(t.shape), t.dtype) for t in self.tensors]
        return self._specs


class P2PHandle:
    """Transfers in flight; `wait` completes them (and gathers scattered tensors)."""

    def __init__(
        self,
        communicator: P2PCommunicator,
        works: list[tuple[dist.Work, list[_Transfer]]],
        transfers: list[_Transfer],
        *,
        operation: str,
        microbatch: int | None,
        deadline: float = 0.0,
    ) -> None:
        """Made by `P2PCommunicator.communicate`."""
        self._communicator = communicator
        self._works = works
        self._transfers = transfers
        self._operation = operation
        self._microbatch = microbatch
        self._deadline = deadline
        self._done = not works

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this call sends or receives into (what it keeps alive until done)."""
        return [t for transfer in self._transfers for t in transfer.wire]

    def is_completed(self) -> bool:
        """Whether `wait` would return at once.

        With scatter-gather, received tensors are whole only after `wait` has gathered them,
        so this stays False until then. On gloo a send reports completion only once waited.
        """
        if self._done:
            return True
        if self._communicator._gathers(self._transfers):
            return False
        return all(work.is_completed() for work, _ in self._works)

    def wait(self) -> None:
        """Block until every transfer of the call completes.

        Raises:
            P2PTimeoutError: A transfer did not complete within the configured timeout; the
                message names this rank, the peer, the operation, the microbatch and what
                was expected.
            P2PError: The peer failed (for instance its process died).
        """
        if self._done:
            return
        self._communicator._wait(self._works, self._operation, self._microbatch, self._deadline)
        self._done = True
        self._communicator._gather(self._transfers)


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


class P2PCommunicator:
    """Point-to-point transfers between neighbouring stages of one pipeline.

    Bound to a pipeline process group (from pp-state or any ``torch.distributed`` group whose
    members, in group-rank order, are the stages) and a device. Every member of the group must
    construct it at the same time: with two stages it creates a second group over the same
    ranks so that activations and gradients between the two travel on separate channels.

    The operations keep Megatron-LM's names and meaning. Calls that would cross the ends of
    the pipeline are no-ops returning None (``recv_forward`` on the first stage); an
    interleaved schedule passes ``is_first_stage=False`` (or uses the ``*_recv_forward`` forms
    with ``recv_prev=True``) where the ring wraps from the last stage to the first.
    """

    def __init__(
        self,
        pp_group: dist.ProcessGroup | None,
        *,
        config: CommConfig | None = None,
        device: torch.device | str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        timers: Timers | None = None,
    ) -> None:
        """Bind to `pp_group`.

        Args:
            pp_group: The pipeline group this rank belongs to; None means the default (world)
                group, a pipeline over every rank.
            config: Posting mode, shapes, timeout; see `CommConfig`.
            device: Where received tensors live; by default the current CUDA device for an
                NCCL group, else the CPU.
            tp_group: The tensor-parallel group, needed for
                ``config.scatter_gather_tensors_in_pipeline``.
            timers: Timer hooks (``timers("forward-recv").start()``); none by default.

        Raises:
            ValueError: This rank is not in `pp_group`, or scatter-gather lacks a `tp_group`.
        """
        self.config = config or CommConfig()
        if pp_group is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "torch.distributed is not initialised: call init_process_group first"
                )
            pp_group = dist.group.WORLD
        assert pp_group is not None
        self._group = pp_group
        self._stage = dist.get_rank(pp_group)
        if self._stage < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the pipeline group given")
        self._ranks = dist.get_process_group_ranks(pp_group)
        self._size = len(self._ranks)
        self._rank = self._ranks[self._stage]
        self._backend = str(dist.get_backend(pp_group))
        if device is None:
            # "nccl", or a per-device map such as "cpu:gloo,cuda:nccl".
            uses_nccl = "nccl" in self._backend and torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if uses_nccl else "cpu"
        self.device = torch.device(device)
        self._timers: Timers = timers if timers is not None else NullTimers()
        self._tp_group = tp_group
        if self.config.scatter_gather_tensors_in_pipeline and tp_group is None:
            raise ValueError(
                "scatter_gather_tensors_in_pipeline needs the tensor-parallel group: pass tp_group"
            )
        self._tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self._tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self._channels: dict[str, dist.ProcessGroup] = {"forward": pp_group, "backward": pp_group}
        self._owned: list[dist.ProcessGroup] = []
        if self._size == 2:
            self._channels["backward"] = self._backward_channel(pp_group)
        self._broken: str | None = None
        # Each slot's peer as a rank of the group its channel uses.
        self._group_peer: dict[Slot, int] = {
            slot: dist.get_group_rank(self._channels[CHANNEL_OF_SLOT[slot]], self._peer(slot))
            for slot in ("send_next", "recv_next", "send_prev", "recv_prev")
        }

    def _backward_channel(self, pp_group: dist.ProcessGroup) -> dist.ProcessGroup:
        """A second group over the two stages, so gradients never match activations.

        With two stages, next and previous are the same rank (the crossed tensors of
        Megatron-LM issue 750). As in Megatron, the world group serves as the gradients'
        channel; when the pipeline group is the world itself, every rank is a stage and is
        constructing this communicator, so a duplicate group can be created collectively.
        """
        world = dist.group.WORLD
        assert world is not None
        if pp_group != world:
            return world
        duplicate: dist.ProcessGroup = dist.new_group(self._ranks, backend=self._backend)
        self._owned.append(duplicate)
        return duplicate

    @classmethod
    def from_parallel_state(
        cls,
        state: ParallelState,
        *,
        config: CommConfig | None = None,
        device: torch.device | str | None = None,
        timers: Timers | None = None,
    ) -> P2PCommunicator:
        """A communicator over `state`'s pipeline group (and its tensor-parallel group)."""
        return cls(
            state.group("pp"),
            config=config,
            device=device,
            tp_group=state.group("tp"),
            timers=timers,
        )

    # ------------------------------------------------------------------------------ topology
    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self._rank

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (its rank in the pipeline group)."""
        return self._stage

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return self._size

    @property
    def next_rank(self) -> int:
        """Global rank of the next stage; the last stage's next is the first."""
        return self._ranks[(self._stage + 1) % self._size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous stage; the first stage's previous is the last."""
        return self._ranks[(self._stage - 1) % self._size]

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank is stage 0."""
        return self._stage == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank is the last stage."""
        return self._stage == self._size - 1

    def invalidate(self, reason: str) -> None:
        """Refuse every later call.

        For callers that abandon an exchange: its transfers may still be pending, and a later
        call would be matched with them.
        """
        self._broken = reason

    def destroy(self) -> None:
        """Destroy the extra channel group made for a two-stage pipeline, if any."""
        for group in self._owned:
            if dist.is_initialized():
                dist.destroy_process_group(group)
        self._owned.clear()

    # ------------------------------------------------------------------------------ Megatron's nine
    def recv_forward(
        self,
        tensor_shapes: ShapesArg,
        is_first_stage: bool | None = None,
        *,
        dtypes: _DTypes = None,
        microbatch: int | None = None,
    ) -> Received:
        """Receive activations from the previous stage; None on the first stage."""
        first = self.is_first_stage if is_first_stage is None else is_first_stage
        if first:
            return None
        received, _, _ = self.communicate(
            recv_prev=True,
            tensor_shapes=tensor_shapes,
            dtypes=dtypes,
            operation="recv_forward",
            microbatch=microbatch,
        )
        return received

    def recv_backward(
        self,
        tensor_shapes: ShapesArg,
        is_last_stage: bool | None = None,
        *,
        dtypes: _DTypes = None,
        microbatch: int | None = None,
    ) -> Received:
        """Receive gradients from the next stage; None on the last stage."""
        last = self.is_last_stage if is_last_stage is None else is_last_stage
        if last:
            return None
        _, received, _ = self.communicate(
            recv_next=True,
            tensor_shapes=tensor_shapes,
            dtypes=dtypes,
            operation="recv_backward",
            microbatch=microbatch,
        )
        return received

    def send_forward(
        self,
        output_tensors: Payload,
        is_last_stage: bool | None = None,
        *,
        microbatch: int | None = None,
    ) -> None:
        """Send activations to the next stage; nothing on the last stage."""
        last = self.is_last_stage if is_last_stage is None else is_last_stage
        if not last:
            self.communicate(
                tensor_send_next=output_tensors, operation="send_forward", microbatch=microbatch
            )

    def send_backward(
        self,
        input_tensor_grads: Payload,
        is_first_stage: bool | None = None,
        *,
        microbatch: int | None = None,
    ) -> None:
        """Send gradients to the previous stage; nothing on the first stage."""
        first = self.is_first_stage if is_first_stage is None else is_first_stage
        if not first:
            self.communicate(
                tensor_send_prev=input_tensor_grads,
                operation="send_backward",
                microbatch=microbatch,
            )

    def send_forward_recv_backward(
        self,
        output_tensors: Payload,
        tensor_shapes: ShapesArg,
        is_last_stage: bool | None = None,
        *,
        dtypes: _DTypes = None,
        microbatch: int | None = None,
    ) -> Received:
        """Send activations to the next stage and receive its gradients; None on the last."""
        last = self.is_last_stage if is_last_stage is None else is_last_stage
        if last:
            return None
        _, received, _ = self.communicate(
            tensor_send_next=output_tensors,
            recv_next=True,
            tensor_shapes=tensor_shapes,
            dtypes=dtypes,
            operation="send_forward_recv_backward",
            microbatch=microbatch,
        )
        return received

    def send_backward_recv_forward(
        self,
        input_tensor_grads: Payload,
        tensor_shapes: ShapesArg,
        is_first_stage: bool | None = None,
        *,
        dtypes: _DTypes = None,
        microbatch: int | None = None,
    ) -> Received:
        """Send gradients to the previous stage, receive its next activations; None on the first."""
        first = self.is_first_stage if is_first_stage is None else is_first_stage
        if first:
            return None
        received, _, _ = self.communicate(
            tensor_send_prev=input_tensor_grads,
            recv_prev=True,
            tensor_shapes=tensor_shapes,
            dtypes=dtypes,
            operation="send_backward_recv_forward",
            microbatch=microbatch,
        )
        return received

    @overload
    def send_forward_recv_forward(
        self,
        output_tensor: Payload,
        recv_prev: bool,
        tensor_shapes: ShapesArg,
        overlap_p2p_comm: Literal[False] = False,
        *,
        dtypes: _DTypes = None,
        microbatch: int | None = None,
    ) -> Received: ...
    @overload
    def send_forward_recv_forward(
        self,
        output_tensor: Payload,
        recv_prev: bool,
        tensor_shapes: ShapesArg,
        overlap_p2p_comm: Literal[True],
        *,
        dtypes: _DTypes = None,
        microbatch: int | None = None,
    ) -> tuple[Received, P2PHandle]: ...
    def send_forward_recv_forward(
        self,
        output_tensor: Payload,
        recv_prev: bool,
        tensor_shapes: ShapesArg,
        overlap_p2p_comm: bool = False,
        *,
        dtypes: _DTypes = None,
        microbatch: int | None = None,
    ) -> Received | tuple[Received, P2PHandle]:
        """Send activations to the next stage while receiving the previous stage's.

        The interleaved schedule's call: the ring wraps (the last stage sends to the first), and
        `output_tensor` None or `recv_prev` False drop either half. With `overlap_p2p_comm`
        the call returns at once with ``(received, handle)``; ``handle.wait()`` before use.
        """
        received, _, handle = self.communicate(
            tensor_send_next=output_tensor,
            recv_prev=recv_prev,
            tensor_shapes=tensor_shapes,
            dtypes=dtypes,
            async_op=overlap_p2p_comm,
            operation="send_forward_recv_forward",
            microbatch=microbatch,
        )
        return (received, handle) if overlap_p2p_comm else received

    @overload
    def send_backward_recv_backward(
        self,
        input_tensor_grad: Payload,
        recv_next: bool,
        tensor_shapes: ShapesArg,
        overlap_p2p_comm: Literal[False] = False,
        *,
        dtypes: _DTypes = None,
        microbatch: int | None = None,
    ) -> Received: ...
    @overload
    def send_backward_recv_backward(
        self,
        input_tensor_grad: Payload,
        recv_next: bool,
        tensor_shapes: ShapesArg,
        overlap_p2p_comm: Literal[True],
        *,
        dtypes: _DTypes = None,
        microbatch: int | None = None,
    ) -> tuple[Received, P2PHandle]: ...
    def send_backward_recv_backward(
        self,
        input_tensor_grad: Payload,
        recv_next: bool,
        tensor_shapes: ShapesArg,
        overlap_p2p_comm: bool = False,
        *,
        dtypes: _DTypes = None,
        microbatch: int | None = None,
    ) -> Received | tuple[Received, P2PHandle]:
        """Send gradients to the previous stage while receiving the next stage's (ring wraps)."""
        _, received, handle = self.communicate(
            tensor_send_prev=input_tensor_grad,
            recv_next=recv_next,
            tensor_shapes=tensor_shapes,
            dtypes=dtypes,
            async_op=overlap_p2p_comm,
            operation="send_backward_recv_backward",
            microbatch=microbatch,
        )
        return (received, handle) if overlap_p2p_comm else received

    def send_forward_backward_recv_forward_backward(
        self,
        output_tensor: Payload,
        input_tensor_grad: Payload,
        recv_prev: bool,
        recv_next: bool,
        tensor_shapes: ShapesArg,
        *,
        dtypes: _DTypes = None,
        microbatch: int | None = None,
    ) -> tuple[Received, Received]:
        """Both directions at once: returns (activations from prev, gradients from next)."""
        from_prev, from_next, _ = self.communicate(
            tensor_send_next=output_tensor,
            tensor_send_prev=input_tensor_grad,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shapes=tensor_shapes,
            dtypes=dtypes,
            operation="send_forward_backward_recv_forward_backward",
            microbatch=microbatch,
        )
        return from_prev, from_next

    # ------------------------------------------------------------------------- the general call
    def communicate(
        self,
        *,
        tensor_send_next: Payload = None,
        tensor_send_prev: Payload = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        tensor_shapes: ShapesArg = None,
        dtypes: _DTypes = None,
        requires_grad: bool | None = None,
        async_op: bool = False,
        operation: str = "communicate",
        microbatch: int | None = None,
    ) -> tuple[Received, Received, P2PHandle]:
        """Send to and receive from both neighbours in one exchange; every operation uses this.

        Args:
            tensor_send_next: Tensors for the next stage (activations), or None.
            tensor_send_prev: Tensors for the previous stage (gradients), or None.
            recv_prev: Receive from the previous stage.
            recv_next: Receive from the next stage.
            tensor_shapes: Shape(s) of what is received (either direction); may be None with
                ``variable_seq_lengths``.
            dtypes: dtype(s) of what is received; the config's ``pipeline_dtype`` by default.
            requires_grad: Whether received tensors require grad; the config's by default.
            async_op: Return once everything is posted; the handle's ``wait()`` completes it.
            operation: Name for timers and error messages.
            microbatch: Microbatch number for error messages.

        Returns:
            (from the previous stage, from the next stage, handle). A direction not received
            is None. Received tensors are filled once the handle has waited.

        Raises:
            ValueError: Bad shapes, a transfer on a one-stage pipeline, or a communicator
                broken by an earlier failure.
            P2PTimeoutError, P2PMismatchError, P2PError: See `P2PHandle.wait`.
        """
        sends: dict[Slot, list[torch.Tensor]] = {}
        outgoing: tuple[tuple[Slot, Payload], ...] = (
            ("send_next", tensor_send_next),
            ("send_prev", tensor_send_prev),
        )
        for slot, payload in outgoing:
            tensors = _as_list(payload, operation)
            if tensors:
                sends[slot] = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        incoming: tuple[tuple[Slot, bool], ...] = (
            ("recv_prev", recv_prev),
            ("recv_next", recv_next),
        )
        receives = [slot for slot, wanted in incoming if wanted]
        specs: Sequence[TensorSpec] = ()
        single = True
        if receives:
            specs, single = normalize_specs_cached(
                tensor_shapes, dtypes, self.config.pipeline_dtype, operation=operation
            )
        if not sends and not receives:
            return None, None, P2PHandle(self, [], [], operation=operation, microbatch=microbatch)
        self._check_usable(operation)
        grad = self.config.recv_requires_grad if requires_grad is None else requires_grad
        timer = self._timers(_TIMER_NAMES.get(operation, operation))
        timer.start()
        try:
            # One deadline for the whole call, shape exchange included.
            deadline = time.monotonic() + self.config.timeout.total_seconds()
            recv_specs, header_sends = self._agree_on_specs(
                sends,
                receives,
                specs,
                operation=operation,
                microbatch=microbatch,
                deadline=deadline,
            )
            transfers = self._plan(sends, recv_specs, grad)
            works = header_sends + self._post(transfers, operation, microbatch)
            handle = P2PHandle(
                self,
                works,
                transfers,
                operation=operation,
                microbatch=microbatch,
                deadline=deadline,
            )
            if not async_op:
                handle.wait()
            mismatch = self._mismatch(receives, specs, recv_specs, operation, microbatch)
            if mismatch is not None:
                handle.wait()
                raise mismatch
        finally:
            timer.stop()
        results: dict[Slot, Received] = {"recv_prev": None, "recv_next": None}
        for transfer in transfers:
            if transfer.slot in ("recv_prev", "recv_next"):
                results[transfer.slot] = transfer.tensors[0] if single else list(transfer.tensors)
        return results["recv_prev"], results["recv_next"], handle

    # ------------------------------------------------------------------------------ internals
    def _peer(self, slot: Slot) -> int:
        return self.next_rank if slot in ("send_next", "recv_next") else self.prev_rank

    def _check_usable(self, operation: str) -> None:
        if self._broken is not None:
            raise ValueError(
                f"rank {self._rank}: {operation} on a communicator broken by an earlier failure "
                f"({self._broken}); transfers may still be pending, so build a new one"
            )
        if self._size == 1:
            raise ValueError(
                f"rank {self._rank}: {operation} on a pipeline of 1 stage: there is no peer"
            )

    def _agree_on_specs(
        self,
        sends: dict[Slot, list[torch.Tensor]],
        receives: list[Slot],
        specs: Sequence[TensorSpec],
        *,
        operation: str,
        microbatch: int | None,
        deadline: float,
    ) -> tuple[dict[Slot, Sequence[TensorSpec]], list[tuple[dist.Work, list[_Transfer]]]]:
        """What each receive will get, and the header sends still in flight.

        A receive gets the given specs, or what the sender's header says. Only received
        headers are waited for: a sender needs nothing from its receiver, so its header
        travels ahead of its data without blocking it (a send that waited here could deadlock
        a schedule whose receiver posts late).
        """
        exchange = self.config.variable_seq_lengths or self.config.debug
        if not exchange:
            for spec in specs:
                if spec.shape is None:
                    raise ValueError(
                        f"{operation}: receiving needs tensor_shapes, unless the communicator "
                        "is configured with variable_seq_lengths=True"
                    )
            return {slot: specs for slot in receives}, []
        header_spec = [TensorSpec((HEADER_LENGTH,), torch.int64)]
        header_sends = {
            slot: [encode_header(tensors, operation).to(self.device)]
            for slot, tensors in sends.items()
        }
        header_transfers = self._plan(
            header_sends,
            {slot: header_spec for slot in receives},
            requires_grad=False,
            scatter=False,
        )
        # Errors name what the caller expects, not the header that describes it.
        for transfer in header_transfers:
            transfer.described = specs if transfer.slot in receives else None
        posted = self._post(header_transfers, operation, microbatch)
        in_flight = [(work, ts) for work, ts in posted if all(t.slot not in receives for t in ts)]
        arriving = [(work, ts) for work, ts in posted if any(t.slot in receives for t in ts)]
        self._wait(arriving, operation, microbatch, deadline)
        agreed: dict[Slot, Sequence[TensorSpec]] = {
            t.slot: decode_header(t.tensors[0]) for t in header_transfers if t.slot in receives
        }
        return agreed, in_flight

    def _mismatch(
        self,
        receives: list[Slot],
        expected: Sequence[TensorSpec],
        got: dict[Slot, Sequence[TensorSpec]],
        operation: str,
        microbatch: int | None,
    ) -> ValueError | P2PMismatchError | None:
        """The error to raise once the (drained) messages are in, if they are not as asked."""
        if not self.config.debug:
            for slot in receives:
                if self.config.variable_seq_lengths and len(got[slot]) != len(expected):
                    return ValueError(
                        f"rank {self._rank} (stage {self._stage}) in {operation}{_mb(microbatch)}: "
                        f"asked for {len(expected)} tensor(s), but rank {self._peer(slot)} "
                        f"sent {len(got[slot])}"
                    )
            return None
        for slot in receives:
            agrees = len(expected) == len(got[slot]) and all(
                (e.shape is None or e.shape == g.shape) and e.dtype == g.dtype
                for e, g in zip(expected, got[slot], strict=False)
            )
            if not agrees:
                # The message was received in full (as sent), so nothing is left pending and
                # the communicator stays usable.
                peer = self._peer(slot)
                return P2PMismatchError(
                    f"rank {self._rank} (stage {self._stage}) in {operation}{_mb(microbatch)}: "
                    f"expected {describe(expected)} from rank {peer} "
                    f"(stage {self._ranks.index(peer)}), "
                    f"but it sent {describe(got[slot])}",
                    rank=self._rank,
                    peer=peer,
                    operation=operation,
                    microbatch=microbatch,
                )
        return None

    def _scatters(self, spec: TensorSpec) -> bool:
        return (
            self.config.scatter_gather_tensors_in_pipeline
            and self._tp_size > 1
            and spec.numel % self._tp_size == 0
            and spec.numel > 0
        )

    def _plan(
        self,
        sends: dict[Slot, list[torch.Tensor]],
        recv_specs: dict[Slot, Sequence[TensorSpec]],
        requires_grad: bool,
        scatter: bool = True,
    ) -> list[_Transfer]:
        scatter = scatter and self._tp_size > 1 and self.config.scatter_gather_tensors_in_pipeline
        transfers = []
        for slot, tensors in sends.items():
            wire = tensors
            if scatter:
                wire = [self._chunk(t) if self._scatters(_spec_of(t)) else t for t in tensors]
            transfers.append(_Transfer(slot, self._peer(slot), None, tensors, wire))
        for slot, specs in recv_specs.items():
            buffers = [
                torch.empty(
                    _known(spec),
                    dtype=spec.dtype,
                    device=self.device,
                    # Only floating-point tensors can require grad (int ids, bool masks cannot).
                    requires_grad=requires_grad
                    and (spec.dtype.is_floating_point or spec.dtype.is_complex),
                )
                for spec in specs
            ]
            wire = buffers
            if scatter:
                wire = [
                    torch.empty(spec.numel // self._tp_size, dtype=spec.dtype, device=self.device)
                    if self._scatters(spec)
                    else buffer
                    for buffer, spec in zip(buffers, specs, strict=True)
                ]
            transfers.append(_Transfer(slot, self._peer(slot), specs, buffers, wire))
        return transfers

    def _chunk(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() // self._tp_size
        return tensor.detach().reshape(-1)[self._tp_rank * size : (self._tp_rank + 1) * size]

    def _post(
        self, transfers: list[_Transfer], operation: str, microbatch: int | None
    ) -> list[tuple[dist.Work, list[_Transfer]]]:
        """Post every transfer; each work comes with the transfers it carries (for errors)."""
        by_slot = {t.slot: t for t in transfers}
        try:
            if self.config.batch_p2p_comm and self.device.type == "cuda":
                return self._post_coalesced(by_slot)
            return self._post_each(by_slot)
        except RuntimeError as error:  # a peer that died before this call, for instance
            self._broken = f"{operation} failed"
            raise self._failure(error, transfers, operation, microbatch, None) from error

    def _post_each(self, by_slot: dict[Slot, _Transfer]) -> list[tuple[dist.Work, list[_Transfer]]]:
        """Individual posts, in the batch order or the deadlock-free unbatched order.

        gloo runs a batch as individual posts anyway; posting on the group directly (what
        torch's isend/irecv end in) saves their per-call Python work.
        """
        order = (
            batched_order(by_slot)
            if self.config.batch_p2p_comm
            else unbatched_order(self._stage, by_slot)
        )
        posted: list[tuple[dist.Work, list[_Transfer]]] = []
        for slot in order:
            transfer = by_slot[slot]
            group = self._channels[CHANNEL_OF_SLOT[slot]]
            peer = self._group_peer[slot]
            post = group.send if slot in ("send_next", "send_prev") else group.recv
            for wire in transfer.wire:
                posted.append((post([wire], peer, 0), [transfer]))
        return posted

    def _post_coalesced(
        self, by_slot: dict[Slot, _Transfer]
    ) -> list[tuple[dist.Work, list[_Transfer]]]:
        """One ``batch_isend_irecv`` per process group used, launched by NCCL as one group call.

        Both channels share the pipeline group unless there are two stages.
        """
        posted: list[tuple[dist.Work, list[_Transfer]]] = []
        groups: list[dist.ProcessGroup] = []
        for channel in ("forward", "backward"):
            if all(group is not self._channels[channel] for group in groups):
                groups.append(self._channels[channel])
        for group in groups:
            slots = [
                s for s in batched_order(by_slot) if self._channels[CHANNEL_OF_SLOT[s]] is group
            ]
            ops = [
                dist.P2POp(_OP[s], wire, by_slot[s].peer, group=group)
                for s in slots
                for wire in by_slot[s].wire
            ]
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    posted.append((work, [by_slot[s] for s in slots]))
        return posted

    def _wait(
        self,
        works: list[tuple[dist.Work, list[_Transfer]]],
        operation: str,
        microbatch: int | None,
        deadline: float,
    ) -> None:
        for work, transfers in works:
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                work.wait(datetime.timedelta(seconds=remaining))
            except RuntimeError as error:
                self._broken = f"{operation} failed"
                raise self._failure(error, transfers, operation, microbatch, deadline) from error

    def _failure(
        self,
        error: RuntimeError,
        transfers: list[_Transfer],
        operation: str,
        microbatch: int | None,
        deadline: float | None,
    ) -> P2PError:
        parts = []
        for transfer in transfers:
            verb = "receiving from" if transfer.slot.startswith("recv") else "sending to"
            parts.append(
                f"{verb} rank {transfer.peer} (stage {self._ranks.index(transfer.peer)}) "
                f"{describe(transfer.described or transfer.specs)}"
            )
        timed_out = (deadline is not None and time.monotonic() >= deadline) or "timed out" in str(
            error
        ).lower()
        what = (
            f"timed out after {self.config.timeout.total_seconds():g} s" if timed_out else "failed"
        )
        message = (
            f"rank {self._rank} (stage {self._stage} of {self._size}) {what} in "
            f"{operation}{_mb(microbatch)}: "
            f"{'; '.join(parts)}. Cause: {str(error).strip().splitlines()[0][:300]}"
        )
        kind = P2PTimeoutError if timed_out else P2PError
        return kind(
            message,
            rank=self._rank,
            peer=transfers[0].peer,
            operation=operation,
            microbatch=microbatch,
        )

    def _gathers(self, transfers: list[_Transfer]) -> bool:
        """Whether some received tensor of `transfers` arrives in scattered pieces."""
        return any(
            wire is not buffer
            for t in transfers
            if t.slot.startswith("recv")
            for wire, buffer in zip(t.wire, t.tensors, strict=True)
        )

    def _gather(self, transfers: list[_Transfer]) -> None:
        """Rebuild scattered tensors after their chunks arrived."""
        if self._tp_size == 1 or not self.config.scatter_gather_tensors_in_pipeline:
            return
        for transfer in transfers:
            if not transfer.slot.startswith("recv"):
                continue
            for buffer, wire, spec in zip(
                transfer.tensors, transfer.wire, transfer.specs, strict=True
            ):
                if wire is buffer:
                    continue
                pieces = [torch.empty_like(wire) for _ in range(self._tp_size)]
                dist.all_gather(pieces, wire, group=self._tp_group)
                with torch.no_grad():
                    buffer.copy_(torch.cat(pieces).view(_known(spec)))


_OP = {
    "send_next": dist.isend,
    "send_prev": dist.isend,
    "recv_prev": dist.irecv,
    "recv_next": dist.irecv,
}


def _spec_of(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(tensor.shape), tensor.dtype)


def _known(spec: TensorSpec) -> tuple[int, ...]:
    assert spec.shape is not None, "shapes are known once specs are agreed"
    return spec.shape


def _mb(microbatch: int | None) -> str:
    return "" if microbatch is None else f" (microbatch {microbatch})"


def _as_list(payload: Payload, operation: str) -> list[torch.Tensor]:
    if payload is None:
        return []
    if isinstance(payload, torch.Tensor):
        return [payload]
    tensors = list(payload)
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{operation}: can only send tensors, got {type(tensor).__name__}")
    return tensors
