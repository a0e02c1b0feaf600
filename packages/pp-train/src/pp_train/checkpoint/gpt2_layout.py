"""GPT-2's layout of a Megatron-shaped GPT: one table that the export and the import both read.

GPT-2 and pp-train's bundled GPT are one architecture; only the tensors' names and layouts
differ, and `GPT2_LAYOUT` says how, one `GPT2Parameter` per kind of parameter:

- Megatron's linear weights are ``[out, in]``; GPT-2's ``Conv1D`` weights are ``[in, out]``
  (`GPT2Parameter.transposed`);
- Megatron's fused qkv rows go head by head (``[head 0: q, k, v | head 1: q, k, v | ...]``, so
  a tensor-parallel rank's rows are whole heads); GPT-2's columns are all queries, then all
  keys, then all values (`GPT2Parameter.qkv`);
- Megatron pads the vocabulary (``--make-vocab-size-divisible-by`` x the tensor-parallel
  size); GPT-2 has one row per token (`GPT2Parameter.vocabulary`).

`pp_train.checkpoint.hf` (export) and `pp_train.checkpoint.hf_import` (import) convert with
it; the import also takes the shapes it checks and the tensor-parallel split dimensions it
records from it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping

import torch

__all__ = [
    "GPT2_LAYOUT",
    "HF_NAMES",
    "OUTPUT_LAYER",
    "POSITION_EMBEDDING",
    "WORD_EMBEDDING",
    "GPT2Parameter",
    "from_hf_name",
    "gpt2_names",
    "hf_shapes",
    "split_dims",
    "to_hf_name",
]

WORD_EMBEDDING = "embedding.word_embeddings.weight"
POSITION_EMBEDDING = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Parameter:
    """One kind of parameter of the GPT and its GPT-2 counterpart."""

    ours: str
    """The global name in the Megatron-shaped GPT (``{i}``: the layer's global index)."""

    hf: str
    """The name in a Hugging Face ``GPT2LMHeadModel`` (``{i}``: the same layer)."""

    hf_shape: tuple[str, ...]
    """GPT-2's shape in sizes of `hf_shapes`: ``vocab``, ``positions``, ``hidden``, ``qkv``
    (three times ``hidden``) and ``inner`` (the MLP's hidden size)."""

    transposed: bool = False
    """A linear weight: ``[out, in]`` here, ``[in, out]`` in GPT-2 (``Conv1D``)."""

    qkv: bool = False
    """The fused qkv projection: per-head ``q, k, v`` rows here, GPT-2's all-q, all-k, all-v."""

    vocabulary: bool = False
    """Rows are the vocabulary: padded here, one per token in GPT-2."""

    split_dim: int | None = None
    """The dimension the GPT's tensor-parallel layers split it along; None: not split."""

    @property
    def layered(self) -> bool:
        """Whether there is one per transformer layer (the names hold ``{i}``)."""
        return "{i}" in self.ours

    def to_hf(self, value: torch.Tensor, heads: int) -> torch.Tensor:
        """`value` in GPT-2's layout: qkv rows regrouped, a linear weight transposed.

        The vocabulary's padding is the caller's (it needs the vocabulary's size).
        """
        if self.qkv:
            grouped = value.reshape(heads, 3, value.shape[0] // (3 * heads), *value.shape[1:])
            value = grouped.transpose(0, 1).reshape(value.shape)
        return (value.t() if self.transposed else value).contiguous()

    def from_hf(self, value: torch.Tensor, heads: int) -> torch.Tensor:
        """`to_hf` undone."""
        if self.transposed:
            value = value.t()
        if self.qkv:
            grouped = value.reshape(3, heads, value.shape[0] // (3 * heads), *value.shape[1:])
            value = grouped.transpose(0, 1).reshape(value.shape)
        return value.contiguous()


# The vocabulary is split by rows; the qkv and MLP-in layers are column-parallel (their rows
# and biases split), the attention and MLP-out projections row-parallel (their columns split,
# biases whole); split dims count in pp's [out, in] layout, not GPT-2's.
GPT2_LAYOUT: tuple[GPT2Parameter, ...] = (
    GPT2Parameter(ours=WORD_EMBEDDING, hf="transformer.wte.weight", hf_shape=("vocab", "hidden"),
                  vocabulary=True, split_dim=0),
    GPT2Parameter(ours=POSITION_EMBEDDING, hf="transformer.wpe.weight",
                  hf_shape=("positions", "hidden")),
    GPT2Parameter(ours="layers.{i}.input_layernorm.weight", hf="transformer.h.{i}.ln_1.weight",
                  hf_shape=("hidden",)),
    GPT2Parameter(ours="layers.{i}.input_layernorm.bias", hf="transformer.h.{i}.ln_1.bias",
                  hf_shape=("hidden",)),
    GPT2Parameter(ours="layers.{i}.self_attention.qkv.weight",
                  hf="transformer.h.{i}.attn.c_attn.weight", hf_shape=("hidden", "qkv"),
                  transposed=True, qkv=True, split_dim=0),
    GPT2Parameter(ours="layers.{i}.self_attention.qkv.bias",
                  hf="transformer.h.{i}.attn.c_attn.bias", hf_shape=("qkv",),
                  qkv=True, split_dim=0),
    GPT2Parameter(ours="layers.{i}.self_attention.proj.weight",
                  hf="transformer.h.{i}.attn.c_proj.weight", hf_shape=("hidden", "hidden"),
                  transposed=True, split_dim=1),
    GPT2Parameter(ours="layers.{i}.self_attention.proj.bias",
                  hf="transformer.h.{i}.attn.c_proj.bias", hf_shape=("hidden",)),
    GPT2Parameter(ours="layers.{i}.post_attention_layernorm.weight",
                  hf="transformer.h.{i}.ln_2.weight", hf_shape=("hidden",)),
    GPT2Parameter(ours="layers.{i}.post_attention_layernorm.bias", hf="transformer.h.{i}.ln_2.bias",
                  hf_shape=("hidden",)),
    GPT2Parameter(ours="layers.{i}.mlp.fc1.weight", hf="transformer.h.{i}.mlp.c_fc.weight",
                  hf_shape=("hidden", "inner"), transposed=True, split_dim=0),
    GPT2Parameter(ours="layers.{i}.mlp.fc1.bias", hf="transformer.h.{i}.mlp.c_fc.bias",
                  hf_shape=("inner",), split_dim=0),
    GPT2Parameter(ours="layers.{i}.mlp.fc2.weight", hf="transformer.h.{i}.mlp.c_proj.weight",
                  hf_shape=("inner", "hidden"), transposed=True, split_dim=1),
    GPT2Parameter(ours="layers.{i}.mlp.fc2.bias", hf="transformer.h.{i}.mlp.c_proj.bias",
                  hf_shape=("hidden",)),
    GPT2Parameter(ours="final_layernorm.weight", hf="transformer.ln_f.weight",
                  hf_shape=("hidden",)),
    GPT2Parameter(ours="final_layernorm.bias", hf="transformer.ln_f.bias",
                  hf_shape=("hidden",)),
    GPT2Parameter(ours=OUTPUT_LAYER, hf="lm_head.weight", hf_shape=("vocab", "hidden"),
                  vocabulary=True, split_dim=0),
)  # fmt: skip
"""Every kind of parameter of the GPT, in the model's order; the output layer only when it
is not tied to the word embedding."""

HF_NAMES: tuple[tuple[str, str], ...] = tuple((p.ours, p.hf) for p in GPT2_LAYOUT)
"""Each global name of the Megatron-shaped GPT with its GPT-2 name (``{i}``: the layer)."""


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


_BY_OURS = [(_pattern(p.ours), p.hf, p) for p in GPT2_LAYOUT]
_BY_HF = [(_pattern(p.hf), p.ours, p) for p in GPT2_LAYOUT]


def _renamed(
    name: str, table: list[tuple[re.Pattern[str], str, GPT2Parameter]]
) -> tuple[GPT2Parameter, str] | None:
    for pattern, template, parameter in table:
        found = pattern.match(name)
        if found is not None:
            renamed = template.replace("{i}", found.group(1)) if found.groups() else template
            return parameter, renamed
    return None


def to_hf_name(name: str) -> tuple[GPT2Parameter, str] | None:
    """The parameter kind of global name `name` and its GPT-2 name; None when it has none."""
    return _renamed(name, _BY_OURS)


def from_hf_name(name: str) -> tuple[GPT2Parameter, str] | None:
    """The parameter kind of GPT-2 name `name` and its global name; None when it has none."""
    return _renamed(name, _BY_HF)


def gpt2_names(*, layers: int, tied: bool) -> Iterator[tuple[GPT2Parameter, str, str]]:
    """Every parameter of a GPT of `layers` layers: its kind, global name and GPT-2 name.

    In the model's order: the embeddings, each layer's parameters, then the final layer norm
    and (when not `tied`) the output layer.
    """
    in_layer = [p for p in GPT2_LAYOUT if p.layered]
    for parameter in GPT2_LAYOUT:
        if parameter.ours == OUTPUT_LAYER and tied:
            continue
        if not parameter.layered:
            yield parameter, parameter.ours, parameter.hf
        elif parameter is in_layer[0]:
            for i in range(layers):
                for each in in_layer:
                    yield each, each.ours.format(i=i), each.hf.format(i=i)


def hf_shapes(sizes: Mapping[str, int], *, layers: int, tied: bool) -> dict[str, tuple[int, ...]]:
    """Each GPT-2 tensor of such a GPT with its shape (`gpt2_names` order).

    Args:
        sizes: ``vocab``, ``positions``, ``hidden``, ``qkv`` and ``inner``.
        layers: The transformer layers.
        tied: The output layer is the word embedding (no ``lm_head.weight``).
    """
    return {
        hf: tuple(sizes[size] for size in parameter.hf_shape)
        for parameter, _, hf in gpt2_names(layers=layers, tied=tied)
    }


def split_dims(names: Iterable[str]) -> dict[str, int]:
    """The dimension the GPT's tensor-parallel layers split each of `names` (global) along.

    Names of tensors every rank holds whole, and names outside the table, are left out.
    """
    dims = {}
    for name in names:
        found = to_hf_name(name)
        if found is not None and found[0].split_dim is not None:
            dims[name] = found[0].split_dim
    return dims
