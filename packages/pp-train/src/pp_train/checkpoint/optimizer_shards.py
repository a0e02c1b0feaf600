"""The distributed optimizer's state in a torch_dist checkpoint, reassembled at any layout.

pp-optim's `DistributedOptimizer` keeps, on each data-parallel rank, the fp32 main copy and
optimizer state of a flat range of some parameters (`DistributedOptimizer.shard_ranges`).
Each rank writes each range under the parameter's global name and the range itself:

- ``optimizer.shard.<global name>.<entry>.<start>-<end>``: elements ``[start, end)`` of the
  flattened parameter's ``entry``: ``fp32_param`` (the main copy of an fp16/bf16
  parameter; an fp32 parameter is its own main copy, saved as ``model.<global name>``) or
  an optimizer state tensor (Adam's ``exp_avg``, ``exp_avg_sq``, SGD's ``momentum_buffer``);
- ``optimizer.state.<global name>.step``: Adam's step count, the key the whole optimizer
  uses too.

DCP's ``.metadata`` lists every key, so a loader at another data-parallel or pipeline size
finds, for each range it owns, the saved ranges that overlap it and copies their common
elements (`ShardIndex`). A checkpoint of the whole optimizer (``optimizer.state.<global
name>.<entry>``, ``optimizer.fp32_param.<global name>``) is one range ``[0, numel)`` per
entry, so either optimizer loads the other's checkpoints.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pp_optim import DistributedOptimizer
from pp_train.checkpoint.keys import (
    FP32_PARAM_PREFIX,
    MODEL_PREFIX,
    OPTIMIZER_STATE_PREFIX,
    chunk_global_keys,
)
from pp_train.wrappers import unwrap_model

__all__ = [
    "MAIN_PARAM_ENTRY",
    "SHARD_PREFIX",
    "OwnedShard",
    "SavedRange",
    "ShardIndex",
    "ShardLoad",
    "distributed_state",
    "owned_shards",
    "plan_shard_load",
    "shard_key",
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
    model: Sequence[torch.nn.Module], optimizer: DistributedOptimizer
) -> dict[str, torch.Tensor]:
    """This rank's fp32 main shards and optimizer state under their global keys.

    A range held twice (the tied copies of a word embedding on one rank) is taken from its
    first holder; the copies have equal gradients and so equal state.
    """
    tensors: dict[str, torch.Tensor] = {}
    for owned in owned_shards(model, optimizer):
        if owned.is_copy:
            key = shard_key(owned.name, MAIN_PARAM_ENTRY, owned.start, owned.end)
            tensors.setdefault(key, owned.main_param.detach())
        for entry, value in optimizer.optimizer.state.get(owned.main_param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.dim() == 0:
                tensors.setdefault(f"{OPTIMIZER_STATE_PREFIX}{owned.name}.{entry}", value)
            else:
                key = shard_key(owned.name, entry, owned.start, owned.end)
                tensors.setdefault(key, value.detach())
    return tensors


@dataclasses.dataclass(frozen=True)
class SavedRange:
    """A saved tensor holding elements ``[start, end)`` of one parameter's entry."""

    key: str
    start: int
    end: int


