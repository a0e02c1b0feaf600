"""Checkpoints in Megatron-LM's legacy "torch" layout, written atomically and loaded safely.

A checkpoint of iteration N is one file per (tensor, pipeline) position::

    <root>/iter_000000N/mp_rank_TT/model_optim_rng.pt         (one pipeline stage)
    <root>/iter_000000N/mp_rank_TT_PPP/model_optim_rng.pt     (a pipeline)
    <root>/latest_checkpointed_iteration.txt                  (the text "N")

Saving writes each file under a temporary name, syncs it to disk and renames it into place;
the tracker moves to the new iteration only after every file is in place, so a crash at any
point leaves the previous checkpoint loadable. Loading unpickles with ``weights_only=True``
(plain data and tensors only: a file cannot run code), checks the whole checkpoint against
the run on every rank, and changes nothing anywhere unless every rank can load its part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from pp_optim import Float16OptimizerWithFloat16Params, MegatronOptimizer, OptimizerParamScheduler
from pp_state import ParallelState
from pp_state.collectives import collective
from pp_train.temporaries import (
    PARTIAL_SUFFIX,
    REPLACED_SUFFIX,
    mark_writer,
    restore_moved_aside,
    temporary_path,
)
from pp_train.wrappers import unwrap_model

__all__ = [
    "CHECKPOINT_FILENAME",
    "CHECKPOINT_VERSION",
    "DEFAULT_STRICT_ARGS",
    "TRACKER_FILENAME",
    "CheckpointError",
    "LoadedCheckpoint",
    "checkpoint_path",
    "get_rng_state",
    "load_checkpoint",
    "read_tracker",
    "save_checkpoint",
    "set_rng_state",
]

CHECKPOINT_VERSION = 3.0
"""The ``checkpoint_version`` written and the only one read (Megatron's current layout)."""

CHECKPOINT_FILENAME = "model_optim_rng.pt"
"""Name of each (tensor, pipeline) position's file."""

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
"""Name of the file in the root that holds the latest complete iteration."""

DEFAULT_STRICT_ARGS: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
)
"""Settings a checkpoint must share with the run that loads it."""

# Enough entries of a long list of keys or shapes to recognise the problem.
_MAX_LISTED = 5
_ABSENT = "<absent>"
_PLAIN_SCALARS = (type(None), bool, int, float, str)


class CheckpointError(ValueError):
    """A checkpoint could not be saved or loaded; the message names the rank, file and cause."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadedCheckpoint:
    """What `load_checkpoint` restored besides the model, optimizer, scheduler and RNG."""

    iteration: int
    """The iteration to resume after (0 when fine-tuning)."""

    consumed_train_samples: int
    """Training samples consumed before the checkpoint (0 when fine-tuning)."""

    consumed_valid_samples: int
    """Validation samples consumed before the checkpoint (0 when fine-tuning)."""

    args: dict[str, Any]
    """The configuration the checkpoint was saved with."""

    notes: tuple[str, ...] = ()
    """What the load left as it was, and why (e.g. RNG states saved at another layout)."""

    def __post_init__(self) -> None:
        """Checks the counts and the args.

        Raises:
            TypeError: A count is not an int, or `args` is not a dict.
            ValueError: A count is negative.
        """
        for name in ("iteration", "consumed_train_samples", "consumed_valid_samples"):
            _check_count(name, getattr(self, name))
        if not isinstance(self.args, dict):
            raise TypeError(f"args must be a dict, got {type(self.args).__name__}")


# ----------------------------------------------------------------------------- layout
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
    _check_count("iteration", iteration)
    _check_count("tensor_rank", tensor_rank)
    _check_count("pipeline_rank", pipeline_rank)
    _check_count("pipeline_size", pipeline_size)
    if not 0 <= pipeline_rank < pipeline_size:
        raise ValueError(
            f"pipeline_rank must be in 0 .. pipeline_size - 1 = {pipeline_size - 1}, "
            f"got pipeline_rank={pipeline_rank}, pipeline_size={pipeline_size}"
        )
    position = f"mp_rank_{tensor_rank:02d}"
    if pipeline_size > 1:
        position += f"_{pipeline_rank:03d}"
    return Path(root) / f"iter_{iteration:07d}" / position / CHECKPOINT_FILENAME


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


# ----------------------------------------------------------------------------- rng
@dataclasses.dataclass(frozen=True)
class _RngState:
    """An RNG state already checked, ready to apply without failing half-way."""

    python_state: tuple[int, tuple[int, ...], float | None]
    torch_state: torch.Tensor
    cuda_states: list[torch.Tensor] | None
    numpy_state: tuple[str, list[int], int, int, float] | None


def get_rng_state() -> dict[str, Any]:
    """This process's random generator states, as plain data.

    Returns:
        ``{"random", "torch", "cuda", "numpy"}``: Python's state as a list, torch's CPU
        state, every CUDA device's state (None without CUDA) and numpy's legacy global state
        as a list (None without numpy); loadable with ``torch.load(..., weights_only=True)``.
    """
    version, internal, gauss = random.getstate()
    cuda = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else None
    return {
        "random": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "numpy": _numpy_rng_state(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restores what `get_rng_state` returned; a malformed state changes nothing.

    CUDA states are restored for the devices present (none without CUDA); numpy's when numpy
    is importable and the state holds one.

    Args:
        state: The states, as `get_rng_state` returns them.

    Raises:
        ValueError: An entry is missing or malformed.
    """
    _restore_rng(_parse_rng_state(state))


