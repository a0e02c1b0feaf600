"""The training loop as composable pieces: model setup, one step, evaluation, the loop itself.

Each piece takes the objects it works on as arguments (the `ParallelState`, model chunks,
optimizer, scheduler, forward-backward function): use them together through `train`, or call
`train_step` from a loop of your own. The shapes follow Megatron-LM's ``training.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, Literal, Protocol, cast

import torch
import torch.distributed as dist

from pp_comm import CommConfig, NullTimers, P2PCommunicator, Timers
from pp_optim import (
    DDPConfig,
    DistributedDataParallel,
    Float16Module,
    LRScheduleConfig,
    MegatronOptimizer,
    NonFiniteGradError,
    OptimizerConfig,
    OptimizerParamScheduler,
    all_reduce_grads,
    get_canonical_lr_for_logging,
    get_megatron_optimizer,
)
from pp_schedules import (
    PipelineExecutor,
    Plan,
    ScheduleConfig,
    check_trace_path,
    get_forward_backward_func,
    write_schedule_trace,
)
from pp_state import ParallelState, Placement
from pp_state.collectives import at_iteration, collective
from pp_train.checkpoint import (
    AsyncCheckpointSaver,
    CkptFormat,
    check_save_directory,
    load_checkpoint,
    save_checkpoint,
)
from pp_train.checkpointing import LoadedCheckpoint, collective_device, gather_ints
from pp_train.norms import calc_params_l2_norm
from pp_train.num_microbatches_calculator import NumMicroBatchesCalculator
from pp_train.reporting import Timers as LevelledTimers
from pp_train.reporting import TrainingLogger
from pp_train.wrappers import unwrap_model

__all__ = [
    "EncoderDecoderModelProvider",
    "ExitReason",
    "ForwardBackwardFunc",
    "ModelProvider",
    "ModelType",
    "NonFiniteError",
    "TiedEmbeddingSync",
    "TrainingConfig",
    "TrainingProgress",
    "build_forward_backward_func",
    "evaluate",
    "finalize_model_grads",
    "finetune",
    "get_model",
    "schedule_placement",
    "setup_model_and_optimizer",
    "tied_embedding_sync",
    "train",
    "train_step",
]

ExitReason = Literal[
    "train_iters", "exit_interval", "exit_duration", "signal", "autoresume", "converted"
]
"""Why a run stopped; ``converted``: `pretrain` converted ``--load``'s checkpoint and did
not train (``--ckpt-convert-format``)."""
ForwardStepFunc = Callable[[Any, torch.nn.Module], tuple[Any, Callable[..., Any]]]


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


class ForwardBackwardFunc(Protocol):
    """What `pp_schedules.get_forward_backward_func` returns (Megatron's interface).

    A function with a ``placement`` attribute (pp-schedules' executor) says which virtual
    stage each chunk holds; any other is taken to run Megatron's looped placement.
    """

    def __call__(
        self,
        *,
        forward_step_func: ForwardStepFunc,
        data_iterator: Any,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
    ) -> list[Any]:
        """Runs one step's forward (and backward) passes; loss dicts on the last stage."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """How long to train, how often to evaluate, save and log, and when to stop early."""

    train_iters: int
    """Iterations to train for (Megatron's ``--train-iters``)."""

    micro_batch_size: int
    """Samples per microbatch on one data-parallel rank."""

    seq_length: int
    """Tokens per sample; activations between stages are (seq_length, micro_batch_size, h)."""

    decoder_seq_length: int | None = None
    """Encoder-decoder models: the decoder's tokens per sample (None: `seq_length`)."""

    log_params_norm: bool = False
    """Compute the parameters' L2 norm every iteration (over the whole model, each weight
    counted once) and report it in the log line and TensorBoard (``--log-params-norm``)."""

    barrier_with_l1_time: bool = True
    """Start the level-1 timers of `train_step` after a barrier and a device synchronisation
    (Megatron's ``--barrier-with-L1-time``); off, timers never wait."""

    eval_interval: int | None = None
    """Evaluate every this many iterations (None: never during training)."""

    eval_iters: int = 10
    """Global batches per evaluation."""

    log_interval: int = 100
    """Print the log line every this many iterations."""

    save: str | None = None
    """Directory to write checkpoints to."""

    save_interval: int | None = None
    """Save every this many iterations (and on any early exit) when `save` is set."""

    ckpt_format: CkptFormat = "torch"
    """The format checkpoints are saved in: "torch" (one file per position, same layout to
    resume) or "torch_dist" (DCP, resumes at any layout); see `pp_train.checkpoint`."""

    async_save: bool = False
    """Write torch_dist checkpoints in the background (`AsyncCheckpointSaver`); training
    waits for a save still in flight at the next save and before returning."""

    exit_interval: int | None = None
    """Save and stop when the iteration is a multiple of this."""

    exit_duration_in_mins: float | None = None
    """Save and stop once this many minutes have passed on any rank (decided by all ranks)."""

    exit_signal_handler: bool = True
    """On SIGTERM (any rank), finish the iteration, save and stop."""

    adlr_autoresume_interval: int = 1000
    """Ask the autoresume hook every this many iterations whether to save and stop."""

    profile_schedule_path: str | None = None
    """Record one training iteration's pipeline schedule and write it here as Chrome-trace
    JSON (Perfetto opens it): every pipeline rank's measured forward, backward and exchange
    spans beside the simulator's timeline of the same plan with the measured costs. The
    pipeline of global rank 0 is profiled; its first stage writes the file, and every rank
    gets the summary line through ``print_fn``. Needs pp-schedules' executor as the
    forward-backward function; the path is checked before the first iteration."""

    profile_schedule_iteration: int | None = None
    """The iteration to profile, numbered as in the log (1 is the first of the whole run).
    None: the second iteration this run trains (the first pays one-time costs: plan
    validation, buffer allocation, connection set-up), or its only one."""

    def __post_init__(self) -> None:
        """Checks the numbers.

        Raises:
            ValueError: A count or interval is not positive.
        """
        for name in ("train_iters", "micro_batch_size", "seq_length", "log_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("eval_interval", "save_interval", "exit_interval", "decoder_seq_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.eval_iters < 0:
            raise ValueError(f"eval_iters must be >= 0, got {self.eval_iters}")
        if self.async_save and self.ckpt_format != "torch_dist":
            raise ValueError(f"async_save needs ckpt_format 'torch_dist', got {self.ckpt_format!r}")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise ValueError(f"exit_duration_in_mins must be > 0, got {self.exit_duration_in_mins}")
        if self.adlr_autoresume_interval < 1:
            raise ValueError(
                f"adlr_autoresume_interval must be >= 1, got {self.adlr_autoresume_interval}"
            )
        iteration = self.profile_schedule_iteration
        if iteration is not None:
            if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 1:
                raise ValueError(
                    f"profile_schedule_iteration must be a positive int or None, got {iteration!r}"
                )
            if self.profile_schedule_path is None:
                raise ValueError(
                    f"profile_schedule_iteration {iteration} needs profile_schedule_path (the "
                    "file to write the trace to)"
                )
            if iteration > self.train_iters:
                raise ValueError(
                    f"profile_schedule_iteration {iteration} is past train_iters "
                    f"{self.train_iters}; use 1 .. {self.train_iters}"
                )


@dataclasses.dataclass
class TrainingProgress:
    """Where a run stands; saved in checkpoints."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def _half_dtype(fp16: bool, bf16: bool) -> torch.dtype | None:
    if fp16 and bf16:
        raise ValueError("set at most one of fp16 and bf16")
    return torch.float16 if fp16 else torch.bfloat16 if bf16 else None


def _layout_placement(state: ParallelState, placement: Placement | None) -> Placement:
    """`placement`, checked against the state's pipeline; Megatron's looped one when None."""
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
    tied word embedding are made equal (see `tied_embedding_sync`).

    Encoder-decoder models (``ModelType.encoder_and_decoder``): see
    `EncoderDecoderModelProvider`; their embedding copies start as the first stage's.

    Args:
        model_provider: Builds one chunk (`ModelProvider`, `EncoderDecoderModelProvider`).
        state: The parallel state (pipeline rank and size, virtual size, groups).
        fp16: Wrap each chunk in `Float16Module` with float16.
        bf16: Wrap each chunk in `Float16Module` with bfloat16.
        ddp_config: Grad-buffer settings of `DistributedDataParallel`.
        device: Where the chunks go.
        wrap_with_ddp: Wrap each chunk in `DistributedDataParallel`.
        placement: Which virtual stage each (rank, chunk) holds; the schedule's (a plan's
            placement), Megatron's looped one when None.
        model_type: Megatron's: one stack, or an encoder and a decoder.

    Raises:
        ValueError: fp16 and bf16 together, a placement for another pipeline, a tied
            embedding whose two ends the placement puts where they cannot be kept in sync,
            or an encoder-decoder model with virtual stages or a pipeline without split rank.
    """
    where = _layout_placement(state, placement)
    dtype = _half_dtype(fp16, bf16)
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(where.vp_size):
        chunk, pre, post = _provide(model_provider, state, where, vp_stage, model_type)
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
    _sync_shared_embeddings(chunks, state, where)
    return chunks


def _provide(
    model_provider: ModelProvider | EncoderDecoderModelProvider,
    state: ParallelState,
    where: Placement,
    vp_stage: int,
    model_type: ModelType,
) -> tuple[torch.nn.Module, bool, bool]:
    """One chunk from the provider, and whether it is pre- and post-processing."""
    rank = state.pipeline_model_parallel_rank
    if model_type is ModelType.encoder_or_decoder:
        pre, post = where.is_first(rank, vp_stage), where.is_last(rank, vp_stage)
        provider = cast("ModelProvider", model_provider)
        return provider(pre_process=pre, post_process=post, vp_stage=vp_stage), pre, post
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
    return chunk, pre, post


def _shared_weight(chunk: torch.nn.Module) -> torch.nn.Parameter | None:
    inner = unwrap_model(chunk)
    for name in ("shared_embedding_or_output_weight", "word_embeddings_weight"):
        method = getattr(inner, name, None)
        if callable(method):
            weight = method()
            return weight if isinstance(weight, torch.nn.Parameter) else None
    return None


TiedEmbeddingSync = Literal["none", "local", "embedding_group"]
"""How the two copies of a tied word embedding are kept equal (see `tied_embedding_sync`)."""


def tied_embedding_sync(placement: Placement) -> TiedEmbeddingSync:
    """How the copies of a word embedding tied to the output layer are kept equal.

    The first virtual stage holds the word embedding and the last the output layer, a copy of
    it. Their gradients are summed every step so both copies see the tied weight's gradient:

    - "none": one stage holds both ends, the output layer uses the embedding itself.
    - "local": both ends are chunks of one pipeline rank (the V placement puts them on rank
      0): the two gradients are added in place on that rank.
    - "embedding_group": the first stage is on pipeline rank 0 and the last on the last
      rank (the looped placement): summed over the embedding group, as Megatron does.

    Args:
        placement: Which virtual stage each (rank, chunk) holds.

    Returns:
        One of the three answers above.

    Raises:
        ValueError: The ends are on two ranks other than the first and last pipeline rank,
            where no embedding group connects them.
    """
    if placement.num_stages == 1:
        return "none"
    first = placement.holder(0)[0]
    last = placement.holder(placement.num_stages - 1)[0]
    if first == last:
        return "local"
    if (first, last) == (0, placement.pp_size - 1):
        return "embedding_group"
    raise ValueError(
        f"placement {placement} puts the first stage on pipeline rank {first} and the last on "
        f"rank {last}; a tied word embedding is kept in sync only when both are on one rank "
        f"or on ranks 0 and {placement.pp_size - 1} (the embedding group); use the 'looped' or "
        "'v' placement, or a model without tied embeddings"
    )


def _ties_output_to_embedding(chunk: torch.nn.Module) -> bool:
    # Megatron's flag; a model without it is taken to tie, as Megatron's older models did.
    return bool(getattr(unwrap_model(chunk), "share_embeddings_and_output_weights", True))


def _embedding_weights(
    chunks: Sequence[torch.nn.Module], state: ParallelState, placement: Placement
) -> list[torch.nn.Parameter]:
    """The tied word-embedding copies this rank holds: the first stage's, then the last's.

    With an encoder-decoder split, the first decoder stage's embedding is a copy too.
    """
    if placement.num_stages == 1:
        return []
    rank = state.pipeline_model_parallel_rank
    ends = [
        index
        for holds in (placement.is_first, placement.is_last)
        for index in range(len(chunks))
        if holds(rank, index)
    ]
    if rank == state.pipeline_model_parallel_split_rank:
        ends = list(dict.fromkeys([0, *ends]))  # no virtual stages with a split
    weights = [
        _shared_weight(chunks[index]) for index in ends if _ties_output_to_embedding(chunks[index])
    ]
    return [w for w in weights if w is not None]


def _main_grad(weight: torch.nn.Parameter) -> torch.Tensor | None:
    grad: torch.Tensor | None = getattr(weight, "main_grad", None)
    return weight.grad if grad is None else grad


def _sum_tied_gradients(
    chunks: Sequence[torch.nn.Module], state: ParallelState, placement: Placement
) -> None:
    """Both copies of the tied embedding end with the sum of their gradients."""
    weights = _embedding_weights(chunks, state, placement)
    if not weights:
        return
    if tied_embedding_sync(placement) == "embedding_group":
        all_reduce_grads(weights, group=state.group("embedding"))
        return
    # Both ends on this rank: add the two gradients in place, no communication.
    grads = [grad for grad in map(_main_grad, weights) if grad is not None]
    if len(grads) == len(weights) == 2:  # the embedding and its copy
        with torch.no_grad():
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])


def _sync_shared_embeddings(
    chunks: Sequence[torch.nn.Module], state: ParallelState, placement: Placement
) -> None:
    """Every copy of the word (and position) embedding starts as the first stage's.

    Megatron's way: the copies outside the first stage are zeroed, then summed over the
    embedding (and position-embedding) group.
    """
    first = state.pipeline_model_parallel_rank == 0
    weights = _embedding_weights(chunks, state, placement)
    with torch.no_grad():
        if weights and tied_embedding_sync(placement) == "local":
            if len(weights) == 2:  # the embedding and its copy
                weights[1].copy_(weights[0])
        elif weights:
            for weight in weights:
                if not first:
                    weight.zero_()
                with collective("embedding copy sync", group=state.group("embedding")):
                    dist.all_reduce(weight.data, group=state.group("embedding"))
        position = _split_position_embedding(chunks, state)
        if position is not None:
            if not first:
                position.zero_()
            group = state.group("position_embedding")
            with collective("position embedding copy sync", group=group):
                dist.all_reduce(position.data, group=group)


def _split_position_embedding(
    chunks: Sequence[torch.nn.Module], state: ParallelState
) -> torch.nn.Parameter | None:
    """With an encoder-decoder split, this rank's copy of the position embedding, if any.

    The first encoder and first decoder stage each hold one (``model.embedding.
    position_embeddings``, Megatron's layout); they are kept equal over the position-embedding
    group.
    """
    if (
        state.pipeline_model_parallel_split_rank is None
        or state.pipeline_model_parallel_size == 1
        or not state.is_rank_in_position_embedding_group()
    ):
        return None
    embedding = getattr(unwrap_model(chunks[0]), "embedding", None)
    weight = getattr(getattr(embedding, "position_embeddings", None), "weight", None)
    return weight if isinstance(weight, torch.nn.Parameter) else None


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
    format ones as `pp_train.checkpoint.load_checkpoint`'s.

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
    optimizer = get_megatron_optimizer(
        optimizer_config, [unwrap_model(chunk) for chunk in model], parallel_state=state
    )
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


def build_forward_backward_func(
    state: ParallelState,
    model: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    *,
    hidden_size: int,
    device: torch.device | None = None,
    timers: Timers | None = None,
    comm_config: CommConfig | None = None,
    schedule: str | None = None,
    plan: Plan | str | None = None,
    placement: Placement | None = None,
) -> PipelineExecutor:
    """The schedule for `state`'s pipeline, wired to the optimizer's loss scale and DDP's no_sync.

    Activations travel in the model's dtype (fp16/bf16 chunks send half tensors). The result
    is pp-schedules' executor: its ``placement`` says which stage each chunk holds, and
    `train` can record its timeline (`TrainingConfig.profile_schedule_path`).

    Args:
        state: The parallel state; its pipeline group carries the transfers.
        model: This rank's chunks (from `get_model`).
        optimizer: Its ``scale_loss`` scales each loss before backward.
        hidden_size: Width of the activations between stages.
        device: Where received tensors go.
        timers: Megatron-style timers for the compute and communication phases.
        comm_config: pp-comm settings; by default the model's dtype on the wire.
        schedule: "gpipe", "1f1b" or "interleaved_1f1b"; by default Megatron's choice
            (interleaved 1F1B with virtual stages, 1F1B otherwise, no pipelining for one
            stage).
        plan: A plan to run instead (a `pp_schedules.Plan` or its text); it carries its
            placement.
        placement: The placement the model was built for (`get_model`); checked against
            the plan's. Looped when None and no plan is given.

    Raises:
        ValueError: A schedule and a plan together, or a plan or placement that does not fit
            the pipeline.
    """
    if schedule is not None and plan is not None:
        raise ValueError(f"give a schedule name or a plan, not both (schedule {schedule!r})")
    communicator = _pipeline_communicator(
        state, model, device=device, timers=timers, comm_config=comm_config
    )
    return get_forward_backward_func(
        communicator,
        vp_size=len(model),
        config=ScheduleConfig(
            hidden_size=hidden_size,
            schedule=schedule,
            plan=plan,
            placement=placement,
            pipeline_model_parallel_split_rank=state.pipeline_model_parallel_split_rank
            if state.pipeline_model_parallel_size > 1
            else None,
            grad_scale_func=optimizer.scale_loss,
            no_sync_func=_no_sync_func(model),
            timers=timers,
        ),
    )


def _pipeline_communicator(
    state: ParallelState,
    model: Sequence[torch.nn.Module],
    *,
    device: torch.device | None,
    timers: Timers | None,
    comm_config: CommConfig | None,
) -> P2PCommunicator | None:
    """The transfers between stages (None for one stage), by default in the model's dtype."""
    dtype = next(unwrap_model(model[0]).parameters()).dtype
    if state.pipeline_model_parallel_size <= 1:
        return None
    config = comm_config or CommConfig(pipeline_dtype=dtype)
    return P2PCommunicator.from_parallel_state(state, config=config, device=device, timers=timers)


def _no_sync_func(model: Sequence[torch.nn.Module]) -> Any:
    """The chunks' ``no_sync`` (one, or a list for several); None unless every chunk has one."""
    no_sync = [getattr(chunk, "no_sync", None) for chunk in model]
    if not all(func is not None for func in no_sync):
        return None
    return no_sync if len(no_sync) > 1 else no_sync[0]


def schedule_placement(forward_backward_func: Any, state: ParallelState) -> Placement:
    """The placement a forward-backward function runs: the executor's, else Megatron's looped.

    Args:
        forward_backward_func: pp-schedules' executor (it has ``placement``) or any function
            with Megatron's interface (taken to run the looped placement).
        state: The parallel state (pipeline and virtual sizes).
    """
    placement = getattr(forward_backward_func, "placement", None)
    if isinstance(placement, Placement):
        return placement
    return _layout_placement(state, None)


def finalize_model_grads(
    model: Sequence[torch.nn.Module],
    state: ParallelState,
    *,
    placement: Placement | None = None,
) -> None:
    """After backward: data-parallel reduction, then the tied embeddings' gradients.

    Every chunk's grad buffer is reduced over data parallelism; the word embedding's copies on
    the first and last stage are summed (over the embedding group, or in place when one rank
    holds both, see `tied_embedding_sync`); with a split rank the position embedding over its
    group (Megatron's encoder-decoder models).

    Args:
        model: This rank's chunks.
        state: The parallel state.
        placement: Which stage each chunk holds (the schedule's); looped when None.
    """
    for chunk in model:
        finish = getattr(chunk, "finish_grad_sync", None)
        if callable(finish):
            finish()
    _sum_tied_gradients(model, state, _layout_placement(state, placement))
    position = _split_position_embedding(model, state)
    if position is not None:
        all_reduce_grads([position], group=state.group("position_embedding"))


def _average_losses(losses: list[dict[str, Any]], state: ParallelState) -> dict[str, float]:
    """Microbatch losses averaged, then over data-parallel ranks (last stage's ranks only)."""
    if not losses:
        return {}
    averaged = {}
    for key in losses[0]:
        values = torch.stack(
            [torch.as_tensor(x[key], dtype=torch.float32).detach().reshape(()) for x in losses]
        )
        averaged[key] = values.mean()
    stacked = torch.stack(list(averaged.values())).cpu()
    if state.group_size("dp_cp") > 1:
        device = "cuda" if dist.get_backend(state.group("dp_cp")) == "nccl" else "cpu"
        stacked = stacked.to(device)
        with collective("loss averaging over data parallel", group=state.group("dp_cp")):
            dist.all_reduce(stacked, group=state.group("dp_cp"))
        stacked = stacked.cpu() / state.group_size("dp_cp")
    return {key: float(value) for key, value in zip(averaged, stacked.tolist(), strict=True)}


def train_step(
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    model: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    *,
    forward_backward_func: ForwardBackwardFunc,
    state: ParallelState,
    num_microbatches: int,
    micro_batch_size: int,
    seq_length: int,
    decoder_seq_length: int | None = None,
    timers: Timers | None = None,
    barrier_with_l1_time: bool = True,
    iteration: int | None = None,
) -> tuple[dict[str, float], int, float | None, int | None]:
    """One iteration, as Megatron's ``train_step``.

    Zeroes the grads, runs the forward-backward function, `finalize_model_grads`, steps the
    optimizer and, unless it skipped, the scheduler by ``microbatches * mbs * dp`` samples.
    Phases "forward-backward", "grads-all-reduce", "optimizer" are timed at level 1 (after a
    barrier and a device sync with `barrier_with_l1_time`).

    Returns:
        ``(loss_dict, skipped_iter, grad_norm, num_zeros_in_grad)``: the losses averaged over
        microbatches and data-parallel ranks (on the rank holding the last stage; else empty).

    Raises:
        NonFiniteError: A NaN or inf gradient norm without a loss scaler; nothing applied.
    """
    timers = timers or NullTimers()
    for zero in (getattr(chunk, "zero_grad_buffer", None) for chunk in model):
        if callable(zero):
            zero()
    optimizer.zero_grad()
    _phase(timers, "forward-backward").start(**_barrier(timers, barrier_with_l1_time))
    losses = forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=list(model),
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        forward_only=False,
    )
    _phase(timers, "forward-backward").stop()
    placement = schedule_placement(forward_backward_func, state)
    _phase(timers, "grads-all-reduce").start()
    finalize_model_grads(model, state, placement=placement)
    _phase(timers, "grads-all-reduce").stop()
    step = _optimizer_step(optimizer, timers, barrier_with_l1_time, losses, iteration)
    update_successful, grad_norm, num_zeros_in_grad = step
    if update_successful:
        scheduler.step(increment=num_microbatches * micro_batch_size * state.group_size("dp_cp"))
    skipped_iter = 0 if update_successful else 1
    holds_loss = placement.holds_last(state.pipeline_model_parallel_rank)
    loss_dict = _average_losses(losses, state) if holds_loss else {}
    return loss_dict, skipped_iter, grad_norm, num_zeros_in_grad


