"""Posting transfers on the process groups, waiting for them, and turning failures into errors.

On gloo (CPU tensors) a receive meets the oldest unmatched send of the same peer and tag, so
tags keep streams apart: each channel (activations, gradients) and each kind (shape headers,
data) has its own tag. The n-th header a stage sends on a link meets the n-th header receive
of its neighbour, and the same for data, however each side groups its messages into calls;
and with two stages, where next and previous are the same rank, an activation can never meet
a receive meant for a gradient.

NCCL ignores tags (``batch_isend_irecv`` and individual sends alike): sends and receives
between two ranks of one communicator match in posting order, and a rank runs its calls on
one communicator one after another. There each stream (one sender, one receiver, one
channel) travels on a two-rank process group of its own (see `pp_comm.topology`), and
headers and data share their stream: on each stream a call posts all its headers before its
data, so both sides see the same sequence, and agree, as long as they group their
header-carrying messages (variable shapes or debug) into calls alike. Without headers,
pairing is by order alone on every backend.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import TypeAlias

import torch
import torch.distributed as dist

from pp_comm.config import CommConfig
from pp_comm.errors import P2PError, P2PTimeoutError
from pp_comm.message import SEND_SLOTS
from pp_comm.ordering import (
    CHANNEL_OF_SLOT,
    SLOTS,
    Channel,
    Slot,
    batched_order,
    unbatched_order,
)
from pp_comm.payload import TensorSpec, describe
from pp_comm.topology import CHANNELS, Topology

__all__ = [
    "DATA_TAG",
    "EXPECTATION_TAG",
    "HEADER_TAG",
    "Posted",
    "Transfer",
    "Transport",
    "matches_by_tag",
]

DATA_TAG = 0
"""Tag of data on the forward channel (gloo adds `_BACKWARD_TAG` on the backward channel)."""
HEADER_TAG = 2
"""Tag of shape headers on the forward channel."""
EXPECTATION_TAG = 4
"""Tag of debug mode's expectations (what a receiver asked for, sent back to the sender) for
messages on the forward channel."""
_BACKWARD_TAG = 1
_SLACK_S = 0.01


def matches_by_tag(device: torch.device) -> bool:
    """Whether transfers of tensors on `device` meet by peer and tag (gloo), not in order only.

    CUDA tensors travel over NCCL, which ignores tags; CPU tensors over gloo, which does not.
    """
    return device.type != "cuda"


class Transfer:
    """One message of one call on the wire (a plain class: several are built per call).

    Attributes:
        slot: Direction and kind.
        channel: The stream of the link it travels in: activations ("forward") or gradients
            ("backward"); by default the slot's. Streams pair up separately.
        sends: Whether it is a send.
        peer: The neighbour's global rank.
        microbatch: For error messages.
        requested: A receive's specs as asked for (shapes may be unknown).
        requires_grad: Whether a receive's floating-point buffers require grad.
        tensors: What is sent, or the buffers received into (once allocated).
        wire: What actually travels (1/tp chunks when scattering).
        described: What errors name, when not `specs` (a header names its message).
        expectation: For a send in debug mode, the receive of what its receiver asked for.
    """

    __slots__ = (
        "_specs",
        "channel",
        "described",
        "expectation",
        "microbatch",
        "peer",
        "requested",
        "requires_grad",
        "sends",
        "slot",
        "tensors",
        "wire",
    )

    def __init__(
        self,
        slot: Slot,
        peer: int,
        tensors: list[torch.Tensor],
        *,
        specs: Sequence[TensorSpec] | None = None,
        requires_grad: bool = False,
        microbatch: int | None = None,
        channel: Channel | None = None,
    ) -> None:
        self.slot = slot
        self.channel: Channel = CHANNEL_OF_SLOT[slot] if channel is None else channel
        self.sends = slot in SEND_SLOTS
        self.peer = peer
        self.tensors = tensors
        self.wire = tensors
        self._specs = specs
        self.requested: Sequence[TensorSpec] = specs or ()
        self.requires_grad = requires_grad
        self.microbatch = microbatch
        self.described: Sequence[TensorSpec] | None = None
        self.expectation: Transfer | None = None

    @property
    def specs(self) -> Sequence[TensorSpec]:
        """Shapes and dtypes (for a send, read off its tensors when first needed)."""
        if self._specs is None:
            self._specs = [TensorSpec(tuple(t.shape), t.dtype) for t in self.tensors]
        return self._specs

    @specs.setter
    def specs(self, specs: Sequence[TensorSpec]) -> None:
        self._specs = specs


Posted: TypeAlias = tuple[dist.Work, Sequence[Transfer]]
"""One posted operation and the transfers it carries (what an error about it names)."""


class Transport:
    """Posts transfers in a deadlock-free order, waits with a deadline, reports failures.

    Attributes:
        matches_by_tag: Whether a receive meets a send of the same tag (gloo; posts never
            block) or, as on NCCL, sends and receives meet in posting order, tags ignored.
        broken: Why this communicator refuses further calls (a transfer may be pending), or
            None while it is usable.
    """

    def __init__(self, topology: Topology, config: CommConfig, device: torch.device) -> None:
        """Fix the posting mode and precompute each slot's group and peer."""
        self.topology = topology
        self.config = config
        self.broken: str | None = None
        self._timeout = config.timeout
        self._timeout_s = config.timeout.total_seconds()
        self.matches_by_tag = matches_by_tag(device)
        self._coalesced = config.batch_p2p_comm and not self.matches_by_tag
        order = (
            # gloo posts never block: sends, which a peer may be waiting for, go out first.
            sorted(SLOTS, key=lambda slot: slot not in SEND_SLOTS)
            if self.matches_by_tag
            else batched_order(SLOTS)
            if config.batch_p2p_comm
            else unbatched_order(topology.stage, SLOTS)
        )
        rank_of_slot = {slot: index for index, slot in enumerate(order)}
        self._slot_rank: Callable[[Transfer], int] = lambda t: rank_of_slot[t.slot]
        # Per slot and channel: its group, and how to post on it, to which group rank, with
        # what tag offset.
        self._groups = {
            (slot, channel): topology.group_for(slot, channel)
            for slot in SLOTS
            for channel in CHANNELS
        }
        self._posts = {
            key: (
                group.send if key[0] in SEND_SLOTS else group.recv,
                topology.peer_in(*key),
                _BACKWARD_TAG if self.matches_by_tag and key[1] == "backward" else 0,
            )
            for key, group in self._groups.items()
        }

    def post(self, transfers: list[Transfer], *, tag: int, operation: str) -> list[Posted]:
        """Post every transfer; each posted work comes with the transfers it carries.

        Transfers are posted by slot, keeping the given order among transfers of one slot: on
        gloo, whose posts never block, sends first; on NCCL in the order the posting mode says
        (see `pp_comm.ordering`). gloo runs
        a batch as individual posts anyway; posting on the group directly (what torch's
        isend/irecv end in) saves their per-call Python work, and lets a caller wait for the
        receives of a call while its sends are still in flight.

        Raises:
            P2PError: The backend refused a post (a peer that died before this call).
        """
        if len(transfers) > 1:
            transfers = sorted(transfers, key=self._slot_rank)
        try:
            if self._coalesced:
                return self._post_coalesced(transfers, tag)
            posted: list[Posted] = []
            for transfer in transfers:
                posted += self._post_wires(transfer, (tag,) * len(transfer.wire))
            return posted
        except RuntimeError as error:
            raise self.failure(error, transfers, operation, None) from error

    def post_each(self, transfer: Transfer, tags: Sequence[int], *, operation: str) -> list[Posted]:
        """Post each tensor of one transfer under its own tag (gloo only: tags must match).

        Raises:
            P2PError: The backend refused a post (a peer that died before this call).
        """
        assert self.matches_by_tag, "tags are ignored in posting order (NCCL)"
        try:
            return self._post_wires(transfer, tags)
        except RuntimeError as error:
            raise self.failure(error, [transfer], operation, None) from error

    def _post_wires(self, transfer: Transfer, tags: Sequence[int]) -> list[Posted]:
        """Post each tensor of `transfer.wire` alone, the i-th under ``tags[i]``."""
        post, peer, channel_tag = self._posts[(transfer.slot, transfer.channel)]
        carried = (transfer,)
        return [
            (post([wire], peer, tag + channel_tag), carried)
            for wire, tag in zip(transfer.wire, tags, strict=True)
        ]

    def _post_coalesced(self, ordered: list[Transfer], tag: int) -> list[Posted]:
        """One ``batch_isend_irecv`` per process group used, launched by NCCL as one group call.

        Each stream has a group of its own (see `pp_comm.topology`), so a batch holds one
        stream's messages of the call, in order, and has one work: waiting for it waits for
        that stream's messages only.
        """
        posted: list[Posted] = []
        by_group: dict[int, tuple[dist.ProcessGroup, list[Transfer]]] = {}
        for transfer in ordered:
            group = self._groups[(transfer.slot, transfer.channel)]
            by_group.setdefault(id(group), (group, []))[1].append(transfer)
        for group, members in by_group.values():
            ops = [
                dist.P2POp(dist.isend if t.sends else dist.irecv, wire, t.peer, group, tag)
                for t in members
                for wire in t.wire
            ]
            if ops:
                posted.extend((work, members) for work in dist.batch_isend_irecv(ops))
        return posted

    def wait(self, posted: Sequence[Posted], operation: str, deadline: float) -> None:
        """Wait for every work until `deadline` (a `time.monotonic` value).

        Raises:
            P2PTimeoutError: A work did not complete in time.
            P2PError: A work failed (the peer died, for instance).
        """
        timeout, timeout_s = self._timeout, self._timeout_s
        for work, transfers in posted:
            remaining = deadline - time.monotonic()
            # Early in a call the whole timeout is left: wait with the timedelta made once
            # (the deadline then moves by under _SLACK_S) instead of building one per wait.
            if remaining < timeout_s - _SLACK_S:
                timeout = datetime.timedelta(seconds=max(remaining, 0.001))
            try:
                work.wait(timeout)
            except P2PError:
                raise  # a framed receive's own error (see `pp_comm.framing`)
            except RuntimeError as error:
                raise self.failure(error, transfers, operation, deadline) from error

    def failure(
        self,
        error: RuntimeError,
        transfers: Sequence[Transfer],
        operation: str,
        deadline: float | None,
    ) -> P2PError:
        """The error naming this rank, the peer, the operation and the microbatch.

        The transport is broken from then on: no later call may use it.
        """
        self.broken = f"{operation} failed"
        microbatch = transfers[0].microbatch
        parts = [self._part(transfer, microbatch) for transfer in transfers]
        cause = str(error).strip()
        timed_out = (
            deadline is not None and time.monotonic() >= deadline
        ) or "timed out" in cause.lower()
        what = (
            f"timed out after {self.config.timeout.total_seconds():g} s" if timed_out else "failed"
        )
        first_line = cause.splitlines()[0][:300] if cause else type(error).__name__
        message = (
            f"{self.topology.where()} {what} in {operation}{in_microbatch(microbatch)}: "
            f"{'; '.join(parts)}. Cause: {first_line}"
        )
        kind = P2PTimeoutError if timed_out else P2PError
        return kind(
            message,
            rank=self.topology.rank,
            peer=transfers[0].peer,
            operation=operation,
            microbatch=microbatch,
        )

    def _part(self, transfer: Transfer, microbatch: int | None) -> str:
        verb = "sending to" if transfer.sends else "receiving from"
        other = "" if transfer.microbatch == microbatch else in_microbatch(transfer.microbatch)
        return (
            f"{verb} rank {transfer.peer} (stage {self.topology.stage_of(transfer.peer)}) "
            f"{describe(transfer.described or transfer.specs)}{other}"
        )


def in_microbatch(microbatch: int | None) -> str:
    """Text like " (microbatch 7)" for messages; empty when no microbatch was named."""
    return "" if microbatch is None else f" (microbatch {microbatch})"