def _numpy_rng_state() -> list[Any] | None:
    try:
        import numpy as np
    except ImportError:
        return None
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return [str(name), [int(key) for key in keys], int(pos), int(has_gauss), float(cached)]


def _parse_rng_state(state: Mapping[str, Any]) -> _RngState:
    if not isinstance(state, Mapping):
        raise ValueError(f"an RNG state must be a dict, got {type(state).__name__}")
    missing = [key for key in ("random", "torch") if key not in state]
    if missing:
        raise ValueError(
            f"RNG state lacks {missing}; expected keys 'random', 'torch', 'cuda', 'numpy'"
        )
    return _RngState(
        python_state=_parse_python_rng(state["random"]),
        torch_state=_parse_byte_tensor(state["torch"], "torch", torch.get_rng_state().numel()),
        cuda_states=_parse_cuda_rng(state.get("cuda")),
        numpy_state=_parse_numpy_rng(state.get("numpy")),
    )


def _is_int_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(_is_int(item) for item in value)


def _parse_python_rng(value: object) -> tuple[int, tuple[int, ...], float | None]:
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError("RNG state 'random' must be [version, internal state, gauss_next]")
    version, internal, gauss = value
    if not _is_int(version) or not _is_int_list(internal):
        raise ValueError("RNG state 'random' must hold an int version and a list of ints")
    if gauss is not None and not isinstance(gauss, float):
        raise ValueError(f"RNG state 'random' gauss_next must be a float or None, got {gauss!r}")
    return version, tuple(internal), gauss


def _parse_byte_tensor(value: object, name: str, numel: int | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise ValueError(f"RNG state {name!r} must be a 1-D uint8 tensor, got {value!r:.80}")
    if numel is not None and value.numel() != numel:
        raise ValueError(
            f"RNG state {name!r} has {value.numel()} bytes; this torch's generator has {numel}"
        )
    return value.cpu()


def _parse_cuda_rng(value: object) -> list[torch.Tensor] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"RNG state 'cuda' must be a list of tensors or None, got {value!r:.80}")
    return [_parse_byte_tensor(item, "cuda", None) for item in value]


def _parse_numpy_rng(value: object) -> tuple[str, list[int], int, int, float] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 5:
        raise ValueError(
            "RNG state 'numpy' must be [name, keys, pos, has_gauss, cached_gaussian] or None"
        )
    name, keys, pos, has_gauss, cached = value
    if not (
        isinstance(name, str)
        and _is_int_list(keys)
        and _is_int(pos)
        and _is_int(has_gauss)
        and isinstance(cached, float)
    ):
        raise ValueError("RNG state 'numpy' has entries of the wrong types")
    return name, list(keys), pos, has_gauss, cached


