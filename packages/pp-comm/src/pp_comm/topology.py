"""Where a rank sits in its pipeline, and which process group each stream travels on."""

from __future__ import annotations

from typing import TypeAlias

import torch
import torch.distributed as dist

from pp_comm.message import SEND_SLOTS
from pp_comm.ordering import SLOTS, Channel, Slot

__all__ = ["CHANNELS", "Stream", "Topology", "ring_links"]

CHANNELS: tuple[Channel, ...] = ("forward", "backward")
"""The two channels: activations and gradients."""

Stream: TypeAlias = tuple[int, int, Channel]
"""A stream: (sending global rank, receiving global rank, channel)."""


class Topology:
    """A rank's stage, its neighbours, and the process group each stream travels on.

    A *stream* is what one rank sends one neighbour on one channel: activations ("forward")
    or gradients ("backward"). Where tags keep streams apart (gloo, see `pp_comm.transport`)
    every stream uses the pipeline group. NCCL ignores tags and pairs the sends and receives
    of two ranks of one communicator in posting order, running each rank's calls on one
    communicator one after another; there every stream gets a two-rank process group of its
    own (`stream_groups`), so streams never pair with each other (with two stages, an
    activation with a gradient: the crossed tensors of Megatron-LM issue 750) and a receive
    posted early holds up only later messages of its own stream.

    Attributes:
        group: The pipeline group.
        ranks: Global ranks of the stages, in stage order.
        stage: This rank's stage.
        size: Number of stages.
        rank: This rank's global rank.
        backend: The pipeline group's backend name.
        peer: Each slot's peer, as a global rank.
        stream_groups: The process group of each stream this rank sends or receives, by
            (sending rank, receiving rank, channel); empty where tags separate the streams.
    """

    def __init__(
        self,
        pp_group: dist.ProcessGroup,
        *,
        stream_groups: bool,
        device: torch.device | None = None,
    ) -> None:
        """Read the layout of `pp_group`.

        Args:
            pp_group: The pipeline group.
            stream_groups: Whether each stream needs a process group of its own (tags do not
                separate streams). Making them is collective over the default group: every
                rank constructs its pipeline's topology at the same point, as with
                ``torch.distributed.new_group``.
            device: Where the stream groups' first collective runs (CPU by default).

        Raises:
            ValueError: This rank is not in `pp_group`.
        """
        self.group = pp_group
        self.stage = dist.get_rank(pp_group)
        if self.stage < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the pipeline group given")
        self.ranks: list[int] = dist.get_process_group_ranks(pp_group)
        self.size = len(self.ranks)
        self.rank = self.ranks[self.stage]
        self.backend = str(dist.get_backend(pp_group))
        self.peer: dict[Slot, int] = {slot: self._neighbour(slot) for slot in SLOTS}
        self.stream_groups: dict[Stream, dist.ProcessGroup] = (
            self._make_stream_groups(device or torch.device("cpu"))
            if stream_groups and self.size > 1
            else {}
        )

    def _neighbour(self, slot: Slot) -> int:
        step = 1 if slot in ("send_next", "recv_next") else -1
        return self.ranks[(self.stage + step) % self.size]

    def _make_stream_groups(self, device: torch.device) -> dict[Stream, dist.ProcessGroup]:
        """One two-rank group per stream of every pipeline, made by every rank in one order.

        ``new_group`` must be called by every rank of the default group for every group, in
        the same order, so each rank first learns every pipeline's ranks. Each group then
        runs one all-reduce, in that order: NCCL creates a group's communicator at its first
        use, blocking until both ranks use it, and a rank blocked so at its first send on one
        stream while its peer is blocked at its first send on another would never go on.
        One global order lets the first pending group always complete.
        """
        pipelines: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(pipelines, self.ranks)
        mine: dict[Stream, dist.ProcessGroup] = {}
        for ranks in sorted({tuple(p) for p in pipelines if p is not None}):
            for sender, receiver in ring_links(ranks):
                for channel in CHANNELS:
                    group = dist.new_group([sender, receiver], backend=self.backend)
                    if self.rank in (sender, receiver):
                        mine[(sender, receiver, channel)] = group
        for group in mine.values():
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        return mine

    def stream(self, slot: Slot, channel: Channel) -> Stream:
        """The stream a transfer in `slot` on `channel` belongs to."""
        peer = self.peer[slot]
        return (self.rank, peer, channel) if slot in SEND_SLOTS else (peer, self.rank, channel)

    def group_for(self, slot: Slot, channel: Channel) -> dist.ProcessGroup:
        """The process group a transfer in `slot` on `channel` travels on."""
        if not self.stream_groups:
            return self.group
        return self.stream_groups[self.stream(slot, channel)]

    def peer_in(self, slot: Slot, channel: Channel) -> int:
        """The peer of `slot` as a rank of the group a transfer on `channel` travels on."""
        return dist.get_group_rank(self.group_for(slot, channel), self.peer[slot])

    def stage_of(self, rank: int) -> int:
        """The stage of global rank `rank`."""
        return self.ranks.index(rank)

    def where(self) -> str:
        """This rank in words, for error messages: "rank 2 (stage 2 of 4)"."""
        return f"rank {self.rank} (stage {self.stage} of {self.size})"

    def destroy(self) -> None:
        """Destroy the stream groups, if any."""
        groups = list(self.stream_groups.values())
        self.stream_groups.clear()
        for group in groups:
            if dist.is_initialized():
                dist.destroy_process_group(group)


def ring_links(ranks: tuple[int, ...]) -> list[tuple[int, int]]:
    """Each (sender, receiver) pair of neighbouring stages of a pipeline, both ways round.

    Stages form a ring (the last stage's next is the first: interleaved schedules use that
    link), so a pipeline of n > 2 stages has 2n pairs; two stages have two, one has none.
    """
    n = len(ranks)
    pairs = {(ranks[s], ranks[(s + 1) % n]) for s in range(n)} if n > 1 else set()
    pairs |= {(b, a) for a, b in pairs}
    return sorted(pairs)
