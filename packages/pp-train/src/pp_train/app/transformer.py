"""The GPT's building blocks, split over a tensor-parallel group as Megatron-LM splits them.

Attention and MLP are each a column-parallel layer (the fused qkv projection, ``fc1``)
followed by a row-parallel one (``proj``, ``fc2``): every tensor-parallel rank holds whole
attention heads and a slice of the MLP's hidden layer, and one all-reduce per block sums the
partial outputs. The word embedding and the output layer split the vocabulary. With a
tensor-parallel group of None every layer is the plain local computation (pp-tensor runs no
collective then), so one code path serves every tensor-parallel size.

The fused qkv weight's rows are in Megatron's per-head order ``[head 0: q, k, v | head 1:
q, k, v | ...]`` (``head_size`` rows each), so the contiguous slice a column-parallel layer
keeps is the q, k and v of whole heads.

Under sequence parallelism the activations between layers are this rank's part of the
sequence, ``[seq / tp, batch, hidden]``: layer norms and dropout work on it, column-parallel
layers all-gather the sequence and row-parallel layers reduce-scatter it.

Under context parallelism every activation holds this rank's two chunks of the sequence
(``seq / cp`` tokens, `pp_tensor.split_for_context_parallel`'s load-balanced split) and the
core attention is `pp_tensor.context_parallel_attention` over the context-parallel group: the
only layer that sees other ranks' tokens. Packed documents (``document_ids``, the document of
each token of the whole sequence) restrict attention to each token's own document.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from pp_tensor import (
    ColumnParallelLinear,
    InitMethod,
    RNGStatesTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    context_parallel_attention,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    mark_sequence_parallel,
    scatter_to_sequence_parallel_region,
    tp_size,
    vocab_parallel_cross_entropy,
)
from pp_tensor.layers import split_parameter
from pp_train.app.gpt_config import GPTConfig
from pp_train.data import attention_mask_from_document_ids

__all__ = [
    "MLP",
    "CoreAttention",
    "Embedding",
    "OutputLayer",
    "SelfAttention",
    "TensorParallelism",
    "TransformerLayer",
    "WeightInit",
    "document_attention_mask",
    "dropout",
    "gathered_logits",
    "layer_norm",
    "parallel_logits",
    "parallel_loss",
]

WeightInit = Callable[[str], InitMethod]
"""The init method of a weight, given its name inside the module being built (e.g.
``"mlp.fc1.weight"``); it fills the full, unsplit weight."""

RNGContext = Callable[[], AbstractContextManager[Any]]


@dataclasses.dataclass(frozen=True)
class TensorParallelism:
    """How a chunk splits over its tensor-parallel group, and where its dropout draws.

    Shared by every module of a chunk, never copied: a deep copy of a chunk keeps the same
    process group and RNG tracker (a process group cannot be copied).
    """

    group: dist.ProcessGroup | None = None
    """The tensor-parallel group; None: no tensor parallelism."""

    sequence_parallel: bool = False
    """Whether activations between layers are split along the sequence (off at size 1)."""

    rng_tracker: RNGStatesTracker | None = None
    """The model-parallel RNG tracker; None: every dropout draws from torch's default
    generator."""

    cp_group: dist.ProcessGroup | None = None
    """The context-parallel group the sequence is split over; None: no context parallelism."""

    cp_comm_type: str = "p2p"
    """How context-parallel attention exchanges keys and values ("p2p" or "all_gather")."""

    def __post_init__(self) -> None:
        """Turns sequence parallelism off at size 1, where there is nothing to split."""
        if self.size == 1:
            object.__setattr__(self, "sequence_parallel", False)

    def __deepcopy__(self, memo: dict[int, Any]) -> TensorParallelism:
        """This object itself (see the class docstring)."""
        return self

    @property
    def size(self) -> int:
        """The tensor-parallel size."""
        return tp_size(self.group)

    @property
    def cp_size(self) -> int:
        """The context-parallel size (1 without a group)."""
        return 1 if self.cp_group is None else dist.get_world_size(self.cp_group)

    def attention_rng(self) -> AbstractContextManager[Any]:
        """Where attention dropout draws: the tracker's state when there is one.

        Attention probabilities are split by head, so each tensor-parallel rank draws its own
        numbers, as in Megatron.
        """
        return nullcontext() if self.rng_tracker is None else self.rng_tracker.fork()

    def hidden_rng(self) -> AbstractContextManager[Any]:
        """Where hidden dropout draws: the tracker's state under sequence parallelism only.

        Replicated activations draw the same numbers on every tensor-parallel rank (the
        default generator); split along the sequence, each rank draws its own.
        """
        if self.rng_tracker is None or not self.sequence_parallel:
            return nullcontext()
        return self.rng_tracker.fork()


def dropout(x: torch.Tensor, p: float, training: bool, rng: RNGContext) -> torch.Tensor:
    """Dropout with probability `p` drawn under the generator `rng` selects.

    No call at all for ``p == 0`` or outside training: the model without dropout stays
    exactly what it was and draws nothing.
    """
    if p == 0 or not training:
        return x
    with rng():
        return torch.nn.functional.dropout(x, p, training=True)


def layer_norm(config: GPTConfig, parallel: TensorParallelism) -> torch.nn.LayerNorm:
    """A LayerNorm over the hidden size (weight one, bias zero; no random draw).

    Under sequence parallelism each rank normalises its own part of the sequence, so the
    parameters' gradients are partial sums and are marked ``sequence_parallel``.
    """
    norm = torch.nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
    if parallel.sequence_parallel:
        mark_sequence_parallel(norm)
    return norm


class CoreAttention(torch.nn.Module):
    """Softmax, dropout and weighted sum of causal attention over this rank's heads.

    A module of its own, under Megatron's name ``core_attention``, so that selective recompute
    (`pp_train.recompute.checkpoint_core_attention`) finds it; it exposes `rng_tracker` so that
    recomputation replays the tracker's states too.
    """

    def __init__(self, config: GPTConfig, parallel: TensorParallelism) -> None:
        super().__init__()
        self.dropout = config.attention_dropout
        self.parallel = parallel

    @property
    def rng_tracker(self) -> RNGStatesTracker | None:
        """The tracker the attention dropout draws under (None: the default generator)."""
        return self.parallel.rng_tracker

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``[batch, heads, seq, head_size]`` queries, keys and values.

        Under context parallelism the sequence is this rank's part and the keys and values
        of the others travel (`pp_tensor.context_parallel_attention`; no attention dropout,
        which `GPTChunk` checks). `document_ids` (``[batch, whole seq]`` or ``[whole seq]``)
        keeps each token's attention inside its document.
        """
        parallel = self.parallel
        if parallel.cp_size > 1:
            return context_parallel_attention(
                query, key, value, group=parallel.cp_group, comm_type=parallel.cp_comm_type,
                document_ids=document_ids,
            )  # fmt: skip
        p = self.dropout if self.training else 0.0
        mask = None if document_ids is None else document_attention_mask(document_ids)
        with parallel.attention_rng() if p else nullcontext():
            out: torch.Tensor = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=p, is_causal=mask is None
            )
        return out


