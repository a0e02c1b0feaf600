"""A small GPT that splits into pipeline chunks the way Megatron-LM's GPT model does.

Each `GPTChunk` holds one virtual pipeline stage: the embeddings when it is the first
(``pre_process``), some consecutive transformer layers, and the final layernorm and output
layer when it is the last (``post_process``). Activations between chunks are shaped
``[seq, batch, hidden]``.

Every parameter is initialised from a generator seeded by the run's seed and the parameter's
global name, so the chunks of any pipeline layout together hold exactly the values of the
single chunk of an unpipelined run.

Dropout sits where Megatron puts it: on the attention probabilities (``attention_dropout``)
and on the embedding's, the attention's and the MLP's output (before each residual add;
``hidden_dropout``). It draws from torch's global generator, so pipeline ranks draw
differently (Megatron without the tensor-parallel RNG tracker). ``recompute`` checkpoints
layers or the core attention (`pp_train.recompute`); parameter names and ``state_dict`` keys
are the same either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence

import torch

from pp_state import PipelineLayerLayout, Placement
from pp_state.numbers import divisors, is_int, is_real
from pp_train.recompute import RecomputeConfig, checkpoint_core_attention, run_layers

__all__ = ["GPTChunk", "GPTConfig", "chunk_layers", "init_parameter_"]

_WORD_EMBEDDING_NAME = "embedding.word_embeddings.weight"


def _joined(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def _check_positive_int(name: str, value: object) -> None:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    assert isinstance(value, int)
    if value < 1:
        raise ValueError(f"{name} must be a positive int (1 or more), got {value}")


def _check_probability(name: str, value: object) -> None:
    if not is_real(value):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    assert isinstance(value, (int, float))
    if not 0 <= value < 1:
        raise ValueError(f"{name} must be a probability in [0, 1), got {value}")


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    # No call at all for p == 0: the model without dropout stays exactly what it was.
    if p == 0 or not training:
        return x
    return torch.nn.functional.dropout(x, p, training=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and initialisation of the GPT model (Megatron's transformer config, reduced)."""

    num_layers: int
    """Transformer layers in the whole model (all pipeline stages together)."""

    hidden_size: int
    """Width of the residual stream; must be divisible by ``num_attention_heads``."""

    num_attention_heads: int
    """Attention heads per layer; each has ``hidden_size // num_attention_heads`` channels."""

    seq_length: int
    """Longest sequence the model takes (rows of the learned position embedding)."""

    vocab_size: int = 256
    """Rows of the word embedding and of the output layer (256: one per byte)."""

    ffn_hidden_size: int | None = None
    """Width of the MLP's hidden layer; None means ``4 * hidden_size``."""

    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation of weights; the output projections
    of attention and MLP use it divided by ``sqrt(2 * num_layers)``."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm."""

    hidden_dropout: float = 0.0
    """Dropout probability on the embedding's output and on the attention's and the MLP's
    output before each residual add (Megatron's ``--hidden-dropout``; 0: none)."""

    attention_dropout: float = 0.0
    """Dropout probability on the attention probabilities (Megatron's ``--attention-dropout``;
    0: none)."""

    recompute: RecomputeConfig | None = None
    """Which activations backward recomputes instead of keeping; None: none."""

    def __post_init__(self) -> None:
        """Checks that the sizes are positive ints and the heads split the hidden size.

        Raises:
            TypeError: A size is not an int (bools are refused), a float field is not a real
                number, or `recompute` is not a `RecomputeConfig`.
            ValueError: A size is below 1, ``hidden_size`` is not divisible by
                ``num_attention_heads``, a float field is not positive and finite, or a
                dropout probability is outside [0, 1).
        """
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            _check_positive_int(name, getattr(self, name))
        _check_positive_int("vocab_size", self.vocab_size)
        if self.ffn_hidden_size is not None:
            _check_positive_int("ffn_hidden_size", self.ffn_hidden_size)
        for name in ("init_method_std", "layernorm_epsilon"):
            value = getattr(self, name)
            if not is_real(value):
                raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        for name in ("hidden_dropout", "attention_dropout"):
            _check_probability(name, getattr(self, name))
        if self.recompute is not None and not isinstance(self.recompute, RecomputeConfig):
            raise TypeError(
                f"recompute must be a RecomputeConfig or None, got {type(self.recompute).__name__}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden size {self.hidden_size} is not divisible by "
                f"{self.num_attention_heads} attention heads; use one of "
                f"{_joined(divisors(self.hidden_size))}"
            )

    @property
    def ffn_size(self) -> int:
        """Width of the MLP's hidden layer, with None resolved to ``4 * hidden_size``."""
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size

    @property
    def head_size(self) -> int:
        """Channels of one attention head."""
        return self.hidden_size // self.num_attention_heads


