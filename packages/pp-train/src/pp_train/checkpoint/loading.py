"""Loading a torch_dist checkpoint into any layout holding the same model.

Four steps, each ending in a check that every rank passed, so a refused load changes
nothing anywhere and never touches the files: (1) each rank reads ``common.pt`` and DCP's
``.metadata``, checks the model's shape, that every shard file is there, that each key it
needs has the shape it expects and that the saved chunks hold the block of it this rank
needs, and allocates buffers; (2) DCP reads the buffers (the resharding: each rank asks for
its own global keys, a tensor split over tensor parallelism for its part of the whole,
`pp_train.checkpoint.tensor_parallel`); (3) the optimizer, scheduler and RNG states are
checked; (4) everything is applied.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pp_optim import DistributedOptimizer, Float16OptimizerWithFloat16Params
from pp_train.checkpoint.agreement import raise_if_any_failed
from pp_train.checkpoint.errors import CheckpointError, DamagedCheckpointError, listed
from pp_train.checkpoint.keys import MODEL_PREFIX, chunk_global_keys, main_params, model_targets
from pp_train.checkpoint.load_request import LoadedCheckpoint, LoadRequest
from pp_train.checkpoint.optimizer_shards import (
    MAIN_PARAM_ENTRY,
    OwnedShard,
    ShardIndex,
    ShardLoad,
    distributed_state,
    owned_shards,
    plan_shard_load,
)
from pp_train.checkpoint.planners import RegionLoadPlanner
from pp_train.checkpoint.rng import RngState, parse_rng_state, restore_rng
from pp_train.checkpoint.tensor_parallel import (
    Box,
    RegionRead,
    TensorSplit,
    VocabResize,
    assemble,
    coverage_gap,
    plan_region,
    tensor_splits,
)
from pp_train.checkpoint.torch_dist import (
    COMMON_FILENAME,
    dcp_failure,
    describe_dcp_error,
    layout_of,
)
from pp_train.checkpoint.tracker import CHECKPOINT_VERSION, iteration_directory
from pp_train.checkpoint.validation import check_scheduler_state
from pp_train.wrappers import unwrap_model

__all__ = ["LAYOUT_ARGS", "load_planner", "load_torch_dist", "read_common", "read_metadata"]

LAYOUT_ARGS = (
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "data_parallel_size",
    "tensor_model_parallel_size",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
)
"""Settings a torch_dist checkpoint does not need to share with the run that loads it (a
padded vocabulary of another size is trimmed or padded, `VocabResize`)."""


@dataclasses.dataclass
class _Plan:
    """What this rank reads and where it goes."""

    directory: Path
    common: dict[str, Any]
    buffers: dict[str, Any]
    rng_key: str | None
    notes: list[str]
    optimizer: ShardLoad | None = None
    reads: dict[str, RegionRead] = dataclasses.field(default_factory=dict)
    """The tensors read as this rank's block of a whole (model, whole optimizer state)."""

    def regions(self) -> dict[str, Any]:
        """The block of each saved tensor read, for the planner."""
        return {key: read.box for key, read in self.reads.items() if read.box is not None}

    def assemble(self) -> None:
        """Replaces each block read by this rank's part (zero rows where a vocabulary grew)."""
        for key, read in self.reads.items():
            self.buffers[key] = assemble(read, self.buffers.get(key))


def load_torch_dist(request: LoadRequest, iteration: int) -> LoadedCheckpoint:
    """Loads iteration `iteration` of `request.root` (a torch_dist checkpoint); a collective.

    Raises:
        CheckpointError: On every rank when any rank cannot load; nothing was changed.
    """
    rank, directory = request.state.rank, iteration_directory(request.root, iteration)
    unchanged = f"torch_dist checkpoint {directory} was not loaded; nothing was changed"
    named = _Named(f"torch_dist load of iteration {iteration}", iteration)
    plan: _Plan | None = None
    error: BaseException | None = None
    try:
        plan = _plan(request, directory, iteration)
    except Exception as caught:
        error = caught
    named.agree(rank, error, f"cannot load {directory}", unchanged)
    assert plan is not None
    try:
        reader, planner = FileSystemReader(directory), load_planner(plan.regions())
        dcp.load(plan.buffers, storage_reader=reader, planner=planner)
        plan.assemble()
    except (Exception, CheckpointException) as caught:  # DCP's is a BaseException
        raise dcp_failure(
            caught,
            named.operation,
            iteration,
            f"rank {rank}: reading {directory} failed: {describe_dcp_error(caught)}; {unchanged}",
            DamagedCheckpointError,
        ) from caught
    staged: tuple[dict[str, Any] | None, RngState | None] | None = None
    try:
        staged = _check_states(plan, request)
    except Exception as caught:
        error = caught
    named.agree(rank, error, f"cannot load {directory}", unchanged)
    assert staged is not None
    try:
        _apply(plan, request, *staged)
    except Exception as caught:
        error = caught
    named.agree(
        rank, error, f"failed while applying {directory}", f"{directory} was not applied: restart"
    )
    return _result(plan, request, iteration)