def _restore_rng(state: _RngState) -> None:
    random.setstate(state.python_state)
    torch.set_rng_state(state.torch_state)
    if state.cuda_states is not None and torch.cuda.is_available():
        # A run restarted on fewer visible devices restores the ones it has.
        for device, cuda_state in enumerate(state.cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
    if state.numpy_state is not None:
        try:
            import numpy as np
        except ImportError:
            return
        name, keys, pos, has_gauss, cached = state.numpy_state
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ----------------------------------------------------------------------------- save
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
) -> Path:
    """Saves this job's state as iteration `iteration` under `root`; every rank calls it.

    Data-parallel rank 0 of each (tensor, pipeline) position writes that position's file
    atomically; once every file is in place, global rank 0 points the tracker at
    `iteration`. A failure anywhere raises `CheckpointError` on every rank and leaves the
    tracker, and so the checkpoint that loads, as it was. Saving again an iteration that
    already exists writes into ``iter_N.partial`` and renames it in whole (the old directory
    moved aside first, deleted once the tracker moved), so a crash never mixes old and new.

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
    consumed = (consumed_train_samples, consumed_valid_samples)
    _check_save_arguments(iteration, consumed, model, args)
    content = functools.partial(
        _checkpoint_content,
        iteration,
        model=model,
        optimizer=optimizer if save_optim else None,
        scheduler=scheduler if save_optim else None,
        args=args,
        consumed=consumed,
        save_rng=save_rng,
    )
    return _write_checkpoint(Path(root), iteration, state, content)


def _check_save_arguments(
    iteration: int, consumed: tuple[int, int], model: object, args: object
) -> None:
    _check_count("iteration", iteration)
    _check_count("consumed_train_samples", consumed[0])
    _check_count("consumed_valid_samples", consumed[1])
    _check_chunks(model)
    _check_plain(args, "args")


def _write_checkpoint(
    root: Path, iteration: int, state: ParallelState, content: Callable[[], dict[str, Any]]
) -> Path:
    """Writes every position's file, then moves the tracker; a collective (`save_checkpoint`).

    Only data-parallel rank 0 of each position calls `content` and writes its file (at the
    path returned); only global rank 0 writes the tracker. When the iteration's directory
    exists the files go into ``iter_N.partial``, renamed in whole before the tracker moves.
    """
    operation = f"torch save of iteration {iteration}"
    path = _own_path(root, iteration, state)
    final = path.parent.parent
    staging = _staging_for_resave(final, state, operation, iteration)
    error: BaseException | None = None
    if state.group_rank("dp_cp") == 0:
        written = path if staging is None else staging / path.relative_to(final)
        try:
            saved = content()
            _atomic_write(written, lambda file: torch.save(saved, file))
            _fsync_directory(written.parent.parent)
        except Exception as caught:
            error = caught
    # Stands in for a barrier and also tells every rank whether any file failed, so no rank
    # moves the tracker or waits forever for a writer that gave up.
    _raise_if_any_failed(
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
    _raise_if_any_failed(
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
    _raise_if_any_failed(
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
            replaced = _move_in(staging, staging.with_suffix(""))
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # this failed save's own files
            raise
    _fsync_directory(root)
    tracker = root / TRACKER_FILENAME
    _atomic_write(tracker, lambda file: file.write(str(iteration).encode("ascii")))
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _move_in(staging: Path, final: Path) -> Path:
    """Renames the complete directory `staging` to `final`; an existing `final` is moved aside.

    The aside copy (``iter_N.replaced``) is returned, to be deleted once the tracker moved;
    a failed rename in puts it back. A kill between the two renames is repaired by the next
    save or load (`pp_train.temporaries.restore_moved_aside`). The caller syncs the parent.
    """
    replaced = final.with_name(final.name + REPLACED_SUFFIX)
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        os.replace(final, replaced)
    try:
        os.replace(staging, final)
    except OSError as error:
        if replaced.exists() and not final.exists():
            os.replace(replaced, final)  # the tracker may name it: keep it loadable
        detail = f"could not rename {staging.name} to {final.name}: {error.strerror or error}"
        if error.errno is None:
            raise OSError(detail) from error
        raise OSError(error.errno, detail) from error
    return replaced


def _checkpoint_content(
    iteration: int,
    *,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    args: dict[str, Any],
    consumed: tuple[int, int],
    save_rng: bool,
) -> dict[str, Any]:
    content: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "args": args,
        "consumed_train_samples": consumed[0],
        "consumed_valid_samples": consumed[1],
    }
    for key, chunk in zip(_model_keys(len(model)), model, strict=True):
        content[key] = unwrap_model(chunk).state_dict()
    if optimizer is not None:
        content["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        content["opt_param_scheduler"] = scheduler.state_dict()
    if save_rng:
        content["rng_state"] = get_rng_state()
    return content


def _atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Writes `path` so that it holds either its old content or all of the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Host and pid keep two writers of one name from sharing a temporary and tell whether a
    # leftover's writer is dead (`pp_train.temporaries`); a failure removes it below.
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """Makes a rename or new entry in `directory` survive a power loss."""
    if os.name != "posix":  # other systems cannot open a directory to sync it
        return
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ----------------------------------------------------------------------------- load
@dataclasses.dataclass(frozen=True)
class _LoadPlan:
    """Everything a validated checkpoint will change on this rank."""

    model: list[Mapping[str, Any]]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    rng: _RngState | None
    result: LoadedCheckpoint


@dataclasses.dataclass(frozen=True, kw_only=True)
class _LoadRequest:
    """Where this run loads from, what it expects of the checkpoint and what it wants restored."""

    root: Path
    state: ParallelState
    model: list[torch.nn.Module]
    optimizer: MegatronOptimizer | None
    scheduler: OptimizerParamScheduler | None
    args: dict[str, Any]
    strict_args: tuple[str, ...]
    finetune: bool
    load_optim: bool
    load_rng: bool


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
        strict_args: Keys whose saved value must equal `args`'s (absent counts as a value).

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
    _check_load_arguments(model, args, strict_args)
    request = _LoadRequest(
        root=Path(root), state=state, model=model, optimizer=optimizer, scheduler=scheduler,
        args=args, strict_args=strict_args, finetune=finetune,
        load_optim=not (finetune or no_load_optim), load_rng=not (finetune or no_load_rng),
    )  # fmt: skip
    if state.rank == 0:  # before any rank reads the tracker
        restore_moved_aside(request.root)
    return _load_latest(request)


def _check_load_arguments(model: object, args: object, strict_args: object) -> None:
    _check_chunks(model)
    if not isinstance(args, dict):
        raise TypeError(f"args must be a dict, got {type(args).__name__}")
    if not isinstance(strict_args, tuple) or not all(isinstance(k, str) for k in strict_args):
        raise TypeError(f"strict_args must be a tuple of str, got {strict_args!r}")


def _load_latest(request: _LoadRequest) -> LoadedCheckpoint | None:
    """Checks the tracker's iteration on every rank, then applies it; a collective.

    None on every rank when there is no tracker (see `load_checkpoint`).
    """
    root, state = request.root, request.state
    iteration = _agree_on_iteration(root, state.rank)
    if iteration is None:
        return None
    path = _own_path(root, iteration, state)
    plan: _LoadPlan | None = None
    error: BaseException | None = None
    try:
        plan = _plan_load(_read_checkpoint(path, iteration, state.rank), request, path, iteration)
    except Exception as caught:  # whatever the cause, every rank must hear of it
        error = caught
    _raise_if_any_failed(
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
    _raise_if_any_failed(
        state.rank,
        error,
        f"failed while applying checkpoint file {path}; its state may be partly loaded",
        f"checkpoint iteration {iteration} in {root} was not applied on every rank: restart",
        operation=f"torch load of iteration {iteration}",
        iteration=iteration,
    )
    return plan.result


def _agree_on_iteration(root: Path, rank: int) -> int | None:
    """The tracker's iteration as every rank reads it; raises unless all agree."""
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


