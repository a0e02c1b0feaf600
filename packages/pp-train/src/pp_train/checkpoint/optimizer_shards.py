"""The distributed optimizer's state in a torch_dist checkpoint, reassembled at any layout.

pp-optim's `DistributedOptimizer` keeps, on each data-parallel rank, the fp32 main copy and
optimizer state of a flat range of some parameters (`DistributedOptimizer.shard_ranges`).
Each rank writes each range under the parameter's global name and the range itself:

- ``optimizer.shard.<global name>.<entry>.<start>-<end>``: the elements numbered
  ``[start, end)`` of the parameter's ``entry``: ``fp32_param`` (the main copy of an
  fp16/bf16 parameter; an fp32 parameter is its own main copy, saved as
  ``model.<global name>``) or an optimizer state tensor (Adam's ``exp_avg``, ``exp_avg_sq``,
  SGD's ``momentum_buffer``). Elements are numbered by the flattened parameter; under tensor
  parallelism a rank's parameter is its part of the whole, and the parts are numbered one
  after the other in tensor-parallel rank order (`SavedNumbering`);
- ``optimizer.state.<global name>.step``: Adam's step count, the key the whole optimizer
  uses too.

DCP's ``.metadata`` lists every key, so a loader at another data-parallel, pipeline or
tensor-parallel size finds the saved number of each element it owns (`saved_numbers`: where
its part lies in the whole, then where that is in the saving run's parts) and copies it from
the saved range holding it (`ShardIndex`). A checkpoint of the whole optimizer
(``optimizer.state.<global name>.<entry>``, ``optimizer.fp32_param.<global name>``) is read
like a model tensor (this rank's block of the whole) and sliced, so either optimizer loads the
other's checkpoints.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pp_optim import DistributedOptimizer
from pp_train.checkpoint.errors import listed
from pp_train.checkpoint.keys import (
    FP32_PARAM_PREFIX,
    MODEL_PREFIX,
    OPTIMIZER_STATE_PREFIX,
    chunk_global_keys,
)
from pp_train.checkpoint.tensor_parallel import TensorSplit
from pp_train.wrappers import unwrap_model

__all__ = [
    "MAIN_PARAM_ENTRY",
    "SHARD_PREFIX",
    "OwnedShard",
    "SavedNumbering",
    "SavedRange",
    "ShardIndex",
    "ShardLoad",
    "Source",
    "distributed_state",
    "owned_shards",
    "plan_shard_load",
    "saved_numbers",
    "shard_key",
    "shard_offset",
    "shard_tensors",
]

SHARD_PREFIX = "optimizer.shard."
MAIN_PARAM_ENTRY = "fp32_param"
"""The entry of a shard key holding the fp32 main copy."""

_SHARD_KEY = re.compile(r"^optimizer\.shard\.(.+)\.(\w+)\.(\d+)-(\d+)$")


def shard_key(name: str, entry: str, start: int, end: int) -> str:
    """The key of elements ``[start, end)`` of parameter `name`'s `entry`."""
    return f"{SHARD_PREFIX}{name}.{entry}.{start}-{end}"


@dataclasses.dataclass(frozen=True)
class OwnedShard:
    """A flat range of one parameter this rank's distributed optimizer owns, named."""

    name: str
    """The parameter's global name."""
    start: int
    """First owned element of the flattened parameter."""
    end: int
    """One past the last."""
    numel: int
    """Elements of the whole parameter."""
    main_param: torch.Tensor
    """The fp32 main shard the inner optimizer updates."""
    is_copy: bool
    """Whether the main shard is a copy (an fp16/bf16 parameter) or the parameter's own."""


def owned_shards(
    model: Sequence[torch.nn.Module], optimizer: DistributedOptimizer
) -> list[OwnedShard]:
    """This rank's ranges in the optimizer's order, each under its parameter's global name.

    Raises:
        ValueError: A range's parameter belongs to none of the chunks.
    """
    names: dict[int, str] = {}
    for index, chunk in enumerate(model):
        keys = chunk_global_keys(chunk, index)
        for local, param in unwrap_model(chunk).named_parameters():
            names[id(param)] = keys[local]
    owned = []
    for shard in optimizer.shard_ranges():
        if id(shard.param) not in names:
            raise ValueError(f"optimizer shard of {shard.name} belongs to no model chunk")
        is_copy = shard.param.dtype != torch.float32
        name, numel = names[id(shard.param)], shard.param.numel()
        owned.append(OwnedShard(name, shard.start, shard.end, numel, shard.main_param, is_copy))
    return owned


