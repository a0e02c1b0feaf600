"""The error every checkpoint refusal raises, and the lists its messages show."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "MAX_LISTED",
    "CheckpointError",
    "DamagedCheckpointError",
    "PeerCheckpointError",
    "first_line",
    "listed",
]

MAX_LISTED = 5
"""Enough entries of a long list of keys, shapes or files to recognise the problem."""


class CheckpointError(ValueError):
    """A checkpoint could not be saved or loaded; the message names the rank, file and cause."""


class DamagedCheckpointError(CheckpointError):
    """A file of the checkpoint is missing, truncated or corrupt: an older one may still load."""


class PeerCheckpointError(CheckpointError):
    """Another rank's refusal, relayed to this rank, whose own part was fine."""


def listed(items: Sequence[str], separator: str = ", ") -> str:
    """``[a, b, c, d, e, and 3 more]``: the first `MAX_LISTED` of `items` and how many follow.

    Args:
        items: What to show.
        separator: Between two items (``"; "`` when the items hold commas themselves).
    """
    shown = separator.join(items[:MAX_LISTED])
    more = len(items) - MAX_LISTED
    return f"[{shown}{f'{separator}and {more} more' if more > 0 else ''}]"


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, or its type's name when it has none."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
