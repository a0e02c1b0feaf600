"""A small GPT that splits into pipeline chunks the way Megatron-LM's GPT model does.

Each `GPTChunk` holds one virtual pipeline stage: the embeddings when it is the first
(``pre_process``), some consecutive transformer layers, and the final layernorm and output
layer when it is the last (``post_process``). Activations between chunks are shaped
``[seq, batch, hidden]`` (``[seq / tp, batch, hidden]`` under sequence parallelism).

Every parameter is initialised from a generator seeded by the run's seed and the parameter's
global name, over the full (unsplit) tensor, so the chunks of any pipeline layout and any
tensor-parallel size together hold exactly the values of the single chunk of an unpipelined
run at tensor-parallel size 1. The layers and their tensor-parallel split are in
`pp_train.app.transformer` (the fused qkv weight is in Megatron's per-head order).

Dropout sits where Megatron puts it: on the attention probabilities (``attention_dropout``)
and on the embedding's, the attention's and the MLP's output (before each residual add;
``hidden_dropout``). Without an RNG tracker it draws from torch's global generator, so
pipeline ranks draw differently; with one it follows Megatron's rule (see
`pp_train.app.transformer.TensorParallelism`). ``recompute`` checkpoints layers or the core
attention (`pp_train.recompute`); parameter names and ``state_dict`` keys are the same either
way and at every tensor-parallel size.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pp_state import PipelineLayerLayout, Placement
from pp_state.numbers import divisors, is_int
from pp_tensor import (
    CP_COMM_TYPES,
    InitMethod,
    RNGStatesTracker,
    context_parallel_positions,
    tp_size,
)
from pp_train.app.gpt_config import (
    GPTConfig,
    check_positive_int,
    check_tensor_parallel,
    joined,
)
from pp_train.app.transformer import (
    Embedding,
    OutputLayer,
    TensorParallelism,
    TransformerLayer,
    WeightInit,
    gathered_logits,
    layer_norm,
    parallel_logits,
    parallel_loss,
)
from pp_train.recompute import RecomputeConfig, checkpoint_core_attention, run_layers

__all__ = ["GPTChunk", "GPTConfig", "check_tensor_parallel", "chunk_layers", "init_parameter_"]

_WORD_EMBEDDING_NAME = "embedding.word_embeddings.weight"
# Output projections get the smaller std, as in Megatron's scaled_init_method_normal.
_SCALED_SUFFIXES = ("self_attention.proj.weight", "mlp.fc2.weight")


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
            f"be one of {joined(divisors(num_layers))}"
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
        check_positive_int(name, value)
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


class GPTChunk(torch.nn.Module):
    """One virtual pipeline stage of the GPT model, on one tensor-parallel rank.

    Parameter names are local (``layers.0`` is this chunk's first layer); `layer_numbers`
    and `global_named_parameters` give the global layer indices. Names and ``state_dict``
    keys are the same at every tensor-parallel size; a split parameter holds this rank's
    contiguous slice (`tensor_parallel_dims` says along which dimension). ``recompute`` is
    the config's recompute setting for this chunk (`RecomputeConfig.for_chunk`), which
    `forward` hands to `pp_train.recompute.run_layers`.
    """

    output_layer: OutputLayer | None
    takes_document_ids = True
    """Its attention keeps each token inside its document (``forward(..., document_ids=)``)."""

    def __init__(
        self,
        config: GPTConfig,
        *,
        layers: range,
        pre_process: bool,
        post_process: bool,
        seed: int,
        share_embeddings_and_output_weights: bool = True,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        rng_tracker: RNGStatesTracker | None = None,
        cp_group: dist.ProcessGroup | None = None,
        cp_comm_type: str = "p2p",
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
            share_embeddings_and_output_weights: Tie the output layer to the word embedding;
                on another chunk than the embedding's it is a copy marked ``shared`` and
                ``shared_embedding`` (the embedding too), whose gradient the trainer
                all-reduces with the embedding's over the embedding group, as in Megatron.
            tp_group: The tensor-parallel group; None: tensor-parallel size 1.
            sequence_parallel: Split the activations between layers along the sequence (off
                at tensor-parallel size 1).
            rng_tracker: A seeded model-parallel RNG tracker: dropout then follows Megatron's
                rule (`pp_train.app.transformer.TensorParallelism`). None: every dropout
                draws from torch's default generator.
            cp_group: The context-parallel group the sequence is split over; None: size 1.
            cp_comm_type: How attention exchanges keys and values: "p2p" or "all_gather".

        Raises:
            TypeError: `config` is not a `GPTConfig`, `layers` not a range, or `seed` not an
                int.
            ValueError: `layers` is not a run of consecutive indices inside
                ``0 .. num_layers - 1``, the model does not split over the tensor-parallel
                size (`check_tensor_parallel`), or cp with attention dropout.
        """
        super().__init__()
        _check_chunk_arguments(config, layers, seed, tp_group=tp_group, cp=(cp_group, cp_comm_type))
        self.config = config
        self.layer_numbers = layers
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.parallel = TensorParallelism(
            tp_group, sequence_parallel, rng_tracker, cp_group, cp_comm_type
        )
        self.input_tensor: torch.Tensor | None = None
        self._build(seed)
        self._mark_tied_output_weight()
        self.recompute = _chunk_recompute(config.recompute, self.layers)

    def _build(self, seed: int) -> None:
        """The chunk's modules, every weight drawn by global name over its full shape."""
        config, parallel = self.config, self.parallel
        self.embedding = (
            Embedding(config, parallel, _weight_init(config, seed, ""))
            if self.pre_process
            else None
        )
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, parallel, _weight_init(config, seed, f"layers.{index}."))
            for index in self.layer_numbers
        )
        self.final_layernorm = layer_norm(config, parallel) if self.post_process else None
        self.output_layer = None
        tied = self.share_embeddings_and_output_weights
        if self.post_process and not (self.pre_process and tied):
            # The tied copy starts as the word embedding itself, so the stages agree without
            # the broadcast Megatron needs.
            name = _WORD_EMBEDDING_NAME if tied else "output_layer.weight"
            self.output_layer = OutputLayer(config, parallel, _init_method(config, seed, name))

    @property
    def context_parallel_size(self) -> int:
        """Ranks each sequence is split over; attention exchanges keys and values over them.

        `pp_train.models.check_context_parallel_chunk` reads it.
        """
        return self.parallel.cp_size

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

    def tensor_parallel_dims(self) -> dict[str, int]:
        """The dimension along which each split parameter is sliced over tensor parallelism.

        The same at every tensor-parallel size (1 included), so a checkpoint saved at one
        size can be cut for another. Parameters every rank holds whole are left out.

        Returns:
            Partition dimension by global name (see `global_name`) and by checkpoint key
            (see `sharded_state_keys`; a tied output layer is keyed as the word embedding).
        """
        by_local = {
            local: int(getattr(param, "partition_dim", -1))  # set by pp-tensor
            for local, param in self.named_parameters()
            if getattr(param, "tensor_model_parallel", False)
        }
        dims = {self.global_name(local): dim for local, dim in by_local.items()}
        for local, key in self.sharded_state_keys().items():
            if local in by_local:
                dims[key] = by_local[local]
        return dims

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

    def _chunk_input(
        self, tokens: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> torch.Tensor:
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
        cp = self.parallel.cp_size
        whole = tokens.shape[1] * cp
        if whole > self.config.seq_length:
            held = f" ({tokens.shape[1]} on each of {cp} context-parallel ranks)" if cp > 1 else ""
            raise ValueError(
                f"sequence length {whole}{held} exceeds the model's seq_length "
                f"{self.config.seq_length}; use sequences of 1 .. {self.config.seq_length}"
            )
        size = self.parallel.size
        if self.parallel.sequence_parallel and tokens.shape[1] % size:
            raise ValueError(
                f"sequence length {tokens.shape[1]} does not divide over tensor-parallel size "
                f"{size} under sequence parallelism; use a multiple of {size}"
            )
        if position_ids is None and cp > 1:
            cp_rank = dist.get_rank(self.parallel.cp_group)
            position_ids = context_parallel_positions(whole, cp, cp_rank, device=tokens.device)
        embedded: torch.Tensor = self.embedding(tokens, position_ids)
        return embedded

    def forward(
        self,
        tokens: torch.Tensor | None,
        labels: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs the chunk.

        Under context parallelism every sequence argument is this rank's part of the sequence
        (`pp_train.get_batch_on_this_cp_rank`), but `document_ids` the whole sequence's.

        Args:
            tokens: int64 ``[batch, seq]`` token ids; used by the first stage only.
            labels: int64 ``[batch, seq]`` targets; used by the last stage only.
            position_ids: int64 ``[batch, seq]`` positions for the position embedding; used by
                the first stage only. None: ``0 .. seq - 1``, or under context parallelism
                the global positions of this rank's tokens.
            document_ids: The document of each token of the whole sequence (packed
                documents, ``[batch, seq]`` or ``[seq]``): attention stays inside a document.
                None: one document.

        Returns:
            On the last stage, the per-token cross-entropy loss as fp32 ``[batch, seq]`` when
            `labels` is given, else the logits ``[batch, seq, vocab]`` (the whole vocabulary;
            both the same on every tensor-parallel rank). On other stages the activations
            ``[seq, batch, hidden]``, or ``[seq / tp, batch, hidden]`` (this rank's part of
            the sequence) under sequence parallelism.

        Raises:
            ValueError: The first stage got no tokens, tokens of the wrong rank, a sequence
                longer than ``seq_length`` or, under sequence parallelism, one that does not
                divide over the tensor-parallel size.
            RuntimeError: A later stage was run before `set_input_tensor`.
        """
        hidden = run_layers(
            self.layers,
            self._chunk_input(tokens, position_ids),
            self.recompute,
            rng_tracker=self.parallel.rng_tracker,
            document_ids=document_ids,
        )
        if self.final_layernorm is None:
            return hidden
        logits = parallel_logits(self.final_layernorm(hidden), self._output_weight(), self.parallel)
        if labels is None:
            return gathered_logits(logits, self.parallel)
        return parallel_loss(logits, labels, self.parallel)


def _init_method(config: GPTConfig, seed: int, name: str) -> InitMethod:
    """Fills the full weight named `name` (global) by `init_parameter_`."""
    std = config.init_method_std
    if name.endswith(_SCALED_SUFFIXES):
        std /= math.sqrt(2.0 * config.num_layers)
    return functools.partial(init_parameter_, seed=seed, name=name, std=std)


def _weight_init(config: GPTConfig, seed: int, prefix: str) -> WeightInit:
    """The init methods of a module whose weights' global names start with `prefix`."""

    def init_method(local_name: str) -> InitMethod:
        return _init_method(config, seed, prefix + local_name)

    return init_method


def _chunk_recompute(
    recompute: RecomputeConfig | None, layers: torch.nn.ModuleList
) -> RecomputeConfig | None:
    """What `run_layers` recomputes in a chunk; selective recompute wraps its attention now."""
    if recompute is None:
        return None
    if recompute.granularity == "selective" and len(layers):
        checkpoint_core_attention(layers)
    return recompute.for_chunk(len(layers))


def _check_context_parallel(
    config: GPTConfig, cp_group: dist.ProcessGroup | None, cp_comm_type: str
) -> None:
    """Context parallelism's attention has no dropout; the exchange is a known kind."""
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(
            f"unknown cp_comm_type {cp_comm_type!r}; use one of {', '.join(CP_COMM_TYPES)}"
        )
    cp = 1 if cp_group is None else dist.get_world_size(cp_group)
    if cp > 1 and config.attention_dropout:
        raise ValueError(
            f"attention dropout {config.attention_dropout} with context-parallel size {cp}: "
            "context-parallel attention applies no dropout to the attention probabilities; "
            "use attention_dropout 0 (--attention-dropout 0)"
        )


def _check_chunk_arguments(
    config: GPTConfig,
    layers: range,
    seed: int,
    *,
    tp_group: dist.ProcessGroup | None,
    cp: tuple[dist.ProcessGroup | None, str],
) -> None:
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
    check_tensor_parallel(config, tp_size(tp_group))
    _check_context_parallel(config, *cp)
