"""Megatron-LM's legacy "torch" checkpoint format, written atomically and loaded safely.

A checkpoint of iteration N is one file per (tensor, pipeline) position::

    <root>/iter_000000N/mp_rank_TT/model_optim_rng.pt         (one pipeline stage)
    <root>/iter_000000N/mp_rank_TT_PPP/model_optim_rng.pt     (a pipeline)
    <root>/latest_checkpointed_iteration.txt                  (the text "N")

Saving writes each file under a temporary name, syncs it to disk and renames it into place;
the tracker moves to the new iteration only after every file is in place, so a crash at any
point leaves the previous checkpoint loadable. Loading unpickles with ``weights_only=True``
(plain data and tensors only: a file cannot run code), checks the whole checkpoint against
the run on every rank, and changes nothing anywhere unless every rank can load its part.

`pp_train.checkpoint.save_checkpoint` / ``load_checkpoint`` with ``ckpt_format="torch"``
use this module; `save_torch_checkpoint` / `load_torch_checkpoint` are the format alone.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from pp_optim import (
    DistributedOptimizer,
    Float16OptimizerWithFloat16Params,
    MegatronOptimizer,
    OptimizerParamScheduler,
)
from pp_state import ParallelState
from pp_train.checkpoint.agreement import gather_ints, raise_if_any_failed
from pp_train.checkpoint.distrib_optim import (
    DP_ZERO_STATE,
    dp_zero_state,
    gather_optimizer_files,
    optimizer_entry,
)
from pp_train.checkpoint.errors import (
    CheckpointError,
    DamagedCheckpointError,
    first_line,
    listed,
)
from pp_train.checkpoint.files import atomic_write, fsync_directory, move_in
from pp_train.checkpoint.load_request import (
    DEFAULT_STRICT_ARGS,
    LoadedCheckpoint,
    LoadRequest,
)
from pp_train.checkpoint.rng import RngState, get_rng_state, parse_rng_state, restore_rng
from pp_train.checkpoint.save_request import SaveRequest
from pp_train.checkpoint.tracker import (
    CHECKPOINT_VERSION,
    TRACKER_FILENAME,
    agree_on_iteration,
    checkpoint_path,
    iteration_directory,
)
from pp_train.checkpoint.validation import check_load_arguments, check_scheduler_state
from pp_train.temporaries import PARTIAL_SUFFIX, mark_writer, restore_moved_aside
from pp_train.wrappers import finish_param_sync, unwrap_model

__all__ = [
    "load_latest_torch",
    "load_torch_checkpoint",
    "load_torch_iteration",
    "model_keys",
    "save_torch_checkpoint",
    "torch_checkpoint_content",
    "torch_header_problem",
    "write_torch_checkpoint",
]

# This format's file steps go through these module names, so a test can stop a rank at one
# of them (integration_tests/test_checkpoint_crash.py replaces them here).
_fsync_directory = fsync_directory


def _atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    atomic_write(path, write, sync_directory=_fsync_directory)


def save_torch_checkpoint(
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
) -> Path:
    """Saves this job's state as iteration `iteration` under `root`; every rank calls it.

    Data-parallel rank 0 of each (tensor, pipeline) position writes its file atomically (and
    a `DistributedOptimizer`'s ``distrib_optim.pt``); then global rank 0 points the tracker
    at `iteration`. A failure anywhere raises `CheckpointError` on every rank and leaves the
    tracker as it was. Saving an existing iteration again writes into ``iter_N.partial``,
    renamed in whole (the old directory moved aside, deleted once the tracker moved).

    Args:
        root: The checkpoint directory; created when missing.
        iteration: The iteration just completed.
        state: The process groups (which file this rank's position writes, who writes).
        model: This rank's model chunks (one per virtual pipeline stage); wrappers exposing
            ``.module`` are unwrapped so keys do not depend on them.
        optimizer: Saved unless None or `save_optim` is False.
        scheduler: Saved unless None or `save_optim` is False.
        args: The run's configuration: plain Python values only (None, bool, int, float,
            str, and lists, tuples and str-keyed dicts of them).
        consumed_train_samples: Training samples consumed so far.
        consumed_valid_samples: Validation samples consumed so far.
        save_optim: Save the optimizer and scheduler states.
        save_rng: Save the writer's random generator states.

    Returns:
        The file of this rank's position (written by its data-parallel rank 0).

    Raises:
        TypeError: An argument has the wrong type, or `args` holds something other than
            plain values.
        ValueError: A count is negative or `model` is empty.
        CheckpointError: A rank could not write its file or the tracker.
    """
    request = SaveRequest(
        root=Path(root), iteration=iteration, state=state, model=model,
        optimizer=optimizer if save_optim else None,
        scheduler=scheduler if save_optim else None, args=args,
        consumed_train_samples=consumed_train_samples,
        consumed_valid_samples=consumed_valid_samples, save_rng=save_rng, ckpt_format="torch",
    )  # fmt: skip
    return write_torch_checkpoint(request, functools.partial(torch_checkpoint_content, request))


def write_torch_checkpoint(request: SaveRequest, content: Callable[[], dict[str, Any]]) -> Path:
    """Writes every position's file, then moves the tracker; a collective (`save_torch_checkpoint`).

    The request is checked first (`SaveRequest.check_contents`); then a distributed
    optimizer's ``distrib_optim.pt`` is gathered (a collective). Only data-parallel rank 0 of
    each position calls `content` and writes its file (at the path returned), after that
    companion beside it; only global rank 0 writes the tracker. When the iteration's directory
    exists the files go into ``iter_N.partial``, renamed in whole before the tracker moves.
    """
    request.check_contents()
    companions = gather_optimizer_files(request.optimizer)  # distrib_optim.pt, a collective
    root, iteration, state = request.root, request.iteration, request.state
    operation = f"torch save of iteration {iteration}"
    path = _own_path(root, iteration, state)
    final = path.parent.parent
    staging = _staging_for_resave(final, state, operation, iteration)
    error: BaseException | None = None
    if state.group_rank("dp_cp") == 0:
        written = path if staging is None else staging / path.relative_to(final)
        try:
            for name, companion in companions.items():
                _atomic_write(written.parent / name, functools.partial(_save_to, companion))
            saved = content()
            _atomic_write(written, lambda file: torch.save(saved, file))
            _fsync_directory(written.parent.parent)
        except Exception as caught:
            error = caught
    # Stands in for a barrier and also tells every rank whether any file failed, so no rank
    # moves the tracker or waits forever for a writer that gave up.
    raise_if_any_failed(
        state.rank,
        error,
        f"could not write checkpoint file {path}",
        f"checkpoint files of iteration {iteration} were not all written; the tracker in "
        f"{root} was not moved",
        operation=operation,
        iteration=iteration,
    )
    if state.rank == 0:
        try:
            _publish_files(root, iteration, staging)
        except Exception as caught:
            error = caught
    raise_if_any_failed(
        state.rank,
        error,
        f"could not publish iteration {iteration} in {root}",
        f"the tracker in {root} was not moved to iteration {iteration}",
        operation=operation,
        iteration=iteration,
    )
    return path


def _staging_for_resave(
    final: Path, state: ParallelState, operation: str, iteration: int
) -> Path | None:
    """``iter_N.partial`` when `final` exists (global rank 0 decides for all), else None.

    Replacing the files of a published iteration one by one would let a crash mix old and
    new ones under a tracker that names it; a collective.
    """
    staging = final.with_name(final.name + PARTIAL_SUFFIX)
    error: BaseException | None = None
    resave = 0
    if state.rank == 0 and final.exists():
        try:
            if staging.exists():
                shutil.rmtree(staging)  # a crashed save's leftovers
            staging.mkdir()
            mark_writer(staging)
            resave = 1
        except OSError as caught:
            error = caught
    raise_if_any_failed(
        state.rank,
        error,
        f"could not make {staging}",
        f"iteration {iteration} was not saved; the tracker in {final.parent} was not moved",
        operation=operation,
        iteration=iteration,
    )
    return staging if gather_ints(resave, operation, iteration=iteration)[0] else None


def _publish_files(root: Path, iteration: int, staging: Path | None) -> None:
    """Global rank 0: renames a complete `staging` in (if any), then moves the tracker."""
    replaced = None
    if staging is not None:
        try:
            replaced = move_in(staging, staging.with_suffix(""))
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # this failed save's own files
            raise
    _fsync_directory(root)
    tracker = root / TRACKER_FILENAME
    _atomic_write(tracker, lambda file: file.write(str(iteration).encode("ascii")))
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def torch_checkpoint_content(request: SaveRequest) -> dict[str, Any]:
    """One position's file content: the header, model chunks and the states asked for.

    Args:
        request: The save; its model chunks are unwrapped here, its optimizer's and
            scheduler's states saved unless None, this process's RNG states with ``save_rng``.

    Returns:
        What ``torch.save`` writes to the position's ``model_optim_rng.pt``.
    """
    model, optimizer, scheduler = request.model, request.optimizer, request.scheduler
    finish_param_sync(model)  # the distributed optimizer's all-gathers still in flight
    content: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": request.iteration,
        "args": request.args,
        "consumed_train_samples": request.consumed_train_samples,
        "consumed_valid_samples": request.consumed_valid_samples,
    }
    for key, chunk in zip(model_keys(len(model)), model, strict=True):
        content[key] = unwrap_model(chunk).state_dict()
    if optimizer is not None:
        content["optimizer"] = optimizer_entry(optimizer)
    if scheduler is not None:
        content["opt_param_scheduler"] = scheduler.state_dict()
    if request.save_rng:
        content["rng_state"] = get_rng_state()
    return content


@dataclasses.dataclass(frozen=True)
class _LoadPlan:
    """Everything a validated checkpoint will change on this rank."""

    model: list[Mapping[str, Any]]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    rng: RngState | None
    result: LoadedCheckpoint


def load_torch_checkpoint(
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
) -> LoadedCheckpoint | None:
    """Restores the latest checkpoint under `root`; every rank calls it.

    Each rank reads its position's file with ``weights_only=True`` and checks it against
    the run (the `strict_args` settings, the model chunks' keys and shapes, the presence of
    the optimizer, scheduler and RNG states it is to restore). Only when every rank's check
    passes does any rank change anything: model chunks, then the optimizer and scheduler,
    then the RNG. Without optimizer state loaded, a `Float16OptimizerWithFloat16Params`
    takes its fp32 main copies from the loaded model.

    Args:
        root: The checkpoint directory (Megatron's ``--load``).
        state: The process groups (which file this rank reads).
        model: This rank's model chunks, built as for the save.
        optimizer: Restored unless None, `finetune` or `no_load_optim`.
        scheduler: Restored unless None, `finetune` or `no_load_optim`.
        args: This run's configuration, compared with the saved one on `strict_args`.
        finetune: Load only the model and start counting from iteration 0 (Megatron's
            ``--finetune``).
        no_load_optim: Leave the optimizer and scheduler as they are.
        no_load_rng: Leave the random generators as they are.
        strict_args: Keys whose saved value must equal `args`'s (absent counts as a value,
            or as its `STRICT_ARG_DEFAULTS` entry).

    Returns:
        The iteration, consumed samples and saved args; None on every rank when `root` holds
        no tracker file (the run starts from scratch).

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: `model` is empty.
        CheckpointError: On every rank when any rank cannot load its part: a bad tracker, a
            missing, corrupt or unsafe file, or a checkpoint that does not fit the run. The
            model, optimizer, scheduler and RNG are then unchanged on every rank.

    Global rank 0 first renames back an ``iter_N.replaced`` whose ``iter_N`` is missing (a
    save of an existing iteration killed between its two renames) and prints a line saying so.
    """
    check_load_arguments(model, args, strict_args)
    request = LoadRequest(
        root=Path(root), state=state, model=model, optimizer=optimizer, scheduler=scheduler,
        args=args, strict_args=strict_args, finetune=finetune,
        load_optim=not (finetune or no_load_optim), load_rng=not (finetune or no_load_rng),
    )  # fmt: skip
    if state.rank == 0:  # before any rank reads the tracker
        restore_moved_aside(request.root)
    return load_latest_torch(request)


def load_latest_torch(request: LoadRequest) -> LoadedCheckpoint | None:
    """Checks the tracker's iteration on every rank, then applies it; a collective.

    None on every rank when there is no tracker (see `load_torch_checkpoint`).
    """
    iteration = agree_on_iteration(request.root, request.state.rank)
    return None if iteration is None else load_torch_iteration(request, iteration)


def load_torch_iteration(request: LoadRequest, iteration: int) -> LoadedCheckpoint:
    """Checks iteration `iteration` of `request.root` on every rank, then applies it.

    Raises:
        CheckpointError: On every rank when any rank cannot load it (`DamagedCheckpointError`
            where this rank's file is missing, truncated or corrupt); nothing was changed.
    """
    root, state = request.root, request.state
    path = _own_path(root, iteration, state)
    plan: _LoadPlan | None = None
    error: BaseException | None = None
    try:
        _check_tensor_parallel_size(root, iteration, state)
        plan = _plan_load(_read_checkpoint(path, iteration, state.rank), request, path, iteration)
    except Exception as caught:  # whatever the cause, every rank must hear of it
        error = caught
    raise_if_any_failed(
        state.rank,
        error,
        f"cannot load checkpoint file {path}",
        f"checkpoint iteration {iteration} in {root} was not loaded; nothing was changed",
        operation=f"torch load of iteration {iteration}",
        iteration=iteration,
    )
    assert plan is not None
    try:
        _apply(plan, request)
    except Exception as caught:
        error = caught
    # Validation makes this unlikely; still, no rank may train on while another stopped.
    raise_if_any_failed(
        state.rank,
        error,
        f"failed while applying checkpoint file {path}; its state may be partly loaded",
        f"checkpoint iteration {iteration} in {root} was not applied on every rank: restart",
        operation=f"torch load of iteration {iteration}",
        iteration=iteration,
    )
    return plan.result


_POSITION = re.compile(r"mp_rank_(\d{2})(?:_\d{3})?")


def _check_tensor_parallel_size(root: Path, iteration: int, state: ParallelState) -> None:
    """Refuses a checkpoint whose ``mp_rank_TT`` directories are of another tensor size.

    Raises:
        CheckpointError: The directories name another number of tensor-parallel ranks;
            the message names both sizes and how to load it (through torch_dist).
    """
    directory = iteration_directory(root, iteration)
    found = [_POSITION.fullmatch(p.name) for p in directory.glob("mp_rank_*")]
    ranks = {int(match[1]) for match in found if match is not None}
    saved, current = max(ranks, default=-1) + 1, state.tensor_model_parallel_size
    if not ranks or saved == current:
        return
    raise CheckpointError(
        f"rank {state.rank}: torch checkpoint {directory} was saved at tensor-parallel size "
        f"{saved} (mp_rank_00 .. mp_rank_{saved - 1:02d}); this run has tensor-parallel size "
        f"{current}, and the torch format loads only at the size that saved it. Convert it "
        f"to torch_dist (python -m pp_train.checkpoint convert --input {root} --output NEW "
        "--to torch_dist), then load NEW with --ckpt-format torch_dist, which reshards "
        "across tensor-parallel sizes; nothing was loaded"
    )


def _read_checkpoint(path: Path, iteration: int, rank: int) -> dict[str, Any]:
    if not path.is_file():
        raise DamagedCheckpointError(
            f"rank {rank}: checkpoint file {path} of iteration {iteration} is missing "
            "(the tracker names that iteration)"
        )
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        refused = "Unsupported global" in str(error)
        raise (CheckpointError if refused else DamagedCheckpointError)(
            f"rank {rank}: refused to load {path}: it holds objects other than tensors and "
            f"plain values (unpickling them could run code) or is corrupt: "
            f"{_unpickling_reason(error)}"
        ) from error
    except Exception as error:
        raise DamagedCheckpointError(
            f"rank {rank}: checkpoint file {path} is corrupt or truncated: "
            f"{type(error).__name__}: {first_line(error)}"
        ) from error
    if not isinstance(content, dict):
        raise CheckpointError(
            f"rank {rank}: checkpoint file {path} holds a {type(content).__name__}, not a dict"
        )
    return content


def _plan_load(
    content: dict[str, Any], request: LoadRequest, path: Path, iteration: int
) -> _LoadPlan:
    where = f"rank {request.state.rank}: checkpoint {path}"
    problem = torch_header_problem(content, iteration)
    if problem is None:
        problem = _strict_args_problem(content["args"], request)
    if problem is not None:
        raise CheckpointError(f"{where} {problem}")
    model = _model_states(content, request, where)
    optimizer = scheduler = None
    rng = None
    try:
        if request.load_optim and request.optimizer is not None:
            optimizer = _required(content, "optimizer", "no_load_optim")
            distributed = dp_zero_state(optimizer, request.optimizer, path)
            if distributed is None:
                request.optimizer.check_state_dict(optimizer)
            optimizer = distributed or optimizer
        if request.load_optim and request.scheduler is not None:
            scheduler = _required(content, "opt_param_scheduler", "no_load_optim")
            check_scheduler_state(request.scheduler, scheduler)
        if request.load_rng:
            rng = parse_rng_state(_required(content, "rng_state", "no_load_rng"))
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(f"{where}: {error}") from error
    if request.finetune:
        result = LoadedCheckpoint(
            iteration=0, consumed_train_samples=0, consumed_valid_samples=0, args=content["args"]
        )
    else:
        result = LoadedCheckpoint(
            iteration=iteration,
            consumed_train_samples=content["consumed_train_samples"],
            consumed_valid_samples=content["consumed_valid_samples"],
            args=content["args"],
        )
    return _LoadPlan(model=model, optimizer=optimizer, scheduler=scheduler, rng=rng, result=result)


def torch_header_problem(content: dict[str, Any], iteration: int) -> str | None:
    """What is wrong with a torch file's version, iteration, args and counts; None if nothing.

    Args:
        content: The unpickled file.
        iteration: The iteration whose directory holds it.
    """
    version = content.get("checkpoint_version")
    if version != CHECKPOINT_VERSION:
        return f"has checkpoint_version {version!r}; only {CHECKPOINT_VERSION} is supported"
    if content.get("iteration") != iteration:
        return (
            f"holds iteration {content.get('iteration')!r}, but sits in the directory of "
            f"iteration {iteration}"
        )
    if not isinstance(content.get("args"), dict):
        return "has no args dict"
    for name in ("consumed_train_samples", "consumed_valid_samples"):
        value = content.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"has {name}={value!r}; expected an int >= 0"
    return None


def _strict_args_problem(saved: dict[str, Any], request: LoadRequest) -> str | None:
    differences = [
        f"{key}={was!r}; this run has {now!r}"
        for key, was, now in request.strict_differences(saved)
    ]
    if not differences:
        return None
    return "was saved with " + "; and with ".join(differences)


def _model_states(
    content: dict[str, Any], request: LoadRequest, where: str
) -> list[Mapping[str, Any]]:
    saved_keys = sorted(
        key for key in content if key == "model" or re.fullmatch(r"model[0-9]+", key)
    )
    expected_keys = model_keys(len(request.model))
    if sorted(expected_keys) != saved_keys:
        raise CheckpointError(
            f"{where} holds {len(saved_keys)} model chunk(s) ({saved_keys}); this run has "
            f"{len(request.model)} ({expected_keys})"
        )
    states = []
    for index, (key, chunk) in enumerate(zip(expected_keys, request.model, strict=True)):
        saved = content[key]
        if not isinstance(saved, Mapping):
            raise CheckpointError(f"{where} entry {key!r} is a {type(saved).__name__}, not a dict")
        problem = _state_dict_problem(unwrap_model(chunk).state_dict(), saved)
        if problem is not None:
            raise CheckpointError(f"{where} model chunk {index} ({key!r}) does not fit: {problem}")
        states.append(saved)
    return states


def _state_dict_problem(expected: Mapping[str, Any], saved: Mapping[str, Any]) -> str | None:
    problems = []
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    if missing:
        problems.append(f"missing keys {listed(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {listed(unexpected)}")
    shapes = [
        f"{key}: checkpoint {_shape(saved[key])}, model {tuple(value.shape)}"
        for key, value in expected.items()
        if isinstance(value, torch.Tensor)
        and key in saved
        and (not isinstance(saved[key], torch.Tensor) or saved[key].shape != value.shape)
    ]
    if shapes:
        problems.append(f"shape mismatches {listed(shapes)}")
    return "; ".join(problems) if problems else None


def _required(content: dict[str, Any], key: str, flag: str) -> Any:
    if key not in content:
        raise ValueError(f"has no {key!r} state; to load without it pass {flag}=True")
    return content[key]


def _apply(plan: _LoadPlan, request: LoadRequest) -> None:
    for chunk, saved in zip(request.model, plan.model, strict=True):
        unwrap_model(chunk).load_state_dict(saved, strict=True)
    optimizer = request.optimizer
    if optimizer is not None:
        if isinstance(optimizer, DistributedOptimizer) and plan.optimizer is not None:
            optimizer.load_state_from_dp_zero(plan.optimizer[DP_ZERO_STATE])
        elif plan.optimizer is not None:
            optimizer.load_state_dict(plan.optimizer)
        elif isinstance(optimizer, (Float16OptimizerWithFloat16Params, DistributedOptimizer)):
            # The fp32 copies would otherwise still hold the weights from before the load.
            optimizer.reload_model_params()
    if request.scheduler is not None and plan.scheduler is not None:
        request.scheduler.load_state_dict(plan.scheduler)
    if plan.rng is not None:
        restore_rng(plan.rng)


def _own_path(root: Path, iteration: int, state: ParallelState) -> Path:
    return checkpoint_path(
        root,
        iteration,
        tensor_rank=state.tensor_model_parallel_rank,
        pipeline_rank=state.pipeline_model_parallel_rank,
        pipeline_size=state.pipeline_model_parallel_size,
    )


def _save_to(content: object, file: IO[bytes]) -> None:
    torch.save(content, file)


def model_keys(chunks: int) -> list[str]:
    """The file's entries of `chunks` model chunks: ``model``, or ``model0``, ``model1``, ..."""
    return ["model"] if chunks == 1 else [f"model{index}" for index in range(chunks)]


def _shape(value: object) -> tuple[int, ...] | str:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _unpickling_reason(error: BaseException) -> str:
    """The cause in torch's weights-only refusal, without its generic advice."""
    kept = [
        line.strip()
        for line in str(error).splitlines()
        if line.strip()
        and not line.startswith(("Weights only load failed", "Check the documentation"))
    ]
    reason = " ".join(kept)
    if "WeightsUnpickler error:" in reason:
        reason = reason.split("WeightsUnpickler error:", 1)[1].strip()
    return reason[:200] or first_line(error)