def _optimizer_step(
    optimizer: MegatronOptimizer,
    timers: Timers,
    barrier: bool,
    losses: list[Any],
    iteration: int | None,
) -> tuple[bool, float | None, int | None]:
    """The optimizer's step, timed; a non-finite norm becomes one `NonFiniteError`."""
    _phase(timers, "optimizer").start(**_barrier(timers, barrier))
    try:
        result = optimizer.step()
    except NonFiniteGradError as error:
        raise _non_finite(error, losses, iteration) from error
    _phase(timers, "optimizer").stop()
    return result


class NonFiniteError(FloatingPointError):
    """A NaN or inf loss or gradient norm stopped training before the step was applied."""


def _non_finite(
    error: NonFiniteGradError, losses: list[Any], iteration: int | None
) -> NonFiniteError:
    """The error every rank raises, naming the ranks whose loss was not finite (a collective)."""
    bad_loss = any(
        not math.isfinite(float(torch.as_tensor(v).float().reshape(-1)[0]))
        for item in losses
        for v in (item.values() if isinstance(item, dict) else [item])
    )
    flags = gather_ints(int(bad_loss), "non-finite loss check", iteration=iteration)
    loss_ranks = [rank for rank, flag in enumerate(flags) if flag]
    where = "" if iteration is None else f"iteration {iteration}: "
    loss = f"non-finite loss on rank(s) {loss_ranks}; " if loss_ranks else ""
    return NonFiniteError(
        f"{where}{loss}{error}; training stopped, the last checkpoint is as it was "
        "(--no-check-for-nan-in-loss-and-grad turns this check off)"
    )


