"""Converting a checkpoint between the ``torch`` and ``torch_dist`` formats without the model.

One process, no process group, no model: every file says where its tensors go. A torch file
carries a `conversion_record` under ``"conversion"`` (each chunk's global names, the
optimizer's parameter order, the layout); a torch_dist checkpoint carries one record per
(tensor, pipeline) position under ``conversion.tp<TT>.pp<PPP>``. Both are written by every
save through `pp_train.checkpoint.save_checkpoint` whose chunks implement
`ShardedStateKeys`; files without them are refused (the training command's
``--ckpt-convert-format`` converts those, with the model).

``torch`` -> ``torch_dist`` keys every tensor by its global name, as a torch_dist save does,
joining the tensor-parallel parts of a split tensor into the whole (the record names each
split tensor's dimension). ``torch_dist`` -> ``torch`` writes the layout that saved the
checkpoint (one file per recorded position, each with its tensor-parallel parts). The output
is written into a temporary sibling directory, its tracker last, and renamed into place; the
input is only read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pp_tensor import join_shards, shard_of
from pp_train.checkpoint.errors import CheckpointError
from pp_train.checkpoint.files import atomic_write, fsync_directory
from pp_train.checkpoint.formats import CKPT_FORMATS, CkptFormat, detect_format
from pp_train.checkpoint.keys import FP32_PARAM_PREFIX, MODEL_PREFIX, OPTIMIZER_STATE_PREFIX
from pp_train.checkpoint.loading import load_planner, read_common, read_metadata
from pp_train.checkpoint.model_free import no_records, position_files, single_process
from pp_train.checkpoint.tensor_parallel import name_of_key
from pp_train.checkpoint.torch_dist import (
    CONVERSION_KEY,
    RECORD_PREFIX,
    record_key,
    write_common,
    writer_and_planner,
)
from pp_train.checkpoint.torch_format import model_keys
from pp_train.checkpoint.tracker import (
    CHECKPOINT_VERSION,
    TRACKER_FILENAME,
    checkpoint_path,
    iteration_directory,
    read_tracker,
)
from pp_train.temporaries import temporary_path

__all__ = [
    "check_output",
    "convert_checkpoint",
    "publish",
    "source_iteration",
]


def convert_checkpoint(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    to: CkptFormat,
    *,
    iteration: int | None = None,
) -> Path:
    """Converts iteration `iteration` (the tracker's when None) of `source` into `target`.

    `target` gets Megatron's layout (``iter_N/...`` and a tracker naming N); it must not
    exist or be empty, and is complete or absent: written beside it under a temporary name
    and renamed. `source` is only read. Needs no model and no process group.

    Returns:
        The iteration's directory in `target`.

    Raises:
        CheckpointError: `to` is not a format, `source` holds no such iteration, it is in
            `to` already, its files lack the conversion records (saved before they were
            written; convert with the training command's ``--ckpt-convert-format``), or
            `target` is not empty. Nothing was written.
    """
    source, target = Path(source), Path(target)
    if to not in CKPT_FORMATS:
        raise CheckpointError(f"--to must be one of {list(CKPT_FORMATS)}, got {to!r}")
    check_output(source, target)
    iteration = source_iteration(source, iteration)
    directory = iteration_directory(source, iteration)
    found = detect_format(directory)
    if found is None or found == to:
        what = "holds neither format" if found is None else f"is in the {to!r} format already"
        raise CheckpointError(f"checkpoint {directory} {what}; nothing was written")
    if to == "torch_dist":
        write = _torch_writer(_read_torch(directory, iteration), iteration)
    else:
        write = _dist_writer(directory, iteration)
    publish(target, write, iteration=iteration)
    return iteration_directory(target, iteration)


def check_output(source: Path, target: Path) -> None:
    """Refuses an input that is no directory and an output that is not new or empty.

    Raises:
        CheckpointError: `source` is not a directory, `target` exists and is not an empty
            directory, or `target` is `source` or inside it.
    """
    if not source.is_dir():
        raise CheckpointError(f"input {source} is not a directory; nothing was written")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(
            f"output {target} exists and is not an empty directory; choose a new one "
            "(nothing was written)"
        )
    resolved = target.resolve()
    if resolved == source.resolve() or source.resolve() in resolved.parents:
        raise CheckpointError(
            f"output {target} is inside input {source}; the input is never written to"
        )


def source_iteration(source: Path, iteration: int | None) -> int:
    """`iteration`, or the tracker's when None, once `source` has its directory.

    Raises:
        CheckpointError: No iteration was given and `source` has no tracker, or `source`
            has no directory of the iteration (the message lists those it has).
    """
    if iteration is None:
        iteration = read_tracker(source)
        if iteration is None:
            raise CheckpointError(
                f"input {source} has no {TRACKER_FILENAME}; pass --iteration N to name the "
                "iteration to read (nothing was written)"
            )
    if not iteration_directory(source, iteration).is_dir():
        present = sorted(p.name for p in source.glob("iter_*"))
        raise CheckpointError(
            f"input {source} has no {iteration_directory(source, iteration).name}; found "
            f"{present[:5]} (nothing was written)"
        )
    return iteration


def publish(target: Path, write: Any, *, iteration: int | None = None) -> None:
    """Runs `write` into a temporary sibling of `target` and renames it to `target`.

    With `iteration`, Megatron's tracker naming it is written last, before the rename.
    `target` is then complete or absent; a failure removes the temporary directory.
    """
    staging = temporary_path(target)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        write(staging)
        if iteration is not None:
            tracker = staging / TRACKER_FILENAME
            atomic_write(tracker, lambda f: f.write(str(iteration).encode("ascii")))
        fsync_directory(staging)
        if target.exists():
            target.rmdir()  # checked empty
        os.replace(staging, target)
        fsync_directory(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- torch -> dist
def _read_torch(directory: Path, iteration: int) -> list[dict[str, Any]]:
    """Every position's file of a torch checkpoint, checked to hold one whole layout."""
    files = position_files(directory, iteration)
    for path, content in files:
        _refuse_distributed_optimizer(content[CONVERSION_KEY], f"checkpoint {path}")
    return [content for _, content in files]


def _refuse_distributed_optimizer(record: dict[str, Any], where: str) -> None:
    """The converter moves the whole optimizer's state only, not a distributed one's shards."""
    if record.get("distributed_optimizer"):
        raise CheckpointError(
            f"{where} was saved with --use-distributed-optimizer; the converter does not take "
            "sharded optimizer state: convert it with pretrain's --ckpt-convert-format (the "
            "run's model and optimizer load it and save it again); nothing was written"
        )


def _torch_writer(files: list[dict[str, Any]], iteration: int) -> Any:
    """What writes the torch_dist iteration directory of the torch `files`."""
    parts: dict[str, dict[int, Any]] = {}
    tensors: dict[str, Any] = {}
    for content in files:
        record = content[CONVERSION_KEY]
        rank = record["tensor_rank"]
        chunk_keys = model_keys(len(record["chunks"]))
        for key, names in zip(chunk_keys, record["chunks"], strict=True):
            for local, name in names.items():
                parts.setdefault(MODEL_PREFIX + name, {}).setdefault(rank, content[key][local])
        if "optimizer" in content and record["optimizer_params"] is not None:
            for key, value in _optimizer_entries(content["optimizer"], record).items():
                parts.setdefault(key, {}).setdefault(rank, value)
        if "rng_state" in content:
            tensors.update({f"rng_state.rank{r}": content["rng_state"] for r in record["ranks"]})
        tensors[record_key(record["tensor_rank"], record["pipeline_rank"])] = record
    layout = files[0][CONVERSION_KEY]["layout"]
    dims = {n: d for c in files for n, d in c[CONVERSION_KEY].get("tensor_parallel", {}).items()}
    for key, held in parts.items():
        tensors[key] = _whole(key, held, dims, layout["tensor_model_parallel_size"])
    common = _common(files[0], iteration)

    def write(staging: Path) -> None:
        directory = iteration_directory(staging, iteration)
        directory.mkdir()
        write_common(directory, common)
        writer, planner = writer_and_planner(directory)
        with single_process():
            dcp.save(tensors, storage_writer=writer, planner=planner, no_dist=True)

    return write


def _whole(key: str, held: dict[int, Any], dims: dict[str, int], size: int) -> Any:
    """The whole tensor of `key` from each tensor-parallel rank's part (`held`, by rank).

    Raises:
        CheckpointError: A split tensor lacks some rank's part.
    """
    name = name_of_key(key)
    dim = None if name is None else dims.get(name)
    first = held[min(held)]
    if dim is None or size == 1 or not isinstance(first, torch.Tensor) or first.dim() <= dim:
        return first  # held whole by every tensor-parallel rank
    if sorted(held) != list(range(size)):
        raise CheckpointError(
            f"{key} is split over {size} tensor-parallel ranks, but only the files of ranks "
            f"{sorted(held)} hold it; nothing was written"
        )
    return join_shards([held[rank] for rank in range(size)], dim)


def _part(name: str, value: Any, record: dict[str, Any]) -> Any:
    """This position's tensor-parallel part of the whole `value` of global name `name`."""
    dim = record.get("tensor_parallel", {}).get(name)
    size = record["layout"]["tensor_model_parallel_size"]
    if dim is None or size == 1 or not isinstance(value, torch.Tensor) or value.dim() <= dim:
        return value
    return shard_of(value, dim, record["tensor_rank"], size)


def _optimizer_entries(optimizer: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """A torch file's optimizer state under the global keys (`pp_train.checkpoint.keys`)."""
    state = optimizer["optimizer"]["state"]
    copies = optimizer.get("fp32_from_fp16_params")
    taken = [0] * len(record["param_groups"])
    entries: dict[str, Any] = {}
    for index, (name, group, is_copy) in enumerate(record["optimizer_params"]):
        for entry, value in state.get(index, {}).items():
            if isinstance(value, torch.Tensor):
                entries.setdefault(f"{OPTIMIZER_STATE_PREFIX}{name}.{entry}", value)
        if is_copy and copies is not None:
            entries.setdefault(FP32_PARAM_PREFIX + name, copies[group][taken[group]])
            taken[group] += 1
    return entries


def _common(content: dict[str, Any], iteration: int) -> dict[str, Any]:
    """``common.pt`` of the torch_dist checkpoint made of a torch file's shared state."""
    common: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "ckpt_format": "torch_dist",
        "iteration": iteration,
        "args": content["args"],
        "consumed_train_samples": content["consumed_train_samples"],
        "consumed_valid_samples": content["consumed_valid_samples"],
        "layout": content[CONVERSION_KEY]["layout"],
    }
    if "optimizer" in content:
        common["grad_scaler"] = content["optimizer"]["grad_scaler"]
    if "opt_param_scheduler" in content:
        common["opt_param_scheduler"] = content["opt_param_scheduler"]
    return common


# ----------------------------------------------------------------------------- dist -> torch
def _dist_writer(directory: Path, iteration: int) -> Any:
    """What writes the torch files of the torch_dist `directory`, at its recorded layout."""
    where = f"torch_dist checkpoint {directory}"
    common = read_common(directory, iteration, where)
    metadata = read_metadata(directory, where)
    records = sorted(key for key in metadata.state_dict_metadata if key.startswith(RECORD_PREFIX))
    if not records:
        raise no_records(where)
    buffers: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            buffers[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        elif key.startswith((RECORD_PREFIX, "rng_state.")):
            buffers[key] = None
    with single_process():
        reader = FileSystemReader(directory)
        dcp.load(buffers, storage_reader=reader, planner=load_planner(), no_dist=True)

    for key in records:
        _refuse_distributed_optimizer(buffers[key], where)

    def write(staging: Path) -> None:
        for key in records:
            record = buffers[key]
            path = checkpoint_path(
                staging, iteration, tensor_rank=record["tensor_rank"],
                pipeline_rank=record["pipeline_rank"],
                pipeline_size=record["layout"]["pipeline_model_parallel_size"],
            )  # fmt: skip
            _save(path, _torch_file(record, buffers, common, iteration))

    return write


def _save(path: Path, content: dict[str, Any]) -> None:
    atomic_write(path, lambda f: torch.save(content, f))


def _torch_file(
    record: dict[str, Any], buffers: dict[str, Any], common: dict[str, Any], iteration: int
) -> dict[str, Any]:
    """One position's torch file, as `torch_format.save_torch_checkpoint` writes it."""
    content: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "args": common["args"],
        "consumed_train_samples": common["consumed_train_samples"],
        "consumed_valid_samples": common["consumed_valid_samples"],
    }
    for key, names in zip(model_keys(len(record["chunks"])), record["chunks"], strict=True):
        content[key] = {
            local: _part(name, buffers[MODEL_PREFIX + name], record)
            for local, name in names.items()
        }
    if record["optimizer_params"] is not None and "grad_scaler" in common:
        content["optimizer"] = _torch_optimizer(record, buffers, common["grad_scaler"])
    if "opt_param_scheduler" in common:
        content["opt_param_scheduler"] = common["opt_param_scheduler"]
    rng = buffers.get(f"rng_state.rank{record['ranks'][0]}")
    if rng is not None:
        content["rng_state"] = rng
    content[CONVERSION_KEY] = record
    return content


def _torch_optimizer(
    record: dict[str, Any], buffers: dict[str, Any], grad_scaler: Any
) -> dict[str, Any]:
    """pp-optim's ``state_dict()`` of one position, from the global keys."""
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in buffers.items():
        if key.startswith(OPTIMIZER_STATE_PREFIX) and isinstance(value, torch.Tensor):
            name, entry = key[len(OPTIMIZER_STATE_PREFIX) :].rsplit(".", 1)
            by_name.setdefault(name, {})[entry] = value
    state: dict[int, dict[str, torch.Tensor]] = {}
    copies: list[list[torch.Tensor]] = [[] for _ in record["param_groups"]]
    for index, (name, group, is_copy) in enumerate(record["optimizer_params"]):
        if name in by_name:  # a copy each: tied parameters must not share one state tensor
            state[index] = {
                entry: _part(name, value, record).clone() for entry, value in by_name[name].items()
            }
        if is_copy:
            copies[group].append(_part(name, buffers[FP32_PARAM_PREFIX + name], record))
    optimizer: dict[str, Any] = {
        "optimizer": {"state": state, "param_groups": record["param_groups"]},
        "grad_scaler": grad_scaler,
    }
    if record["fp32_copies"]:
        optimizer["fp32_from_fp16_params"] = copies
    return optimizer
