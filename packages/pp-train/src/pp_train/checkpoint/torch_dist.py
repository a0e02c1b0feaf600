"""Megatron's ``torch_dist`` checkpoint format, written and read by torch.distributed.checkpoint.

A checkpoint of iteration N is one directory in Megatron's layout::

    <root>/iter_000000N/.metadata            DCP's index of every tensor (written last)
    <root>/iter_000000N/__<rank>_0.distcp    each rank's share of the tensors
    <root>/iter_000000N/common.pt            iteration, samples, args, scheduler, loss scaler
    <root>/iter_000000N/metadata.json        {"sharded_backend": "torch_dist", ...}
    <root>/latest_checkpointed_iteration.txt the text "N", moved last

Tensors are keyed by global names (`pp_train.checkpoint.keys`), so a checkpoint saved at
one (tensor, pipeline, virtual, data) layout loads at any other holding the same model: DCP
reads each rank's keys from wherever they were written. A tensor split over tensor
parallelism is written by each tensor-parallel rank as its part of the whole, at its offsets
(`pp_train.checkpoint.tensor_parallel`, `pp_train.checkpoint.planners`), so the checkpoint
holds each whole tensor once, as at tensor-parallel size 1. Every rank writes into
``iter_000000N.partial``; once DCP has written ``.metadata`` (after every rank's data),
global rank 0 renames it to ``iter_000000N`` and then moves the tracker, so a crash at any
moment leaves the tracker on the last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from pp_optim import DistributedOptimizer, Float16OptimizerWithFloat16Params, MegatronOptimizer
from pp_state import CollectiveError, ParallelState
from pp_state.collectives import collective_error, is_lost_peer
from pp_train.checkpoint.agreement import raise_if_any_failed
from pp_train.checkpoint.errors import CheckpointError

# This format's file steps go through module names of its own, so a test can stop a rank at
# one of them (integration_tests/test_checkpoint_crash.py replaces them here).
from pp_train.checkpoint.files import atomic_write as _atomic_write
from pp_train.checkpoint.files import fsync_directory as _fsync_directory
from pp_train.checkpoint.files import move_in
from pp_train.checkpoint.keys import (
    chunk_global_keys,
    main_params,
    model_targets,
    optimizer_tensors,
)
from pp_train.checkpoint.optimizer_shards import shard_tensors
from pp_train.checkpoint.planners import ChunkSavePlanner
from pp_train.checkpoint.rng import get_rng_state
from pp_train.checkpoint.save_request import SaveRequest
from pp_train.checkpoint.tensor_parallel import Box, TensorSplit, save_chunks, tensor_splits
from pp_train.checkpoint.tracker import CHECKPOINT_VERSION, TRACKER_FILENAME, iteration_directory
from pp_train.temporaries import PARTIAL_SUFFIX, mark_writer
from pp_train.wrappers import finish_param_sync, unwrap_model

__all__ = [
    "COMMON_FILENAME",
    "CONVERSION_KEY",
    "FORMAT_METADATA_FILENAME",
    "PARTIAL_SUFFIX",
    "RECORD_PREFIX",
    "SaveContent",
    "conversion_record",
    "dcp_failure",
    "iteration_directory",
    "layout_of",
    "publish",
    "record_key",
    "remove_failed_save",
    "save_content",
    "write_common",
    "write_torch_dist",
]

COMMON_FILENAME = "common.pt"
"""The state every rank shares (written by global rank 0, read with ``weights_only``)."""

FORMAT_METADATA_FILENAME = "metadata.json"
"""Megatron's mark of a distributed checkpoint directory, naming its backend."""

CONVERSION_KEY = "conversion"
"""The entry of a torch-format file holding its `conversion_record`."""

RECORD_PREFIX = "conversion."
"""torch_dist keys ``conversion.tp<TT>.pp<PPP>``: each position's `conversion_record`."""

CONVERSION_RECORD_VERSION = 1