def _phase(timers: Timers, name: str) -> Any:
    """A once-per-iteration phase's timer: level 1 with pp-train's `Timers` (Megatron's)."""
    return timers(name, log_level=1) if isinstance(timers, LevelledTimers) else timers(name)


def _barrier(timers: Timers, barrier: bool) -> dict[str, bool]:
    """``start``'s keywords: pp-train's timers take a barrier; a plain `Timers` hook none."""
    return {"barrier": barrier} if isinstance(timers, LevelledTimers) else {}


def evaluate(
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    model: Sequence[torch.nn.Module],
    *,
    forward_backward_func: ForwardBackwardFunc,
    state: ParallelState,
    eval_iters: int,
    num_microbatches: int,
    micro_batch_size: int,
    seq_length: int,
    decoder_seq_length: int | None = None,
) -> dict[str, float]:
    """Forward-only over `eval_iters` global batches; the model is back in train mode after.

    Returns:
        Each loss averaged over all microbatches and data-parallel ranks (on the rank holding
        the last stage; empty elsewhere).
    """
    for chunk in model:
        chunk.eval()
    collected: list[dict[str, Any]] = []
    try:
        with torch.no_grad():
            for _ in range(eval_iters):
                collected += forward_backward_func(
                    forward_step_func=forward_step_func,
                    data_iterator=data_iterator,
                    model=list(model),
                    num_microbatches=num_microbatches,
                    seq_length=seq_length,
                    micro_batch_size=micro_batch_size,
                    decoder_seq_length=decoder_seq_length,
                    forward_only=True,
                )
    finally:
        for chunk in model:
            chunk.train()
    placement = schedule_placement(forward_backward_func, state)
    holds_loss = placement.holds_last(state.pipeline_model_parallel_rank)
    return _average_losses(collected, state) if holds_loss else {}


