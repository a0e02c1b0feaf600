"""Finetuning: training over epochs of a finite data source, one microbatch per iteration."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from pp_optim import MegatronOptimizer, OptimizerParamScheduler
from pp_state import ParallelState
from pp_train.arguments import PretrainConfig
from pp_train.reporting import TrainingLogger
from pp_train.run import (
    ExitReason,
    TrainingConfig,
    TrainingProgress,
    TrainingRun,
    every,
    loop_config,
)
from pp_train.step import ForwardBackwardFunc, ForwardStepFunc
from pp_train.step_log import log_step

__all__ = ["finetune"]


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
    config: TrainingConfig | PretrainConfig,
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
    would. After each epoch: save (when a save directory is set) and call
    ``end_of_epoch_callback(model, epoch)``. `config` as `train` takes it.

    Returns:
        "exit_interval" when the exit interval stopped it, else "train_iters".
    """
    if train_iters_per_epoch < 1 or epochs < 1:
        raise ValueError(
            f"epochs and train_iters_per_epoch must be >= 1, got {epochs} and "
            f"{train_iters_per_epoch}"
        )
    sections, extra = loop_config(config), checkpoint_args or {}
    run = TrainingRun(state, model, optimizer, scheduler, sections, progress, extra, print_fn)
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
                run, forward_step_func, forward_backward_func, logger, batch
            )
            if reason is not None:
                return reason
        run.save()
        if end_of_epoch_callback is not None:
            end_of_epoch_callback(model, epoch)
    run.finish_saves()
    return "train_iters"


def _finetune_iteration(
    run: TrainingRun,
    forward_step_func: ForwardStepFunc,
    forward_backward_func: ForwardBackwardFunc,
    logger: TrainingLogger,
    batch: Any,
) -> ExitReason | None:
    """One `finetune` iteration on one microbatch; "exit_interval" when the run stops after it."""
    model, progress = run.model, run.progress
    step = run.step(
        forward_step_func,
        [iter([batch]) for _ in model] if len(model) > 1 else iter([batch]),
        forward_backward_func,
        num_microbatches=1,
    )
    global_batch_size = run.config.training.micro_batch_size * run.state.group_size("dp")
    progress.iteration += 1
    progress.consumed_train_samples += global_batch_size
    log_step(logger, run.optimizer, progress, step, global_batch_size=global_batch_size)
    run.save_on_interval()
    if every(run.config.training.exit_interval, progress.iteration):
        return run.stop("exit_interval")
    return None