def document_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Which keys each query may see: causal, and inside its own document.

    Args:
        document_ids: The document of each token, ``[seq]`` or ``[batch, seq]`` integers.

    Returns:
        A boolean ``[batch or 1, 1, seq, seq]`` mask, True where a query attends to a key
        (scaled_dot_product_attention's convention; Megatron's ``attention_mask`` is its
        negation).
    """
    return ~attention_mask_from_document_ids(document_ids.reshape(-1, document_ids.shape[-1]))


class SelfAttention(torch.nn.Module):
    """Causal multi-head self-attention on ``[seq, batch, hidden]`` activations."""

    def __init__(self, config: GPTConfig, parallel: TensorParallelism, init: WeightInit) -> None:
        super().__init__()
        self.local_heads = config.num_attention_heads // parallel.size
        self.head_size = config.head_size
        hidden, group, sequence = config.hidden_size, parallel.group, parallel.sequence_parallel
        self.qkv = ColumnParallelLinear(
            hidden, 3 * hidden, tp_group=group, init_method=init("self_attention.qkv.weight"),
            sequence_parallel=sequence,
        )  # fmt: skip
        self.core_attention = CoreAttention(config, parallel)
        self.proj = RowParallelLinear(
            hidden, hidden, tp_group=group, init_method=init("self_attention.proj.weight"),
            input_is_parallel=True, sequence_parallel=sequence,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of `x` (``[seq, batch, hidden]``, or this rank's part of the sequence).

        `document_ids`: the document of each token of the whole sequence (packed documents).
        """
        qkv: torch.Tensor = self.qkv(x)[0]  # the whole sequence, this rank's heads
        seq, batch, _ = qkv.shape
        # Per-head rows: head h's query, key and value are adjacent blocks of head_size.
        heads = qkv.view(seq, batch, self.local_heads, 3, self.head_size).permute(3, 1, 2, 0, 4)
        # Contiguous copies: a view would keep the whole qkv output alive for backward (the
        # math attention saves the value as given), three times what the value needs.
        query, key, value = (part.contiguous() for part in heads.unbind(0))
        if document_ids is None:
            context: torch.Tensor = self.core_attention(query, key, value)
        else:
            context = self.core_attention(query, key, value, document_ids)
        context = context.permute(2, 0, 1, 3).reshape(seq, batch, -1)
        out: torch.Tensor = self.proj(context)[0]
        return out


