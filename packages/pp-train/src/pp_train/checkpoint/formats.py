"""`save_checkpoint` / `load_checkpoint` in either of Megatron's formats, and format detection.

``torch`` (the default here) is Megatron's legacy format: one file per (tensor, pipeline)
position, loadable only in the layout that saved it (`pp_train.checkpoint.torch_format`).
``torch_dist`` is one torch.distributed.checkpoint directory per iteration with
layout-independent keys: it resumes at any pipeline, virtual and data-parallel size holding
the same model, and can be written asynchronously (`AsyncCheckpointSaver`).
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pp_optim import MegatronOptimizer, OptimizerParamScheduler
from pp_state import ParallelState
from pp_train.checkpoint.agreement import raise_if_any_failed
from pp_train.checkpoint.async_save import AsyncCheckpointSaver
from pp_train.checkpoint.errors import CheckpointError, first_line
from pp_train.checkpoint.fallback import older_after_damage
from pp_train.checkpoint.load_request import DEFAULT_STRICT_ARGS, LoadedCheckpoint, LoadRequest
from pp_train.checkpoint.loading import load_torch_dist
from pp_train.checkpoint.save_request import CKPT_FORMATS, CkptFormat, SaveRequest, check_format
from pp_train.checkpoint.torch_dist import (
    CONVERSION_KEY,
    FORMAT_METADATA_FILENAME,
    PARTIAL_SUFFIX,
    SaveContent,
    conversion_record,
    publish,
    save_content,
    save_operation,
    write_torch_dist,
)
from pp_train.checkpoint.torch_format import (
    load_torch_iteration,
    torch_checkpoint_content,
    write_torch_checkpoint,
)
from pp_train.checkpoint.tracker import agree_on_iteration, iteration_directory
from pp_train.checkpoint.validation import check_load_arguments
from pp_train.temporaries import remove_stale_temporaries, restore_moved_aside

__all__ = [
    "CKPT_FORMATS",
    "CkptFormat",
    "check_save_directory",
    "detect_format",
    "load_checkpoint",
    "save_checkpoint",
]


def detect_format(directory: str | os.PathLike[str]) -> CkptFormat | None:
    """The format of one iteration's directory: what its files say, None when it holds neither.

    ``torch_dist``: a ``metadata.json`` or DCP's ``.metadata``; ``torch``: ``mp_rank_*``
    directories.
    """
    path = Path(directory)
    if (path / FORMAT_METADATA_FILENAME).is_file() or (path / ".metadata").is_file():
        return "torch_dist"
    if path.is_dir() and any(path.glob("mp_rank_*")):
        return "torch"
    return None


def save_checkpoint(
    root: str | os.PathLike[str],
    iteration: int,
    *,
    state: ParallelState,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    args: dict[str, Any],
    consumed_train_samples: int,
    consumed_valid_samples: int = 0,
    save_optim: bool = True,
    save_rng: bool = True,
    ckpt_format: CkptFormat = "torch",
    async_saver: AsyncCheckpointSaver | None = None,
    report: Callable[[str], None] | None = print,
) -> Path:
    """Saves iteration `iteration` under `root` in `ckpt_format`; every rank calls it.

    ``torch``: as `pp_train.checkpoint.torch_format.save_torch_checkpoint`, plus a
    `conversion_record` in each file. ``torch_dist``: every rank writes its tensors under global
    keys into ``iter_000000N.partial``; when all are written, global rank 0 renames it
    ``iter_000000N`` and then moves the tracker. With `async_saver` the write runs in the
    background (it returns after copying the tensors) and is published by the saver
    (`AsyncCheckpointSaver.poll` / ``wait``); a save still in flight is waited for first. The
    model chunks must implement `pp_train.checkpoint.ShardedStateKeys`. The arguments become
    one `pp_train.checkpoint.save_request.SaveRequest`, which either format's writer takes.

    Args: as `pp_train.checkpoint.torch_format.save_torch_checkpoint`'s, and
        ckpt_format: ``"torch"`` or ``"torch_dist"``.
        async_saver: Write a torch_dist checkpoint in the background with this saver.
        report: Gets the line naming dead writers' temporaries removed (`pp_train.temporaries`).

    Returns:
        The torch format: this rank's file; torch_dist: the iteration's directory.

    Raises:
        TypeError: An argument has the wrong type, or a chunk lacks ``sharded_state_keys``
            (torch_dist; raised on every rank as a `CheckpointError`).
        ValueError: A bad count, an empty model, an unknown format, or an async saver with
            the torch format.
        CheckpointError: A rank could not write; the tracker names the checkpoint before.
        CollectiveError: A rank died or hung (on every survivor, naming the save); as above.
    """
    request = SaveRequest(
        root=Path(root), iteration=iteration, state=state, model=model,
        optimizer=optimizer if save_optim else None,
        scheduler=scheduler if save_optim else None, args=args,
        consumed_train_samples=consumed_train_samples,
        consumed_valid_samples=consumed_valid_samples, save_rng=save_rng,
        ckpt_format=ckpt_format, async_saver=async_saver,
    )  # fmt: skip
    _tidy_before_save(request.root, state, report)
    if ckpt_format == "torch":
        return write_torch_checkpoint(request, functools.partial(_torch_content, request))
    return _save_torch_dist(request)


def _torch_content(request: SaveRequest) -> dict[str, Any]:
    """`torch_checkpoint_content` plus the position's `conversion_record`."""
    saved = torch_checkpoint_content(request)
    record = conversion_record(request.state, request.model, request.optimizer)
    if record is not None:
        saved[CONVERSION_KEY] = record
    return saved


