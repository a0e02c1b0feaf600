"""Cross-rank agreement of a checkpoint operation: no rank goes on while another failed.

Every save and load ends its steps with `raise_if_any_failed`, a collective that stands in
for a barrier and also tells each rank whether any other failed, so a refusal raises on every
rank and no rank waits forever for a peer that gave up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pp_state.collectives import collective, collective_device
from pp_train.checkpoint.errors import CheckpointError, PeerCheckpointError

__all__ = ["collective_device", "gather_ints", "raise_if_any_failed"]


def gather_ints(
    value: int, operation: str = "checkpoint agreement", *, iteration: int | None = None
) -> list[int]:
    """Every rank's `value`, indexed by global rank (one all-reduce named `operation`)."""
    values = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=collective_device())
    values[dist.get_rank()] = value
    with collective(operation, iteration=iteration):
        dist.all_reduce(values)
    return [int(v) for v in values.tolist()]


def raise_if_any_failed(
    rank: int,
    error: BaseException | None,
    own_failure: str,
    consequence: str,
    *,
    operation: str = "checkpoint agreement",
    iteration: int | None = None,
) -> None:
    """A collective: raises `CheckpointError` on every rank when any rank has an error.

    The failing rank's message is its own error; the others name the ranks that failed and
    repeat the first failure's message, so any one rank's report says what went wrong. A
    peer lost meanwhile raises a `CollectiveError` naming `operation` and `iteration`.

    Args:
        rank: This process's global rank.
        error: What this rank failed with, or None.
        own_failure: What this rank could not do, when `error` is not a `CheckpointError`.
        consequence: What the failure leaves undone (the same on every rank).
        operation: The name a lost peer's `CollectiveError` gives.
        iteration: The iteration a lost peer's `CollectiveError` gives.

    Raises:
        CheckpointError: This or another rank has an error (`PeerCheckpointError` on the
            ranks that had none: another's, relayed).
        CollectiveError: A peer was lost during the exchange.
    """
    own: str | None = None
    if error is not None:
        own = (
            str(error)
            if isinstance(error, CheckpointError)
            else f"rank {rank} {own_failure}: {type(error).__name__}: {error}; {consequence}"
        )
    messages: list[str | None] = [None] * dist.get_world_size()
    with collective(operation, iteration=iteration):
        dist.all_gather_object(messages, own)
    failed = [r for r, message in enumerate(messages) if message is not None]
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(own) from error
    if failed:
        raise PeerCheckpointError(
            f"rank {rank}: rank(s) {failed} failed; {consequence}. "
            f"First failure: {messages[failed[0]]}"
        )
