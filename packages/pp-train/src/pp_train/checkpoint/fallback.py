"""Falling back from a damaged newest checkpoint to the newest complete one before it.

A checkpoint directory only gets its ``iter_N`` name once every rank's files are written (see
`pp_train.temporaries`), so a damaged one was complete once and lost a file or some bytes
since (a disk fault, a copy cut short, a hand at work). When any rank finds its part of the
tracked iteration missing, truncated or corrupt (`DamagedCheckpointError`) and no rank
refused it for another reason, every rank loads the newest older ``iter_M`` instead, and
says so; any other refusal still stops the load.
"""

from __future__ import annotations

import re
from pathlib import Path

from pp_train.checkpoint.agreement import gather_ints
from pp_train.checkpoint.errors import CheckpointError, DamagedCheckpointError, PeerCheckpointError

__all__ = ["older_after_damage", "previous_iteration"]

_ITERATION_DIRECTORY = re.compile(r"iter_(\d{7,})")


def previous_iteration(root: Path, before: int) -> int | None:
    """The newest ``iter_N`` directory under `root` with N below `before`, or None."""
    found = [
        int(match.group(1))
        for entry in root.iterdir()
        if (match := _ITERATION_DIRECTORY.fullmatch(entry.name)) and entry.is_dir()
    ]
    older = [n for n in found if n < before]
    return max(older) if older else None


def older_after_damage(root: Path, iteration: int, rank: int, error: CheckpointError) -> int | None:
    """The iteration to load instead of `iteration`, which failed with `error`; a collective.

    Every rank calls it with what it caught. The answer is the same on every rank: None unless
    some rank's own part was damaged and no rank refused for another reason; then global rank
    0's `previous_iteration` (None when there is none).
    """
    own = 0 if isinstance(error, PeerCheckpointError) else 1
    if own and not isinstance(error, DamagedCheckpointError):
        own = 2  # refused for another reason: another model, an unsafe file, ...
    if max(gather_ints(own, "checkpoint fallback", iteration=iteration)) != 1:
        return None
    older = previous_iteration(root, iteration) if rank == 0 else None
    answer = gather_ints(-1 if older is None else older, "checkpoint fallback")[0]
    return None if answer < 0 else answer
