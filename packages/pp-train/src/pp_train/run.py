"""One training run: its settings, where it stands, and the objects it steps and saves.

`TrainingConfig` says how long to train and how often to evaluate, save and log;
`TrainingProgress` is where a run stands (saved in checkpoints); `TrainingRun` steps and
saves the model, optimizer and scheduler, for `train` and `finetune` alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from pp_comm import Timers
from pp_optim import MegatronOptimizer, OptimizerParamScheduler
from pp_state import ParallelState, Placement
from pp_state.collectives import at_iteration
from pp_state.numbers import is_int
from pp_train.arguments import (
    CheckpointArgs,
    LoggingArgs,
    ModelArgs,
    PretrainConfig,
    TrainingArgs,
)
from pp_train.checkpoint import (
    AsyncCheckpointSaver,
    CkptFormat,
    check_save_directory,
    save_checkpoint,
)
from pp_train.step import ForwardBackwardFunc, ForwardStepFunc, StepResult, train_step

__all__ = [
    "ExitReason",
    "TrainingConfig",
    "TrainingProgress",
    "TrainingRun",
    "as_pretrain_config",
    "every",
    "loop_config",
]

ExitReason = Literal[
    "train_iters", "exit_interval", "exit_duration", "signal", "autoresume", "converted"
]
"""Why a run stopped; ``converted``: `pretrain` converted ``--load``'s checkpoint and did
not train (``--ckpt-convert-format``)."""


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
            ValueError: A count or interval is not positive, or a value the loop's sections
                refuse (`as_pretrain_config` runs here, so nothing fails later in `train`).
        """
        for name in ("train_iters", "micro_batch_size", "seq_length", "log_interval"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("eval_interval", "save_interval", "exit_interval", "decoder_seq_length"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
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
            if not is_int(iteration) or iteration < 1:
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
        as_pretrain_config(self)


def as_pretrain_config(config: TrainingConfig) -> PretrainConfig:
    """`config` as the sections of a `PretrainConfig`, which the loop reads.

    The Megatron-shaped `train` and `finetune` take a `TrainingConfig` and hand this on; a
    `PretrainConfig` goes to them as it is. A save interval without a save directory saves
    nothing, as before, so it is left out.
    """
    return PretrainConfig(
        model=ModelArgs(seq_length=config.seq_length, decoder_seq_length=config.decoder_seq_length),
        training=TrainingArgs(
            train_iters=config.train_iters,
            micro_batch_size=config.micro_batch_size,
            eval_interval=config.eval_interval,
            eval_iters=config.eval_iters,
            exit_interval=config.exit_interval,
            # Never, said as infinity, is None to the flags.
            exit_duration_in_mins=None
            if config.exit_duration_in_mins == math.inf
            else config.exit_duration_in_mins,
            exit_signal_handler=config.exit_signal_handler,
            adlr_autoresume_interval=config.adlr_autoresume_interval,
        ),
        checkpoint=CheckpointArgs(
            save=config.save,
            save_interval=config.save_interval if config.save is not None else None,
            ckpt_format=config.ckpt_format,
            async_save=config.async_save,
        ),
        logging=LoggingArgs(
            log_interval=config.log_interval,
            log_params_norm=config.log_params_norm,
            barrier_with_l1_time=config.barrier_with_l1_time,
            profile_schedule=config.profile_schedule_path,
            profile_schedule_iteration=config.profile_schedule_iteration,
        ),
    )


def loop_config(config: TrainingConfig | PretrainConfig) -> PretrainConfig:
    """What the loop reads: a `PretrainConfig` as it is, a `TrainingConfig` as its sections."""
    return as_pretrain_config(config) if isinstance(config, TrainingConfig) else config


@dataclasses.dataclass
class TrainingProgress:
    """Where a run stands; saved in checkpoints."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def every(interval: int | None, iteration: int) -> bool:
    """Whether `iteration` is a multiple of `interval` (never when it is None)."""
    return interval is not None and iteration % interval == 0


@dataclasses.dataclass
class TrainingRun:
    """The model, optimizer and scheduler a run steps, and how it saves them.

    Checks the save directory when built; with an asynchronous save
    (`CheckpointArgs.async_save`) it owns the background writer.
    """

    state: ParallelState
    model: Sequence[torch.nn.Module]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    config: PretrainConfig
    """The run's sections (`loop_config` turns a `TrainingConfig` into them)."""
    progress: TrainingProgress
    checkpoint_args: dict[str, Any]
    print_fn: Callable[[str], None]
    placement: Placement | None = None
    """Which stage each chunk holds (the resolved schedule's); None: `train_step` asks the
    forward-backward function."""
    saved: bool = dataclasses.field(default=False, init=False)
    """Whether the latest iteration saved a checkpoint (`save_on_interval`)."""
    async_saver: AsyncCheckpointSaver | None = dataclasses.field(default=None, init=False)
    """Writes checkpoints in the background (`CheckpointArgs.async_save`)."""

    def __post_init__(self) -> None:
        """Checks the save directory; starts the background writer when asked for."""
        if self.config.checkpoint.save is not None:
            check_save_directory(self.config.checkpoint.save, self.state)
        if self.config.checkpoint.async_save:
            self.async_saver = AsyncCheckpointSaver()

    def step(
        self,
        forward_step_func: ForwardStepFunc,
        data_iterator: Any,
        forward_backward_func: ForwardBackwardFunc,
        *,
        num_microbatches: int,
        timers: Timers | None = None,
    ) -> StepResult:
        """`train_step` of the next iteration, in the configured batch shape."""
        iteration = self.progress.iteration + 1
        with at_iteration(iteration):
            return train_step(
                forward_step_func,
                data_iterator,
                self.model,
                self.optimizer,
                self.scheduler,
                forward_backward_func=forward_backward_func,
                state=self.state,
                num_microbatches=num_microbatches,
                micro_batch_size=self.config.training.micro_batch_size,
                seq_length=self.config.model.seq_length,
                decoder_seq_length=self.config.model.decoder_seq_length,
                timers=timers,
                barrier_with_l1_time=self.config.logging.barrier_with_l1_time,
                iteration=iteration,
                placement=self.placement,
                empty_unused_memory_level=self.config.training.empty_unused_memory_level,
            )

    def save_on_interval(self) -> None:
        """Saves when the iteration is a multiple of `save_interval`; sets `saved`."""
        self.saved = every(self.config.checkpoint.save_interval, self.progress.iteration)
        if self.saved:
            self.save()

    def stop(self, reason: ExitReason) -> ExitReason:
        """Saves unless this iteration just did, waits for the saves, says why; `reason`."""
        if not self.saved:
            self.save()
        self.print_fn(f"exiting at iteration {self.progress.iteration}: {reason}")
        self.finish_saves()
        return reason

    def finish_saves(self) -> None:
        """Waits for an asynchronous save in flight (published when it returns)."""
        if self.async_saver is not None:
            self.async_saver.wait(self.state)

    def save(self) -> None:
        """Saves a checkpoint of the current iteration when `CheckpointArgs.save` is set."""
        directory = self.config.checkpoint.save
        if directory is None:
            return
        with at_iteration(self.progress.iteration):
            save_checkpoint(
                directory,
                self.progress.iteration,
                state=self.state,
                model=list(self.model),
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                args=self.checkpoint_args,
                consumed_train_samples=self.progress.consumed_train_samples,
                consumed_valid_samples=self.progress.consumed_valid_samples,
                ckpt_format=self.config.checkpoint.ckpt_format,
                async_saver=self.async_saver,
            )
        self.print_fn(f"saved checkpoint at iteration {self.progress.iteration} to {directory}")
