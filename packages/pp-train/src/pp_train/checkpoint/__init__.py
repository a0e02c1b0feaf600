"""Checkpoints in Megatron's ``torch`` and ``torch_dist`` formats.

`save_checkpoint` / `load_checkpoint` take the format (``ckpt_format=``); ``torch_dist``
checkpoints (torch.distributed.checkpoint directories with layout-independent keys) reshard
on load and can be written in the background (`AsyncCheckpointSaver`). Model chunks name
their state by global keys through `ShardedStateKeys`. ``python -m pp_train.checkpoint
convert`` converts between the formats without the model (`pp_train.checkpoint.convert`);
`pretrain` with ``--ckpt-convert-format`` / ``--ckpt-convert-save`` does it with the model.
`export_hf` / `import_hf` (``python -m pp_train.checkpoint export-hf`` / ``import-hf``) move
a Megatron-shaped GPT to and from the Hugging Face GPT-2 format, model-free; `read_weights`
reads any checkpoint's whole model tensors without the model.

The modules: `formats` (the API above), `torch_format` and `torch_dist` / `loading` (each
format), `optimizer_shards` and `distrib_optim` (the distributed optimizer's state in each),
`tensor_parallel` and `planners` (tensor-parallel parts placed in, and read from, the whole
tensors of a torch_dist checkpoint), `async_save`, `convert`, `model_free` and
`saved_weights` (files and whole tensors read without the model), `hf` and `hf_import` (the
Hugging Face GPT-2 converter) and `gpt2_layout` (the one table of GPT-2's names and layouts
they both read), `keys` (global keys), `tracker` (paths and the tracker file),
`rng` (random generator states), `agreement` (every rank's verdict before any acts), `files`
(atomic writes and renames), `load_request` and `save_request` (what a load or a save is
asked for, one record each that both formats take), `validation` and `errors`.
"""

from __future__ import annotations

from pp_train.checkpoint.async_save import AsyncCheckpointSaver
from pp_train.checkpoint.errors import CheckpointError, DamagedCheckpointError
from pp_train.checkpoint.formats import (
    CKPT_FORMATS,
    CkptFormat,
    check_save_directory,
    detect_format,
    load_checkpoint,
    save_checkpoint,
)
from pp_train.checkpoint.hf import ExportedHF, export_hf
from pp_train.checkpoint.hf_import import ImportedHF, TokenizerChoice, choose_tokenizer, import_hf
from pp_train.checkpoint.keys import ShardedStateKeys
from pp_train.checkpoint.load_request import DEFAULT_STRICT_ARGS, LoadedCheckpoint
from pp_train.checkpoint.rng import get_rng_state, set_rng_state
from pp_train.checkpoint.saved_weights import SavedWeights, read_weights
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
    "CKPT_FORMATS",
    "DEFAULT_STRICT_ARGS",
    "TRACKER_FILENAME",
    "AsyncCheckpointSaver",
    "CheckpointError",
    "CkptFormat",
    "DamagedCheckpointError",
    "ExportedHF",
    "ImportedHF",
    "LoadedCheckpoint",
    "SavedWeights",
    "ShardedStateKeys",
    "TokenizerChoice",
    "check_save_directory",
    "checkpoint_path",
    "choose_tokenizer",
    "detect_format",
    "export_hf",
    "get_rng_state",
    "import_hf",
    "load_checkpoint",
    "read_tracker",
    "read_weights",
    "save_checkpoint",
    "set_rng_state",
]
