"""Context-parallel attention as a Hugging Face transformers attention function.

transformers runs a model's attention through a function looked up by name (its attention
interface, ``AttentionInterface``; a model picks one with ``attn_implementation``). The
function `transformers_attention` returns takes what transformers hands such a function
(the module, queries, keys and values as [batch, heads, sequence, head dim], the mask, dropout
and scaling) and runs `pp_tensor.context_parallel_attention` over a context-parallel group,
so a transformers model whose every sequence is split across the group (each rank holding its
two chunks, `split_for_context_parallel`; position ids the global positions,
`context_parallel_positions`) attends over the whole sequence. Packed documents are given as
the keyword input ``document_ids`` (the whole sequence's), which transformers' decoder layers
pass on to the attention function.

`register_transformers_attention` registers it under a name. transformers is imported only
there: pp-tensor does not depend on it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pp_tensor.context_parallel import CP_COMM_TYPES, context_parallel_attention

__all__ = [
    "TRANSFORMERS_ATTENTION_NAME",
    "register_transformers_attention",
    "transformers_attention",
]

TRANSFORMERS_ATTENTION_NAME = "pp_context_parallel"
"""The name `register_transformers_attention` registers under by default."""

TransformersAttention = Callable[..., tuple[torch.Tensor, None]]


def transformers_attention(
    *, group: dist.ProcessGroup | None, comm_type: str = "p2p"
) -> TransformersAttention:
    """A transformers attention function running context-parallel causal attention.

    Args:
        group: The context-parallel group every sequence is split over; None for plain causal
            attention on one rank.
        comm_type: "p2p" (a ring) or "all_gather" (`CP_COMM_TYPES`).

    Returns:
        ``attention(module, query, key, value, attention_mask, *, dropout=0.0,
        scaling=None, is_causal=None, document_ids=None, **kwargs) -> (output, None)``: the output
        [batch, local sequence, heads, head dim] as transformers' attention functions return
        it; no attention weights.

    Raises:
        ValueError: An unknown `comm_type` (here); at a call, attention dropout, a dense
            attention mask (give ``document_ids`` for packed documents instead: a dense mask
            cannot be split with the sequence), or a non-causal call.
    """
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(
            f"unknown comm_type {comm_type!r}; use one of {', '.join(map(repr, CP_COMM_TYPES))}"
        )

    def attention(
        module: torch.nn.Module | None,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        document_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        _check_call(attention_mask, dropout, is_causal)
        out = context_parallel_attention(
            query, key, value, group=group, comm_type=comm_type, document_ids=document_ids,
            scale=scaling,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None

    return attention


def _check_call(
    attention_mask: torch.Tensor | None, dropout: float, is_causal: bool | None
) -> None:
    if dropout:
        raise ValueError(
            f"attention dropout {dropout}: context-parallel attention applies no dropout to "
            "the attention probabilities; set the model's attention_dropout to 0"
        )
    if attention_mask is not None:
        raise ValueError(
            f"a dense attention mask of shape {tuple(attention_mask.shape)} cannot follow a "
            "sequence split across context-parallel ranks; the attention is causal by itself, "
            "and packed documents are given as document_ids (the document of each token of "
            "the whole sequence)"
        )
    if is_causal is False:
        raise ValueError(
            "a non-causal attention call: context-parallel attention is causal (decoder "
            "self-attention); use another attention implementation for this module"
        )


def register_transformers_attention(
    name: str = TRANSFORMERS_ATTENTION_NAME,
    *,
    group: dist.ProcessGroup | None,
    comm_type: str = "p2p",
) -> str:
    """Registers `transformers_attention` with transformers under `name`.

    A model then uses it with ``attn_implementation=name`` (in its config, or
    ``model.set_attn_implementation(name)``). Registering again under the same name replaces
    the function (e.g. for another group).

    Args:
        name: The attention implementation's name.
        group: The context-parallel group.
        comm_type: "p2p" or "all_gather".

    Returns:
        `name`.

    Raises:
        ImportError: transformers is not installed (pp-tensor does not depend on it).
        ValueError: An unknown `comm_type`.
    """
    function = transformers_attention(group=group, comm_type=comm_type)
    try:
        interface = importlib.import_module("transformers").AttentionInterface
    except ImportError as error:
        raise ImportError(
            "register_transformers_attention needs the transformers library "
            "(pip install transformers); pp-tensor itself does not depend on it"
        ) from error
    interface.register(name, function)
    return name