@dataclasses.dataclass(frozen=True)
class _Named:
    """The operation and iteration a lost peer's error names during one load."""

    operation: str
    iteration: int

    def agree(self, rank: int, error: BaseException | None, failure: str, result: str) -> None:
        raise_if_any_failed(
            rank, error, failure, result, operation=self.operation, iteration=self.iteration
        )


def load_planner(regions: dict[str, Any] | None = None) -> RegionLoadPlanner:
    """DCP's load planner for our flat keys, unpickling objects with ``weights_only=True``.

    Args:
        regions: Keys read as a block of the saved tensor (`pp_train.checkpoint.
            tensor_parallel.Box`); the others are read whole.
    """
    return RegionLoadPlanner(regions)


def _where(request: LoadRequest, directory: Path) -> str:
    return f"rank {request.state.rank}: torch_dist checkpoint {directory}"


def _plan(request: LoadRequest, directory: Path, iteration: int) -> _Plan:
    where = _where(request, directory)
    common = read_common(directory, iteration, where)
    _check_model_args(common["args"], request, where)
    metadata = read_metadata(directory, where)
    state = request.state
    splits = tensor_splits(
        request.model, state.tensor_model_parallel_rank, state.tensor_model_parallel_size
    )
    resize = VocabResize.between(common["args"], request.args)
    problems: list[str] = []
    names = {key: key[len(MODEL_PREFIX) :] for key in model_targets(request.model)}
    reads = _region_reads(metadata, names, splits, resize, problems)
    buffers: dict[str, Any] = {}
    shards = None
    if request.load_optim and request.optimizer is not None:
        shards = _optimizer_load(request, metadata, problems, splits, _saved_tp_size(common))
        if shards is not None:
            reads.update(_region_reads(metadata, shards.whole_keys(), splits, resize, problems))
            buffers.update(shards.buffers(metadata))
        for name in ("opt_param_scheduler", "grad_scaler"):
            if name not in common:
                problems.append(f"has no {name!r} state (to load without it: no_load_optim)")
    if problems:
        raise CheckpointError(f"{where} does not fit this run: {listed(problems, '; ')}")
    buffers.update({key: read.buffer() for key, read in reads.items() if read.box is not None})
    notes = [resize.note()] if resize is not None and any(r.resized for r in reads.values()) else []
    rng_key = _rng_key(request, common, metadata, where, notes)
    if rng_key is not None:
        buffers[rng_key] = None
    return _Plan(directory, common, buffers, rng_key, notes, shards, reads)


def _saved_tp_size(common: dict[str, Any]) -> int:
    """The saving run's tensor-parallel size (recorded with its layout; 1 before tp)."""
    layout = common.get("layout")
    size = layout.get("tensor_model_parallel_size", 1) if isinstance(layout, dict) else 1
    return size if isinstance(size, int) and size >= 1 else 1


def read_common(directory: Path, iteration: int, where: str) -> dict[str, Any]:
    """The ``common.pt`` of a torch_dist iteration directory, its header checked.

    Args:
        directory: The iteration's directory.
        iteration: The iteration it must hold.
        where: Begins each error message (the rank and checkpoint).

    Raises:
        CheckpointError: The file is missing, unsafe, corrupt, of another version or
            iteration, or has no args dict.
    """
    path = directory / COMMON_FILENAME
    if not path.is_file():
        raise DamagedCheckpointError(
            f"{where}: {path} is missing (the tracker names iteration {iteration})"
        )
    try:
        common = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as error:
        refused = "Unsupported global" in str(error)
        raise (CheckpointError if refused else DamagedCheckpointError)(
            f"{where}: {path} is corrupt or unsafe: {error}"
        ) from error
    if not isinstance(common, dict) or common.get("checkpoint_version") != CHECKPOINT_VERSION:
        version = common.get("checkpoint_version") if isinstance(common, dict) else None
        raise CheckpointError(
            f"{where}: {path} has checkpoint_version {version!r}; expected {CHECKPOINT_VERSION}"
        )
    if common.get("iteration") != iteration or not isinstance(common.get("args"), dict):
        raise CheckpointError(
            f"{where}: {path} holds iteration {common.get('iteration')!r} (expected {iteration}) "
            "or no args dict"
        )
    return common