def _read_checkpoint(path: Path, iteration: int, rank: int) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(
            f"rank {rank}: checkpoint file {path} of iteration {iteration} is missing "
            "(the tracker names that iteration)"
        )
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"rank {rank}: refused to load {path}: it holds objects other than tensors and "
            f"plain values (unpickling them could run code) or is corrupt: "
            f"{_unpickling_reason(error)}"
        ) from error
    except Exception as error:
        raise CheckpointError(
            f"rank {rank}: checkpoint file {path} is corrupt or truncated: "
            f"{type(error).__name__}: {_first_line(error)}"
        ) from error
    if not isinstance(content, dict):
        raise CheckpointError(
            f"rank {rank}: checkpoint file {path} holds a {type(content).__name__}, not a dict"
        )
    return content


def _plan_load(
    content: dict[str, Any], request: _LoadRequest, path: Path, iteration: int
) -> _LoadPlan:
    where = f"rank {request.state.rank}: checkpoint {path}"
    problem = _header_problem(content, iteration)
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
            request.optimizer.check_state_dict(optimizer)
        if request.load_optim and request.scheduler is not None:
            scheduler = _required(content, "opt_param_scheduler", "no_load_optim")
            _check_scheduler_state(request.scheduler, scheduler)
        if request.load_rng:
            rng = _parse_rng_state(_required(content, "rng_state", "no_load_rng"))
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


def _header_problem(content: dict[str, Any], iteration: int) -> str | None:
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


def _strict_args_problem(saved: dict[str, Any], request: _LoadRequest) -> str | None:
    differences = [
        f"{key}={saved.get(key, _ABSENT)!r}; this run has {request.args.get(key, _ABSENT)!r}"
        for key in request.strict_args
        if saved.get(key, _ABSENT) != request.args.get(key, _ABSENT)
    ]
    if not differences:
        return None
    return "was saved with " + "; and with ".join(differences)


