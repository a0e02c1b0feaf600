"""A Hugging Face GPT-2 directory imported as a torch_dist checkpoint at iteration 0.

`import_hf` reads ``config.json`` and the safetensors weights (one ``model.safetensors`` or
the shards its ``model.safetensors.index.json`` names, one tensor at a time), refuses what the
Megatron-shaped GPT cannot compute the same way, renames and reorders the tensors
(`pp_train.checkpoint.hf.from_hf_tensors`) and writes a torch_dist checkpoint of one
tensor-parallel, one pipeline position. torch_dist reshards on load, so ``pp-train --load DIR
--finetune`` trains from it at any layout; `ImportedHF.flags` are the model flags that run
needs (the loader compares them with the saved args).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from pp_tensor import pad_vocab_size
from pp_train.checkpoint.convert import check_output, publish
from pp_train.checkpoint.errors import CheckpointError
from pp_train.checkpoint.gpt2_layout import hf_shapes, split_dims
from pp_train.checkpoint.hf import from_hf_tensors, safetensors_module
from pp_train.checkpoint.keys import MODEL_PREFIX
from pp_train.checkpoint.model_free import single_process
from pp_train.checkpoint.torch_dist import (
    CONVERSION_RECORD_VERSION,
    record_key,
    write_common,
    writer_and_planner,
)
from pp_train.checkpoint.tracker import CHECKPOINT_VERSION, iteration_directory

__all__ = ["GELU_FLAVOURS", "ImportedHF", "TokenizerChoice", "choose_tokenizer", "import_hf"]

GELU_FLAVOURS: Mapping[str, bool] = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
"""GPT-2's ``activation_function`` values the GPT computes: False for the exact GELU, True for
its tanh approximation (``--openai-gelu``)."""

_REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("scale_attn_by_inverse_layer_idx", False, "attention scores are not scaled by layer"),
    ("scale_attn_weights", True, "attention scores are always scaled by 1/sqrt(head size)"),
    ("add_cross_attention", False, "the GPT has no cross-attention"),
    ("reorder_and_upcast_attn", False, "attention is not reordered and upcast"),
)
"""GPT-2 settings the GPT has one way only: (field, the value it must have, why)."""

_LAYERNORM_EPSILON = 1e-5


@dataclasses.dataclass(frozen=True)
class TokenizerChoice:
    """The tokenizer the fine-tuning run will use, as pp-train's flags name it."""

    vocab_size: int
    """Its ids (the saved ``vocab_size`` the loading run must equal)."""
    flags: tuple[str, ...]
    """pp-train's flags that choose it."""
    args: Mapping[str, Any]
    """What a run with those flags saves in its args."""


def choose_tokenizer(
    directory: Path,
    model_vocab: int,
    *,
    tokenizer_type: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
) -> TokenizerChoice:
    """The fine-tuning run's tokenizer: the one named, else one that fits the model.

    Without a type: the directory's ``tokenizer.json`` (``HuggingFaceTokenizer``), else the
    command's bundled corpus (256 byte ids) for a model of up to 256 tokens, else the byte
    tokenizer with its end-of-document id (257), else ``NullTokenizer`` with
    ``--vocab-size`` one less than the model's tokens (the last is the end of a document).

    Raises:
        CheckpointError: The named tokenizer cannot be built (message names the flag).
    """
    from pp_train.data.tokenizer import build_tokenizer

    if tokenizer_type is None:
        if (directory / "tokenizer.json").is_file():
            tokenizer_type, tokenizer_model = "HuggingFaceTokenizer", str(directory)
        elif model_vocab <= 256:
            return TokenizerChoice(256, (), {"tokenizer_type": "ByteTokenizer", "data_path": None})
        elif model_vocab == 257:
            tokenizer_type = "ByteTokenizer"
        else:
            tokenizer_type, vocab_size = "NullTokenizer", model_vocab - 1
    try:
        tokens = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size).vocab_size
    except (ValueError, ImportError) as error:
        raise CheckpointError(f"--tokenizer-type {tokenizer_type}: {error}") from error
    flags = ["--tokenizer-type", tokenizer_type]
    if tokenizer_model is not None:
        flags += ["--tokenizer-model", tokenizer_model]
    if vocab_size is not None:
        flags += ["--vocab-size", str(vocab_size)]
    args = {"tokenizer_type": tokenizer_type, "tokenizer_model": tokenizer_model}
    return TokenizerChoice(tokens, tuple(flags), args)


@dataclasses.dataclass(frozen=True)
class ImportedHF:
    """What `import_hf` wrote."""

    directory: Path
    """The checkpoint directory (its tracker names iteration 0)."""
    args: dict[str, Any]
    """The args saved with it."""
    flags: tuple[str, ...]
    """The flags ``pp-train --load DIR --finetune`` needs: the format, the model's and the
    tokenizer's."""