def _save_torch_dist(request: SaveRequest) -> Path:
    """Checks, collects every rank's share, then writes it (or starts writing it) and publishes."""
    request.check_contents()
    content = _content_on_every_rank(request)
    root, iteration, state = request.root, request.iteration, request.state
    final = iteration_directory(root, iteration)
    staging = final.with_name(final.name + PARTIAL_SUFFIX)
    if request.async_saver is not None:
        request.async_saver.start(
            content, root=root, iteration=iteration, staging=staging, state=state
        )
        return final
    write_torch_dist(staging, content, state, iteration)
    _publish_on_rank_0(root, iteration, state)
    return final


def _content_on_every_rank(request: SaveRequest) -> SaveContent:
    """`save_content` on every rank; raises on all when any failed (before any rank writes)."""
    content = error = None
    try:
        content = save_content(request)
    except Exception as caught:
        error = caught
    raise_if_any_failed(
        request.state.rank,
        error,
        "cannot collect its torch_dist checkpoint state",
        f"iteration {request.iteration} was not saved",
        operation=save_operation(request.iteration),
        iteration=request.iteration,
    )
    assert content is not None
    return content


def _publish_on_rank_0(root: Path, iteration: int, state: ParallelState) -> None:
    error: BaseException | None = None
    if state.rank == 0:
        try:
            publish(root, iteration)
        except Exception as caught:
            error = caught
    raise_if_any_failed(
        state.rank,
        error,
        f"could not publish iteration {iteration} in {root}",
        f"the tracker in {root} was not moved to iteration {iteration}",
        operation=save_operation(iteration),
        iteration=iteration,
    )


