"""A checkpoint's whole model tensors by global name, read without the model or a process group.

`read_weights` takes one iteration of a checkpoint in either format, saved at any layout
(tensor, pipeline and virtual pipeline sizes, data parallelism with or without the distributed
optimizer, uneven stages), and returns each model tensor whole, as at tensor-parallel size 1,
under its global name (`pp_train.checkpoint.keys`). Where the run kept fp32 main copies of
fp16/bf16 parameters (the optimizer's ``fp32_from_fp16_params``, a torch_dist checkpoint's
``optimizer.fp32_param.*`` or the distributed optimizer's shards) those are returned instead of
the half-precision model tensors.

Only what is needed is read: a torch_dist checkpoint through DCP with a buffer for each chosen
key (no optimizer moments); torch files memory-mapped, so the untouched entries (optimizer
state) are never read into memory. The result holds the model once.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pp_tensor import join_shards
from pp_train.checkpoint.distrib_optim import DISTRIB_OPTIM_FILENAME
from pp_train.checkpoint.errors import CheckpointError, DamagedCheckpointError
from pp_train.checkpoint.formats import CkptFormat, detect_format
from pp_train.checkpoint.keys import FP32_PARAM_PREFIX, MODEL_PREFIX
from pp_train.checkpoint.loading import load_planner, read_common, read_metadata
from pp_train.checkpoint.model_free import load_file, no_records, position_files, single_process
from pp_train.checkpoint.optimizer_shards import (
    MAIN_PARAM_ENTRY,
    OwnedShard,
    SavedNumbering,
    SavedRange,
    ShardIndex,
    saved_numbers,
)
from pp_train.checkpoint.tensor_parallel import TensorSplit
from pp_train.checkpoint.torch_dist import CONVERSION_KEY, RECORD_PREFIX, describe_dcp_error
from pp_train.checkpoint.torch_format import model_keys
from pp_train.checkpoint.tracker import iteration_directory

__all__ = ["SavedWeights", "read_weights"]


@dataclasses.dataclass
class SavedWeights:
    """One iteration's model tensors, whole, and what the run that saved it recorded."""

    directory: Path
    """The iteration's directory."""
    ckpt_format: CkptFormat
    """Its format."""
    args: dict[str, Any]
    """The run's saved args (flags and derived sizes)."""
    tensors: dict[str, torch.Tensor]
    """Global name -> whole tensor (fp32 main copies where the run kept them)."""
    main_copies: list[str] = dataclasses.field(default_factory=list)
    """The names taken from fp32 main copies rather than from the model's tensors."""


def read_weights(root: str | os.PathLike[str], iteration: int) -> SavedWeights:
    """The whole model tensors of iteration `iteration` of checkpoint `root`.

    Args:
        root: The checkpoint directory (Megatron's ``--save``).
        iteration: The iteration (its ``iter_N`` directory must exist).

    Raises:
        CheckpointError: The directory holds neither format, a file is missing, damaged or
            unsafe, its files lack conversion records (saved before they were written), or
            a tensor is not covered by the saved parts; the message names the file and key.
    """
    directory = iteration_directory(root, iteration)
    found = detect_format(directory)
    if found == "torch_dist":
        return _read_dist(directory, iteration)
    if found == "torch":
        return _read_torch(directory, iteration)
    raise CheckpointError(
        f"{directory} holds neither checkpoint format (no .metadata or metadata.json of "
        "torch_dist, no mp_rank_* directories of torch); nothing was written"
    )