def chunk_layers(
    num_layers: int,
    pp_size: int,
    vp_size: int,
    pp_rank: int,
    vp_stage: int,
    *,
    placement: Placement | None = None,
    layer_counts: Sequence[int] | None = None,
) -> range:
    """Global indices of the layers that one model chunk holds.

    Without `layer_counts` the layers split evenly over the ``pp_size * vp_size`` virtual
    stages, in order: stage ``s`` holds layers ``[s * per, (s + 1) * per)`` with ``per =
    num_layers // (pp_size * vp_size)``; with them stage ``s`` holds the next
    ``layer_counts[s]`` layers. Which stage a chunk holds is the placement's answer: with
    Megatron's looped placement (the default) chunk ``c`` of rank ``r`` holds stage
    ``c * pp_size + r``; with the V placement rank ``r`` holds stages ``r`` and
    ``2 * pp_size - 1 - r``.

    Args:
        num_layers: Transformer layers of the whole model.
        pp_size: Pipeline stages.
        vp_size: Model chunks per pipeline rank (1 without interleaving).
        pp_rank: This rank's pipeline stage, ``0 .. pp_size - 1``.
        vp_stage: The chunk on this rank, ``0 .. vp_size - 1``.
        placement: Which virtual stage each (rank, chunk) holds; looped when None.
        layer_counts: The layers of each virtual stage for an uneven split (see
            `pp_state.PipelineLayerLayout`); they must add up to `num_layers`. None: the even split.

    Returns:
        The global layer indices of the chunk (empty for a stage of the embedding or the
        output layer alone).

    Raises:
        TypeError: An argument is not an int.
        ValueError: A size is below 1, the layers do not split evenly over
            ``pp_size * vp_size`` virtual stages (without `layer_counts`), the counts do not
            fit, the rank or stage is out of range, or the placement is for another pipeline
            size.
    """
    where = _checked_placement(num_layers, pp_size, vp_size, pp_rank, vp_stage, placement=placement)
    if layer_counts is not None:
        layout = PipelineLayerLayout.from_counts(layer_counts, pp_size, placement=where)
        if layout.num_layers != num_layers:
            raise ValueError(
                f"layer counts {layout.counts} add up to {layout.num_layers} layers, but the "
                f"model has {num_layers}"
            )
        return layout.layers(pp_rank, vp_stage)
    stages = pp_size * vp_size
    if num_layers % stages:
        raise ValueError(
            f"{num_layers} layers do not split evenly over pipeline size {pp_size} x virtual "
            f"size {vp_size} = {stages} virtual stages; pipeline size times virtual size must "
            f"be one of {_joined(divisors(num_layers))}"
        )
    return where.layers(pp_rank, vp_stage, num_layers)


def _checked_placement(
    num_layers: int,
    pp_size: int,
    vp_size: int,
    pp_rank: int,
    vp_stage: int,
    *,
    placement: Placement | None,
) -> Placement:
    """`chunk_layers`' sizes and position checked; the placement, looped when None."""
    for name, value in (("num_layers", num_layers), ("pp_size", pp_size), ("vp_size", vp_size)):
        _check_positive_int(name, value)
    for name, value, size in (("pp_rank", pp_rank, pp_size), ("vp_stage", vp_stage, vp_size)):
        if not is_int(value):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if not 0 <= value < size:
            raise ValueError(f"{name} {value} is out of range; valid: 0 .. {size - 1}")
    where = Placement.looped(pp_size, vp_size) if placement is None else placement
    if (where.pp_size, where.vp_size) != (pp_size, vp_size):
        raise ValueError(
            f"placement {where} covers {where.pp_size} ranks x {where.vp_size} chunks, but the "
            f"pipeline has {pp_size} x {vp_size}"
        )
    return where


