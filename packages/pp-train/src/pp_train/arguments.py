"""A training run's configuration as data: Megatron's flags, one frozen dataclass per group.

The optimizer's group is pp-optim's own `OptimizerConfig`, the gradient buffer's pp-optim's
`DDPConfig`, the learning-rate schedule's pp-optim's `LRScheduleArgs` (Megatron's flags in
iterations, which turn into the scheduler's samples) and the data's
`pp_train.data.DataConfig`. Their fields are Megatron's flag names, or carry the flag in their
metadata, so each setting and its default is declared once, where it is used, and the object
is handed on as it is.

Each field is one flag of the same name (`pp_train.flags` makes the parser from these
classes), with its default and the docstring under it as help. Each class checks its own
values when built; `PretrainConfig` checks those that depend on one another. Checks that need
the world size are `PretrainConfig.check_world`. All of them run before any process group
starts. Messages name the flags, since that is how most runs are configured.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Literal, get_type_hints

from pp_optim import DDPConfig, LRScheduleArgs, OptimizerConfig
from pp_state.numbers import divisors
from pp_tensor import CP_COMM_TYPES
from pp_train.data.config import DataConfig
from pp_train.flags import add_config_flags, config_from_args
from pp_train.recompute import RecomputeConfig
from pp_train.timers import TimingLogOption

__all__ = [
    "CheckpointArgs",
    "LRScheduleArgs",
    "LoggingArgs",
    "ModelArgs",
    "ParallelArgs",
    "PipelineScheduleName",
    "PretrainConfig",
    "TrainingArgs",
    "add_pretrain_flags",
    "pretrain_config_from_args",
]

PipelineScheduleName = Literal[
    "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev", "auto"
]
FbOverlap = Literal["sequential", "chunk", "threads"]
CpCommType = Literal["p2p", "all_gather"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_at_least(config: object, names: tuple[str, ...], minimum: int = 1) -> None:
    """Each named field, unless None, is an int of at least `minimum`."""
    for name in names:
        value = getattr(config, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{_flag(name)} must be an integer {minimum} or more, got {value!r}")


def _check_positive_real(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
            raise ValueError(f"{_flag(name)} must be a positive finite number, got {value!r}")


def _check_margin(margin: float | None, limit: float | None) -> None:
    """A margin is a share of the memory limit, from 0 up to (not including) 1.

    Raises:
        ValueError: Outside that range, not a number, or without --memory-limit-gb.
    """
    if margin is None:
        return
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(
            f"--memory-limit-margin must be a share of --memory-limit-gb from 0 up to (not "
            f"including) 1, such as 0.1 to keep a tenth free; got {margin!r}"
        )
    if limit is None:
        raise ValueError(
            f"--memory-limit-margin {margin:g} needs --memory-limit-gb: it is a share of that limit"
        )


def _check_costs(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value < math.inf):
            raise ValueError(f"{_flag(name)} must be a finite number 0 or more, got {value!r}")


def _check_layout_flags(parallel: ParallelArgs) -> None:
    """A layout, first/last layer counts and layers per virtual stage each describe the split."""
    layout = parallel.pipeline_model_parallel_layout
    given = [
        f"{_flag(name)} {value}"
        for name in (
            "pipeline_model_parallel_layout",
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
            "num_layers_per_virtual_pipeline_stage",
        )
        if (value := getattr(parallel, name)) is not None
    ]
    if layout is not None and len(given) > 1:
        raise ValueError(
            f"{given[0]} says which layers each stage holds, so {', '.join(given[1:])} "
            "cannot be given with it; give the layout alone"
        )
    decoder = [flag for flag in given if flag.startswith("--decoder")]
    if decoder and parallel.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError(
            f"{' and '.join(decoder)} with --num-layers-per-virtual-pipeline-stage "
            f"{parallel.num_layers_per_virtual_pipeline_stage}: with virtual stages, write the "
            "split as --pipeline-model-parallel-layout (e.g. 'Et|tt|tt|tL')"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelArgs:
    """Parallelism and the pipeline schedule."""

    tensor_model_parallel_size: int = 1
    """Ranks each layer's weights are split over (tensor parallelism); the world is tensor x
    pipeline x data parallel. It must divide the attention heads and the FFN size."""

    sequence_parallel: bool = False
    """With tensor parallelism, also split the activations outside the tensor-parallel
    regions (layer norms, dropout, residual adds, the transfers between stages) along the
    sequence; --seq-length must divide by the tensor-parallel size. At tensor-parallel size 1
    it is turned off with a warning (Megatron's behaviour)."""

    pipeline_model_parallel_size: int = 1
    """Pipeline stages; the rest of the world is data parallel."""

    context_parallel_size: int = 1
    """Ranks each sequence is split over (context parallelism): the sequence is cut into 2 x
    this many chunks and each rank holds two (Megatron's load balancing); attention passes
    keys and values between them (--cp-comm-type). --seq-length must divide by 2 x this size.
    The world is tensor x context x pipeline x data parallel; gradients are reduced over data
    x context parallel ranks."""

    cp_comm_type: CpCommType = "p2p"
    """How context-parallel attention exchanges keys and values: p2p (a ring, each block passed
    on while the one held is computed) or all_gather (every rank's at once)."""

    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per model chunk; fewer than layers / pipeline size gives each rank several chunks
    (interleaved 1F1B by default)."""

    pipeline_model_parallel_layout: str | None = None
    """Which layers each virtual stage holds, in Megatron's layout syntax (E embedding, t
    transformer layer, L output layer and loss, '|' between virtual stages, '*N' repeats,
    e.g. 'Ettt|tttL' or 'E|t*3|t*3|L'); the number of stages over the pipeline size gives the
    virtual size. 'auto': the split whose simulated step is shortest (the default when the
    layers do not divide over the pipeline)."""

    decoder_first_pipeline_num_layers: int | None = None
    """Transformer layers of the first pipeline stage (Megatron's shorthand for a layout); the
    stages between the first and the last share the rest evenly."""

    decoder_last_pipeline_num_layers: int | None = None
    """Transformer layers of the last pipeline stage (Megatron's shorthand for a layout)."""

    pipeline_layout_embedding_cost: float | None = None
    """For 'auto' layouts: the embedding's time in transformer layers (e.g. 0.5); measured in a
    short warm-up by the command, and 1 in the library, when not given."""

    pipeline_layout_loss_cost: float | None = None
    """For 'auto' layouts: the output layer's and loss's time in transformer layers; measured in
    a short warm-up by the command, and 1 in the library, when not given."""

    pipeline_schedule: PipelineScheduleName | None = None
    """The schedule; by default interleaved_1f1b with virtual stages, 1f1b otherwise
    (Megatron's choice). zb_h1 and zbv split backwards (zero bubble; zbv needs 2 chunks per
    rank); dualpipev (DeepSeek's DualPipeV, 2 chunks per rank on the V, at least 2 x the
    pipeline size microbatches) runs one microbatch's forward beside another's backward; auto
    picks the shortest simulated schedule that holds no more activations than 1F1B."""

    fb_overlap: FbOverlap | None = None
    """How dualpipev's F&B steps run: sequential (the forward, then the backward), chunk (the
    model chunk class's overlapped_forward_backward) or threads (the two halves take turns,
    each computing while the other waits on communication); by default the chunk's function
    if it has one, else sequential."""

    pipeline_schedule_file: str | None = None
    """Run the plan in this text file instead (one line of actions per pipeline rank, e.g.
    'rank 0: F0 F1 B0 B1'; an optional 'placement: looped|v' line); checked up front."""

    distributed_timeout_minutes: float = 10.0
    """How long any collective or transfer may wait before it fails."""

    memory_limit_gb: float | None = None
    """The most memory (GiB) any rank may allocate, as the byte model predicts its peak
    (parameters, gradients, optimizer state, activations, gradients and tensors in flight,
    transfer buffers; each part measured on one microbatch in a warm-up; host data apart).
    With --pipeline-schedule auto: the schedule, virtual stages, layer split and recomputation
    with the shortest simulated step that fits; with a named schedule: checked before training."""

    memory_limit_margin: float | None = None
    """The share of --memory-limit-gb kept free for what the byte model cannot see (on CUDA
    the caching allocator's fragmentation and rounding): a plan fits when its predicted peak
    is at most (1 - margin) x the limit. Default: 0.1 on CUDA (NCCL), 0 on CPU (gloo), where
    there is no caching allocator."""

    def __post_init__(self) -> None:
        """Checks sizes and the timeout; a schedule name and a plan file exclude each other."""
        _check_at_least(
            self,
            (
                "tensor_model_parallel_size",
                "pipeline_model_parallel_size",
                "context_parallel_size",
                "num_layers_per_virtual_pipeline_stage",
            ),
        )
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"--cp-comm-type {self.cp_comm_type!r} is unknown; use one of "
                f"{', '.join(CP_COMM_TYPES)}"
            )
        _check_positive_real(self, ("distributed_timeout_minutes", "memory_limit_gb"))
        _check_margin(self.memory_limit_margin, self.memory_limit_gb)
        _check_at_least(
            self, ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"), 0
        )
        _check_costs(self, ("pipeline_layout_embedding_cost", "pipeline_layout_loss_cost"))
        _check_layout_flags(self)
        _check_fb_overlap(self)
        if self.pipeline_schedule is not None and self.pipeline_schedule_file is not None:
            raise ValueError(
                f"--pipeline-schedule {self.pipeline_schedule} and --pipeline-schedule-file "
                f"{self.pipeline_schedule_file} exclude each other; give one"
            )

    @property
    def sequence_parallel_in_use(self) -> bool:
        """``--sequence-parallel`` where it applies: off at tensor-parallel size 1 (Megatron)."""
        return self.sequence_parallel and self.tensor_model_parallel_size > 1


def _check_fb_overlap(parallel: ParallelArgs) -> None:
    """``--fb-overlap`` overlaps F&B steps: a schedule with them, and no tensor parallelism.

    Raises:
        ValueError: A named schedule without F&B steps, or ``threads`` with tensor
            parallelism; the message names the flags and the fix.
    """
    overlap, schedule = parallel.fb_overlap, parallel.pipeline_schedule
    if overlap in (None, "sequential"):
        return
    if schedule not in (None, "dualpipev", "auto") or (
        schedule is None and parallel.pipeline_schedule_file is None
    ):
        raise ValueError(
            f"--fb-overlap {overlap} overlaps the F&B steps of dualpipev, but --pipeline-schedule "
            f"{schedule or '(the default)'} has none; use --pipeline-schedule dualpipev, or drop "
            "--fb-overlap"
        )
    tp = parallel.tensor_model_parallel_size
    if overlap == "threads" and tp > 1:
        raise ValueError(
            f"--fb-overlap threads with --tensor-model-parallel-size {tp}: the two halves of an "
            "F&B step would issue their tensor-parallel collectives in an order that can differ "
            "between tensor-parallel ranks; use --fb-overlap sequential (or chunk, with a chunk "
            "that orders them itself)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """The model's shape.

    Also its dropout and activation recomputation (in Megatron, model flags too).
    """

    num_layers: int = 8
    """Transformer layers."""

    hidden_size: int = 64
    """Width of the activations between layers (and between pipeline stages)."""

    num_attention_heads: int = 4
    """Attention heads; they must divide the hidden size."""

    ffn_hidden_size: int | None = None
    """Width of the MLP (None: 4 x hidden size)."""

    seq_length: int = 64
    """Tokens per sample."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size (Megatron's
    rule); the padded rows are never a target."""

    decoder_seq_length: int | None = None
    """Encoder-decoder models: the decoder's tokens per sample (None: --seq-length)."""

    untie_embeddings_and_output_weights: bool = False
    """Give the output layer a weight of its own instead of reusing the word embedding's
    (tied, the default); the last pipeline stage then builds it and no embedding-group sum
    touches it. Saved in checkpoints; a resumed run must use the same setting."""

    openai_gelu: bool = False
    """The MLP's activation is GELU's tanh approximation (GPT-2's gelu_new) instead of the
    exact, erf-based GELU. Saved in checkpoints; a resumed run must use the same setting."""

    hidden_dropout: float = 0.1
    """Dropout probability on the embedding's, the attention's and the MLP's output (before
    each residual add); Megatron's default 0.1 (the pp-train command's is 0)."""

    attention_dropout: float = 0.1
    """Dropout probability on the attention probabilities; Megatron's default 0.1 (the
    pp-train command's is 0)."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """Recompute activations in backward instead of keeping them: full (whole transformer
    layers, with --recompute-method and --recompute-num-layers) or selective (the core
    attention only)."""

    recompute_method: Literal["uniform", "block"] | None = None
    """With --recompute-granularity full: uniform checkpoints groups of --recompute-num-layers
    consecutive layers; block checkpoints the first --recompute-num-layers layers of each
    model chunk and keeps the rest."""

    recompute_num_layers: int | None = None
    """With --recompute-granularity full: layers per group (uniform) or recomputed layers per
    model chunk (block); at most the layers of the fullest chunk."""

    recompute_activations: bool = False
    """Megatron's shorthand for --recompute-granularity selective."""

    def __post_init__(self) -> None:
        """Checks the sizes, that the heads divide the hidden size, dropout and recompute."""
        names = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")
        _check_at_least(
            self, (*names, "seq_length", "decoder_seq_length", "make_vocab_size_divisible_by")
        )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; use one of {divisors(self.hidden_size)} heads"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise ValueError(f"{_flag(name)} must be a probability in [0, 1), got {value!r}")
        if self.recompute_activations and self.recompute_granularity not in (None, "selective"):
            raise ValueError(
                "--recompute-activations means --recompute-granularity selective, but "
                f"--recompute-granularity is {self.recompute_granularity}; give one of the two"
            )
        _ = self.recompute  # building it checks the recompute flags against each other

    @property
    def recompute(self) -> RecomputeConfig | None:
        """The recompute flags as the model takes them; None when nothing is recomputed.

        Raises:
            ValueError: The flags contradict each other (e.g. --recompute-method without
                --recompute-granularity full); the message names them.
        """
        granularity = "selective" if self.recompute_activations else self.recompute_granularity
        config = RecomputeConfig(
            granularity=granularity,
            method=self.recompute_method,
            num_layers=self.recompute_num_layers,
        )
        return config if config.enabled else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingArgs:
    """Training length, batches, evaluation and early exits."""

    train_iters: int = 200
    """Iterations to train for."""

    micro_batch_size: int = 4
    """Samples per microbatch on one data-parallel rank."""

    global_batch_size: int = 32
    """Samples per iteration over all data-parallel ranks."""

    rampup_batch_size: tuple[int, int, int] | None = dataclasses.field(
        default=None, metadata={"metavar": ("START", "INCREMENT", "SAMPLES")}
    )
    """START INCREMENT SAMPLES: grow the global batch from START by INCREMENT over SAMPLES."""

    eval_interval: int | None = 100
    """Evaluate every this many iterations (None, in the library: never during training)."""

    eval_iters: int = 4
    """Global batches per evaluation (0: no evaluation)."""

    exit_interval: int | None = None
    """Save and stop when the iteration is a multiple of this."""

    exit_duration_in_mins: float | None = None
    """Save and stop after this many minutes."""

    exit_signal_handler: bool = True
    """On SIGTERM, finish the iteration, save and stop."""

    adlr_autoresume_interval: int = 1000
    """Ask the autoresume hook (the library's ``autoresume``) every this many iterations
    whether to save and stop."""

    seed: int = 1234
    """Seed of the weights, the data order and dropout."""

    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Hand the CUDA allocator's cached, unused blocks back to the device (Megatron's flag):
    1 after each step's forward and backward passes and after each evaluation step, 2 also
    after the optimizer step. Costs time; helps when memory is fragmented. Nothing on CPU."""

    def __post_init__(self) -> None:
        """Checks counts, intervals and the memory level."""
        names = ("train_iters", "micro_batch_size", "global_batch_size", "eval_interval")
        _check_at_least(self, (*names, "exit_interval", "adlr_autoresume_interval"))
        _check_at_least(self, ("eval_iters", "seed"), minimum=0)
        _check_positive_real(self, ("exit_duration_in_mins",))
        level = self.empty_unused_memory_level
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise ValueError(
                f"--empty-unused-memory-level must be 0, 1 or 2 (0: never empty the CUDA "
                f"cache, 1: after forward-backward, 2: also after the optimizer), got {level!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointArgs:
    """Checkpoints."""

    save: str | None = None
    """Directory to save checkpoints to."""

    load: str | None = None
    """Directory to resume from (an empty one starts from scratch)."""

    save_interval: int | None = None
    """Save every this many iterations (and on an early exit)."""

    finetune: bool = False
    """Load the weights only and start at iteration 0."""

    no_load_optim: bool = False
    """Do not load the optimizer state."""

    no_load_rng: bool = False
    """Do not load the random-number generators' states."""

    ckpt_format: Literal["torch", "torch_dist"] = "torch"
    """Format of saved checkpoints: torch (one file per pipeline stage; resumes only at the
    same layout) or torch_dist (torch.distributed.checkpoint; resumes at any pipeline,
    virtual and data-parallel size)."""

    auto_detect_ckpt_format: bool = False
    """Load a checkpoint in whichever format it is (otherwise it must be --ckpt-format)."""

    async_save: bool = False
    """Write torch_dist checkpoints in the background while training goes on."""

    ckpt_convert_format: Literal["torch", "torch_dist"] | None = None
    """Convert the checkpoint of --load to this format, write it to --ckpt-convert-save and
    exit without training."""

    ckpt_convert_save: str | None = None
    """Directory the checkpoint converted by --ckpt-convert-format is written to."""

    def __post_init__(self) -> None:
        """An interval needs a directory; an asynchronous save needs torch_dist."""
        _check_at_least(self, ("save_interval",))
        self._check_convert()
        if self.save_interval is not None and self.save is None:
            raise ValueError("--save-interval needs --save DIR")
        if self.async_save and self.ckpt_format != "torch_dist":
            raise ValueError(
                f"--async-save needs --ckpt-format torch_dist, got --ckpt-format {self.ckpt_format}"
            )

    def _check_convert(self) -> None:
        """Conversion: both flags or neither, a --load to read, and another directory."""
        fmt, target = self.ckpt_convert_format, self.ckpt_convert_save
        if (fmt is None) != (target is None):
            given, missing = (
                ("--ckpt-convert-format", "--ckpt-convert-save DIR")
                if target is None
                else ("--ckpt-convert-save", "--ckpt-convert-format {torch,torch_dist}")
            )
            raise ValueError(f"{given} needs {missing} (conversion takes both flags)")
        if target is None:
            return
        if self.load is None:
            raise ValueError("--ckpt-convert-format needs --load DIR: the checkpoint to convert")
        if os.path.abspath(target) == os.path.abspath(self.load):
            raise ValueError(
                f"--ckpt-convert-save {target} is the --load directory; write the converted "
                "checkpoint to another directory (the input is never changed)"
            )
        blocked = [flag for flag, on in (("--finetune", self.finetune),
                   ("--no-load-optim", self.no_load_optim), ("--no-load-rng", self.no_load_rng))
                   if on]  # fmt: skip
        if blocked:
            raise ValueError(
                f"--ckpt-convert-format copies the whole checkpoint; it cannot be combined "
                f"with {', '.join(blocked)}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingArgs:
    """Logging, timers and profiles."""

    log_interval: int = 10
    """Print the log line every this many iterations."""

    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here."""

    log_params_norm: bool = False
    """Report the parameters' L2 norm in the log line and TensorBoard."""

    timing_log_level: Literal[0, 1, 2] = 0
    """0: iteration time only (no timer waits); 1: also once-per-iteration phases
    (forward-backward, gradient reduction, optimizer); 2: also each forward, backward and
    transfer."""

    timing_log_option: TimingLogOption = "minmax"
    """What the timers line shows of the ranks' times: the max, min and max, or all."""

    barrier_with_l1_time: bool = dataclasses.field(
        default=True, metadata={"flag": "--barrier-with-L1-time"}
    )
    """Level-1 timers start after a barrier and a device synchronisation; off, no timer
    waits."""

    profile_schedule: str | None = None
    """Write one training iteration's measured and simulated schedule to this Chrome-trace
    JSON file and print a summary line."""

    profile_schedule_iteration: int | None = None
    """The iteration --profile-schedule records (None: the second this run trains)."""

    stop_report_dir: str | None = dataclasses.field(default=None, metadata={"metavar": "DIR"})
    """Where a stopped pipeline's report goes (pipeline-stop-iter<N>-rank<R>.txt, .json,
    .trace.json); None: --tensorboard-dir, else --save, else the working directory."""

    def __post_init__(self) -> None:
        """Checks the interval and that a profile iteration comes with a profile file."""
        _check_at_least(self, ("log_interval", "profile_schedule_iteration"))
        if self.profile_schedule_iteration is not None and self.profile_schedule is None:
            raise ValueError("--profile-schedule-iteration needs --profile-schedule PATH")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    """Everything a training run is configured with, group by group."""

    parallel: ParallelArgs = dataclasses.field(default_factory=ParallelArgs)
    model: ModelArgs = dataclasses.field(default_factory=ModelArgs)
    training: TrainingArgs = dataclasses.field(default_factory=TrainingArgs)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    ddp: DDPConfig = dataclasses.field(default_factory=DDPConfig)
    lr_schedule: LRScheduleArgs = dataclasses.field(default_factory=LRScheduleArgs)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointArgs = dataclasses.field(default_factory=CheckpointArgs)
    logging: LoggingArgs = dataclasses.field(default_factory=LoggingArgs)

    def __post_init__(self) -> None:
        """Checks what one group's value means for another's."""
        schedule, train_iters = self.lr_schedule, self.training.train_iters
        if schedule.min_lr > self.optimizer.lr:
            raise ValueError(f"--min-lr {schedule.min_lr} is above --lr {self.optimizer.lr}")
        if schedule.lr_warmup_iters >= self.lr_decay_iters:
            raise ValueError(
                f"--lr-warmup-iters {schedule.lr_warmup_iters} must be below the decay length "
                f"{self.lr_decay_iters} (--lr-decay-iters, default --train-iters)"
            )
        iteration = self.logging.profile_schedule_iteration
        if iteration is not None and iteration > train_iters:
            raise ValueError(
                f"--profile-schedule-iteration {iteration} is past --train-iters "
                f"{train_iters}; use 1 .. {train_iters}"
            )

    @property
    def groups(self) -> tuple[object, ...]:
        """The groups, in the order of ``--help``."""
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    @property
    def train_valid_test_num_samples(self) -> tuple[int, int, int]:
        """The samples each dataset must hold, as Megatron counts them.

        Training: iterations x global batch; validation: every evaluation during training and
        the final one; test: one evaluation.
        """
        training = self.training
        gbs, eval_iters = training.global_batch_size, training.eval_iters
        interval = training.eval_interval
        evaluations = (0 if interval is None else training.train_iters // interval) + 1
        return training.train_iters * gbs, evaluations * eval_iters * gbs, eval_iters * gbs

    @property
    def lr_decay_iters(self) -> int:
        """The decay length in iterations (--lr-decay-iters, default --train-iters)."""
        return self.lr_schedule.decay_iters(self.training.train_iters)


def add_pretrain_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every group's flags to `parser` (one ``--help`` group each); returns it."""
    hints = get_type_hints(PretrainConfig)
    classes = [hints[field.name] for field in dataclasses.fields(PretrainConfig)]
    add_config_flags(parser, classes)
    return parser


def pretrain_config_from_args(args: argparse.Namespace) -> PretrainConfig:
    """The configuration the parsed flags describe.

    Raises:
        ValueError: A value, or a combination of values, that is refused (the message names
            the flags).
    """
    hints = get_type_hints(PretrainConfig)
    groups = {
        field.name: config_from_args(hints[field.name], args)
        for field in dataclasses.fields(PretrainConfig)
    }
    return PretrainConfig(**groups)
