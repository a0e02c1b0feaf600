"""The log line of a training iteration: losses, learning rate, loss scale, norms, timers."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from pp_optim import MegatronOptimizer, get_canonical_lr_for_logging
from pp_optim.timing import OPTIMIZER_TIMERS
from pp_train.reporting import TrainingLogger
from pp_train.run import TrainingProgress
from pp_train.step import StepResult
from pp_train.timers import ScalarWriter

__all__ = ["log_step", "timers_line", "write_timers"]


def log_step(
    logger: TrainingLogger,
    optimizer: MegatronOptimizer,
    progress: TrainingProgress,
    step: StepResult,
    *,
    global_batch_size: int,
    elapsed_per_iteration: float | None = None,
    timers_line: str | None = None,
    params_norm: float | None = None,
) -> None:
    """Hands one iteration's numbers to `logger` (it prints every log interval).

    Args:
        logger: Prints the line and writes TensorBoard.
        optimizer: Its learning rate and loss scale are logged.
        progress: The iteration and consumed samples, after the step.
        step: What `train_step` returned.
        global_batch_size: Samples in the iteration.
        elapsed_per_iteration: Seconds per iteration over the log interval.
        timers_line: The phases' times (`timers_line`), on a logging iteration.
        params_norm: The parameters' L2 norm (`LoggingArgs.log_params_norm`).
    """
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


# The phases the log line and TensorBoard show, in Megatron's order; those above the timing
# level exist on no rank and are left out.
_LOGGED_TIMERS = (
    "forward-backward",
    "forward-compute",
    "backward-compute",
    "grads-all-reduce",
    *OPTIMIZER_TIMERS,
    "optimizer",
)


def write_timers(timers: Any, writer: ScalarWriter | None, iteration: int, iterations: int) -> None:
    """The phases' per-iteration seconds, max over all ranks, as ``<name>-time`` scalars.

    A collective: every rank calls it at the same log iterations, before `timers_line` (which
    resets the timers); only the writing rank passes a `writer`. Timers without Megatron's
    ``write`` (pp-comm's plain hook) write nothing.
    """
    write = getattr(timers, "write", None)
    if callable(write):
        write(_LOGGED_TIMERS, writer, iteration, normalizer=max(1, iterations), reset=False)


def timers_line(timers: Any, iterations: int) -> str | None:
    """Per-iteration ms of the main phases over all ranks (a collective), with its header."""
    log_string = getattr(timers, "log_string", None)
    if not callable(log_string):
        return None
    line = log_string(
        _LOGGED_TIMERS, normalizer=max(1, iterations), group=dist.group.WORLD, header=True
    )
    return line if isinstance(line, str) else None
