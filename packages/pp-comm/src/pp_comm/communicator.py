"""`P2PCommunicator`: Megatron's nine send/receive operations over one general exchange.

The pieces, by responsibility: `pp_comm.config` (`CommConfig`), `pp_comm.topology` (stages,
neighbours, channels), `pp_comm.message` (`P2PMessage`, payload types), `pp_comm.exchange`
(one call end to end), `pp_comm.agreement` (shape headers), `pp_comm.transport` (posting,
waiting, errors), `pp_comm.handle` (`P2PHandle`). This module is the public face: the
general `exchange` and `communicate`, and the nine operations as a thin layer over them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Literal, overload

import torch
import torch.distributed as dist

from pp_comm.config import CommConfig
from pp_comm.exchange import Exchanger
from pp_comm.framing import FrameBuffers
from pp_comm.handle import P2PHandle
from pp_comm.message import DTypesArg, P2PMessage, Payload, Received
from pp_comm.payload import ShapesArg, normalize_specs_cached
from pp_comm.timers import NullTimers, Timers
from pp_comm.topology import Topology
from pp_comm.transport import Transfer, matches_by_tag

if TYPE_CHECKING:
    from pp_state import ParallelState

__all__ = ["CommConfig", "P2PCommunicator", "P2PHandle", "P2PMessage", "Payload", "Received"]


class _Unset(enum.Enum):
    """The default of the two spellings of a receive's shapes: not given."""

    UNSET = "unset"


_UNSET: Final = _Unset.UNSET


def _pick_shapes(
    operation: str, tensor_shapes: ShapesArg | _Unset, tensor_shape: ShapesArg | _Unset
) -> ShapesArg:
    """The shapes given as ``tensor_shapes`` (ours) or ``tensor_shape`` (Megatron's), not both.

    Raises:
        TypeError: Both spellings are given, or neither.
    """
    if isinstance(tensor_shape, _Unset):
        if isinstance(tensor_shapes, _Unset):
            raise TypeError(
                f"{operation}() needs the shapes to receive: pass tensor_shapes (or Megatron's"
                " spelling, tensor_shape)"
            )
        return tensor_shapes
    if not isinstance(tensor_shapes, _Unset):
        raise TypeError(
            f"{operation}() got both tensor_shapes and tensor_shape, two spellings of the same"
            " argument (tensor_shape is Megatron's); pass one"
        )
    return tensor_shape


def _flag(operation: str, name: str, value: object, default: bool) -> bool:
    """`value` as a bool, `default` for None.

    Raises:
        TypeError: `value` is not a bool: Megatron's older module-level operations took their
            config in this position (``recv_forward(tensor_shape, config)``); the communicator
            holds its own, and a config read as a flag would silently skip the transfer.
    """
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TypeError(
            f"{operation}(): {name} must be a bool or None, got a {type(value).__name__} (the"
            " communicator holds its config; Megatron's old module functions took one here)"
        )
    return value


