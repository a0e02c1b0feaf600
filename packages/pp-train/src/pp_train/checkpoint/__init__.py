"""Checkpoints in Megatron's ``torch`` and ``torch_dist`` formats.

`save_checkpoint` / `load_checkpoint` take the format (``ckpt_format=``); ``torch_dist``
checkpoints (torch.distributed.checkpoint directories with layout-independent keys) reshard
on load and can be written in the background (`AsyncCheckpointSaver`). Model chunks name
their state by global keys through `ShardedStateKeys`. ``python -m pp_train.checkpoint
convert`` converts between the formats without the model (`pp_train.checkpoint.convert`);
`pretrain` with ``--ckpt-convert-format`` / ``--ckpt-convert-save`` does it with the model.
"""

from __future__ import annotations

from pp_train.checkpoint.async_save import AsyncCheckpointSaver
from pp_train.checkpoint.formats import (
    CKPT_FORMATS,
    CkptFormat,
    check_save_directory,
    detect_format,
    load_checkpoint,
    save_checkpoint,
)
from pp_train.checkpoint.keys import ShardedStateKeys

__all__ = [
    "CKPT_FORMATS",
    "AsyncCheckpointSaver",
    "CkptFormat",
    "ShardedStateKeys",
    "check_save_directory",
    "detect_format",
    "load_checkpoint",
    "save_checkpoint",
]
