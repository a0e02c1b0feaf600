"""A Megatron-shaped GPT's checkpoint to and from the Hugging Face GPT-2 format.

GPT-2 and pp-train's bundled GPT are one architecture: learned positions, pre-LayerNorm blocks
with a fused qkv projection and a GELU MLP, a final LayerNorm, an output layer tied to the word
embedding or not. Only the tensors' names and layouts differ, as one table says for the export
and the import alike (`pp_train.checkpoint.gpt2_layout.GPT2_LAYOUT`): linear weights
transposed, the fused qkv's per-head rows regrouped, the padded vocabulary cut.

`export_hf` writes a directory ``transformers.GPT2LMHeadModel.from_pretrained`` loads
(``config.json``, ``model.safetensors``, the tokenizer's files or a note on the ids); the
import is `pp_train.checkpoint.import_hf`. Any model whose checkpoint uses these global
names (`pp_train.checkpoint.ShardedStateKeys`) and whose saved args record ``num_layers``,
``hidden_size`` and ``num_attention_heads`` exports the same way. safetensors is the
``hf`` extra: ``pip install "pp-train[hf]"``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from pp_train.checkpoint.convert import check_output, publish, source_iteration
from pp_train.checkpoint.errors import CheckpointError
from pp_train.checkpoint.gpt2_layout import (
    HF_NAMES,
    OUTPUT_LAYER,
    POSITION_EMBEDDING,
    WORD_EMBEDDING,
    from_hf_name,
    to_hf_name,
)
from pp_train.checkpoint.saved_weights import SavedWeights, read_weights

__all__ = [
    "EXPORT_DTYPES",
    "HF_NAMES",
    "ExportedHF",
    "export_hf",
    "from_hf_tensors",
    "safetensors_module",
    "to_hf_tensors",
]

EXPORT_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The ``--dtype`` choices of an export."""


