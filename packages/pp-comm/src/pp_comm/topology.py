"""Where a rank sits in its pipeline, and which process group each direction travels on."""

from __future__ import annotations

import torch.distributed as dist

from pp_comm.ordering import CHANNEL_OF_SLOT, SLOTS, Channel, Slot

__all__ = ["Topology"]


class Topology:
    """A rank's stage, its neighbours, and the channels (process groups) to reach them.

    Activations travel on the forward channel, gradients on the backward channel. With more
    than two stages both are the pipeline group. With two stages, next and previous are the
    same rank, so a gradient could be matched with a receive meant for an activation (the
    crossed tensors of Megatron-LM issue 750). Where tags keep them apart (gloo, see
    `pp_comm.transport`) both channels still use the pipeline group; elsewhere (NCCL, which
    ignores tags) gradients get a process group of their own.

    Attributes:
        group: The pipeline group.
        ranks: Global ranks of the stages, in stage order.
        stage: This rank's stage.
        size: Number of stages.
        rank: This rank's global rank.
        backend: The pipeline group's backend name.
        channels: The process group each channel uses.
        peer: Each slot's peer, as a global rank.
        group_peer: Each slot's peer, as a rank of the group its channel uses.
    """

    def __init__(self, pp_group: dist.ProcessGroup, *, channel_groups: bool) -> None:
        """Read the layout of `pp_group`.

        Args:
            pp_group: The pipeline group.
            channel_groups: Whether a two-stage pipeline needs a process group for its
                backward channel (tags do not separate the channels).

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
        self._owned: list[dist.ProcessGroup] = []
        self.channels: dict[Channel, dist.ProcessGroup] = {
            "forward": pp_group,
            "backward": (
                self._backward_channel() if self.size == 2 and channel_groups else pp_group
            ),
        }
        self.peer: dict[Slot, int] = {slot: self._neighbour(slot) for slot in SLOTS}
        self.group_peer: dict[Slot, int] = {
            slot: dist.get_group_rank(self.group_of(slot), self.peer[slot]) for slot in SLOTS
        }

    def _neighbour(self, slot: Slot) -> int:
        step = 1 if slot in ("send_next", "recv_next") else -1
        return self.ranks[(self.stage + step) % self.size]

    def _backward_channel(self) -> dist.ProcessGroup:
        """A second group over the two stages, so gradients never match activations.

        As in Megatron, the world group serves as the gradients' channel; when the pipeline
        group is the world itself, every rank is a stage and is constructing a communicator,
        so a duplicate group can be created collectively. Nothing is created with local
        synchronization, so stages that hold different numbers of groups cannot disagree on
        a group's name.
        """
        world = dist.group.WORLD
        assert world is not None
        if self.group != world:
            return world
        duplicate: dist.ProcessGroup = dist.new_group(self.ranks, backend=self.backend)
        self._owned.append(duplicate)
        return duplicate

    def peer_in(self, slot: Slot, channel: Channel) -> int:
        """The peer of `slot` as a rank of the group `channel` uses."""
        if self.channels[channel] is self.group_of(slot):
            return self.group_peer[slot]
        return dist.get_group_rank(self.channels[channel], self.peer[slot])

    def group_of(self, slot: Slot) -> dist.ProcessGroup:
        """The process group `slot` travels on."""
        return self.channels[CHANNEL_OF_SLOT[slot]]

    def stage_of(self, rank: int) -> int:
        """The stage of global rank `rank`."""
        return self.ranks.index(rank)

    def where(self) -> str:
        """This rank in words, for error messages: "rank 2 (stage 2 of 4)"."""
        return f"rank {self.rank} (stage {self.stage} of {self.size})"

    def destroy(self) -> None:
        """Destroy the group made for a two-stage pipeline's backward channel, if any."""
        for group in self._owned:
            if dist.is_initialized():
                dist.destroy_process_group(group)
        self._owned.clear()