def shard_tensors(
    model: Sequence[torch.nn.Module],
    optimizer: DistributedOptimizer,
    splits: Mapping[str, TensorSplit] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's fp32 main shards and optimizer state under their global keys.

    A range held twice (the tied copies of a word embedding on one rank) is taken from its
    first holder; the copies have equal gradients and so equal state. A range of a part of a
    parameter split over tensor parallelism (`splits`, by global name) is numbered from its
    part's first element (`shard_offset`).
    """
    tensors: dict[str, torch.Tensor] = {}
    for owned in owned_shards(model, optimizer):
        offset = shard_offset((splits or {}).get(owned.name))
        start, end = owned.start + offset, owned.end + offset
        if owned.is_copy:
            key = shard_key(owned.name, MAIN_PARAM_ENTRY, start, end)
            tensors.setdefault(key, owned.main_param.detach())
        for entry, value in optimizer.optimizer.state.get(owned.main_param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.dim() == 0:
                tensors.setdefault(f"{OPTIMIZER_STATE_PREFIX}{owned.name}.{entry}", value)
            else:
                tensors.setdefault(shard_key(owned.name, entry, start, end), value.detach())
    return tensors


@dataclasses.dataclass(frozen=True)
class SavedRange:
    """A saved tensor holding the elements numbered ``[start, end)`` of one parameter's entry."""

    key: str
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class SavedNumbering:
    """How a checkpoint numbers one parameter's elements in its shard keys.

    The saving run's tensor-parallel parts in rank order, each flattened: element ``k`` of
    rank ``r``'s part is number ``r * part_numel + k`` (`shard_offset`). At tensor-parallel
    size 1 that is the flattened parameter, and for a split along dimension 0 the flattened
    whole at any size; whole-tensor keys are read as blocks instead (`ShardIndex.wholes`).
    """

    shape: tuple[int, ...]
    """The whole parameter's saved shape."""
    tp_size: int
    """The saving run's tensor-parallel size."""


def shard_offset(split: TensorSplit | None) -> int:
    """The number of the first element of a rank's part (`SavedNumbering`)."""
    if split is None or not split.is_split:
        return 0
    return split.rank * math.prod(split.local_shape)


def _unravel(flat: torch.Tensor, shape: Sequence[int]) -> list[torch.Tensor]:
    index: list[torch.Tensor] = []
    for size in reversed(shape):
        index.append(flat % size)
        flat = flat // size
    return index[::-1]


def _ravel(index: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    flat = torch.zeros_like(index[0])
    for position, size in zip(index, shape, strict=True):
        flat = flat * size + position
    return flat


def saved_numbers(start: int, end: int, split: TensorSplit, saved: SavedNumbering) -> torch.Tensor:
    """The saved numbers of elements ``[start, end)`` of this rank's flattened part `split`.

    -1 for an element past the saved rows (a vocabulary padded further than the saved one).

    Raises:
        ValueError: The saved parameter has another number of dimensions.
    """
    numbers = torch.arange(start, end, dtype=torch.int64)
    whole = split.dim < 0 or (split.size == 1 and saved.tp_size == 1)
    if whole and saved.shape == split.local_shape:  # numbered as the flattened parameter
        return numbers
    if len(saved.shape) != len(split.local_shape):
        raise ValueError(f"saved shape {saved.shape}, this run's {split.full_shape}")
    index = _unravel(numbers, split.local_shape)
    dim = split.dim
    if dim >= 0:
        index[dim] = index[dim] + split.box.offsets[dim]
    inside = index[0] < saved.shape[0]
    if dim >= 0 and saved.tp_size > 1:
        part = saved.shape[dim] // saved.tp_size
        owner = index[dim] // part
        index[dim] = index[dim] - owner * part
        part_shape = [*saved.shape[:dim], part, *saved.shape[dim + 1 :]]
        numbers = owner * math.prod(part_shape) + _ravel(index, part_shape)
    else:
        numbers = _ravel(index, saved.shape)
    return torch.where(inside, numbers, -1)


def _runs(indices: torch.Tensor) -> list[str]:
    """Sorted `indices` as ``[start, end)`` runs of consecutive numbers."""
    if not indices.numel():
        return []
    breaks = torch.nonzero(indices[1:] != indices[:-1] + 1).flatten() + 1
    bounds = [0, *breaks.tolist(), indices.numel()]
    return [
        f"[{int(indices[a])}, {int(indices[b - 1]) + 1})" for a, b in itertools.pairwise(bounds)
    ]


class ShardIndex:
    """Where a checkpoint keeps each parameter's optimizer state.

    Built from DCP's ``.metadata``: shard keys of a distributed optimizer (ranges of the
    `SavedNumbering`), and whole-tensor keys of the other optimizer (read as this rank's
    block of the whole tensor, like a model tensor).
    """

    def __init__(self, metadata: Metadata) -> None:
        """Indexes every optimizer key of `metadata`."""
        self.ranges: dict[tuple[str, str], list[SavedRange]] = {}
        self.wholes: dict[tuple[str, str], str] = {}
        self.scalars: dict[str, dict[str, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                self._add(key, tuple(entry.size))

    def _add(self, key: str, size: tuple[int, ...]) -> None:
        found = _SHARD_KEY.match(key)
        if found is not None:
            saved = SavedRange(key, int(found[3]), int(found[4]))
            self.ranges.setdefault((found[1], found[2]), []).append(saved)
        elif key.startswith(MODEL_PREFIX):
            self.shapes[key[len(MODEL_PREFIX) :]] = size
        elif key.startswith(FP32_PARAM_PREFIX):
            self.wholes[(key[len(FP32_PARAM_PREFIX) :], MAIN_PARAM_ENTRY)] = key
        elif key.startswith(OPTIMIZER_STATE_PREFIX):
            name, _, entry = key[len(OPTIMIZER_STATE_PREFIX) :].rpartition(".")
            if size:
                self.wholes[(name, entry)] = key
            else:
                self.scalars.setdefault(name, {})[entry] = key

    def state_entries(self, name: str) -> list[str]:
        """The optimizer state tensors saved for parameter `name` (main copy left out)."""
        entries = {entry for (saved, entry) in [*self.ranges, *self.wholes] if saved == name}
        return sorted(entries - {MAIN_PARAM_ENTRY})

    def pieces(
        self, shard: OwnedShard, entry: str, numbers: torch.Tensor, total: int
    ) -> list[SavedRange]:
        """Saved ranges that together hold the elements numbered `numbers` (-1: none needed).

        Args:
            shard: The range owned (named in errors).
            entry: The entry (main copy or a state tensor).
            numbers: The saved number of each owned element (`saved_numbers`).
            total: Elements of the whole saved parameter.

        Raises:
            ValueError: Some elements are in no saved range, or a saved range reaches past
                the parameter's size; the message names the key and the elements.
        """
        saved = sorted(self.ranges.get((shard.name, entry), []), key=lambda r: (r.start, -r.end))
        what = f"optimizer state {entry} of {shard.name}"
        too_long = [r for r in saved if r.end > total]
        if too_long:
            raise ValueError(
                f"{what}: saved key {too_long[0].key} reaches element {too_long[0].end}; the "
                f"parameter has {total} elements (the checkpoint holds another model)"
            )
        wanted = numbers >= 0
        starts = torch.tensor([r.start for r in saved] or [0], dtype=torch.int64)
        ends = torch.tensor([r.end for r in saved] or [0], dtype=torch.int64)
        slot = torch.searchsorted(starts, numbers, right=True) - 1
        held = (slot >= 0) & (numbers < ends[slot.clamp(min=0)])
        missing = torch.nonzero(wanted & ~held).flatten() + shard.start
        if missing.numel():
            raise ValueError(
                f"{what}: elements {listed(_runs(missing))} of this rank's range are in no "
                f"saved shard (saved ranges {[(r.start, r.end) for r in saved][:8]}); a rank's "
                "file is missing or the checkpoint holds another model"
            )
        return [saved[i] for i in torch.unique(slot[wanted]).tolist()]


def _gather(
    pieces: Sequence[SavedRange], numbers: torch.Tensor, buffers: dict[str, Any]
) -> torch.Tensor:
    """The elements numbered `numbers` from the loaded `pieces`, in fp32 (0 for -1)."""
    out = torch.zeros(numbers.numel(), dtype=torch.float32)
    for piece in pieces:
        flat = buffers[piece.key].reshape(-1)
        inside = (numbers >= piece.start) & (numbers < piece.end)
        out[inside] = flat[numbers[inside] - piece.start].float()
    return out


Source = str | list[SavedRange]
"""Where an owned range's entry is read from: a whole-tensor key (read as this rank's part),
or the saved ranges holding its elements."""


@dataclasses.dataclass(frozen=True)
class ShardLoad:
    """What one rank reads for its optimizer's ranges, and how each is put together."""

    owned: list[OwnedShard]
    """The ranges, in the optimizer's order."""
    entries: list[list[tuple[str, Source]]]
    """Per range: each entry (main copy, state tensors) and where it is read from."""
    scalars: list[dict[str, str]]
    """Per range: scalar state (Adam's step) and its key."""
    numberings: list[tuple[TensorSplit, SavedNumbering]]
    """Per range: this rank's part of the parameter and the checkpoint's numbering."""

    def whole_keys(self) -> dict[str, str]:
        """Each whole-tensor key read, with its parameter's global name."""
        return {
            source: owned.name
            for owned, entries in zip(self.owned, self.entries, strict=True)
            for _, source in entries
            if isinstance(source, str)
        }

    def buffers(self, metadata: Metadata) -> dict[str, torch.Tensor]:
        """An empty tensor for every saved range and scalar this rank reads."""
        keys = {
            piece.key
            for entries in self.entries
            for _, source in entries
            if not isinstance(source, str)
            for piece in source
        }
        keys.update(key for scalars in self.scalars for key in scalars.values())
        buffers = {}
        for key in sorted(keys):
            entry = metadata.state_dict_metadata[key]
            assert isinstance(entry, TensorStorageMetadata)
            buffers[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        return buffers

    def values(self, index: int, buffers: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Range `index`'s loaded entries: flat fp32 tensors, and its scalars (copies).

        `buffers` holds what DCP read, whole-tensor keys as this rank's part.
        """
        owned = self.owned[index]
        values = {}
        numbers = None
        for entry, source in self.entries[index]:
            if isinstance(source, str):
                part = buffers[source].reshape(-1)[owned.start : owned.end]
                values[entry] = part.to(torch.float32, copy=True)
                continue
            if numbers is None:
                numbers = saved_numbers(owned.start, owned.end, *self.numberings[index])
            values[entry] = _gather(source, numbers, buffers)
        values.update({e: buffers[k].clone() for e, k in self.scalars[index].items()})
        return values


def _split_of(
    shard: OwnedShard, splits: Mapping[str, TensorSplit], index: ShardIndex
) -> TensorSplit:
    """This rank's part of `shard`'s parameter; without a split, the whole parameter."""
    split = splits.get(shard.name)
    if split is not None:
        return split
    saved = index.shapes.get(shard.name)
    shape = saved if saved is not None and math.prod(saved) == shard.numel else (shard.numel,)
    return TensorSplit(-1, 0, 1, shape)


def plan_shard_load(
    owned: list[OwnedShard],
    index: ShardIndex,
    splits: Mapping[str, TensorSplit] | None = None,
    saved_tp_size: int = 1,
) -> ShardLoad:
    """Where each of the `owned` ranges' entries is read from.

    Args:
        owned: The ranges (this rank's parts of parameters, flattened).
        index: The checkpoint's optimizer keys.
        splits: This rank's part of each parameter by global name (whole when absent).
        saved_tp_size: The saving run's tensor-parallel size (`SavedNumbering`).

    Raises:
        ValueError: A range is not covered by the checkpoint (see `ShardIndex.pieces`).
    """
    entries, numberings = [], []
    for shard in owned:
        split = _split_of(shard, splits or {}, index)
        numbering = SavedNumbering(index.shapes.get(shard.name, split.full_shape), saved_tp_size)
        numberings.append((split, numbering))
        names = index.state_entries(shard.name)
        if shard.is_copy:
            names = [MAIN_PARAM_ENTRY, *names]
        sources: list[tuple[str, Source]] = []
        numbers = None
        for entry in names:
            whole = index.wholes.get((shard.name, entry))
            if whole is not None:
                sources.append((entry, whole))
                continue
            if numbers is None:
                numbers = saved_numbers(shard.start, shard.end, split, numbering)
            total = math.prod(numbering.shape)
            sources.append((entry, index.pieces(shard, entry, numbers, total)))
        entries.append(sources)
    scalars = [dict(index.scalars.get(shard.name, {})) for shard in owned]
    return ShardLoad(owned, entries, scalars, numberings)


def distributed_state(
    optimizer: DistributedOptimizer, load: ShardLoad, buffers: dict[str, Any], grad_scaler: Any
) -> dict[str, Any]:
    """The optimizer's own ``state_dict`` holding the loaded values, for ``load_state_dict``.

    The optimizer's current state dict is the template (its layout and hyperparameters);
    the per-range state, the fp32 main shards and the loss scaler are the checkpoint's (an
    fp32 parameter's main shard is the range of its saved ``model.<global name>``).
    """
    template = optimizer.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    params = []
    for index, owned in enumerate(load.owned):
        values = load.values(index, buffers)
        main = values.pop(MAIN_PARAM_ENTRY, None)
        if main is None:  # an fp32 parameter is its own main copy: the model's saved value
            whole = buffers[MODEL_PREFIX + owned.name].reshape(-1)
            main = whole[owned.start : owned.end].float().clone()
        params.append(main)
        if values:
            state[index] = values
    template["optimizer"]["state"] = state
    template["shard_params"] = params
    template["grad_scaler"] = grad_scaler
    return template