_FORMAT_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def layout_of(state: ParallelState, chunks: int) -> dict[str, int]:
    """The parallel layout a checkpoint records (RNG states are restored only in the same)."""
    return {
        "tensor_model_parallel_size": state.tensor_model_parallel_size,
        "pipeline_model_parallel_size": state.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": chunks,
        "data_parallel_size": state.group_size("dp_cp"),
        "world_size": state.world_size,
    }


def record_key(tensor_rank: int, pipeline_rank: int) -> str:
    """The torch_dist key of one (tensor, pipeline) position's `conversion_record`."""
    return f"{RECORD_PREFIX}tp{tensor_rank:02d}.pp{pipeline_rank:03d}"


def conversion_record(
    state: ParallelState, model: list[torch.nn.Module], optimizer: MegatronOptimizer | None
) -> dict[str, Any] | None:
    """What a converter needs to move this position's state between the formats, or None.

    Plain data (``weights_only`` loads it): the layout; this (tensor, pipeline) position and
    the global ranks holding it (the writer first); each chunk's ``state_dict`` keys mapped to
    global names; and, with an optimizer, its parameters in torch's state-dict order as
    ``[global name, group, is fp32 copy]``, its ``param_groups`` and whether it keeps fp32
    copies (``fp32_from_fp16_params``); ``tensor_parallel``: the dimension each tensor split
    over tensor parallelism is split along, by global name (the converter joins and splits
    the parts with it). None when a chunk lacks ``sharded_state_keys``.
    A distributed optimizer's shards are not recorded (``distributed_optimizer``: True): the
    converter does not take them.
    """
    if not all(callable(getattr(unwrap_model(c), "sharded_state_keys", None)) for c in model):
        return None
    record: dict[str, Any] = {
        "version": CONVERSION_RECORD_VERSION,
        "layout": layout_of(state, len(model)),
        "tensor_rank": state.tensor_model_parallel_rank,
        "pipeline_rank": state.pipeline_model_parallel_rank,
        "ranks": state.group_ranks("dp_cp"),
        "chunks": [chunk_global_keys(chunk, index) for index, chunk in enumerate(model)],
        "optimizer_params": None,
        "param_groups": None,
        "fp32_copies": False,
        "distributed_optimizer": isinstance(optimizer, DistributedOptimizer),
        "tensor_parallel": {
            name: split.dim for name, split in _splits(state, model).items() if split.dim >= 0
        },
    }
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        record["optimizer_params"] = [
            [main.name, main.group, main.is_copy] for main in main_params(model, optimizer)
        ]
        record["param_groups"] = optimizer.optimizer.state_dict()["param_groups"]
        record["fp32_copies"] = isinstance(optimizer, Float16OptimizerWithFloat16Params)
    return record


def _splits(state: ParallelState, model: list[torch.nn.Module]) -> dict[str, TensorSplit]:
    rank, size = state.tensor_model_parallel_rank, state.tensor_model_parallel_size
    return tensor_splits(model, rank, size)