# ----------------------------------------------------------------------------- torch_dist
def _read_dist(directory: Path, iteration: int) -> SavedWeights:
    where = f"torch_dist checkpoint {directory}"
    common = read_common(directory, iteration, where)
    metadata = read_metadata(directory, where)
    entries = metadata.state_dict_metadata
    names = sorted(
        key[len(MODEL_PREFIX) :]
        for key, entry in entries.items()
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    )
    if not names:
        raise CheckpointError(f"{where} holds no model tensors (no model.* keys)")
    index = ShardIndex(metadata)
    whole: dict[str, str] = {}
    sharded: dict[str, list[SavedRange]] = {}
    for name in names:
        if FP32_PARAM_PREFIX + name in entries:
            whole[name] = FP32_PARAM_PREFIX + name
        elif index.ranges.get((name, MAIN_PARAM_ENTRY)):
            sharded[name] = []
        else:
            whole[name] = MODEL_PREFIX + name
    numbers = _shard_numbers(directory, metadata, common, index, sharded)
    buffers: dict[str, Any] = {key: _empty(entries[key]) for key in whole.values()}
    buffers.update({r.key: _empty(entries[r.key]) for rs in sharded.values() for r in rs})
    _dcp_read(directory, buffers)
    tensors = {name: buffers.pop(key) for name, key in whole.items()}
    for name, pieces in sharded.items():
        tensors[name] = _assemble(name, entries, pieces, numbers[name], buffers)
    copies = [n for n in names if n in sharded or whole[n].startswith(FP32_PARAM_PREFIX)]
    ordered = {name: tensors[name] for name in names}
    return SavedWeights(directory, "torch_dist", common["args"], ordered, copies)


def _empty(entry: Any) -> torch.Tensor:
    assert isinstance(entry, TensorStorageMetadata)
    return torch.empty(tuple(entry.size), dtype=entry.properties.dtype)


def _dcp_read(directory: Path, buffers: dict[str, Any]) -> None:
    try:
        with single_process():
            reader = FileSystemReader(directory)
            dcp.load(buffers, storage_reader=reader, planner=load_planner(), no_dist=True)
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        raise DamagedCheckpointError(
            f"torch_dist checkpoint {directory}: reading {sorted(buffers)[:3]}... failed: "
            f"{describe_dcp_error(error)}; nothing was written"
        ) from error


def _shard_numbers(
    directory: Path,
    metadata: Metadata,
    common: dict[str, Any],
    index: ShardIndex,
    sharded: dict[str, list[SavedRange]],
) -> dict[str, torch.Tensor]:
    """For each parameter kept in distributed-optimizer shards: each element's saved number.

    Fills `sharded` with the saved ranges holding them.
    """
    if not sharded:
        return {}
    dims = _split_dims(directory, metadata)
    layout = common.get("layout")
    tp = layout.get("tensor_model_parallel_size", 1) if isinstance(layout, dict) else 1
    numbers = {}
    for name in sharded:
        entry = metadata.state_dict_metadata[MODEL_PREFIX + name]
        assert isinstance(entry, TensorStorageMetadata)
        shape = tuple(entry.size)
        total = math.prod(shape)
        whole = TensorSplit(dims.get(name, -1), 0, 1, shape)
        numbers[name] = saved_numbers(0, total, whole, SavedNumbering(shape, tp))
        owner = OwnedShard(name, 0, total, total, torch.empty(0), True)
        try:
            sharded[name] = index.pieces(owner, MAIN_PARAM_ENTRY, numbers[name], total)
        except ValueError as error:
            raise DamagedCheckpointError(
                f"torch_dist checkpoint {directory}: {error}; nothing was written"
            ) from error
    return numbers


def _split_dims(directory: Path, metadata: Metadata) -> dict[str, int]:
    """The tensor-parallel split dimension of each split tensor, from the conversion records."""
    keys = [key for key in metadata.state_dict_metadata if key.startswith(RECORD_PREFIX)]
    if not keys:
        raise no_records(f"torch_dist checkpoint {directory}")
    records: dict[str, Any] = dict.fromkeys(keys)
    _dcp_read(directory, records)
    return {n: d for r in records.values() for n, d in r.get("tensor_parallel", {}).items()}


def _assemble(
    name: str,
    entries: dict[str, Any],
    pieces: list[SavedRange],
    numbers: torch.Tensor,
    buffers: dict[str, Any],
) -> torch.Tensor:
    """Parameter `name`'s whole fp32 main copy from its saved ranges.

    `numbers` holds each element's saved number (`saved_numbers`).
    """
    entry = entries[MODEL_PREFIX + name]
    flat = torch.empty(numbers.numel(), dtype=torch.float32)
    for piece in pieces:
        held = (numbers >= piece.start) & (numbers < piece.end)
        flat[held] = buffers[piece.key].reshape(-1)[numbers[held] - piece.start].float()
    return flat.view(tuple(entry.size))