def _check_model_args(saved: dict[str, Any], request: LoadRequest, where: str) -> None:
    """The model's shape must match; the layout (pipeline, virtual, data) may differ."""
    differences = [
        f"{key}: expected {now!r} (this run), found {was!r}"
        for key, was, now in request.strict_differences(saved, ignore=LAYOUT_ARGS)
    ]
    if differences:
        raise CheckpointError(
            f"{where}/{COMMON_FILENAME} holds another model: " + "; ".join(differences)
        )


def read_metadata(directory: Path, where: str) -> Metadata:
    """DCP's ``.metadata`` of `directory`, once every shard file it names is there.

    Raises:
        CheckpointError: The metadata is missing or unreadable, or a shard file is missing.
    """
    if not (directory / ".metadata").is_file():
        raise DamagedCheckpointError(f"{where} has no .metadata file: the save did not complete")
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as error:
        raise DamagedCheckpointError(f"{where}/.metadata is unreadable: {error}") from error
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    missing = [name for name in files if not (directory / name).is_file()]
    if missing:
        shards = listed([str(directory / name) for name in missing], "; ")
        raise DamagedCheckpointError(
            f"{where} is missing shard file(s) {shards}: "
            f"expected {len(files)} files named in its .metadata, found {len(files) - len(missing)}"
            f"; {_lost_tensors(metadata, set(missing))}"
        )
    return metadata


