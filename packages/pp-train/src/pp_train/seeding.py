"""Seeding a rank's generators as Megatron's ``_set_random_seed`` does."""

from __future__ import annotations

import random

import numpy as np
import torch

from pp_state import ParallelState
from pp_tensor import model_parallel_manual_seed

__all__ = ["set_random_seed"]


def set_random_seed(seed: int, state: ParallelState, device: torch.device | None = None) -> None:
    """Seeds every generator of this rank as Megatron's ``_set_random_seed`` does.

    Pipeline stages draw apart (``seed + 100 x pipeline rank``; Python's, NumPy's and
    torch's default generators); pp-tensor's tracker gets the tensor-parallel seed of
    this rank (`pp_tensor.model_parallel_manual_seed`), so dropout inside tensor-parallel
    regions differs across tensor-parallel ranks and the rest matches. Models that
    initialise their weights from their own generators (the bundled GPT) and train without
    dropout are not affected.

    Args:
        seed: The run's ``--seed``.
        state: The parallel state (pipeline and tensor-parallel ranks).
        device: The run's device (the tracker's states live there).
    """
    stage_seed = seed + 100 * state.pipeline_model_parallel_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    model_parallel_manual_seed(stage_seed, tp_rank=state.tensor_model_parallel_rank, device=device)