def import_hf(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    tokenizer: TokenizerChoice | None = None,
    make_vocab_size_divisible_by: int = 128,
) -> ImportedHF:
    """Writes the GPT-2 of Hugging Face directory `source` as a torch_dist checkpoint.

    `target` gets Megatron's layout at iteration 0 (``iter_0000000``, the tracker), complete
    or absent: written under a temporary name and renamed. It holds the model alone (no
    optimizer, no RNG states), for ``--finetune``.

    Args:
        source: A directory with ``config.json`` and ``model.safetensors`` (or its index).
        target: The new (or empty) checkpoint directory.
        tokenizer: The fine-tuning run's tokenizer (`choose_tokenizer`); None: the one
            `choose_tokenizer` picks for `source`.
        make_vocab_size_divisible_by: The run's ``--make-vocab-size-divisible-by``: the
            saved vocabulary is padded to a multiple of it.

    Returns:
        The directory, the saved args and the flags the fine-tuning run needs.

    Raises:
        CheckpointError: ``config.json`` is missing or describes another model (the message
            names the field), the model has more tokens than the tokenizer, the weights are
            missing, or a tensor is missing or of another shape (the message names the file
            and the tensor). Nothing was written.
        ImportError: safetensors is not installed.
    """
    source, target = Path(source), Path(target)
    check_output(source, target)
    config = read_gpt2_config(source)
    if tokenizer is None:
        tokenizer = choose_tokenizer(source, config["vocab_size"])
    args = _saved_args(source, config, tokenizer, make_vocab_size_divisible_by)
    hf = read_gpt2_tensors(source, config)
    heads, rows = args["num_attention_heads"], args["padded_vocab_size"]
    tensors = from_hf_tensors(hf, num_attention_heads=heads, padded_vocab_size=rows)
    _write_iteration_zero(target, tensors, args)
    flags = ("--ckpt-format", "torch_dist", *model_flags(args), *tokenizer.flags)
    return ImportedHF(target, args, flags)


def model_flags(args: Mapping[str, Any]) -> list[str]:
    """pp-train's model flags of saved `args` (the strict ones the loader compares)."""
    flags = [
        "--num-layers", str(args["num_layers"]), "--hidden-size", str(args["hidden_size"]),
        "--num-attention-heads", str(args["num_attention_heads"]),
        "--seq-length", str(args["seq_length"]),
    ]  # fmt: skip
    if args.get("ffn_hidden_size") is not None:
        flags += ["--ffn-hidden-size", str(args["ffn_hidden_size"])]
    if args.get("untie_embeddings_and_output_weights"):
        flags.append("--untie-embeddings-and-output-weights")
    if args.get("openai_gelu"):
        flags.append("--openai-gelu")
    if args.get("make_vocab_size_divisible_by", 128) != 128:
        flags += ["--make-vocab-size-divisible-by", str(args["make_vocab_size_divisible_by"])]
    return flags


