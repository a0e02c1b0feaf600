"""Evaluation: forward-only passes over validation batches, losses averaged as in training."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pp_state import ParallelState, Placement
from pp_state.numbers import check_int
from pp_train.memory import empty_unused_memory
from pp_train.step import (
    ForwardBackwardFunc,
    ForwardStepFunc,
    average_losses,
    schedule_placement,
)
from pp_train.timers import Timers

__all__ = ["evaluate", "print_on_rank_0"]

# Megatron's level for the whole evaluation: once per evaluation, so always measured.
_EVALUATE_TIMER_LEVEL = 0


def print_on_rank_0(text: str) -> None:
    """Prints `text` on global rank 0 only (every process without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(text, flush=True)


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
    placement: Placement | None = None,
    verbose: bool = False,
    log_interval: int = 1,
    print_fn: Callable[[str], None] = print_on_rank_0,
    timers: Timers | None = None,
    empty_unused_memory_level: int = 0,
) -> dict[str, float]:
    """Forward-only over `eval_iters` global batches; the model is back in train mode after.

    `placement` says which stage each chunk holds (the run's resolved schedule's); when None,
    `schedule_placement` asks the forward-backward function. With `verbose`, Megatron's
    progress line ``Evaluating iter 2/4`` goes to `print_fn` before every `log_interval`-th
    global batch (by default printed on rank 0, as Megatron's ``print_rank_0``). With
    `timers`, the evaluation is timed as Megatron's ``"evaluate"`` (level 0, started after a
    barrier) and, after it, its time over all ranks goes to `print_fn` (a collective). With
    `empty_unused_memory_level` 1 or more the CUDA cache is emptied after each global batch.

    Returns:
        Each loss averaged over all microbatches and data-parallel ranks (on the rank holding
        the last stage; empty elsewhere).
    """
    if verbose:
        check_int("log_interval", log_interval, 1)
    if timers is not None:
        timers("evaluate", log_level=_EVALUATE_TIMER_LEVEL).start(barrier=True)
    for chunk in model:
        chunk.eval()
    collected: list[dict[str, Any]] = []
    try:
        with torch.no_grad():
            for iteration in range(1, eval_iters + 1):
                if verbose and iteration % log_interval == 0:
                    print_fn(f"Evaluating iter {iteration}/{eval_iters}")
                collected += forward_backward_func(
                    forward_step_func=forward_step_func, data_iterator=data_iterator,
                    model=list(model), num_microbatches=num_microbatches,
                    seq_length=seq_length, micro_batch_size=micro_batch_size,
                    decoder_seq_length=decoder_seq_length, forward_only=True,
                )  # fmt: skip
                empty_unused_memory(empty_unused_memory_level, 1, model)
    finally:
        _back_to_training(model, timers)
    if timers is not None:
        print_fn(timers.log_string(["evaluate"], group=dist.group.WORLD, header=True))
    placement = placement or schedule_placement(forward_backward_func, state)
    holds_loss = placement.holds_last(state.pipeline_model_parallel_rank)
    return average_losses(collected, state) if holds_loss else {}


def _back_to_training(model: Sequence[torch.nn.Module], timers: Timers | None) -> None:
    """Train mode again and the evaluation timer stopped, even after an error."""
    for chunk in model:
        chunk.train()
    if timers is not None:
        timers("evaluate").stop()