class _SignalFlag:
    """Records SIGTERM instead of dying, so the loop can save first; restores on exit."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.received = False
        self._previous: Any = None

    def __enter__(self) -> _SignalFlag:
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)


def _any_rank(flags: list[bool]) -> list[bool]:
    """Each flag ORed over every rank, in one collective."""
    values = torch.tensor(flags, dtype=torch.int32, device=collective_device())
    with collective("exit decision"):
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(value) for value in values.tolist()]


@dataclasses.dataclass
class _LoopParts:
    """What `train` and `finetune` step, save and exit with (kept together to pass around)."""

    state: ParallelState
    model: Sequence[torch.nn.Module]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    config: TrainingConfig
    progress: TrainingProgress
    checkpoint_args: dict[str, Any]
    print_fn: Callable[[str], None]
    saved: bool = dataclasses.field(default=False, init=False)
    """Whether the latest iteration saved a checkpoint (`save_on_interval`)."""
    async_saver: AsyncCheckpointSaver | None = dataclasses.field(default=None, init=False)
    """Writes checkpoints in the background (`TrainingConfig.async_save`)."""

    def __post_init__(self) -> None:
        if self.config.save is not None:
            check_save_directory(self.config.save, self.state)
        if self.config.async_save:
            self.async_saver = AsyncCheckpointSaver()

    def finish_saves(self) -> None:
        """Waits for an asynchronous save in flight (published when it returns)."""
        if self.async_saver is not None:
            self.async_saver.wait(self.state)

    def step(
        self,
        forward_step_func: ForwardStepFunc,
        data_iterator: Any,
        forward_backward_func: ForwardBackwardFunc,
        *,
        num_microbatches: int,
        timers: Timers | None = None,
    ) -> tuple[dict[str, float], int, float | None, int | None]:
        """`train_step` on the loop's model, optimizer and scheduler, in its batch shape."""
        with at_iteration(self.progress.iteration + 1):
            return self._train_step(
                forward_step_func,
                data_iterator,
                forward_backward_func,
                num_microbatches=num_microbatches,
                timers=timers,
            )

    def _train_step(
        self,
        forward_step_func: ForwardStepFunc,
        data_iterator: Any,
        forward_backward_func: ForwardBackwardFunc,
        *,
        num_microbatches: int,
        timers: Timers | None,
    ) -> tuple[dict[str, float], int, float | None, int | None]:
        return train_step(
            forward_step_func,
            data_iterator,
            self.model,
            self.optimizer,
            self.scheduler,
            forward_backward_func=forward_backward_func,
            state=self.state,
            num_microbatches=num_microbatches,
            micro_batch_size=self.config.micro_batch_size,
            seq_length=self.config.seq_length,
            decoder_seq_length=self.config.decoder_seq_length,
            timers=timers,
            barrier_with_l1_time=self.config.barrier_with_l1_time,
            iteration=self.progress.iteration + 1,
        )

    def save_on_interval(self) -> None:
        """Saves when the iteration is a multiple of `save_interval`; sets `saved`."""
        self.saved = _every(self.config.save_interval, self.progress.iteration)
        if self.saved:
            self.save()

    def stop(self, reason: ExitReason) -> ExitReason:
        """Saves unless this iteration just did, and says why the loop stops; `reason`."""
        if not self.saved:
            self.save()
        self.print_fn(f"exiting at iteration {self.progress.iteration}: {reason}")
        return reason

    def save(self) -> None:
        if self.config.save is None:
            return
        with at_iteration(self.progress.iteration):
            self._save()
        self.print_fn(
            f"saved checkpoint at iteration {self.progress.iteration} to {self.config.save}"
        )

    def _save(self) -> None:
        assert self.config.save is not None
        save_checkpoint(
            self.config.save,
            self.progress.iteration,
            state=self.state,
            model=list(self.model),
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            args=self.checkpoint_args,
            consumed_train_samples=self.progress.consumed_train_samples,
            consumed_valid_samples=self.progress.consumed_valid_samples,
            ckpt_format=self.config.ckpt_format,
            async_saver=self.async_saver,
        )