@dataclasses.dataclass(frozen=True)
class SaveContent:
    """What one rank hands to DCP, and the common state global rank 0 writes."""

    tensors: dict[str, Any]
    """Global keys to tensors (and this rank's RNG state, an object)."""
    common: dict[str, Any]
    """``common.pt``'s content."""
    chunks: dict[str, tuple[Box, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    """The keys of `tensors` that are this rank's tensor-parallel part of a whole tensor:
    their block in it and its shape (`pp_train.checkpoint.planners.ChunkSavePlanner`)."""


def save_content(request: SaveRequest) -> SaveContent:
    """This rank's share of a torch_dist checkpoint (optimizer and scheduler when given).

    A `DistributedOptimizer`'s state is this rank's shards (`pp_train.checkpoint.
    optimizer_shards`); the parameters' all-gathers still in flight are waited for first.
    Tensors split over tensor parallelism are this rank's parts (`SaveContent.chunks`).
    """
    state, model, optimizer = request.state, request.model, request.optimizer
    finish_param_sync(model)
    splits = _splits(state, model)
    tensors: dict[str, Any] = {key: held[0] for key, held in model_targets(model).items()}
    common: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "ckpt_format": "torch_dist",
        "iteration": request.iteration,
        "args": request.args,
        "consumed_train_samples": request.consumed_train_samples,
        "consumed_valid_samples": request.consumed_valid_samples,
        "layout": layout_of(state, len(model)),
    }
    if optimizer is not None:
        if isinstance(optimizer, DistributedOptimizer):
            tensors.update(shard_tensors(model, optimizer, splits))
        else:
            tensors.update(optimizer_tensors(model, optimizer))
        scaler = optimizer.grad_scaler
        common["grad_scaler"] = None if scaler is None else scaler.state_dict()
    if request.scheduler is not None:
        common["opt_param_scheduler"] = request.scheduler.state_dict()
    if request.save_rng:
        tensors[f"rng_state.rank{state.rank}"] = get_rng_state()
    if state.group_rank("dp_cp") == 0:
        record = conversion_record(state, model, optimizer)
        if record is not None:
            tensors[record_key(record["tensor_rank"], record["pipeline_rank"])] = record
    chunks = save_chunks(tensors, splits)
    return SaveContent({k: _detached(v) for k, v in tensors.items()}, common, chunks)


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def prepare(staging: Path, content: SaveContent, state: ParallelState, iteration: int) -> None:
    """Global rank 0 empties `staging` and writes the common files; a collective.

    Raises:
        CheckpointError: On every rank when the directory cannot be made or written.
    """
    error: BaseException | None = None
    if state.rank == 0:
        try:
            if staging.exists():
                shutil.rmtree(staging)  # a crashed save's leftovers
            staging.mkdir(parents=True)
            mark_writer(staging)
            write_common(staging, content.common)
        except Exception as caught:
            error = caught
            shutil.rmtree(staging, ignore_errors=True)
    raise_if_any_failed(
        state.rank,
        error,
        f"could not write torch_dist checkpoint directory {staging}",
        f"iteration {iteration} was not saved; the tracker in {staging.parent} was not moved",
        operation=save_operation(iteration),
        iteration=iteration,
    )


def save_operation(iteration: int, *, background: bool = False) -> str:
    """The operation a lost peer's `CollectiveError` names for the save of `iteration`."""
    return f"{'asynchronous ' if background else ''}torch_dist save of iteration {iteration}"


def write_common(directory: Path, common: dict[str, Any]) -> None:
    """Writes ``common.pt`` and ``metadata.json`` into `directory`, each atomically."""
    _atomic_write(directory / COMMON_FILENAME, lambda f: torch.save(common, f))
    metadata = json.dumps(_FORMAT_METADATA).encode("utf-8")
    _atomic_write(directory / FORMAT_METADATA_FILENAME, lambda f: f.write(metadata))


def writer_and_planner(
    staging: Path, chunks: dict[str, tuple[Box, tuple[int, ...]]] | None = None
) -> tuple[FileSystemWriter, DefaultSavePlanner]:
    """DCP's file writer (each file synced) and a planner for our flat, global keys.

    Args:
        staging: The directory written.
        chunks: The keys holding a tensor-parallel part, placed in their whole tensor
            (`SaveContent.chunks`).
    """
    return FileSystemWriter(staging, sync_files=True), ChunkSavePlanner(chunks)


def write_torch_dist(
    staging: Path, content: SaveContent, state: ParallelState, iteration: int
) -> None:
    """Writes `content` into `staging` with a blocking ``dcp.save``; a collective.

    Raises:
        CheckpointError: On every rank when any rank failed (DCP reports failures to all).
        CollectiveError: On every survivor when a rank died or stopped answering.
    """
    prepare(staging, content, state, iteration)
    writer, planner = writer_and_planner(staging, content.chunks)
    try:
        dcp.save(content.tensors, storage_writer=writer, planner=planner)
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        remove_failed_save(staging, state.rank)
        raise dcp_failure(
            error,
            save_operation(iteration),
            iteration,
            f"rank {state.rank}: could not write torch_dist checkpoint {staging}: "
            f"{describe_dcp_error(error)}; the tracker in {staging.parent} was not moved",
        ) from error


def dcp_failure(
    error: BaseException,
    operation: str,
    iteration: int,
    message: str,
    kind: type[CheckpointError] = CheckpointError,
) -> CollectiveError | CheckpointError:
    """What a failed DCP save or load raises: a lost peer's `CollectiveError`, else a `kind`.

    DCP reports a peer that died as the backend's bare error, or inside its
    ``CheckpointException`` among each rank's failures; either becomes one `CollectiveError`
    naming this rank, `operation` and `iteration`.
    """
    lost = _lost_peer_in(error)
    if isinstance(lost, CollectiveError):
        return lost if lost.iteration is not None else lost.with_iteration(iteration)
    if lost is not None:
        return collective_error(lost, operation, iteration=iteration)
    return kind(message)


def _lost_peer_in(error: BaseException) -> BaseException | None:
    """The backend's lost-peer error in `error`, its causes or DCP's per-rank failures."""
    failures = getattr(error, "failures", None)
    candidates = [error]
    if isinstance(failures, dict):
        candidates += [failure[0] for failure in failures.values()]
    for candidate in candidates:
        seen: BaseException | None = candidate
        for _ in range(8):  # a chain of causes is short; a cycle must not loop forever
            if seen is None:
                break
            if isinstance(seen, CollectiveError) or is_lost_peer(seen):
                return seen
            seen = seen.__cause__ or seen.__context__
    return None


def describe_dcp_error(error: BaseException) -> str:
    """One line for a DCP failure: each failed rank's exception, without DCP's tracebacks."""
    failures = getattr(error, "failures", None)
    if isinstance(error, CheckpointException) and isinstance(failures, dict) and failures:
        parts = []
        for rank, (exception, _) in sorted(failures.items()):
            first = (str(exception).strip().splitlines() or [""])[0]
            parts.append(f"rank {rank}: {type(exception).__name__}: {first}")
        return "; ".join(parts)
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:400]}"