def to_hf_tensors(
    tensors: Mapping[str, torch.Tensor],
    *,
    num_attention_heads: int,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The GPT-2 state dict of a Megatron-shaped GPT's whole tensors (global names).

    Args:
        tensors: Global name -> whole tensor (tensor-parallel parts joined). Consumed: each
            entry is removed once converted, so the model is held about once.
        num_attention_heads: The attention heads (the qkv rows' grouping).
        vocab_size: The tokenizer's vocabulary: the padded rows past it are dropped.
        dtype: The dtype written.

    Raises:
        CheckpointError: A tensor has no GPT-2 name, or the vocabulary is larger than the
            embedding's rows.
    """
    assert isinstance(tensors, dict)
    converted: dict[str, torch.Tensor] = {}
    for name in list(tensors):
        value = tensors.pop(name)
        found = to_hf_name(name)
        if found is None:
            raise CheckpointError(
                f"tensor {name} (shape {tuple(value.shape)}) has no GPT-2 counterpart; the "
                f"exporter takes the names of {[ours for ours, _ in HF_NAMES]}"
            )
        parameter, target = found
        if parameter.vocabulary:
            if value.shape[0] < vocab_size:
                raise CheckpointError(
                    f"tensor {name} has {value.shape[0]} rows, fewer than the vocabulary's "
                    f"{vocab_size} tokens"
                )
            value = value[:vocab_size]
        value = parameter.to_hf(value, num_attention_heads)
        converted[target] = value.to(dtype).contiguous().clone()
    return converted


def from_hf_tensors(
    tensors: Mapping[str, torch.Tensor], *, num_attention_heads: int, padded_vocab_size: int
) -> dict[str, torch.Tensor]:
    """`to_hf_tensors` undone: the global names, the vocabulary padded with zero rows.

    Args:
        tensors: GPT-2 name (``transformer.`` prefix included) -> tensor; consumed.
        num_attention_heads: The attention heads.
        padded_vocab_size: Rows of the word embedding (and untied output layer) written.

    Raises:
        CheckpointError: A tensor has no Megatron counterpart.
    """
    assert isinstance(tensors, dict)
    converted: dict[str, torch.Tensor] = {}
    for name in list(tensors):
        value = tensors.pop(name)
        found = from_hf_name(name)
        if found is None:
            raise CheckpointError(f"tensor {name} has no counterpart in the Megatron-shaped GPT")
        parameter, target = found
        value = parameter.from_hf(value, num_attention_heads)
        if parameter.vocabulary and value.shape[0] < padded_vocab_size:
            padding = value.new_zeros(padded_vocab_size - value.shape[0], *value.shape[1:])
            value = torch.cat([value, padding])
        converted[target] = value
    return converted


def safetensors_module() -> Any:
    """``safetensors.torch``, or an ImportError saying how to install it."""
    try:
        import safetensors.torch
    except ImportError as error:
        raise ImportError(
            "the Hugging Face converter needs the 'safetensors' library: "
            'pip install "pp-train[hf]"'
        ) from error
    return safetensors.torch


# ----------------------------------------------------------------------------- export
@dataclasses.dataclass(frozen=True)
class ExportedHF:
    """What `export_hf` wrote."""

    directory: Path
    """The Hugging Face directory."""
    config: dict[str, Any]
    """``config.json``'s content."""
    iteration: int
    """The checkpoint iteration exported."""
    main_copies: bool
    """Whether fp32 main copies (not the half-precision model tensors) were read."""
    tokenizer: str
    """``"copied"`` (the run's Hugging Face tokenizer files) or the note's file name."""


TOKENIZER_NOTE = "TOKENIZER.md"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def export_hf(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    iteration: int | None = None,
    dtype: torch.dtype = torch.float32,
    tokenizer_model: str | os.PathLike[str] | None = None,
) -> ExportedHF:
    """Writes iteration `iteration` of checkpoint `source` as a Hugging Face GPT-2 directory.

    Reads either format at any saved layout, without the model or a process group
    (`pp_train.checkpoint.saved_weights`); the fp32 main copies where the run kept them.
    `target` gets ``config.json``, ``model.safetensors`` and the run's Hugging Face tokenizer
    files (or, for the byte and null tokenizers, ``TOKENIZER.md`` saying how the ids map). It
    must not exist or be empty and is complete or absent (written under a temporary name and
    renamed).

    Args:
        source: The checkpoint directory (Megatron's ``--save``).
        target: The new Hugging Face directory.
        iteration: The iteration; the tracker's when None.
        dtype: The dtype of the tensors written (one of `EXPORT_DTYPES`).
        tokenizer_model: Where the run's Hugging Face tokenizer is now, when its saved
            ``tokenizer_model`` path no longer holds it.

    Returns:
        What was written.

    Raises:
        CheckpointError: No such checkpoint or iteration, a missing or damaged file, a tensor
            without a GPT-2 name, saved args without the model's sizes, or a missing
            tokenizer; the message names the file or tensor. Nothing was written.
        ImportError: safetensors is not installed.
    """
    source, target = Path(source), Path(target)
    if dtype not in EXPORT_DTYPES.values():
        raise CheckpointError(f"dtype must be one of {list(EXPORT_DTYPES)}, got {dtype}")
    check_output(source, target)
    iteration = source_iteration(source, iteration)
    saved = read_weights(source, iteration)
    save_file = safetensors_module().save_file
    config = hf_config(saved, dtype)
    tokenizer = _tokenizer_writer(saved.args, tokenizer_model, config)
    heads, vocab = config["n_head"], config["vocab_size"]
    tensors = to_hf_tensors(saved.tensors, num_attention_heads=heads, vocab_size=vocab, dtype=dtype)

    def write(staging: Path) -> None:
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        (staging / "config.json").write_text(text, encoding="utf-8")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer(staging)

    publish(target, write)
    hf_tokenizer = saved.args.get("tokenizer_type") == "HuggingFaceTokenizer"
    copied = "copied" if hf_tokenizer else TOKENIZER_NOTE
    return ExportedHF(target, config, iteration, bool(saved.main_copies), copied)


def _arg(args: Mapping[str, Any], key: str, where: Path, kind: type = int) -> Any:
    value = args.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CheckpointError(
            f"checkpoint {where}: its saved args have {key}={value!r}; the export needs the "
            f"model's {key} (a {kind.__name__}) to write config.json"
        )
    return value


def hf_config(saved: SavedWeights, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of `saved`: sizes from its tensors, the rest from its saved args.

    Raises:
        CheckpointError: A tensor the config needs is missing, or an arg it needs is not
            recorded.
    """
    args, tensors, where = saved.args, saved.tensors, saved.directory
    for name in (WORD_EMBEDDING, POSITION_EMBEDDING, "layers.0.mlp.fc1.weight"):
        if name not in tensors:
            raise CheckpointError(f"checkpoint {where} has no tensor {name}; nothing was written")
    rows, hidden = tensors[WORD_EMBEDDING].shape
    vocab = args.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) and 0 < vocab <= rows else rows
    layers = {int(found[1]) for n in tensors if (found := re.match(r"layers\.(\d+)\.", n))}
    if layers != set(range(_arg(args, "num_layers", where))):
        raise CheckpointError(
            f"checkpoint {where} holds layers {sorted(layers)[:8]}, its args say num_layers="
            f"{args.get('num_layers')}; nothing was written"
        )
    eos = _eos_id(args, vocab)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": int(tensors[POSITION_EMBEDDING].shape[0]),
        "n_embd": int(hidden),
        "n_layer": len(layers),
        "n_head": _arg(args, "num_attention_heads", where),
        "n_inner": int(tensors["layers.0.mlp.fc1.weight"].shape[0]),
        "activation_function": "gelu_new" if args.get("openai_gelu") else "gelu",
        "layer_norm_epsilon": float(args.get("layernorm_epsilon", 1e-5)),
        "initializer_range": float(args.get("init_method_std", 0.02)),
        "resid_pdrop": float(args.get("hidden_dropout", 0.0)),
        "embd_pdrop": float(args.get("hidden_dropout", 0.0)),
        "attn_pdrop": float(args.get("attention_dropout", 0.0)),
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": OUTPUT_LAYER not in tensors,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _eos_id(args: Mapping[str, Any], vocab: int) -> int | None:
    """The end-of-document id of the run's tokenizer; None when it has none (bundled corpus)."""
    kind = args.get("tokenizer_type")
    if kind == "HuggingFaceTokenizer":
        return None  # filled from the tokenizer's files (`_tokenizer_ids`)
    if kind in ("ByteTokenizer", "NullTokenizer") and args.get("data_path"):
        return vocab - 1  # the id after the data's own
    return None


def _tokenizer_writer(
    args: Mapping[str, Any],
    tokenizer_model: str | os.PathLike[str] | None,
    config: dict[str, Any],
) -> Callable[[Path], None]:
    """What writes the tokenizer's files (or the note on the ids); fills the config's ids."""
    if args.get("tokenizer_type") != "HuggingFaceTokenizer":
        note = _id_note(args, config)

        def write_note(staging: Path) -> None:
            (staging / TOKENIZER_NOTE).write_text(note, encoding="utf-8")

        return write_note
    given = tokenizer_model if tokenizer_model is not None else args.get("tokenizer_model")
    path = Path(str(given))
    directory = path if path.is_dir() else path.parent
    if given is None or not (path.is_file() or (directory / "tokenizer.json").is_file()):
        raise CheckpointError(
            f"the run's Hugging Face tokenizer {given!r} is not there (no tokenizer.json); "
            "pass its present place (--tokenizer-model PATH); nothing was written"
        )
    files = {name: directory / name for name in _TOKENIZER_FILES if (directory / name).is_file()}
    if path.is_file():
        files["tokenizer.json"] = path
    config["eos_token_id"], config["bos_token_id"] = _tokenizer_ids(files)

    def copy(staging: Path) -> None:
        for name, found in files.items():
            shutil.copyfile(found, staging / name)

    return copy


def _tokenizer_ids(files: Mapping[str, Path]) -> tuple[int | None, int | None]:
    """The eos and bos ids of a Hugging Face tokenizer, read from its files.

    eos is the run's end-of-document id (`pp_train.data.tokenizer.HuggingFaceTokenizer`);
    bos the ``bos_token`` of ``tokenizer_config.json`` when it names one, else eos (GPT-2's
    convention).
    """
    from pp_train.data.tokenizer import HuggingFaceTokenizer

    try:
        eos: int | None = HuggingFaceTokenizer(files["tokenizer.json"]).eod
    except ValueError:
        eos = None
    config_file = files.get("tokenizer_config.json")
    token = None
    if config_file is not None:
        token = json.loads(config_file.read_text(encoding="utf-8")).get("bos_token")
        token = token.get("content") if isinstance(token, dict) else token
    bos = _token_id(files["tokenizer.json"], token) if isinstance(token, str) else None
    return eos, eos if bos is None else bos


def _token_id(tokenizer_file: Path, token: str) -> int | None:
    """The id of `token` in a ``tokenizer.json`` (added tokens first, then the vocabulary)."""
    content = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    for added in content.get("added_tokens") or []:
        if added.get("content") == token:
            return int(added["id"])
    vocab = (content.get("model") or {}).get("vocab")
    found = vocab.get(token) if isinstance(vocab, dict) else None
    return int(found) if isinstance(found, int) else None


def _id_note(args: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    """``TOKENIZER.md``: how the ids of the byte or null tokenizer map to text."""
    vocab, eos = config["vocab_size"], config["eos_token_id"]
    kind = args.get("tokenizer_type", "unknown")
    lines = [
        "# Token ids",
        "",
        f"This model was trained by pp-train with the {kind} tokenizer ({vocab} ids); it has",
        "no Hugging Face tokenizer files.",
        "",
    ]
    if kind == "ByteTokenizer":
        lines += [
            "Ids 0 .. 255 are the bytes of the UTF-8 text: `ids = list(text.encode('utf-8'))`,",
            "`text = bytes(i for i in ids if i < 256).decode('utf-8', errors='replace')`.",
        ]
    else:
        lines += ["Ids are the data's own (pp-train's NullTokenizer: whitespace-separated ids)."]
    if eos is not None:
        lines += ["", f"Id {eos} is the end of a document (bos_token_id and eos_token_id)."]
    return "\n".join(lines) + "\n"