def _lost_tensors(metadata: Metadata, missing: set[str]) -> str:
    """The tensors whose chunks were in the `missing` files, and what of them is left."""
    lost: dict[str, list[tuple[int, ...]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if info.relative_path in missing and index.offset is not None:
            lost.setdefault(index.fqn, []).append(tuple(index.offset))
    described = []
    for key, offsets in sorted(lost.items()):
        entry = metadata.state_dict_metadata[key]
        if isinstance(entry, TensorStorageMetadata):
            whole = Box((0,) * len(entry.size), tuple(entry.size))
            described.append(coverage_gap(key, entry, whole, offsets) or key)
        else:
            described.append(f"{key} (an object)")
    return f"the missing file(s) held {listed(described, '; ')}"


def _region_reads(
    metadata: Metadata,
    names: dict[str, str],
    splits: dict[str, TensorSplit],
    resize: VocabResize | None,
    problems: list[str],
) -> dict[str, RegionRead]:
    """What to read of each key (of global name `names[key]`): this rank's part of it.

    A missing key, another shape or a block the saved chunks do not cover is recorded in
    `problems` instead.
    """
    reads = {}
    for key, name in names.items():
        split = splits[name]
        entry = metadata.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            problems.append(
                f"{key}: expected shape {split.full_shape}, found "
                f"{'nothing' if entry is None else 'an object'}"
            )
            continue
        try:
            reads[key] = plan_region(key, entry, split, resize)
        except ValueError as error:
            problems.append(str(error))
    return reads


def _optimizer_load(
    request: LoadRequest,
    metadata: Metadata,
    problems: list[str],
    splits: dict[str, TensorSplit],
    saved_tp_size: int,
) -> ShardLoad | None:
    """The saved ranges that fill the optimizer's state, or None with the problem recorded.

    A `DistributedOptimizer` reads the ranges it owns, the other optimizers each parameter
    whole; either from a checkpoint of either (`pp_train.checkpoint.optimizer_shards`).
    """
    optimizer = request.optimizer
    assert optimizer is not None
    if isinstance(optimizer, DistributedOptimizer):
        owned = owned_shards(request.model, optimizer)
    else:
        owned = [
            OwnedShard(main.name, 0, main.param.numel(), main.param.numel(), main.param,
                       main.is_copy)
            for main in main_params(request.model, optimizer)
        ]  # fmt: skip
    try:
        return plan_shard_load(owned, ShardIndex(metadata), splits, saved_tp_size)
    except ValueError as error:
        problems.append(str(error))
        return None


def _rng_key(
    request: LoadRequest, common: dict[str, Any], metadata: Metadata, where: str, notes: list[str]
) -> str | None:
    """This rank's RNG key when it is to be restored: only in the layout that saved it."""
    if not request.load_rng:
        return None
    saved, current = common.get("layout"), layout_of(request.state, len(request.model))
    if saved != current:
        notes.append(
            f"random generator states not restored: saved at layout {saved}, this run is "
            f"{current}; they keep this run's seeding"
        )
        return None
    key = f"rng_state.rank{request.state.rank}"
    if key not in metadata.state_dict_metadata:
        raise CheckpointError(f"{where} has no {key!r} (to load without it: no_load_rng)")
    return key


def _check_states(
    plan: _Plan, request: LoadRequest
) -> tuple[dict[str, Any] | None, RngState | None]:
    """The optimizer state in pp-optim's form, checked with the scheduler and RNG states."""
    where = f"{_where(request, plan.directory)}"
    optimizer_state = None
    try:
        if request.load_optim and request.optimizer is not None:
            optimizer_state = _optimizer_state(plan, request)
            request.optimizer.check_state_dict(optimizer_state)
        if request.load_optim and request.scheduler is not None:
            check_scheduler_state(request.scheduler, plan.common["opt_param_scheduler"])
        rng = None if plan.rng_key is None else parse_rng_state(plan.buffers[plan.rng_key])
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(f"{where}: {error}") from error
    return optimizer_state, rng


def _optimizer_state(plan: _Plan, request: LoadRequest) -> dict[str, Any]:
    optimizer, shards = request.optimizer, plan.optimizer
    assert optimizer is not None
    assert shards is not None
    if isinstance(optimizer, DistributedOptimizer):
        return distributed_state(optimizer, shards, plan.buffers, plan.common["grad_scaler"])
    current = optimizer.optimizer.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    copies: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    for index, main in enumerate(main_params(request.model, optimizer)):
        # Fresh tensors each: tied parameters must not share one state tensor.
        values = shards.values(index, plan.buffers)
        copy = values.pop(MAIN_PARAM_ENTRY, None)
        shape = main.param.shape
        entries = {
            key: value.view(shape) if value.dim() else value for key, value in values.items()
        }
        if entries:
            state[index] = entries
        if main.is_copy:
            assert copy is not None
            copies[main.group].append(copy.view(shape))
    loaded: dict[str, Any] = {
        "optimizer": {"state": state, "param_groups": current["param_groups"]},
        "grad_scaler": plan.common["grad_scaler"],
    }
    if isinstance(optimizer, Float16OptimizerWithFloat16Params):
        loaded["fp32_from_fp16_params"] = copies
    return loaded


def _apply(
    plan: _Plan,
    request: LoadRequest,
    optimizer_state: dict[str, Any] | None,
    rng: RngState | None,
) -> None:
    for index, chunk in enumerate(request.model):
        keys = chunk_global_keys(chunk, index)
        saved = {local: plan.buffers[MODEL_PREFIX + name] for local, name in keys.items()}
        unwrap_model(chunk).load_state_dict(saved, strict=True)
    optimizer = request.optimizer
    if optimizer is not None:
        if optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)
        elif isinstance(optimizer, (Float16OptimizerWithFloat16Params, DistributedOptimizer)):
            optimizer.reload_model_params()
    if request.load_optim and request.scheduler is not None:
        request.scheduler.load_state_dict(plan.common["opt_param_scheduler"])
    if rng is not None:
        restore_rng(rng)


def _result(plan: _Plan, request: LoadRequest, iteration: int) -> LoadedCheckpoint:
    common = plan.common
    if request.finetune:
        return LoadedCheckpoint(
            iteration=0,
            consumed_train_samples=0,
            consumed_valid_samples=0,
            args=common["args"],
            notes=tuple(plan.notes),
        )
    return LoadedCheckpoint(
        iteration=iteration,
        consumed_train_samples=common["consumed_train_samples"],
        consumed_valid_samples=common["consumed_valid_samples"],
        args=common["args"],
        notes=tuple(plan.notes),
    )