def load_checkpoint(
    root: str | os.PathLike[str],
    *,
    state: ParallelState,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    args: dict[str, Any],
    finetune: bool = False,
    no_load_optim: bool = False,
    no_load_rng: bool = False,
    strict_args: tuple[str, ...] = DEFAULT_STRICT_ARGS,
    ckpt_format: CkptFormat = "torch",
    auto_detect_ckpt_format: bool = False,
    report: Callable[[str], None] | None = print,
) -> LoadedCheckpoint | None:
    """Restores the latest checkpoint under `root`; every rank calls it.

    The format is read from the files of the iteration the tracker names. It must be
    `ckpt_format` unless `auto_detect_ckpt_format` (Megatron's ``--auto-detect-ckpt-format``).
    ``torch``: as `pp_train.checkpoint.torch_format.load_torch_checkpoint` (same layout only).
    ``torch_dist``: any layout holding the same model; `strict_args` minus the layout sizes are
    compared; RNG states are restored only when the layout (tensor, pipeline, virtual, data
    sizes) is the saved one, else they keep this run's seeding and `LoadedCheckpoint.notes` says
    so. Before any rank reads the tracker, global rank 0 renames back an ``iter_N.replaced``
    whose ``iter_N`` is missing (a save of an existing iteration killed between its two
    renames); once every rank read it, the stale temporaries of dead writers are removed.
    Each hands `report` one line naming what it did (`pp_train.temporaries`).

    Returns:
        What was loaded; None on every rank when `root` holds no tracker.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: An unknown format or an empty model.
        CheckpointError: On every rank when any rank cannot load (a format other than asked,
            another model shape, a missing shard, ...); nothing was changed.
        CollectiveError: A rank died or stopped answering during the load (every survivor,
            naming the load and its iteration); nothing was changed.
    """
    check_format(ckpt_format)
    check_load_arguments(model, args, strict_args)
    request = LoadRequest(
        root=Path(root), state=state, model=model, optimizer=optimizer, scheduler=scheduler,
        args=args, strict_args=strict_args, finetune=finetune,
        load_optim=not (finetune or no_load_optim), load_rng=not (finetune or no_load_rng),
    )  # fmt: skip
    if state.rank == 0:  # before any rank looks at the directory the tracker names
        restore_moved_aside(request.root, report)
    iteration = agree_on_iteration(request.root, state.rank)
    if state.rank == 0:  # no save of this run in flight
        remove_stale_temporaries(request.root, report)
    if iteration is None:
        return None
    return _load_or_older(request, iteration, ckpt_format, auto_detect_ckpt_format, report)


def _load_or_older(
    request: LoadRequest,
    iteration: int,
    asked: CkptFormat,
    auto_detect: bool,
    report: Callable[[str], None] | None,
) -> LoadedCheckpoint:
    """Load `iteration`, or, while it is damaged (`older_after_damage`), the one before it."""
    rank = request.state.rank
    while True:
        try:
            found = _agreed_format(request.root, iteration, request.state, asked, auto_detect)
            if found == "torch":
                return load_torch_iteration(request, iteration)
            return load_torch_dist(request, iteration)
        except CheckpointError as error:
            older = older_after_damage(request.root, iteration, rank, error)
            if older is None:
                raise
            if report is not None and rank == 0:
                report(
                    f"checkpoint iteration {iteration} is damaged ({first_line(error)}); "
                    f"loading iteration {older}, the newest one before it"
                )
            iteration = older


def _tidy_before_save(
    root: Path, state: ParallelState, report: Callable[[str], None] | None
) -> None:
    """Global rank 0: what a killed save left is put back or removed (`pp_train.temporaries`)."""
    if state.rank == 0:
        restore_moved_aside(root, report)
        remove_stale_temporaries(root, report)


def _agreed_format(
    root: Path, iteration: int, state: ParallelState, asked: CkptFormat, auto_detect: bool
) -> CkptFormat:
    """The format of the tracked iteration, checked on every rank against `asked`."""
    directory = iteration_directory(root, iteration)
    found = detect_format(directory)
    error: CheckpointError | None = None
    if found is None:
        error = CheckpointError(
            f"rank {state.rank}: checkpoint directory {directory} (named by the tracker) holds "
            "neither format: expected mp_rank_* (torch) or metadata.json / .metadata (torch_dist)"
        )
    elif found != asked and not auto_detect:
        error = CheckpointError(
            f"rank {state.rank}: checkpoint {directory} is in the {found!r} format; this run "
            f"loads {asked!r}. Pass --ckpt-format {found} (ckpt_format={found!r}) or "
            "--auto-detect-ckpt-format to load it as it is; nothing was loaded"
        )
    raise_if_any_failed(state.rank, error, "", "nothing was loaded")
    assert found is not None
    return found


def check_save_directory(root: str | os.PathLike[str], state: ParallelState) -> None:
    """Refuses an unwritable checkpoint directory before training starts; a collective.

    Global rank 0 creates `root` if needed and writes and removes a probe file there.

    Raises:
        CheckpointError: On every rank when `root` cannot be created or written.
    """
    error: BaseException | None = None
    path = Path(root)
    if state.rank == 0:
        probe = path / f".write-probe-{uuid.uuid4().hex}"
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as caught:
            error = CheckpointError(
                f"rank 0: checkpoint directory {path} is not writable: expected to create "
                f"{probe.name} there, found {type(caught).__name__}: {caught}"
            )
    raise_if_any_failed(state.rank, error, "", "training did not start")
