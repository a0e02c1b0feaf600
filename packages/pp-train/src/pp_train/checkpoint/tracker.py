"""Where a checkpoint's files lie, and the tracker file naming the latest complete iteration.

Both formats keep one directory per iteration and Megatron's tracker beside them::

    <root>/iter_000000N/...                                   (one iteration)
    <root>/latest_checkpointed_iteration.txt                  (the text "N")
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pp_train.checkpoint.agreement import gather_ints
from pp_train.checkpoint.errors import CheckpointError
from pp_train.checkpoint.validation import check_count

__all__ = [
    "CHECKPOINT_FILENAME",
    "CHECKPOINT_VERSION",
    "TRACKER_FILENAME",
    "agree_on_iteration",
    "checkpoint_path",
    "iteration_directory",
    "read_tracker",
]

CHECKPOINT_VERSION = 3.0
"""The ``checkpoint_version`` written and the only one read (Megatron's current layout)."""

CHECKPOINT_FILENAME = "model_optim_rng.pt"
"""Name of each (tensor, pipeline) position's file."""

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
"""Name of the file in the root that holds the latest complete iteration."""


def iteration_directory(root: str | os.PathLike[str], iteration: int) -> Path:
    """``root/iter_{iteration:07d}``: Megatron's directory of one iteration."""
    return Path(root) / f"iter_{iteration:07d}"


def checkpoint_path(
    root: str | os.PathLike[str],
    iteration: int,
    *,
    tensor_rank: int,
    pipeline_rank: int,
    pipeline_size: int,
) -> Path:
    """The file one (tensor, pipeline) position saves iteration `iteration` to.

    Args:
        root: The checkpoint directory (Megatron's ``--save`` / ``--load``).
        iteration: The training iteration.
        tensor_rank: The position in the tensor-parallel group.
        pipeline_rank: The pipeline stage.
        pipeline_size: The number of pipeline stages; with 1 the directory has no stage part.

    Returns:
        ``root/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt``.

    Raises:
        TypeError: A number is not an int.
        ValueError: A number is negative, `pipeline_size` is below 1 or `pipeline_rank` is
            not below it.
    """
    check_count("iteration", iteration)
    check_count("tensor_rank", tensor_rank)
    check_count("pipeline_rank", pipeline_rank)
    check_count("pipeline_size", pipeline_size)
    if not 0 <= pipeline_rank < pipeline_size:
        raise ValueError(
            f"pipeline_rank must be in 0 .. pipeline_size - 1 = {pipeline_size - 1}, "
            f"got pipeline_rank={pipeline_rank}, pipeline_size={pipeline_size}"
        )
    position = f"mp_rank_{tensor_rank:02d}"
    if pipeline_size > 1:
        position += f"_{pipeline_rank:03d}"
    return iteration_directory(root, iteration) / position / CHECKPOINT_FILENAME


def read_tracker(root: str | os.PathLike[str]) -> int | None:
    """The latest complete iteration recorded in `root`, or None when there is none.

    Args:
        root: The checkpoint directory.

    Returns:
        The iteration, or None when `root` or its tracker file does not exist.

    Raises:
        CheckpointError: The tracker cannot be read, says "release" (release checkpoints are
            not supported) or holds anything but an iteration number.
    """
    path = Path(root) / TRACKER_FILENAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"cannot read tracker file {path}: {error}") from error
    content = text.strip()
    if content == "release":
        raise CheckpointError(
            f"tracker file {path} holds 'release': release checkpoints (Megatron's layout "
            "without iterations) are not supported; expected an iteration number"
        )
    if re.fullmatch(r"[0-9]+", content) is None:
        raise CheckpointError(
            f"tracker file {path} holds {content[:80]!r}; expected an iteration number "
            "(an int >= 0)"
        )
    return int(content)


def agree_on_iteration(root: Path, rank: int) -> int | None:
    """The tracker's iteration as every rank reads it; a collective.

    Returns:
        The iteration, or None on every rank when there is no tracker.

    Raises:
        CheckpointError: On every rank unless every rank read the same iteration (or none).
    """
    error: CheckpointError | None = None
    try:
        found = read_tracker(root)
        code = -1 if found is None else found
    except CheckpointError as caught:
        error, code = caught, -2
    codes = gather_ints(code)
    if error is not None:
        raise CheckpointError(f"rank {rank}: {error}") from error
    unreadable = [r for r, value in enumerate(codes) if value == -2]
    if unreadable:
        raise CheckpointError(
            f"rank {rank}: rank(s) {unreadable} could not read the tracker file "
            f"{root / TRACKER_FILENAME}; nothing was loaded"
        )
    if len(set(codes)) > 1:
        seen = ", ".join(
            f"rank {r}: {'none' if value == -1 else value}" for r, value in enumerate(codes)
        )
        raise CheckpointError(
            f"rank {rank}: ranks read different latest iterations in {root} ({seen}); every "
            "rank must see the same checkpoint directory"
        )
    return None if codes[0] == -1 else codes[0]
