"""The order in which a rank posts its point-to-point operations, and a check that it is safe.

Pure Python, no torch: the rules here decide whether a pipeline can deadlock, so they are tested
exhaustively without processes.

Every exchange between pipeline stages is made of up to four *slots* per rank:
``send_next`` (activations to the next stage), ``recv_prev`` (activations from the previous
one), ``send_prev`` (gradients to the previous stage) and ``recv_next`` (gradients from the
next one). ``send_next`` on stage r pairs with ``recv_prev`` on stage r+1, and ``send_prev`` on
stage r with ``recv_next`` on stage r-1 (the ring wraps around).

Two *channels* keep the two kinds of traffic apart: the forward channel carries
``send_next``/``recv_prev``, the backward channel ``send_prev``/``recv_next``. With two stages
the next and previous stage are the same rank, so a message in one direction could be matched
by a receive meant for the other (the crossed tensors of Megatron-LM issue 750); there the
communicator gives each channel its own tag (gloo), or each stream (sender, receiver, channel)
its own process group (NCCL), and matching by direction is guaranteed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, get_args

__all__ = [
    "CHANNEL_OF_SLOT",
    "SLOTS",
    "Channel",
    "Slot",
    "batched_order",
    "find_deadlock",
    "unbatched_order",
]

Slot = Literal["send_next", "recv_prev", "send_prev", "recv_next"]
SLOTS: tuple[Slot, ...] = get_args(Slot)
Channel = Literal["forward", "backward"]
CHANNEL_OF_SLOT: Mapping[Slot, Channel] = {
    "send_next": "forward",
    "recv_prev": "forward",
    "send_prev": "backward",
    "recv_next": "backward",
}

# Even stages send first and odd stages receive first, on each channel in turn.
_EVEN: tuple[Slot, ...] = ("send_next", "recv_prev", "send_prev", "recv_next")
_ODD: tuple[Slot, ...] = ("recv_prev", "send_next", "recv_next", "send_prev")
_BATCH: tuple[Slot, ...] = ("send_prev", "recv_prev", "send_next", "recv_next")


def unbatched_order(stage: int, slots: Iterable[Slot]) -> list[Slot]:
    """The order to post individual isend/irecv calls for `slots` on `stage`.

    Even stages send first, odd stages receive first, one channel after the other. This is
    free of deadlock for every pipeline size, odd rings included (`find_deadlock` checks every
    combination of slots in the tests).

    Args:
        stage: This rank's pipeline stage.
        slots: The slots this call uses, in any order.

    Returns:
        `slots` in posting order.
    """
    wanted = set(slots)
    order = _ODD if stage % 2 else _EVEN
    return [slot for slot in order if slot in wanted]


def batched_order(slots: Iterable[Slot]) -> list[Slot]:
    """The order of `slots` inside one ``batch_isend_irecv`` (the same on every rank)."""
    wanted = set(slots)
    return [slot for slot in _BATCH if slot in wanted]


def _peer(stage: int, slot: Slot, pp_size: int) -> int:
    step = 1 if slot in ("send_next", "recv_next") else -1
    return (stage + step) % pp_size


_MATCHING: Mapping[Slot, Slot] = {
    "send_next": "recv_prev",
    "recv_prev": "send_next",
    "send_prev": "recv_next",
    "recv_next": "send_prev",
}


def find_deadlock(plans: Sequence[Sequence[Slot]]) -> str | None:
    """Run posted operations under the strictest model and report a deadlock, if any.

    Model: each rank executes its operations one at a time, in order, and an operation
    completes only when the peer is executing the matching operation at the same moment
    (rendezvous, as a large NCCL transfer on one stream behaves). Backends that buffer or post
    asynchronously (gloo, small NCCL messages) can only do better.

    Args:
        plans: For each stage, its operations in posting order.

    Returns:
        None when every operation completes, else a description of the stuck ranks.

    Raises:
        ValueError: An operation has no matching operation on its peer.
    """
    pp_size = len(plans)
    for stage, plan in enumerate(plans):
        for slot in plan:
            peer = _peer(stage, slot, pp_size)
            if _MATCHING[slot] not in plans[peer]:
                raise ValueError(
                    f"stage {stage} posts {slot} but stage {peer} posts no {_MATCHING[slot]}"
                )
    position = [0] * pp_size
    progressed = True
    while progressed:
        progressed = False
        for stage in range(pp_size):
            if position[stage] >= len(plans[stage]):
                continue
            slot = plans[stage][position[stage]]
            peer = _peer(stage, slot, pp_size)
            current = plans[peer][position[peer]] if position[peer] < len(plans[peer]) else None
            if current == _MATCHING[slot] and _peer(peer, current, pp_size) == stage:
                position[stage] += 1
                position[peer] += 1
                progressed = True
    stuck = [
        f"stage {stage} waits in {plans[stage][position[stage]]}"
        for stage in range(pp_size)
        if position[stage] < len(plans[stage])
    ]
    return "; ".join(stuck) if stuck else None