def read_gpt2_config(directory: Path) -> dict[str, Any]:
    """``config.json`` of a GPT-2 the Megatron-shaped GPT computes alike, sizes filled in.

    Raises:
        CheckpointError: The file is missing or unreadable, or a field refuses it (one line
            naming the field, its value and what the GPT needs).
    """
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} cannot be read: {error}; nothing was written") from error
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        found = config.get("model_type") if isinstance(config, dict) else None
        raise CheckpointError(
            f"{path}: model_type {found!r} is not 'gpt2'; only GPT-2's architecture imports "
            "(nothing was written)"
        )
    for field, wanted, why in _REFUSED:
        if config.get(field, wanted) != wanted:
            raise CheckpointError(
                f"{path}: {field}={config[field]!r} is not supported ({why}; needs {wanted!r}); "
                "nothing was written"
            )
    activation = config.get("activation_function", "gelu_new")
    if activation not in GELU_FLAVOURS:
        raise CheckpointError(
            f"{path}: activation_function {activation!r} is not supported; the GPT computes "
            f"{list(GELU_FLAVOURS)}; nothing was written"
        )
    epsilon = config.get("layer_norm_epsilon", _LAYERNORM_EPSILON)
    if epsilon != _LAYERNORM_EPSILON:
        raise CheckpointError(
            f"{path}: layer_norm_epsilon {epsilon!r} is not supported; the GPT's layer norms "
            f"use {_LAYERNORM_EPSILON} (no flag sets another); nothing was written"
        )
    sizes = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12}
    for field, default in sizes.items():
        value = config.setdefault(field, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{path}: {field} {value!r} is not a positive int")
    if config["n_embd"] % config["n_head"]:
        raise CheckpointError(
            f"{path}: n_embd {config['n_embd']} is not divisible by n_head {config['n_head']}"
        )
    config["activation_function"] = activation
    config.setdefault("tie_word_embeddings", True)
    return config


def _saved_args(
    directory: Path, config: dict[str, Any], tokenizer: TokenizerChoice, divisor: int
) -> dict[str, Any]:
    """The args a run of this model with `tokenizer` saves (the strict ones included)."""
    vocab, tokens = config["vocab_size"], tokenizer.vocab_size
    if vocab > tokens:
        raise CheckpointError(
            f"{directory / 'config.json'}: vocab_size {vocab} is larger than the {tokens} ids of "
            f"the tokenizer the flags give ({' '.join(tokenizer.flags) or 'the bundled corpus'}); "
            "name a tokenizer with as many ids (--tokenizer-type, --tokenizer-model, "
            "--vocab-size); nothing was written"
        )
    inner = config.get("n_inner")
    return {
        "num_layers": config["n_layer"],
        "hidden_size": config["n_embd"],
        "num_attention_heads": config["n_head"],
        "ffn_hidden_size": inner,
        "seq_length": config["n_positions"],
        "vocab_size": tokens,
        "padded_vocab_size": pad_vocab_size(tokens, divisor, 1),
        "make_vocab_size_divisible_by": divisor,
        "untie_embeddings_and_output_weights": not config["tie_word_embeddings"],
        "openai_gelu": GELU_FLAVOURS[config["activation_function"]],
        "layernorm_epsilon": config.get("layer_norm_epsilon", _LAYERNORM_EPSILON),
        "init_method_std": config.get("initializer_range", 0.02),
        "hidden_dropout": config.get("resid_pdrop", 0.1),
        "attention_dropout": config.get("attn_pdrop", 0.1),
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "data_parallel_size": 1,
        **tokenizer.args,
    }


def _expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every GPT-2 tensor the import reads, with its shape."""
    hidden = config["n_embd"]
    sizes = {
        "vocab": config["vocab_size"],
        "positions": config["n_positions"],
        "hidden": hidden,
        "qkv": 3 * hidden,
        "inner": config.get("n_inner") or 4 * hidden,
    }
    return hf_shapes(sizes, layers=config["n_layer"], tied=config["tie_word_embeddings"])


def _weight_files(directory: Path) -> dict[str, Path]:
    """Each tensor's safetensors file, by its name in the file."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index} cannot be read: {error!r}") from error
        return {str(name): directory / str(file) for name, file in weight_map.items()}
    if not single.is_file():
        raise CheckpointError(
            f"{directory} has no weights: neither model.safetensors nor "
            "model.safetensors.index.json (other weight formats are not read); nothing was "
            "written"
        )
    safe_open = safetensors_module().safe_open
    try:
        with safe_open(str(single), framework="pt") as opened:
            return dict.fromkeys(opened.keys(), single)
    except Exception as error:  # safetensors raises its own error types
        raise CheckpointError(f"{single} is damaged: {error}; nothing was written") from error


def read_gpt2_tensors(directory: Path, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The GPT-2 tensors, each read alone and checked against `config`'s shapes (as fp32).

    Names without ``transformer.`` (a ``GPT2Model`` file) are read as with it.

    Raises:
        CheckpointError: A tensor is missing, unreadable or of another shape (the message
            names the file and the tensor).
    """
    files = _weight_files(directory)
    stored = {name.removeprefix("transformer."): name for name in files}
    safe_open = safetensors_module().safe_open
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _expected_shapes(config).items():
        key = stored.get(name.removeprefix("transformer."))
        if key is None:
            raise CheckpointError(
                f"{directory}: tensor {name} (shape {shape}) is in none of the weight files "
                f"{sorted({p.name for p in files.values()})}; nothing was written"
            )
        try:
            with safe_open(str(files[key]), framework="pt") as opened:
                value = opened.get_tensor(key)
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(
                f"{files[key]}: tensor {key} cannot be read: {error}; nothing was written"
            ) from error
        if tuple(value.shape) != shape:
            raise CheckpointError(
                f"{files[key]}: tensor {key} has shape {tuple(value.shape)}, config.json "
                f"needs {shape}; nothing was written"
            )
        tensors[name] = value.float()
    return tensors


def _record(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The conversion record of the one position written (the converter reads it)."""
    layout = {
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": 1,
        "data_parallel_size": 1,
        "world_size": 1,
    }
    return {
        "version": CONVERSION_RECORD_VERSION, "layout": layout, "tensor_rank": 0,
        "pipeline_rank": 0, "ranks": [0], "chunks": [{name: name for name in tensors}],
        "optimizer_params": None, "param_groups": None, "fp32_copies": False,
        "distributed_optimizer": False, "tensor_parallel": split_dims(tensors),
    }  # fmt: skip


def _write_iteration_zero(
    target: Path, tensors: dict[str, torch.Tensor], args: dict[str, Any]
) -> None:
    record = _record(tensors)
    content: dict[str, Any] = {MODEL_PREFIX + name: value for name, value in tensors.items()}
    content[record_key(0, 0)] = record
    common = {
        "checkpoint_version": CHECKPOINT_VERSION, "ckpt_format": "torch_dist", "iteration": 0,
        "args": args, "consumed_train_samples": 0, "consumed_valid_samples": 0,
        "layout": record["layout"],
    }  # fmt: skip

    def write(staging: Path) -> None:
        directory = iteration_directory(staging, 0)
        directory.mkdir()
        write_common(directory, common)
        writer, planner = writer_and_planner(directory)
        with single_process():
            dcp.save(content, storage_writer=writer, planner=planner, no_dist=True)

    publish(target, write, iteration=0)