class _ScheduleProfile:
    """Records one training iteration's schedule and writes its trace (see TrainingConfig)."""

    def __init__(
        self,
        config: TrainingConfig,
        forward_backward_func: Any,
        state: ParallelState,
        *,
        start: int,
        print_fn: Callable[[str], None],
    ) -> None:
        self.iteration: int | None = None
        self.path = config.profile_schedule_path
        if self.path is None:
            return
        if not isinstance(forward_backward_func, PipelineExecutor):
            raise TypeError(
                "profile_schedule_path needs pp-schedules' executor as forward_backward_func "
                f"(build_forward_backward_func), got {type(forward_backward_func).__name__}"
            )
        check_trace_path(self.path)
        self.executor = forward_backward_func
        self.state = state
        # One pipeline is enough (the others run the same plan); its first stage writes.
        self.records = 0 in state.group_ranks("pp")
        target = config.profile_schedule_iteration
        if target is None:
            target = min(start + 2, config.train_iters)
        if target <= start < config.train_iters:
            print_fn(
                f"not profiling the schedule: iteration {target} was trained before this run "
                f"started at iteration {start}"
            )
            return
        self.iteration = target

    def starts(self, iteration: int) -> bool:
        """Turns recording on when `iteration` (1-based, about to run) is the profiled one."""
        active = iteration == self.iteration
        if active and self.records:
            self.executor.record_timeline(True)
        return active

    def finish(self, num_microbatches: int) -> str:
        """Turns recording off, writes the trace (collective over every rank); the summary."""
        assert self.path is not None
        summary = None
        if self.records:
            self.executor.record_timeline(False)
            summary = write_schedule_trace(
                self.path,
                self.executor,
                num_microbatches=num_microbatches,
                group=self.state.group("pp"),
            )
        # Global rank 0 is in the profiled pipeline; every rank gets its summary.
        shared: list[object] = [summary]
        with collective("schedule profile broadcast", iteration=self.iteration):
            dist.broadcast_object_list(shared, src=0, device=collective_device())
        return f"schedule profile of iteration {self.iteration} written to {self.path}: {shared[0]}"


