"""Model building: Megatron's model providers and types, `get_model`, `setup_model_and_optimizer`.

`get_model` asks the provider for one chunk per virtual stage, casts and wraps them as Megatron
does and makes the copies of shared embeddings equal; `setup_model_and_optimizer` adds the
optimizer and scheduler and restores a checkpoint.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, cast

import torch

from pp_optim import (
    DDPConfig,
    DistributedDataParallel,
    Float16Module,
    LRScheduleConfig,
    MegatronOptimizer,
    OptimizerConfig,
    OptimizerParamScheduler,
    get_megatron_optimizer,
)
from pp_state import ParallelState, Placement
from pp_tensor import set_defaults_if_not_set_tensor_model_parallel_attributes
from pp_train.checkpoint import CkptFormat, LoadedCheckpoint, load_checkpoint
from pp_train.embeddings import sync_shared_embeddings
from pp_train.wrappers import unwrap_model

__all__ = [
    "EncoderDecoderModelProvider",
    "ModelProvider",
    "ModelType",
    "check_context_parallel_chunk",
    "check_document_ids_chunk",
    "checked_placement",
    "get_model",
    "setup_model_and_optimizer",
]


class ModelProvider(Protocol):
    """Builds one model chunk; Megatron's ``model_provider(pre_process, post_process)``."""

    def __call__(self, *, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        """The chunk of virtual stage `vp_stage`; `pre_process` / `post_process` on the ends."""


class EncoderDecoderModelProvider(Protocol):
    """Builds an encoder-decoder model's stage, as Megatron calls it for such models.

    `get_model(model_type=ModelType.encoder_and_decoder)` calls it once per rank. With a
    pipeline, the state's split rank ``s`` is the first decoder stage: ``pre_process`` on
    stages 0 and ``s``, ``post_process`` on stages ``s - 1`` and the last. The word embedding
    is copied on stages 0, ``s`` and the last (summed over the embedding group), the position
    embedding (``model.embedding.position_embeddings``) on stages 0 and ``s`` (its group).
    """

    def __call__(
        self, *, pre_process: bool, post_process: bool, add_encoder: bool, add_decoder: bool
    ) -> torch.nn.Module:
        """One stage of the model.

        `pre_process`: the stage embeds (the first encoder or first decoder stage);
        `post_process`: it ends the encoder or the whole model; `add_encoder` /
        `add_decoder`: which half it holds (both on a single stage).
        """


class ModelType(enum.Enum):
    """Megatron's model types: one stack, or an encoder and a decoder split at a pipeline rank."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2


def _half_dtype(fp16: bool, bf16: bool) -> torch.dtype | None:
    if fp16 and bf16:
        raise ValueError("set at most one of fp16 and bf16")
    return torch.float16 if fp16 else torch.bfloat16 if bf16 else None


def checked_placement(state: ParallelState, placement: Placement | None) -> Placement:
    """`placement`, checked against the state's pipeline; Megatron's looped one when None.

    Raises:
        ValueError: `placement` covers another pipeline or virtual size than `state`.
    """
    pp = state.pipeline_model_parallel_size
    vp = state.virtual_pipeline_model_parallel_size or 1
    if placement is None:
        return Placement.looped(pp, vp)
    if (placement.pp_size, placement.vp_size) != (pp, vp):
        raise ValueError(
            f"placement {placement} covers {placement.pp_size} ranks x {placement.vp_size} "
            f"chunks, but the parallel state has pipeline size {pp} and virtual size {vp}"
        )
    return placement


def get_model(
    model_provider: ModelProvider | EncoderDecoderModelProvider,
    state: ParallelState,
    *,
    fp16: bool = False,
    bf16: bool = False,
    ddp_config: DDPConfig | None = None,
    device: torch.device | None = None,
    wrap_with_ddp: bool = True,
    placement: Placement | None = None,
    model_type: ModelType = ModelType.encoder_or_decoder,
) -> list[torch.nn.Module]:
    """One model chunk per virtual stage, moved to `device`, cast and wrapped as Megatron does.

    The placement says which virtual stage each chunk of this rank holds: chunk ``v`` gets
    ``pre_process`` when it holds the first stage and ``post_process`` when it holds the last
    (with the V placement both are chunks of pipeline rank 0). With fp16/bf16 each chunk is
    wrapped in `Float16Module`; then in `DistributedDataParallel` over the data (x context)
    parallel group, bucketed only for the chunk holding the first stage (Megatron's choice),
    after which parameters are broadcast from data-parallel rank 0. Last, the copies of a
    tied word embedding are made equal (see `tied_embedding_sync`). Encoder-decoder models
    (``ModelType.encoder_and_decoder``): see `EncoderDecoderModelProvider`; their embedding
    copies start as the first stage's.

    Args:
        model_provider: Builds one chunk (`ModelProvider`, `EncoderDecoderModelProvider`).
        state: The parallel state (pipeline rank and size, virtual size, groups).
        fp16: Wrap each chunk in `Float16Module` with float16.
        bf16: Wrap each chunk in `Float16Module` with bfloat16.
        ddp_config: Grad-buffer settings of `DistributedDataParallel`.
        device: Where the chunks go.
        wrap_with_ddp: Wrap each chunk in `DistributedDataParallel`.
        placement: Which virtual stage each (rank, chunk) holds (the schedule's); looped if None.
        model_type: Megatron's: one stack, or an encoder and a decoder.

    Raises:
        ValueError: fp16 and bf16 together, a placement for another pipeline, a tied
            embedding whose two ends the placement puts where they cannot be kept in sync,
            an encoder-decoder model with virtual stages or a pipeline without split rank,
            or a chunk not for the context-parallel size (`check_context_parallel_chunk`).
    """
    where = checked_placement(state, placement)
    dtype = _half_dtype(fp16, bf16)
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(where.vp_size):
        chunk, pre, post = _provide(model_provider, state, where, vp_stage, model_type)
        check_context_parallel_chunk(chunk, state.context_parallel_size)
        if device is not None:
            chunk = chunk.to(device)
        if dtype is not None:
            chunk = Float16Module(chunk, dtype, pre_process=pre, post_process=post)
        if wrap_with_ddp:
            ddp = DistributedDataParallel.from_parallel_state(
                chunk, state, ddp_config, disable_bucketing=not pre
            )
            ddp.broadcast_params()
            chunk = ddp
        chunks.append(chunk)
    sync_shared_embeddings(chunks, state, where)
    return chunks


def check_context_parallel_chunk(chunk: torch.nn.Module, cp_size: int) -> None:
    """At context-parallel size above 1, `chunk` must say its attention spans the group.

    A chunk's attention sees only this rank's part of the sequence unless it exchanges keys
    and values over the context-parallel group (`pp_tensor.context_parallel_attention`); the
    losses of a model that does not would be wrong without any error. So a chunk declares it:
    an attribute ``context_parallel_size`` equal to the run's (the bundled GPT's chunks have
    it; a model of one's own sets it once its attention is context-parallel).

    Raises:
        ValueError: The chunk has no such attribute, or another size; the message names the
            sizes and the fix.
    """
    if cp_size == 1:
        return
    declared = getattr(chunk, "context_parallel_size", None)
    if declared == cp_size:
        return
    said = (
        "does not say that its attention is context-parallel (no context_parallel_size)"
        if declared is None
        else f"says context_parallel_size {declared}"
    )
    raise ValueError(
        f"the model chunk {type(chunk).__name__} {said}, but the run splits each sequence over "
        f"context-parallel size {cp_size}: its attention would see only this rank's part of "
        "the sequence. Build its attention with pp_tensor.context_parallel_attention over the "
        f"context-parallel group and set chunk.context_parallel_size = {cp_size}, or use "
        "context-parallel size 1"
    )


def check_document_ids_chunk(chunk: torch.nn.Module) -> None:
    """With ``--reset-attention-mask``, `chunk` must say its attention takes document ids.

    Every microbatch then carries ``document_ids`` (which document each token belongs to); a
    model whose attention ignores them would let tokens attend across documents without any
    error. A chunk declares it with an attribute ``takes_document_ids = True`` (the bundled
    GPT's chunks have it; `pp_tensor.context_parallel_attention` takes ``document_ids=``).

    Raises:
        ValueError: The chunk (under its wrappers) does not declare it; the message names the
            flag and the fix.
    """
    inner = unwrap_model(chunk)
    if getattr(inner, "takes_document_ids", False) is True:
        return
    raise ValueError(
        f"--reset-attention-mask gives every microbatch document_ids, but the model chunk "
        f"{type(inner).__name__} does not say that its attention takes them (no "
        "takes_document_ids = True): its tokens would attend across documents. Pass the ids "
        "to its attention (e.g. pp_tensor.context_parallel_attention(..., document_ids=)) "
        "and set takes_document_ids = True on the chunk, or drop --reset-attention-mask"
    )


def _marked(chunk: torch.nn.Module) -> torch.nn.Module:
    """`chunk`, its parameters that no tensor-parallel layer marked marked replicated.

    Megatron's ``get_model`` does so (``tensor_model_parallel = False``, ``partition_dim =
    -1``), for what reads the marks (norms, clipping, checkpoints).
    """
    for param in chunk.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    return chunk


def _provide(
    model_provider: ModelProvider | EncoderDecoderModelProvider,
    state: ParallelState,
    where: Placement,
    vp_stage: int,
    model_type: ModelType,
) -> tuple[torch.nn.Module, bool, bool]:
    """One chunk from the provider (`_marked`), and whether it is pre- and post-processing."""
    rank = state.pipeline_model_parallel_rank
    if model_type is ModelType.encoder_or_decoder:
        pre, post = where.is_first(rank, vp_stage), where.is_last(rank, vp_stage)
        provider = cast("ModelProvider", model_provider)
        return _marked(provider(pre_process=pre, post_process=post, vp_stage=vp_stage)), pre, post
    pp, split = state.pipeline_model_parallel_size, state.pipeline_model_parallel_split_rank
    if where.vp_size > 1 or (pp > 1 and split is None):
        raise ValueError(
            f"an encoder-decoder model needs a pipeline split rank (the first decoder stage) "
            f"when the pipeline has more than one stage, and no virtual stages; got pipeline "
            f"size {pp}, split rank {split}, virtual size {where.vp_size}"
        )
    encoder = pp == 1 or state.is_pipeline_stage_before_split()
    decoder = pp == 1 or state.is_pipeline_stage_after_split()
    pre = rank in (0, split)
    post = rank == pp - 1 or (split is not None and rank == split - 1)
    provider_ed = cast("EncoderDecoderModelProvider", model_provider)
    chunk = provider_ed(
        pre_process=pre, post_process=post, add_encoder=encoder, add_decoder=decoder
    )
    return _marked(chunk), pre, post


def setup_model_and_optimizer(
    model_provider: ModelProvider | EncoderDecoderModelProvider,
    state: ParallelState,
    *,
    optimizer_config: OptimizerConfig,
    lr_schedule: LRScheduleConfig,
    ddp_config: DDPConfig | None = None,
    device: torch.device | None = None,
    load: str | None = None,
    checkpoint_args: dict[str, Any] | None = None,
    finetune: bool = False,
    no_load_optim: bool = False,
    no_load_rng: bool = False,
    placement: Placement | None = None,
    model_type: ModelType = ModelType.encoder_or_decoder,
    ckpt_format: CkptFormat = "torch",
    auto_detect_ckpt_format: bool = False,
) -> tuple[
    list[torch.nn.Module], MegatronOptimizer, OptimizerParamScheduler, LoadedCheckpoint | None
]:
    """Model chunks, optimizer and scheduler, restored from `load` when it holds a checkpoint.

    `placement` is the schedule's: which virtual stage each chunk holds (see `get_model`);
    Megatron's looped placement when None. Give the same one to `build_forward_backward_func`
    (a plan's placement when you run a plan). `model_type` as `get_model`'s; the checkpoint
    format ones as `pp_train.checkpoint.load_checkpoint`'s. The optimizer is pp-optim's
    `DistributedOptimizer` when ``ddp_config.use_distributed_optimizer`` (sharded state).

    Returns:
        ``(model, optimizer, scheduler, loaded)``: `loaded` None when nothing was loaded.
    """
    model = get_model(
        model_provider,
        state,
        fp16=optimizer_config.fp16,
        bf16=optimizer_config.bf16,
        ddp_config=ddp_config,
        device=device,
        placement=placement,
        model_type=model_type,
    )
    # The wrapped chunks: a DistributedOptimizer shards over their grad buffers.
    optimizer = get_megatron_optimizer(optimizer_config, model, parallel_state=state)
    scheduler = OptimizerParamScheduler(optimizer.optimizer, lr_schedule)
    loaded = None
    if load is not None:
        loaded = load_checkpoint(
            load,
            state=state,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            args=checkpoint_args or {},
            finetune=finetune,
            no_load_optim=no_load_optim,
            no_load_rng=no_load_rng,
            ckpt_format=ckpt_format,
            auto_detect_ckpt_format=auto_detect_ckpt_format,
        )
    return model, optimizer, scheduler, loaded