# ----------------------------------------------------------------------------- torch
def _read_torch(directory: Path, iteration: int) -> SavedWeights:
    files = position_files(directory, iteration, mmap=True)
    parts: dict[str, dict[int, torch.Tensor]] = {}
    copies: set[str] = set()
    dims: dict[str, int] = {}
    for path, content in files:
        record = content[CONVERSION_KEY]
        dims.update(record.get("tensor_parallel", {}))
        mains = _main_copies(path, content, record)
        for key, names in zip(model_keys(len(record["chunks"])), record["chunks"], strict=True):
            for local, name in names.items():
                value = mains.get(name, content[key][local])
                parts.setdefault(name, {}).setdefault(record["tensor_rank"], value)
                if name in mains:
                    copies.add(name)
    size = files[0][1][CONVERSION_KEY]["layout"]["tensor_model_parallel_size"]
    tensors = {name: _joined(directory, name, held, dims, size) for name, held in parts.items()}
    args = files[0][1]["args"]
    return SavedWeights(directory, "torch", args, tensors, sorted(copies))


def _joined(
    directory: Path, name: str, held: dict[int, torch.Tensor], dims: dict[str, int], size: int
) -> torch.Tensor:
    dim = dims.get(name)
    first = held[min(held)]
    if dim is None or size == 1 or first.dim() <= dim:
        return first.clone()  # every tensor-parallel rank holds it whole; off the mapped file
    if sorted(held) != list(range(size)):
        raise DamagedCheckpointError(
            f"checkpoint {directory}: {name} is split over {size} tensor-parallel ranks, but "
            f"only the files of ranks {sorted(held)} hold it; nothing was written"
        )
    return join_shards([held[rank] for rank in range(size)], dim)


def _main_copies(path: Path, content: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """The fp32 main copies of this position's fp16/bf16 parameters, by global name."""
    optimizer = content.get("optimizer")
    if record.get("distributed_optimizer"):
        half = any(
            t.dtype != torch.float32
            for key in model_keys(len(record["chunks"]))
            for t in content[key].values()
            if isinstance(t, torch.Tensor)
        )
        if not half:
            return {}  # fp32 parameters are their own main copies
        return _distributed_copies(path.parent / DISTRIB_OPTIM_FILENAME, content, record)
    if not isinstance(optimizer, dict) or record.get("optimizer_params") is None:
        return {}
    held = optimizer.get("fp32_from_fp16_params")
    if not held:
        return {}
    taken = [0] * len(held)
    found: dict[str, Any] = {}
    for name, group, is_copy in record["optimizer_params"]:
        if is_copy:
            found.setdefault(name, held[group][taken[group]])
            taken[group] += 1
    return found


def _distributed_copies(
    path: Path, content: dict[str, Any], record: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """A torch-format distributed optimizer's fp32 parameters (``distrib_optim.pt``)."""
    if not path.is_file():
        raise DamagedCheckpointError(
            f"checkpoint {path.parent} was saved with the distributed optimizer and fp16/bf16 "
            f"parameters, whose fp32 main copies are in {path}: missing; nothing was written"
        )
    params = load_file(path, mmap=True).get("params")
    if not isinstance(params, dict):
        raise DamagedCheckpointError(f"checkpoint {path} holds no 'params' dict")
    found: dict[str, torch.Tensor] = {}
    for chunk, (key, names) in enumerate(
        zip(model_keys(len(record["chunks"])), record["chunks"], strict=True)
    ):
        for saved, entry in params.items():
            head, _, local = str(saved).partition(".")
            while local.startswith("module."):  # the wrappers' (Float16Module's) prefix
                local = local[len("module.") :]
            if head != str(chunk) or local not in names or not isinstance(entry, dict):
                continue
            shape = content[key][local].shape
            found.setdefault(names[local], entry["param"].view(shape))
    return found