_AGREED_EXITS: tuple[ExitReason, ...] = ("signal", "autoresume", "exit_duration")


def _exit_reason(
    parts: _LoopParts,
    *,
    started: float,
    signals: _SignalFlag,
    autoresume: Callable[[], bool] | None,
) -> ExitReason | None:
    config, iteration = parts.config, parts.progress.iteration
    asks = autoresume is not None and iteration % config.adlr_autoresume_interval == 0
    timed = config.exit_duration_in_mins is not None
    if config.exit_signal_handler or asks or timed:
        # The checks every rank must agree on share one all-reduce per iteration.
        local = [
            config.exit_signal_handler and signals.received,
            asks and autoresume is not None and autoresume(),
            timed and (time.monotonic() - started) / 60.0 > (config.exit_duration_in_mins or 0),
        ]
        with at_iteration(iteration):
            agreed = _any_rank(local)
        for reason, flagged in zip(_AGREED_EXITS, agreed, strict=True):
            if flagged:
                return reason
    if _every(config.exit_interval, iteration):
        return "exit_interval"
    return None


def _every(interval: int | None, iteration: int) -> bool:
    """Whether `iteration` is a multiple of `interval` (never when it is None)."""
    return interval is not None and iteration % interval == 0


def train(  # noqa: PLR0917 - Megatron's positional order
    forward_step_func: ForwardStepFunc,
    model: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    train_data_iterator: Any,
    valid_data_iterator: Any,
    *,
    state: ParallelState,
    config: TrainingConfig,
    forward_backward_func: ForwardBackwardFunc,
    calculator: NumMicroBatchesCalculator,
    progress: TrainingProgress,
    logger: TrainingLogger,
    timers: Any = None,
    checkpoint_args: dict[str, Any] | None = None,
    autoresume: Callable[[], bool] | None = None,
    print_fn: Callable[[str], None] = print,
) -> ExitReason:
    """Trains until `config.train_iters` or an early exit, as Megatron's ``train``.

    Each iteration: update the microbatch count from the consumed samples, `train_step`,
    count the samples, log; evaluate every `eval_interval`; save every `save_interval`;
    then stop, saving first, on SIGTERM, an autoresume request, `exit_duration_in_mins` or
    `exit_interval`; every rank takes each of these decisions together. With
    `config.profile_schedule_path`, one iteration's schedule is recorded and written as a
    Chrome trace, and its summary line goes to `print_fn`.

    Returns:
        Why training stopped.

    Raises:
        ValueError: `config.profile_schedule_path` cannot be written.
        TypeError: Profiling was asked for without pp-schedules' executor.
    """
    timers = timers if timers is not None else NullTimers()
    parts = _LoopParts(
        state, model, optimizer, scheduler, config, progress, checkpoint_args or {}, print_fn
    )
    profile = _ScheduleProfile(
        config, forward_backward_func, state, start=progress.iteration, print_fn=print_fn
    )
    for chunk in model:
        chunk.train()
    started = time.monotonic()
    loop = _TrainLoop(
        parts, forward_step_func, forward_backward_func, calculator, logger, timers, profile
    )
    with _SignalFlag(config.exit_signal_handler) as signals:
        while progress.iteration < config.train_iters:
            loop.iteration(train_data_iterator, valid_data_iterator)
            reason = _exit_reason(parts, started=started, signals=signals, autoresume=autoresume)
            if reason is not None:
                reason = parts.stop(reason)
                parts.finish_saves()
                return reason
    if not parts.saved and progress.iteration > 0:
        parts.save()  # the final state, unless the last iteration just saved it
    parts.finish_saves()
    return "train_iters"


