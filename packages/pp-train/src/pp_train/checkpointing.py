"""Deprecated: the torch checkpoint format and its helpers now live in `pp_train.checkpoint`.

Every name here is the same object as in its new home; this module is removed in the next
minor version of pp-train. `save_checkpoint` / `load_checkpoint` here are the torch format
alone (`pp_train.checkpoint.torch_format.save_torch_checkpoint` / ``load_torch_checkpoint``);
`pp_train.checkpoint.save_checkpoint` / ``load_checkpoint`` take either format.
"""

from __future__ import annotations

import warnings

# Deprecated re-exports, removed in the next minor version; import from the modules named.
from pp_train.checkpoint.agreement import collective_device, gather_ints
from pp_train.checkpoint.errors import CheckpointError
from pp_train.checkpoint.load_request import DEFAULT_STRICT_ARGS, LoadedCheckpoint
from pp_train.checkpoint.rng import get_rng_state, set_rng_state
from pp_train.checkpoint.torch_format import load_torch_checkpoint as load_checkpoint
from pp_train.checkpoint.torch_format import save_torch_checkpoint as save_checkpoint
from pp_train.checkpoint.tracker import (
    CHECKPOINT_FILENAME,
    CHECKPOINT_VERSION,
    TRACKER_FILENAME,
    checkpoint_path,
    read_tracker,
)

__all__ = [
    "CHECKPOINT_FILENAME",
    "CHECKPOINT_VERSION",
    "DEFAULT_STRICT_ARGS",
    "TRACKER_FILENAME",
    "CheckpointError",
    "LoadedCheckpoint",
    "checkpoint_path",
    "collective_device",
    "gather_ints",
    "get_rng_state",
    "load_checkpoint",
    "read_tracker",
    "save_checkpoint",
    "set_rng_state",
]

warnings.warn(
    "pp_train.checkpointing is deprecated and removed in pp-train 0.9: import from "
    "pp_train.checkpoint (the torch format's own save and load are "
    "pp_train.checkpoint.torch_format.save_torch_checkpoint / load_torch_checkpoint)",
    DeprecationWarning,
    stacklevel=2,
)