def _generator_seed(seed: int, name: str) -> int:
    # hashlib rather than hash(): Python randomises str hashes per process, and every rank
    # must draw the same values for the same parameter.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def init_parameter_(tensor: torch.Tensor, *, seed: int, name: str, std: float) -> None:
    """Fills `tensor` in place with normal(0, std) values that depend only on seed and name.

    The values are drawn in fp32 on the CPU from a generator of their own, so they do not
    depend on the global random state, the device or the tensor's dtype beyond the final
    cast.

    Args:
        tensor: The tensor to fill.
        seed: The run's seed.
        name: The parameter's global name (for layers, with the global layer index).
        std: Standard deviation of the normal distribution.
    """
    generator = torch.Generator(device="cpu").manual_seed(_generator_seed(seed, name))
    values = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    with torch.no_grad():
        tensor.copy_(values)


class _CoreAttention(torch.nn.Module):
    """Softmax, dropout and weighted sum of causal attention (no parameters).

    A module of its own, under Megatron's name ``core_attention``, so that selective recompute
    (`pp_train.recompute.checkpoint_core_attention`) finds it.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.dropout = config.attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return out


class _SelfAttention(torch.nn.Module):
    """Causal multi-head self-attention on ``[seq, batch, hidden]`` activations."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.qkv = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.core_attention = _CoreAttention(config)
        self.proj = torch.nn.Linear(config.hidden_size, config.hidden_size)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        seq, batch, _ = x.shape
        return x.reshape(seq, batch, self.num_heads, self.head_size).permute(1, 2, 0, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, batch, hidden = x.shape
        qkv: torch.Tensor = self.qkv(x)
        query, key, value = (self._heads(part) for part in torch.chunk(qkv, 3, dim=-1))
        context: torch.Tensor = self.core_attention(query, key, value)
        context = context.permute(2, 0, 1, 3).reshape(seq, batch, hidden)
        out: torch.Tensor = self.proj(context)
        return out


class _MLP(torch.nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(config.hidden_size, config.ffn_size)
        self.fc2 = torch.nn.Linear(config.ffn_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return out


class _TransformerLayer(torch.nn.Module):
    """Pre-LayerNorm block: ``x + attention(LN(x))``, then ``x + mlp(LN(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        eps = config.layernorm_epsilon
        self.input_layernorm = torch.nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attention = _SelfAttention(config)
        self.post_attention_layernorm = torch.nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = _MLP(config)
        self.hidden_dropout = config.hidden_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, training = self.hidden_dropout, self.training
        x = x + _dropout(self.self_attention(self.input_layernorm(x)), p, training)
        mlp_out = self.mlp(self.post_attention_layernorm(x))
        out: torch.Tensor = x + _dropout(mlp_out, p, training)
        return out


class _Embedding(torch.nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = torch.nn.Embedding(config.seq_length, config.hidden_size)
        self.hidden_dropout = config.hidden_dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        embedded: torch.Tensor = self.word_embeddings(tokens) + self.position_embeddings(positions)
        # Megatron's activations are sequence-first; its embedding dropout is the hidden one.
        return _dropout(embedded.transpose(0, 1).contiguous(), self.hidden_dropout, self.training)


# Output projections get the smaller std, as in Megatron's scaled_init_method_normal.
_SCALED_SUFFIXES = ("self_attention.proj.weight", "mlp.fc2.weight")


class GPTChunk(torch.nn.Module):
    """One virtual pipeline stage of the GPT model.

    Parameter names are local (``layers.0`` is this chunk's first layer); `layer_numbers`
    and `global_named_parameters` give the global layer indices. ``recompute`` is the
    config's recompute setting for this chunk (`RecomputeConfig.for_chunk`), which `forward`
    hands to `pp_train.recompute.run_layers`.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        layers: range,
        pre_process: bool,
        post_process: bool,
        seed: int,
        share_embeddings_and_output_weights: bool = True,
    ) -> None:
        """Builds and initialises the chunk.

        Args:
            config: The model's shape.
            layers: Global indices of this chunk's transformer layers (see `chunk_layers`:
                the placement says which stage, and so which layers, a chunk holds).
            pre_process: This chunk is the first virtual stage: it holds the embeddings.
            post_process: This chunk is the last virtual stage: it holds the final layernorm
                and the output layer and returns the loss or the logits.
            seed: The run's seed; with the parameter names it fixes every initial value.
            share_embeddings_and_output_weights: Tie the output layer to the word embedding.
                When another chunk holds the embedding, the output layer is a copy marked
                ``shared`` and ``shared_embedding`` whose gradient the trainer all-reduces
                with the embedding's over the embedding group (the embedding, when a later
                chunk holds the copy, is marked ``shared_embedding`` too, as in Megatron).

        Raises:
            TypeError: `config` is not a `GPTConfig`, `layers` not a range, or `seed` not an
                int.
            ValueError: `layers` is not a run of consecutive indices inside
                ``0 .. num_layers - 1``.
        """
        super().__init__()
        _check_chunk_arguments(config, layers, seed)
        self.config = config
        self.layer_numbers = layers
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.input_tensor: torch.Tensor | None = None
        # Built on the meta device: torch's own initialisation would draw from the global
        # generator, which the chunks of different layouts would then leave in different
        # states. Every value is set by _initialise instead.
        with torch.device("meta"):
            self.embedding = _Embedding(config) if pre_process else None
            self.layers = torch.nn.ModuleList(_TransformerLayer(config) for _ in layers)
            self.final_layernorm = (
                torch.nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
                if post_process
                else None
            )
            self.output_layer = (
                torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                if post_process and not (pre_process and share_embeddings_and_output_weights)
                else None
            )
        self.to_empty(device="cpu")
        self._initialise(seed)
        self._mark_tied_output_weight()
        self.recompute = _chunk_recompute(config.recompute, self.layers)

    def global_name(self, local_name: str) -> str:
        """The global name of a parameter: its layer index made global.

        Args:
            local_name: A name from `named_parameters`, e.g. ``"layers.0.mlp.fc1.weight"``.

        Returns:
            The name in the unpipelined model, e.g. ``"layers.4.mlp.fc1.weight"``.
        """
        head, _, rest = local_name.partition(".")
        if head != "layers":
            return local_name
        index, _, tail = rest.partition(".")
        return f"layers.{self.layer_numbers[int(index)]}.{tail}"

    def sharded_state_keys(self) -> dict[str, str]:
        """Each ``state_dict`` key's global name (pp-train's torch_dist checkpoints use them).

        Layers get their global index; a tied output layer (a copy of the word embedding on
        the last stage) is named as the word embedding, so a checkpoint holds it once.
        """
        keys = {}
        for local_name in self.state_dict():
            name = self.global_name(local_name)
            if name == "output_layer.weight" and self.share_embeddings_and_output_weights:
                name = _WORD_EMBEDDING_NAME
            keys[local_name] = name
        return keys

    def global_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This chunk's parameters under their global names (see `global_name`)."""
        return [(self.global_name(name), param) for name, param in self.named_parameters()]

    def _initialise(self, seed: int) -> None:
        std = self.config.init_method_std
        scaled_std = std / math.sqrt(2.0 * self.config.num_layers)
        for local_name, param in self.named_parameters():
            name = self.global_name(local_name)
            if name == "output_layer.weight" and self.share_embeddings_and_output_weights:
                # The tied copy starts as the word embedding itself, so the stages agree
                # without the broadcast Megatron needs.
                init_parameter_(param, seed=seed, name=_WORD_EMBEDDING_NAME, std=std)
            elif name.endswith(_SCALED_SUFFIXES):
                init_parameter_(param, seed=seed, name=name, std=scaled_std)
            elif "layernorm" in name:
                with torch.no_grad():
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                with torch.no_grad():
                    param.zero_()
            else:
                init_parameter_(param, seed=seed, name=name, std=std)

    def _mark_tied_output_weight(self) -> None:
        if not self.share_embeddings_and_output_weights:
            return
        if self.output_layer is not None:
            # Megatron's marks: the grad norm skips `shared`, the trainer syncs
            # `shared_embedding` with the first stage's word embedding.
            self.output_layer.weight.shared = True  # type: ignore[attr-defined]
            self.output_layer.weight.shared_embedding = True  # type: ignore[attr-defined]
        if self.embedding is not None and not self.post_process:
            # Megatron marks the first stage's copy too: the distributed optimizer's grad
            # buffer gives both copies a bucket of their own, so they are sharded alike and
            # their reduce-scattered shards can be summed.
            self.embedding.word_embeddings.weight.shared_embedding = True  # type: ignore[attr-defined]

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter | None:
        """The weight tied between the first and last stage, as this chunk holds it.

        Returns:
            The word embedding on a ``pre_process`` chunk, the output layer's weight on a
            chunk that is only ``post_process``, else None.
        """
        if self.embedding is not None:
            weight = self.embedding.word_embeddings.weight
        elif self.output_layer is not None:
            weight = self.output_layer.weight
        else:
            return None
        assert isinstance(weight, torch.nn.Parameter)
        return weight

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None]) -> None:
        """Megatron's hook: the previous stage's activations ([None] on the first stage).

        Args:
            input_tensor: A one-element list with the ``[seq, batch, hidden]`` activations.
        """
        self.input_tensor = input_tensor[0]

    def _output_weight(self) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer.weight
        assert self.embedding is not None
        return self.embedding.word_embeddings.weight

    def _chunk_input(self, tokens: torch.Tensor | None) -> torch.Tensor:
        if self.embedding is None:
            if self.input_tensor is None:
                raise RuntimeError(
                    "this chunk is not the first stage and has no input; call "
                    "set_input_tensor([activations]) before forward"
                )
            return self.input_tensor
        if tokens is None or tokens.dim() != 2:
            shape = None if tokens is None else tuple(tokens.shape)
            raise ValueError(f"the first stage needs tokens shaped [batch, seq], got {shape}")
        if tokens.shape[1] > self.config.seq_length:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds the model's seq_length "
                f"{self.config.seq_length}; use sequences of 1 .. {self.config.seq_length}"
            )
        embedded: torch.Tensor = self.embedding(tokens)
        return embedded

    def forward(
        self, tokens: torch.Tensor | None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Runs the chunk.

        Args:
            tokens: int64 ``[batch, seq]`` token ids; used by the first stage only.
            labels: int64 ``[batch, seq]`` targets; used by the last stage only.

        Returns:
            On the last stage, the per-token cross-entropy loss as fp32 ``[batch, seq]`` when
            `labels` is given, else the logits ``[batch, seq, vocab]``. On other stages the
            activations ``[seq, batch, hidden]``.

        Raises:
            ValueError: The first stage got no tokens, tokens of the wrong rank, or a
                sequence longer than ``seq_length``.
            RuntimeError: A later stage was run before `set_input_tensor`.
        """
        hidden = run_layers(self.layers, self._chunk_input(tokens), self.recompute)
        if self.final_layernorm is None:
            return hidden
        hidden = self.final_layernorm(hidden)
        logits = torch.matmul(hidden, self._output_weight().t()).transpose(0, 1)
        if labels is None:
            return logits.contiguous()
        # fp32 cross entropy even for a half model: the softmax over the vocabulary loses
        # too much in bf16.
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        )
        return loss.view(labels.shape)


def _chunk_recompute(
    recompute: RecomputeConfig | None, layers: torch.nn.ModuleList
) -> RecomputeConfig | None:
    """What `run_layers` recomputes in a chunk; selective recompute wraps its attention now."""
    if recompute is None:
        return None
    if recompute.granularity == "selective" and len(layers):
        checkpoint_core_attention(layers)
    return recompute.for_chunk(len(layers))


def _check_chunk_arguments(config: GPTConfig, layers: range, seed: int) -> None:
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    if not isinstance(layers, range):
        raise TypeError(f"layers must be a range of global layer indices, got {layers!r}")
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if len(layers) and (layers.step != 1 or layers.start < 0 or layers.stop > config.num_layers):
        raise ValueError(
            f"layers {layers} must be consecutive indices inside 0 .. {config.num_layers - 1} "
            f"(the model has {config.num_layers} layers)"
        )