@dataclasses.dataclass
class _TrainLoop:
    """`train`'s iterations, and the log interval they are timed over."""

    parts: _LoopParts
    forward_step_func: ForwardStepFunc
    forward_backward_func: ForwardBackwardFunc
    calculator: NumMicroBatchesCalculator
    logger: TrainingLogger
    timers: Any
    profile: _ScheduleProfile
    interval_started: float = dataclasses.field(default_factory=time.perf_counter, init=False)
    """When the current log interval started."""
    interval_iterations: int = dataclasses.field(default=0, init=False)
    """Iterations trained in the current log interval."""

    def iteration(self, train_data_iterator: Any, valid_data_iterator: Any) -> None:
        """One iteration: the step (profiled at its turn), the log, evaluation and saving."""
        parts, calculator = self.parts, self.calculator
        config, progress = parts.config, parts.progress
        calculator.update(progress.consumed_train_samples, True)
        profiling = self.profile.starts(progress.iteration + 1)
        step = parts.step(
            self.forward_step_func,
            train_data_iterator,
            self.forward_backward_func,
            num_microbatches=calculator.get(),
            timers=self.timers,
        )
        if profiling:
            parts.print_fn(self.profile.finish(calculator.get()))
        progress.iteration += 1
        batch = calculator.get_current_global_batch_size()
        progress.consumed_train_samples += batch
        self._log(step, batch)
        if (
            _every(config.eval_interval, progress.iteration)
            and valid_data_iterator is not None
            and config.eval_iters > 0
        ):
            _evaluate_and_print(
                self.forward_step_func,
                valid_data_iterator,
                parts=parts,
                calculator=calculator,
                forward_backward_func=self.forward_backward_func,
                logger=self.logger,
            )
        parts.save_on_interval()
        if parts.async_saver is not None:
            parts.async_saver.poll(parts.state)

    def _log(
        self, step: tuple[dict[str, float], int, float | None, int | None], global_batch_size: int
    ) -> None:
        """The iteration's log line, with time and timers averaged over the log interval."""
        self.interval_iterations += 1
        log_now = self.parts.progress.iteration % self.parts.config.log_interval == 0
        _log_step(
            self.logger,
            self.parts.optimizer,
            self.parts.progress,
            step,
            global_batch_size=global_batch_size,
            elapsed_per_iteration=(time.perf_counter() - self.interval_started)
            / self.interval_iterations,
            timers_line=_timers_line(self.timers, self.interval_iterations) if log_now else None,
            params_norm=calc_params_l2_norm(self.parts.model, self.parts.state)
            if self.parts.config.log_params_norm
            else None,
        )
        if log_now:
            self.interval_started, self.interval_iterations = time.perf_counter(), 0


def _log_step(
    logger: TrainingLogger,
    optimizer: MegatronOptimizer,
    progress: TrainingProgress,
    step: tuple[dict[str, float], int, float | None, int | None],
    *,
    global_batch_size: int,
    elapsed_per_iteration: float | None = None,
    timers_line: str | None = None,
    params_norm: float | None = None,
) -> None:
    loss_dict, skipped, grad_norm, zeros = step
    logger.training_log(
        loss_dict,
        iteration=progress.iteration,
        learning_rate=_logged_lr(optimizer),
        loss_scale=float(optimizer.get_loss_scale().item()),
        skipped_iter=skipped,
        grad_norm=grad_norm,
        num_zeros_in_grad=zeros,
        consumed_samples=progress.consumed_train_samples,
        global_batch_size=global_batch_size,
        elapsed_per_iteration=elapsed_per_iteration,
        timers_line=timers_line,
        params_norm=params_norm,
    )


