"""The error every checkpoint refusal raises, and the lists its messages show."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_LISTED", "CheckpointError", "listed"]

MAX_LISTED = 5
"""Enough entries of a long list of keys, shapes or files to recognise the problem."""


class CheckpointError(ValueError):
    """A checkpoint could not be saved or loaded; the message names the rank, file and cause."""


def listed(items: Sequence[str], separator: str = ", ") -> str:
    """``[a, b, c, d, e, and 3 more]``: the first `MAX_LISTED` of `items` and how many follow.

    Args:
        items: What to show.
        separator: Between two items (``"; "`` when the items hold commas themselves).
    """
    shown = separator.join(items[:MAX_LISTED])
    more = len(items) - MAX_LISTED
    return f"[{shown}{f'{separator}and {more} more' if more > 0 else ''}]"