class ShardIndex:
    """Where a checkpoint keeps each parameter's optimizer state, by element range.

    Built from DCP's ``.metadata``: shard keys of a distributed optimizer, whole-tensor keys
    of the other optimizer, both read as ranges of the flattened parameter.
    """

    def __init__(self, metadata: Metadata) -> None:
        """Indexes every optimizer key of `metadata`."""
        self.ranges: dict[tuple[str, str], list[SavedRange]] = {}
        self.scalars: dict[str, dict[str, str]] = {}
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                self._add(key, tuple(entry.size))

    def _add(self, key: str, size: tuple[int, ...]) -> None:
        numel = 1
        for dim in size:
            numel *= dim
        found = _SHARD_KEY.match(key)
        if found is not None:
            name, entry = found[1], found[2]
            saved = SavedRange(key, int(found[3]), int(found[4]))
        elif key.startswith(FP32_PARAM_PREFIX):
            name, entry = key[len(FP32_PARAM_PREFIX) :], MAIN_PARAM_ENTRY
            saved = SavedRange(key, 0, numel)
        elif key.startswith(OPTIMIZER_STATE_PREFIX):
            name, _, entry = key[len(OPTIMIZER_STATE_PREFIX) :].rpartition(".")
            if not size:
                self.scalars.setdefault(name, {})[entry] = key
                return
            saved = SavedRange(key, 0, numel)
        else:
            return
        self.ranges.setdefault((name, entry), []).append(saved)

    def state_entries(self, name: str) -> list[str]:
        """The optimizer state tensors saved for parameter `name` (main copy left out)."""
        return sorted(
            entry for (saved, entry) in self.ranges if saved == name and entry != MAIN_PARAM_ENTRY
        )

    def pieces(self, shard: OwnedShard, entry: str) -> list[SavedRange]:
        """Saved ranges that together cover `shard`'s range of its parameter's `entry`.

        Raises:
            ValueError: Some elements are in no saved range, or a saved range reaches past
                the parameter's size; the message names the key and the elements.
        """
        saved = sorted(self.ranges.get((shard.name, entry), []), key=lambda r: (r.start, -r.end))
        what = f"optimizer state {entry} of {shard.name}"
        too_long = [r for r in saved if r.end > shard.numel]
        if too_long:
            raise ValueError(
                f"{what}: saved key {too_long[0].key} reaches element {too_long[0].end}; the "
                f"parameter has {shard.numel} elements (the checkpoint holds another model)"
            )
        chosen, reached = [], shard.start
        for piece in saved:
            if reached >= shard.end:
                break
            if piece.start <= reached < piece.end:
                chosen.append(piece)
                reached = piece.end
        if reached < shard.end:
            raise ValueError(
                f"{what}: elements [{reached}, {shard.end}) are in no saved shard (saved "
                f"ranges {[(r.start, r.end) for r in saved]}); a rank's file is missing or the "
                "checkpoint holds another model"
            )
        return chosen


def _copy_range(
    pieces: Sequence[SavedRange], buffers: dict[str, Any], start: int, end: int
) -> torch.Tensor:
    """Elements ``[start, end)`` assembled from the loaded `pieces`, in fp32."""
    out = torch.empty(end - start, dtype=torch.float32)
    for piece in pieces:
        flat = buffers[piece.key].reshape(-1)
        low, high = max(start, piece.start), min(end, piece.end)
        out[low - start : high - start] = flat[low - piece.start : high - piece.start]
    return out


@dataclasses.dataclass(frozen=True)
class ShardLoad:
    """What one rank reads for its optimizer's ranges, and how each is put together."""

    owned: list[OwnedShard]
    """The ranges, in the optimizer's order."""
    entries: list[list[tuple[str, list[SavedRange]]]]
    """Per range: each entry (main copy, state tensors) and the saved ranges covering it."""
    scalars: list[dict[str, str]]
    """Per range: scalar state (Adam's step) and its key."""

    def buffers(self, metadata: Metadata) -> dict[str, torch.Tensor]:
        """An empty tensor for every saved key this rank reads."""
        keys = {piece.key for shard in self.entries for _, ps in shard for piece in ps}
        keys.update(key for scalars in self.scalars for key in scalars.values())
        buffers = {}
        for key in sorted(keys):
            entry = metadata.state_dict_metadata[key]
            assert isinstance(entry, TensorStorageMetadata)
            buffers[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        return buffers

    def values(self, index: int, buffers: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Range `index`'s loaded entries: flat fp32 tensors, and its scalars (copies)."""
        owned = self.owned[index]
        values = {
            entry: _copy_range(pieces, buffers, owned.start, owned.end)
            for entry, pieces in self.entries[index]
        }
        values.update({e: buffers[k].clone() for e, k in self.scalars[index].items()})
        return values


def plan_shard_load(owned: list[OwnedShard], index: ShardIndex) -> ShardLoad:
    """Which saved ranges fill each of the `owned` ranges.

    Raises:
        ValueError: A range is not covered by the checkpoint (see `ShardIndex.pieces`).
    """
    entries = []
    for shard in owned:
        names = index.state_entries(shard.name)
        if shard.is_copy:
            names = [MAIN_PARAM_ENTRY, *names]
        entries.append([(e, index.pieces(shard, e)) for e in names])
    scalars = [dict(index.scalars.get(shard.name, {})) for shard in owned]
    return ShardLoad(owned, entries, scalars)


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
