"""pp-state: the process groups of pipeline-parallel training, as explicit objects.

- `rank_layout`: which global ranks form each group (pure, no torch), equal to Megatron's;
  `expert_rank_layout` the expert and optimizer-instance groups; `RankGenerator` Megatron's
  class of that name.
- `ParallelConfig` / `ParallelState`: every group of a job, built once and passed down.
- `Placement`: which virtual stage each (rank, chunk) holds (looped, V-shape, or a table).
- `PipelineLayerLayout`: how many transformer layers each virtual stage holds (Megatron's
  layout string "Ettt|tttL", first/last counts, or the even split), and which global layers,
  embedding or loss each (rank, chunk) holds; `LayerLayoutError` for a layout that cannot be.
- `collective`: wrap a collective so a dead or silent peer raises one `CollectiveError`
  naming the rank, the peer, the operation and the iteration; `set_collective_hook` tells a
  recorder of every wrapped collective, `set_peer_finder` names a lost member by evidence,
  `set_address_book` the member a backend's peer address belongs to.
- `RankCoordinates` / `coordinates_in` (`ParallelState.coordinates`): where a global rank sits
  ("rank 1 (pipeline stage 0 of [1, 3], dp 1, tp 0)"); `pp_state.liveness`: each rank's
  identity, heartbeat and endpoints in the store, and what they say of a rank (gone, stopped,
  silent, left).
- `is_int`, `is_real`, `check_int`, `check_at_least`, `divisors` (`pp_state.numbers`): the
  whole-number checks every layer shares (a bool is never a count).
- `pp_state.parallel_state`: Megatron's ``parallel_state`` names over a set-once default state.
- `StoreChannel` (`pp_state.store_channel`): keys every rank can set and wait for through
  torchrun's store, before and after the process groups exist.
- `ProcessGroupCollection` (`pp_state.process_groups_config`): Megatron's holder of process
  groups by short names (``tp``, ``pp``, ``dp_cp``, ...), from a `ParallelState` or the default.
- `param_is_not_tensor_parallel_duplicate` (`pp_state.params`): whether a parameter counts on
  this rank in a statistic over tensor parallelism (split, or this is the group's rank 0).

Importing the package and using `rank_layout`, `expert_rank_layout`, `RankGenerator`,
`Placement`, `PipelineLayerLayout` or the number checks does not import torch; the names
that need it load on first use.
"""

from __future__ import annotations

import importlib
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

from pp_state.coordinates import RankCoordinates, coordinates_in
from pp_state.errors import (
    AlreadyInitializedError,
    DistributedNotInitializedError,
    InvalidArgumentError,
    LayerLayoutError,
    ParallelSizeAssertionError,
    ParallelSizeError,
)
from pp_state.layer_layout import PipelineLayerLayout
from pp_state.layout import (
    ALL_KINDS,
    AXES,
    DEFAULT_ORDER,
    EXPERT_KINDS,
    KINDS,
    AnyGroupKind,
    ExpertGroupKind,
    GroupKind,
    RankGenerator,
    expert_rank_layout,
    find_group,
    group_containing,
    rank_layout,
)
from pp_state.numbers import check_at_least, check_int, divisors, is_int, is_real
from pp_state.placement import PLACEMENTS, Placement

if TYPE_CHECKING:
    from pp_state import parallel_state
    from pp_state.collectives import (
        CollectiveError,
        at_iteration,
        collective,
        collective_device,
        collective_error,
        is_lost_peer,
        set_address_book,
        set_collective_hook,
        set_peer_finder,
    )
    from pp_state.default import (
        NotInitializedError,
        get_default_state,
        has_default_state,
        reset_default_state,
        set_default_state,
    )
    from pp_state.parallel_state import (
        destroy_model_parallel,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from pp_state.params import param_is_not_tensor_parallel_duplicate
    from pp_state.process_groups_config import ProcessGroupCollection
    from pp_state.state import ParallelConfig, ParallelState, StateDestroyedError
    from pp_state.store_channel import StoreChannel, StoreGoneError, StoreTimeoutError

__version__ = _version("pp-state")

# Names backed by torch.distributed, and the module each comes from.
_LAZY = {
    "CollectiveError": "pp_state.collectives",
    "at_iteration": "pp_state.collectives",
    "collective": "pp_state.collectives",
    "collective_device": "pp_state.collectives",
    "collective_error": "pp_state.collectives",
    "set_address_book": "pp_state.collectives",
    "set_collective_hook": "pp_state.collectives",
    "set_peer_finder": "pp_state.collectives",
    "is_lost_peer": "pp_state.collectives",
    "NotInitializedError": "pp_state.default",
    "get_default_state": "pp_state.default",
    "has_default_state": "pp_state.default",
    "reset_default_state": "pp_state.default",
    "set_default_state": "pp_state.default",
    "destroy_model_parallel": "pp_state.parallel_state",
    "initialize_model_parallel": "pp_state.parallel_state",
    "model_parallel_is_initialized": "pp_state.parallel_state",
    "ParallelConfig": "pp_state.state",
    "ParallelState": "pp_state.state",
    "param_is_not_tensor_parallel_duplicate": "pp_state.params",
    "ProcessGroupCollection": "pp_state.process_groups_config",
    "StateDestroyedError": "pp_state.state",
    "StoreChannel": "pp_state.store_channel",
    "StoreGoneError": "pp_state.store_channel",
    "StoreTimeoutError": "pp_state.store_channel",
}


def __getattr__(name: str) -> Any:
    if name == "parallel_state":
        return importlib.import_module("pp_state.parallel_state")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pp_state' has no attribute {name!r}")


__all__ = [
    "ALL_KINDS",
    "AXES",
    "DEFAULT_ORDER",
    "EXPERT_KINDS",
    "KINDS",
    "PLACEMENTS",
    "AlreadyInitializedError",
    "AnyGroupKind",
    "CollectiveError",
    "DistributedNotInitializedError",
    "ExpertGroupKind",
    "GroupKind",
    "InvalidArgumentError",
    "LayerLayoutError",
    "NotInitializedError",
    "ParallelConfig",
    "ParallelSizeAssertionError",
    "ParallelSizeError",
    "ParallelState",
    "PipelineLayerLayout",
    "Placement",
    "ProcessGroupCollection",
    "RankCoordinates",
    "RankGenerator",
    "StateDestroyedError",
    "StoreChannel",
    "StoreGoneError",
    "StoreTimeoutError",
    "__version__",
    "at_iteration",
    "check_at_least",
    "check_int",
    "collective",
    "collective_device",
    "collective_error",
    "coordinates_in",
    "destroy_model_parallel",
    "divisors",
    "expert_rank_layout",
    "find_group",
    "get_default_state",
    "group_containing",
    "has_default_state",
    "initialize_model_parallel",
    "is_int",
    "is_lost_peer",
    "is_real",
    "model_parallel_is_initialized",
    "parallel_state",
    "param_is_not_tensor_parallel_duplicate",
    "rank_layout",
    "reset_default_state",
    "set_address_book",
    "set_collective_hook",
    "set_default_state",
    "set_peer_finder",
]
