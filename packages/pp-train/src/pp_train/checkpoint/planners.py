"""DCP planners that write a rank's part of a tensor at its offsets and read any block back.

DCP's own planners treat a plain tensor as the whole of its key. A tensor-parallel rank holds
one part of a whole tensor, so `ChunkSavePlanner` writes the parts it is told about as chunks
of the whole (offsets and whole shape in ``.metadata``, as DCP records a DTensor's shards),
and `RegionLoadPlanner` reads a block of a saved tensor (a part at any tensor-parallel size, or
the rows a resized vocabulary keeps) from whichever chunks hold it. Plain blocks rather than
DTensors: a block need not be an even split of a device mesh (a trimmed vocabulary's is not),
and no device mesh has to be built over the tensor-parallel group for a save.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from pp_train.checkpoint.tensor_parallel import Box

__all__ = ["ChunkSavePlanner", "RegionLoadPlanner"]


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's save planner for flat keys, writing the tensors of `chunks` as parts of a whole.

    Args:
        chunks: Key to (its block in the whole tensor, the whole tensor's shape); the other
            keys are written whole, as DCP's planner writes them.
    """

    def __init__(self, chunks: Mapping[str, tuple[Box, tuple[int, ...]]] | None = None) -> None:
        # No flattening of sharded tensors either: it rebuilds nested objects and drops an
        # empty dict inside one (an RNG state whose tracker holds no state).
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = dict(chunks or {})

    def create_local_plan(self) -> SavePlan:
        """DCP's plan with each part's write item placed at its offsets in the whole."""
        plan = super().create_local_plan()
        items = [self._placed(item) for item in plan.items]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _placed(self, item: WriteItem) -> WriteItem:
        part = self.chunks.get(item.index.fqn)
        if part is None or item.tensor_data is None:
            return item
        box, whole = part
        offsets = torch.Size(box.offsets)
        return WriteItem(
            index=MetadataIndex(item.index.fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(box.sizes)),
                properties=item.tensor_data.properties,
                size=torch.Size(whole),
            ),
        )

    def lookup_object(self, index: MetadataIndex) -> Any:
        """The tensor of a part (DCP would look for a sharded tensor at its offsets)."""
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class RegionLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner for flat keys, reading the keys of `regions` as a block.

    Objects are unpickled with ``weights_only=True`` (no code runs); each key of `regions` is
    read as a block of the saved tensor.

    Args:
        regions: Key to the block of the saved (whole) tensor to read into the state dict's
            tensor of that key, whose shape is the block's; other keys are read whole.
    """

    def __init__(self, regions: Mapping[str, Box] | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.regions = dict(regions or {})

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan for the whole keys, and reads from every saved chunk a block overlaps."""
        assert self.metadata is not None
        whole = {k: v for k, v in self.state_dict.items() if k not in self.regions}
        plan = create_default_local_load_plan(whole, self.metadata, True)
        items = list(plan.items)
        for key, box in self.regions.items():
            entry = self.metadata.state_dict_metadata[key]
            assert isinstance(entry, TensorStorageMetadata)
            wanted = ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes))
            items += create_read_items_for_chunk_list(key, entry, [wanted])
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The block's tensor (DCP would look for a sharded tensor at its offsets)."""
        if index.fqn in self.regions:
            tensor = self.state_dict[index.fqn]
            assert isinstance(tensor, torch.Tensor)
            return tensor
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        """Unpickles an object with ``weights_only=True`` into the (flat) state dict."""
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