def _model_states(
    content: dict[str, Any], request: _LoadRequest, where: str
) -> list[Mapping[str, Any]]:
    saved_keys = sorted(
        key for key in content if key == "model" or re.fullmatch(r"model[0-9]+", key)
    )
    expected_keys = _model_keys(len(request.model))
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
        problems.append(f"missing keys {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_listed(unexpected)}")
    shapes = [
        f"{key}: checkpoint {_shape(saved[key])}, model {tuple(value.shape)}"
        for key, value in expected.items()
        if isinstance(value, torch.Tensor)
        and key in saved
        and (not isinstance(saved[key], torch.Tensor) or saved[key].shape != value.shape)
    ]
    if shapes:
        problems.append(f"shape mismatches {_listed(shapes)}")
    return "; ".join(problems) if problems else None


def _required(content: dict[str, Any], key: str, flag: str) -> Any:
    if key not in content:
        raise ValueError(f"has no {key!r} state; to load without it pass {flag}=True")
    return content[key]


def _check_scheduler_state(scheduler: OptimizerParamScheduler, saved: object) -> None:
    """Raises unless `scheduler` would accept `saved`, without touching it."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"'opt_param_scheduler' state is a {type(saved).__name__}, not a dict")
    # A scheduler over a throwaway optimizer runs the real checks on a copy of the config.
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    OptimizerParamScheduler(probe, scheduler.config).load_state_dict(saved)


def _apply(plan: _LoadPlan, request: _LoadRequest) -> None:
    for chunk, saved in zip(request.model, plan.model, strict=True):
        unwrap_model(chunk).load_state_dict(saved, strict=True)
    optimizer = request.optimizer
    if optimizer is not None:
        if plan.optimizer is not None:
            optimizer.load_state_dict(plan.optimizer)
        elif isinstance(optimizer, Float16OptimizerWithFloat16Params):
            # The fp32 copies would otherwise still hold the weights from before the load.
            optimizer.reload_model_params()
    if request.scheduler is not None and plan.scheduler is not None:
        request.scheduler.load_state_dict(plan.scheduler)
    if plan.rng is not None:
        _restore_rng(plan.rng)


# ----------------------------------------------------------------------------- collectives
def collective_device() -> torch.device:
    """Where a rank's small collective tensors live: the GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_ints(
    value: int, operation: str = "checkpoint agreement", *, iteration: int | None = None
) -> list[int]:
    """Every rank's `value`, indexed by global rank (one all-reduce named `operation`)."""
    values = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=collective_device())
    values[dist.get_rank()] = value
    with collective(operation, iteration=iteration):
        dist.all_reduce(values)
    return [int(v) for v in values.tolist()]


def _raise_if_any_failed(
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
        raise CheckpointError(
            f"rank {rank}: rank(s) {failed} failed; {consequence}. "
            f"First failure: {messages[failed[0]]}"
        )


# ----------------------------------------------------------------------------- helpers
def _is_int(value: object) -> bool:
    # bool subclasses int, but True as a count is always a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(name: str, value: object) -> None:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int >= 0, got {value!r}")
    assert isinstance(value, int)
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value}")


def _check_chunks(model: object) -> None:
    if not isinstance(model, list) or not all(isinstance(c, torch.nn.Module) for c in model):
        raise TypeError(f"model must be a list of torch.nn.Module chunks, got {model!r:.80}")
    if not model:
        raise ValueError("model must hold at least one chunk, got an empty list")


def _check_plain(value: object, where: str) -> None:
    """Raises TypeError unless `value` unpickles with ``weights_only=True`` as itself."""
    if isinstance(value, _PLAIN_SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where} has a key {key!r} of type {type(key).__name__}; keys must be str"
                )
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; checkpoint args hold only None, bool, int, "
        "float, str, and lists, tuples and str-keyed dicts of them"
    )


def _own_path(root: Path, iteration: int, state: ParallelState) -> Path:
    return checkpoint_path(
        root,
        iteration,
        tensor_rank=state.tensor_model_parallel_rank,
        pipeline_rank=state.pipeline_model_parallel_rank,
        pipeline_size=state.pipeline_model_parallel_size,
    )


def _model_keys(chunks: int) -> list[str]:
    return ["model"] if chunks == 1 else [f"model{index}" for index in range(chunks)]


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return f"[{shown}{f', and {more} more' if more > 0 else ''}]"


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
    return reason[:200] or _first_line(error)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