class MLP(torch.nn.Module):
    """``fc2(gelu(fc1(x)))``, the hidden layer split over the tensor-parallel ranks.

    The GELU is exact (erf) by default, its tanh approximation with ``config.openai_gelu``;
    either is elementwise, so each rank applies it to its own slice of the hidden layer.
    """

    def __init__(self, config: GPTConfig, parallel: TensorParallelism, init: WeightInit) -> None:
        super().__init__()
        hidden, ffn = config.hidden_size, config.ffn_size
        group, sequence = parallel.group, parallel.sequence_parallel
        self.fc1 = ColumnParallelLinear(
            hidden, ffn, tp_group=group, init_method=init("mlp.fc1.weight"),
            sequence_parallel=sequence,
        )  # fmt: skip
        self.fc2 = RowParallelLinear(
            ffn, hidden, tp_group=group, init_method=init("mlp.fc2.weight"),
            input_is_parallel=True, sequence_parallel=sequence,
        )  # fmt: skip
        self.approximate = "tanh" if config.openai_gelu else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of `x`, shaped like `x`."""
        hidden = self.fc1(x)[0]
        activated = torch.nn.functional.gelu(hidden, approximate=self.approximate)
        out: torch.Tensor = self.fc2(activated)[0]
        return out


class TransformerLayer(torch.nn.Module):
    """Pre-LayerNorm block: ``x + attention(LN(x))``, then ``x + mlp(LN(x))``."""

    def __init__(self, config: GPTConfig, parallel: TensorParallelism, init: WeightInit) -> None:
        super().__init__()
        self.input_layernorm = layer_norm(config, parallel)
        self.self_attention = SelfAttention(config, parallel, init)
        self.post_attention_layernorm = layer_norm(config, parallel)
        self.mlp = MLP(config, parallel, init)
        self.hidden_dropout = config.hidden_dropout
        self.parallel = parallel

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output, shaped like `x` (`document_ids`: see `SelfAttention`)."""
        p, training, rng = self.hidden_dropout, self.training, self.parallel.hidden_rng
        attended = self.self_attention(self.input_layernorm(x), document_ids)
        x = x + dropout(attended, p, training, rng)
        mlp_out = self.mlp(self.post_attention_layernorm(x))
        out: torch.Tensor = x + dropout(mlp_out, p, training, rng)
        return out