def remove_failed_save(staging: Path, rank: int) -> None:
    """Removes this rank's files of a failed save; global rank 0 the whole directory.

    Called on every rank once every rank knows the save failed (DCP's collectives or
    `raise_if_any_failed` told them), so no rank still writes there; rank 0's removal
    may run while another rank lists its files.
    """
    try:
        own = list(staging.glob(f"__{rank}_*.distcp"))
    except OSError:  # removed while listed (rank 0 got there first): nothing of ours left
        own = []
    for path in own:
        with contextlib.suppress(OSError):
            path.unlink()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)


def publish(root: Path, iteration: int) -> None:
    """Global rank 0 only: renames the complete ``.partial`` directory, then moves the tracker.

    Called once DCP's ``.metadata`` is written, that is after every rank's data. A directory
    of the same iteration already there (a run that saves again the iteration it resumed
    from) is moved aside first and deleted last (`pp_train.checkpoint.files.move_in`).
    """
    final = iteration_directory(root, iteration)
    staging = final.with_name(final.name + PARTIAL_SUFFIX)
    if not (staging / ".metadata").is_file():
        raise CheckpointError(f"rank 0: {staging} has no .metadata; it is not complete")
    _fsync_directory(staging)
    replaced = move_in(staging, final)
    _fsync_directory(root)
    _atomic_write(root / TRACKER_FILENAME, lambda f: f.write(str(iteration).encode("ascii")))
    with contextlib.suppress(OSError):
        shutil.rmtree(replaced)