class P2PCommunicator:
    """Point-to-point transfers between neighbouring stages of one pipeline.

    Bound to a pipeline process group (from pp-state or any ``torch.distributed`` group whose
    members, in group-rank order, are the stages) and a device. On CUDA (NCCL, which pairs
    transfers by posting order, not tags) each stream (one sender, one receiver, activations
    or gradients) gets a two-rank process group of its own, and making those is collective:
    every rank of the default group constructs its communicator at the same point. On gloo
    tags separate the streams and nothing is created.

    The operations keep Megatron-LM's names and meaning. Calls that would cross the ends of
    the pipeline are no-ops returning None (``recv_forward`` on the first stage); an
    interleaved schedule passes ``is_first_stage=False`` (or uses the ``*_recv_forward`` forms
    with ``recv_prev=True``) where the ring wraps from the last stage to the first. `exchange`
    posts any number of messages to and from both neighbours as one call.
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
            RuntimeError: `pp_group` is None and torch.distributed is not initialised.
        """
        self.config = config or CommConfig()
        if pp_group is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "torch.distributed is not initialised: call init_process_group first"
                )
            pp_group = dist.group.WORLD
        assert pp_group is not None
        if dist.get_rank(pp_group) < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the pipeline group given")
        if self.config.scatter_gather_tensors_in_pipeline and tp_group is None:
            raise ValueError(
                "scatter_gather_tensors_in_pipeline needs the tensor-parallel group: pass tp_group"
            )
        self.device = torch.device(device if device is not None else _default_device(pp_group))
        self._topology = Topology(
            pp_group, stream_groups=not matches_by_tag(self.device), device=self.device
        )
        self._engine = Exchanger(
            self._topology,
            self.config,
            self.device,
            tp_group,
            timers if timers is not None else NullTimers(),
        )
        self._first = self._topology.stage == 0
        self._last = self._topology.stage == self._topology.size - 1

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
        return self._topology.rank

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (its rank in the pipeline group)."""
        return self._topology.stage

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return self._topology.size

    @property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of the pipeline, in stage order (a copy)."""
        return list(self._topology.ranks)

    @property
    def next_rank(self) -> int:
        """Global rank of the next stage; the last stage's next is the first."""
        return self._topology.peer["send_next"]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous stage; the first stage's previous is the last."""
        return self._topology.peer["send_prev"]

    @property
    def transport(self) -> str:
        """Whose matching rules the transfers follow: "gloo" (tags) or "nccl" (order)."""
        return "gloo" if self._engine.transport.matches_by_tag else "nccl"

    @property
    def frames(self) -> FrameBuffers:
        """What this communicator holds for transfers beyond the tensors (see `FrameBuffers`)."""
        return self._engine.frames

    def kept_frames(self) -> list[torch.Tensor]:
        """The contract frames kept for reuse between calls now (see `FrameBuffers`).

        For a memory probe that starts counting after they were made: they are held
        between steps, as the byte model's transfer buffers.
        """
        return self._engine.kept_frames()

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank is stage 0."""
        return self._first

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank is the last stage."""
        return self._last

    def invalidate(self, reason: str) -> None:
        """Refuse every later call.

        For callers that abandon an exchange: its transfers may still be pending, and a later
        call would be matched with them.
        """
        self._engine.transport.broken = reason

    def destroy(self) -> None:
        """Destroy the stream groups made on NCCL, if any."""
        self._topology.destroy()

    # ------------------------------------------------------------------------- the general calls
    def exchange(
        self,
        messages: Sequence[P2PMessage],
        *,
        operation: str = "exchange",
        async_op: bool = False,
    ) -> tuple[list[list[torch.Tensor] | None], P2PHandle]:
        """Post all `messages` to and from both neighbours together, as one call.

        Several messages may use the same slot; on each link they are posted in the order
        given, and the n-th message sent on a link is the n-th received there, however the
        two sides group messages into calls (one exception: on NCCL with variable shapes or
        debug checks, both sides must group alike; see `pp_comm.transport`). Within the call,
        messages are posted by slot in the batched or the deadlock-free unbatched order (see
        `pp_comm.ordering`), keeping the given order among messages of one slot.

        Args:
            messages: What to send and receive.
            operation: Name for timers and error messages.
            async_op: Return once everything is posted: ``handle.wait_recv()`` completes the
                receives, ``handle.wait()`` everything.

        Returns:
            Per message, in the given order: the received tensors (always a list) for a
            receive, None for a send; and the handle. Received tensors are filled once the
            handle has waited (at once unless `async_op`).

        Raises:
            TypeError: A message is not a `P2PMessage`, or a shape not a sequence of ints.
            ValueError: Bad shapes or dtypes, unknown shapes without variable shapes, a
                pipeline of one stage, or a communicator broken by an earlier failure.
            P2PTimeoutError, P2PMismatchError, P2PError: See `P2PHandle.wait`; each names
                the microbatch of the message that failed.
        """
        engine = self._engine
        transfers = [engine.from_message(message, operation) for message in messages]
        handle = engine.run(transfers, operation, async_op)
        return [None if t.sends else t.tensors for t in transfers], handle

    def communicate(
        self,
        *,
        tensor_send_next: Payload = None,
        tensor_send_prev: Payload = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        tensor_shapes: ShapesArg = None,
        dtypes: DTypesArg = None,
        requires_grad: bool | None = None,
        async_op: bool = False,
        operation: str = "communicate",
        microbatch: int | None = None,
    ) -> tuple[Received, Received, P2PHandle]:
        """Send to and receive from both neighbours in one exchange, at most one message each way.

        Every operation uses this; `exchange` is the general form.

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
            ValueError, TypeError: Bad arguments, one stage, or a broken communicator.
            P2PTimeoutError, P2PMismatchError, P2PError: See `P2PHandle.wait`.
        """
        engine = self._engine
        transfers: list[Transfer] = []
        if tensor_send_next is not None:
            engine.add_send(transfers, "send_next", tensor_send_next, microbatch, operation)
        if tensor_send_prev is not None:
            engine.add_send(transfers, "send_prev", tensor_send_prev, microbatch, operation)
        from_prev = from_next = None
        single = True
        if recv_prev or recv_next:
            specs, single = normalize_specs_cached(
                tensor_shapes, dtypes, self.config.pipeline_dtype, operation=operation
            )
            if recv_prev:
                from_prev = engine.receive("recv_prev", specs, requires_grad, microbatch)
                transfers.append(from_prev)
            if recv_next:
                from_next = engine.receive("recv_next", specs, requires_grad, microbatch)
                transfers.append(from_next)
        handle = engine.run(transfers, operation, async_op)
        return (*_received(from_prev, from_next, single), handle)

    # ------------------------------------------------------------------------------ Megatron's nine
    # Each receiving operation takes its shapes as ``tensor_shapes`` (positional or keyword) or
    # as ``tensor_shape=`` (Megatron's name where its signature has it); see `_pick_shapes`.
    def recv_forward(
        self,
        tensor_shapes: ShapesArg | _Unset = _UNSET,
        is_first_stage: bool | None = None,
        *,
        tensor_shape: ShapesArg | _Unset = _UNSET,
        dtypes: DTypesArg = None,
        microbatch: int | None = None,
    ) -> Received:
        """Receive activations from the previous stage; None on the first stage."""
        shapes = _pick_shapes("recv_forward", tensor_shapes, tensor_shape)
        first = _flag("recv_forward", "is_first_stage", is_first_stage, self._first)
        if first:
            return None
        received, _, _ = self.communicate(
            recv_prev=True,
            tensor_shapes=shapes,
            dtypes=dtypes,
            operation="recv_forward",
            microbatch=microbatch,
        )
        return received

    def recv_backward(
        self,
        tensor_shapes: ShapesArg | _Unset = _UNSET,
        is_last_stage: bool | None = None,
        *,
        tensor_shape: ShapesArg | _Unset = _UNSET,
        dtypes: DTypesArg = None,
        microbatch: int | None = None,
    ) -> Received:
        """Receive gradients from the next stage; None on the last stage."""
        shapes = _pick_shapes("recv_backward", tensor_shapes, tensor_shape)
        last = _flag("recv_backward", "is_last_stage", is_last_stage, self._last)
        if last:
            return None
        _, received, _ = self.communicate(
            recv_next=True,
            tensor_shapes=shapes,
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
        last = _flag("send_forward", "is_last_stage", is_last_stage, self._last)
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
        first = _flag("send_backward", "is_first_stage", is_first_stage, self._first)
        if not first:
            self.communicate(
                tensor_send_prev=input_tensor_grads,
                operation="send_backward",
                microbatch=microbatch,
            )

    def send_forward_recv_backward(
        self,
        output_tensors: Payload,
        tensor_shapes: ShapesArg | _Unset = _UNSET,
        is_last_stage: bool | None = None,
        *,
        tensor_shape: ShapesArg | _Unset = _UNSET,
        dtypes: DTypesArg = None,
        microbatch: int | None = None,
    ) -> Received:
        """Send activations to the next stage and receive its gradients; None on the last."""
        shapes = _pick_shapes("send_forward_recv_backward", tensor_shapes, tensor_shape)
        last = _flag("send_forward_recv_backward", "is_last_stage", is_last_stage, self._last)
        if last:
            return None
        _, received, _ = self.communicate(
            tensor_send_next=output_tensors,
            recv_next=True,
            tensor_shapes=shapes,
            dtypes=dtypes,
            operation="send_forward_recv_backward",
            microbatch=microbatch,
        )
        return received

    def send_backward_recv_forward(
        self,
        input_tensor_grads: Payload,
        tensor_shapes: ShapesArg | _Unset = _UNSET,
        is_first_stage: bool | None = None,
        *,
        tensor_shape: ShapesArg | _Unset = _UNSET,
        dtypes: DTypesArg = None,
        microbatch: int | None = None,
    ) -> Received:
        """Send gradients to the previous stage, receive its next activations; None on the first."""
        shapes = _pick_shapes("send_backward_recv_forward", tensor_shapes, tensor_shape)
        first = _flag("send_backward_recv_forward", "is_first_stage", is_first_stage, self._first)
        if first:
            return None
        received, _, _ = self.communicate(
            tensor_send_prev=input_tensor_grads,
            recv_prev=True,
            tensor_shapes=shapes,
            dtypes=dtypes,
            operation="send_backward_recv_forward",
            microbatch=microbatch,
        )
        return received

    # The two ring forms: returning at once (overlap) or not, in either spelling of the shapes.
    @overload
    def send_forward_recv_forward(
        self,
        output_tensor: Payload,
        recv_prev: bool,
        tensor_shapes: ShapesArg | _Unset = _UNSET,
        overlap_p2p_comm: Literal[False] = False,
        *,
        tensor_shape: ShapesArg | _Unset = _UNSET,
        dtypes: DTypesArg = None,
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
        dtypes: DTypesArg = None,
        microbatch: int | None = None,
    ) -> tuple[Received, P2PHandle]: ...
    @overload
    def send_forward_recv_forward(
        self,
        output_tensor: Payload,
        recv_prev: bool,
        tensor_shapes: ShapesArg | _Unset = _UNSET,
        *,
        overlap_p2p_comm: Literal[True],
        tensor_shape: ShapesArg | _Unset = _UNSET,
        dtypes: DTypesArg = None,
        microbatch: int | None = None,
    ) -> tuple[Received, P2PHandle]: ...
    def send_forward_recv_forward(
        self,
        output_tensor: Payload,
        recv_prev: bool,
        tensor_shapes: ShapesArg | _Unset = _UNSET,
        overlap_p2p_comm: bool = False,
        *,
        tensor_shape: ShapesArg | _Unset = _UNSET,
        dtypes: DTypesArg = None,
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
            tensor_shapes=_pick_shapes("send_forward_recv_forward", tensor_shapes, tensor_shape),
            dtypes=dtypes,
            async_op=_flag(
                "send_forward_recv_forward", "overlap_p2p_comm", overlap_p2p_comm, False
            ),
            operation="send_forward_recv_forward",
            microbatch=microbatch,
        )
        return (received, handle) if overlap_p2p_comm else received

    @overload
    def send_backward_recv_backward(
        self,
        input_tensor_grad: Payload,
        recv_next: bool,
        tensor_shapes: ShapesArg | _Unset = _UNSET,
        overlap_p2p_comm: Literal[False] = False,
        *,
        tensor_shape: ShapesArg | _Unset = _UNSET,
        dtypes: DTypesArg = None,
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
        dtypes: DTypesArg = None,
        microbatch: int | None = None,
    ) -> tuple[Received, P2PHandle]: ...
    @overload
    def send_backward_recv_backward(
        self,
        input_tensor_grad: Payload,
        recv_next: bool,
        tensor_shapes: ShapesArg | _Unset = _UNSET,
        *,
        overlap_p2p_comm: Literal[True],
        tensor_shape: ShapesArg | _Unset = _UNSET,
        dtypes: DTypesArg = None,
        microbatch: int | None = None,
    ) -> tuple[Received, P2PHandle]: ...
    def send_backward_recv_backward(
        self,
        input_tensor_grad: Payload,
        recv_next: bool,
        tensor_shapes: ShapesArg | _Unset = _UNSET,
        overlap_p2p_comm: bool = False,
        *,
        tensor_shape: ShapesArg | _Unset = _UNSET,
        dtypes: DTypesArg = None,
        microbatch: int | None = None,
    ) -> Received | tuple[Received, P2PHandle]:
        """Send gradients to the previous stage while receiving the next stage's (ring wraps)."""
        _, received, handle = self.communicate(
            tensor_send_prev=input_tensor_grad,
            recv_next=recv_next,
            tensor_shapes=_pick_shapes("send_backward_recv_backward", tensor_shapes, tensor_shape),
            dtypes=dtypes,
            async_op=_flag(
                "send_backward_recv_backward", "overlap_p2p_comm", overlap_p2p_comm, False
            ),
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
        tensor_shapes: ShapesArg | _Unset = _UNSET,
        *,
        tensor_shape: ShapesArg | _Unset = _UNSET,
        dtypes: DTypesArg = None,
        microbatch: int | None = None,
    ) -> tuple[Received, Received]:
        """Both directions at once: returns (activations from prev, gradients from next)."""
        operation = "send_forward_backward_recv_forward_backward"
        from_prev, from_next, _ = self.communicate(
            tensor_send_next=output_tensor,
            tensor_send_prev=input_tensor_grad,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shapes=_pick_shapes(operation, tensor_shapes, tensor_shape),
            dtypes=dtypes,
            operation=operation,
            microbatch=microbatch,
        )
        return from_prev, from_next


def _default_device(pp_group: dist.ProcessGroup) -> torch.device | str:
    # "nccl", or a per-device map such as "cpu:gloo,cuda:nccl".
    uses_nccl = "nccl" in str(dist.get_backend(pp_group)) and torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if uses_nccl else "cpu"


def _received(
    from_prev: Transfer | None, from_next: Transfer | None, single: bool
) -> tuple[Received, Received]:
    """What `communicate` returns for its receives: a tensor each, or a list each."""
    if single:
        return (
            None if from_prev is None else from_prev.tensors[0],
            None if from_next is None else from_next.tensors[0],
        )
    return (
        None if from_prev is None else from_prev.tensors,
        None if from_next is None else from_next.tensors,
    )