def _logged_lr(optimizer: MegatronOptimizer) -> float:
    """Megatron's canonical rate (the default-config group's), else the first group's."""
    lr = get_canonical_lr_for_logging(optimizer.param_groups)
    return float(optimizer.param_groups[0]["lr"] if lr is None else lr)


_LOGGED_TIMERS = (
    "forward-backward",
    "forward-compute",
    "backward-compute",
    "grads-all-reduce",
    "optimizer",
)


def _timers_line(timers: Any, iterations: int) -> str | None:
    """Per-iteration ms of the main phases over all ranks (a collective), with its header."""
    log_string = getattr(timers, "log_string", None)
    if not callable(log_string):
        return None
    line = log_string(
        _LOGGED_TIMERS, normalizer=max(1, iterations), group=dist.group.WORLD, header=True
    )
    return line if isinstance(line, str) else None


def _evaluate_and_print(
    forward_step_func: ForwardStepFunc,
    valid_data_iterator: Any,
    *,
    parts: _LoopParts,
    calculator: NumMicroBatchesCalculator,
    forward_backward_func: ForwardBackwardFunc,
    logger: TrainingLogger,
) -> dict[str, float]:
    config, progress = parts.config, parts.progress
    losses = evaluate(
        forward_step_func,
        valid_data_iterator,
        parts.model,
        forward_backward_func=forward_backward_func,
        state=parts.state,
        eval_iters=config.eval_iters,
        num_microbatches=calculator.get(),
        micro_batch_size=config.micro_batch_size,
        seq_length=config.seq_length,
        decoder_seq_length=config.decoder_seq_length,
    )
    progress.consumed_valid_samples += (
        config.eval_iters * calculator.get_current_global_batch_size()
    )
    if losses:
        text = " | ".join(
            f"{key} value: {value:.6E} | {key} PPL: {math.exp(min(20.0, value)):.6E}"
            for key, value in losses.items()
        )
        logger.validation_log(
            losses,
            iteration=progress.iteration,
            consumed_samples=progress.consumed_train_samples,
            line=text,
        )
    return losses


def finetune(
    forward_step_func: ForwardStepFunc,
    model: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    epoch_batches: Callable[[int], Iterator[Any]],
    *,
    epochs: int,
    train_iters_per_epoch: int,
    state: ParallelState,
    config: TrainingConfig,
    forward_backward_func: ForwardBackwardFunc,
    progress: TrainingProgress,
    logger: TrainingLogger,
    end_of_epoch_callback: Callable[[Sequence[torch.nn.Module], int], None] | None = None,
    valid_data_iterator: Any = None,
    checkpoint_args: dict[str, Any] | None = None,
    print_fn: Callable[[str], None] = print,
) -> ExitReason:
    """Trains over epochs of a finite data source, as the seed's ``_train`` (one microbatch).

    `epoch_batches(epoch)` yields the epoch's microbatches in order (shuffle by epoch inside
    it). A run resumed at iteration ``i`` starts in epoch ``i // train_iters_per_epoch`` and
    skips its first ``i % train_iters_per_epoch`` batches, so it sees what an unbroken run
    would. After each epoch: save (when `config.save`) and call
    ``end_of_epoch_callback(model, epoch)``.

    Returns:
        "exit_interval" when `config.exit_interval` stopped it, else "train_iters".
    """
    if train_iters_per_epoch < 1 or epochs < 1:
        raise ValueError(
            f"epochs and train_iters_per_epoch must be >= 1, got {epochs} and "
            f"{train_iters_per_epoch}"
        )
    parts = _LoopParts(
        state, model, optimizer, scheduler, config, progress, checkpoint_args or {}, print_fn
    )
    start_epoch = progress.iteration // train_iters_per_epoch
    skip = progress.iteration % train_iters_per_epoch
    for chunk in model:
        chunk.train()
    for epoch in range(start_epoch, epochs):
        print_fn(f"working on epoch {epoch + 1} ...")
        for index, batch in enumerate(epoch_batches(epoch)):
            if index >= train_iters_per_epoch:
                break
            if index < skip:
                continue
            skip = 0
            reason = _finetune_iteration(
                parts, forward_step_func, forward_backward_func, logger, batch
            )
            if reason is not None:
                return reason
        parts.save()
        if end_of_epoch_callback is not None:
            end_of_epoch_callback(model, epoch)
    parts.finish_saves()
    return "train_iters"


def _finetune_iteration(
    parts: _LoopParts,
    forward_step_func: ForwardStepFunc,
    forward_backward_func: ForwardBackwardFunc,
    logger: TrainingLogger,
    batch: Any,
) -> ExitReason | None:
    """One `finetune` iteration on one microbatch; "exit_interval" when the run stops after it."""
    model, progress = parts.model, parts.progress
    step = parts.step(
        forward_step_func,
        [iter([batch]) for _ in model] if len(model) > 1 else iter([batch]),
        forward_backward_func,
        num_microbatches=1,
    )
    global_batch_size = parts.config.micro_batch_size * parts.state.group_size("dp_cp")
    progress.iteration += 1
    progress.consumed_train_samples += global_batch_size
    _log_step(logger, parts.optimizer, progress, step, global_batch_size=global_batch_size)
    parts.save_on_interval()
    if _every(parts.config.exit_interval, progress.iteration):
        reason = parts.stop("exit_interval")
        parts.finish_saves()
        return reason
    return None