class Embedding(torch.nn.Module):
    """Word (vocabulary-parallel) plus learned position embedding, then hidden dropout."""

    def __init__(self, config: GPTConfig, parallel: TensorParallelism, init: WeightInit) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_group=parallel.group,
            init_method=init("embedding.word_embeddings.weight"),
        )  # fmt: skip
        # Built on the meta device: torch's own initialisation would draw from the global
        # generator; the init method sets every value instead.
        positions = torch.nn.Embedding(config.seq_length, config.hidden_size, device="meta")
        self.position_embeddings = positions.to_empty(device="cpu")
        init("embedding.position_embeddings.weight")(self.position_embeddings.weight)
        self.hidden_dropout = config.hidden_dropout
        self.parallel = parallel

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ``[seq, batch, hidden]`` embeddings of ``[batch, seq]`` tokens.

        `position_ids` (``[batch, seq]`` or ``[seq]``): each token's position; ``0 .. seq -
        1`` when None. Under sequence parallelism, this rank's part of the sequence.
        """
        positions = (
            torch.arange(tokens.shape[1], device=tokens.device)
            if position_ids is None
            else position_ids.to(tokens.device)
        )
        embedded: torch.Tensor = self.word_embeddings(tokens) + self.position_embeddings(positions)
        # Megatron's activations are sequence-first; its embedding dropout is the hidden one.
        embedded = embedded.transpose(0, 1).contiguous()
        if self.parallel.sequence_parallel:
            # Scattered after the position embedding is added (Megatron's order with learned
            # positions): the replicated position embedding then gets its whole gradient on
            # every rank and needs no all-reduce.
            embedded = scatter_to_sequence_parallel_region(embedded, tp_group=self.parallel.group)
            # The shard may be a view of the whole sequence; a copy lets that be freed.
            embedded = embedded.clone()
        return dropout(embedded, self.hidden_dropout, self.training, self.parallel.hidden_rng)


class OutputLayer(torch.nn.Module):
    """The output layer's weight when it is not the word embedding itself.

    This rank's rows (its vocabulary slice) of the full ``[vocab, hidden]`` weight;
    `parallel_logits` applies it.
    """

    def __init__(
        self, config: GPTConfig, parallel: TensorParallelism, init_method: InitMethod
    ) -> None:
        super().__init__()
        self.weight = split_parameter(
            (config.vocab_size, config.hidden_size), init_method, partition_dim=0,
            tp_group=parallel.group, device=None, params_dtype=torch.float32,
        )  # fmt: skip


def parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, parallel: TensorParallelism
) -> torch.Tensor:
    """The logits of this rank's vocabulary slice, ``[seq, batch, vocab / tp]``.

    Args:
        hidden: The final layernorm's output (this rank's part of the sequence under sequence
            parallelism; the sequence is gathered first).
        weight: This rank's rows of the output layer (or of the tied word embedding).
        parallel: The chunk's tensor parallelism.
    """
    if parallel.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tp_group=parallel.group)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden, tp_group=parallel.group)
    return torch.nn.functional.linear(hidden, weight)


def parallel_loss(
    logits: torch.Tensor, labels: torch.Tensor, parallel: TensorParallelism
) -> torch.Tensor:
    """Per-token cross entropy, fp32 ``[batch, seq]``, the same on every tensor-parallel rank.

    Computed in fp32 even for a half model: the softmax over the vocabulary loses too much in
    bf16.
    """
    target = labels.t().contiguous()  # sequence-first, like the logits
    loss = vocab_parallel_cross_entropy(logits.float(), target, tp_group=parallel.group)
    return loss.t().contiguous()


def gathered_logits(logits: torch.Tensor, parallel: TensorParallelism) -> torch.Tensor:
    """The whole vocabulary's logits, ``[batch, seq, vocab]``, on every tensor-parallel rank."""
    whole = gather_from_tensor_model_parallel_region(logits, tp_group=parallel.group)
    return whole.transpose(0, 1).contiguous()
