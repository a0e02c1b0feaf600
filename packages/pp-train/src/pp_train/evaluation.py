"""Evaluation: forward-only passes over validation batches, losses averaged as in training."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pp_state import ParallelState, Placement
from pp_train.step import (
    ForwardBackwardFunc,
    ForwardStepFunc,
    average_losses,
    schedule_placement,
)

__all__ = ["evaluate"]


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
) -> dict[str, float]:
    """Forward-only over `eval_iters` global batches; the model is back in train mode after.

    `placement` says which stage each chunk holds (the run's resolved schedule's); when None,
    `schedule_placement` asks the forward-backward function.

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
    placement = placement or schedule_placement(forward_backward_func, state)
    holds_loss = placement.holds_last(state.pipeline_model_parallel_rank)
    return average_losses(collected, state) if holds_loss else {}
