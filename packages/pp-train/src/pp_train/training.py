"""Megatron's ``training.py`` names in one place: model setup, one step, evaluation, the loop.

This module is the Megatron-shaped entry point and stays (it is not deprecated): import from it
as you would from Megatron-LM's ``megatron.training.training``. The code lives in modules named
for what they hold:

- `pp_train.models`: `ModelProvider`, `EncoderDecoderModelProvider`, `ModelType`, `get_model`,
  `setup_model_and_optimizer`;
- `pp_train.embeddings`: `TiedEmbeddingSync`, `tied_embedding_sync` (tied and split
  embeddings, their copies and gradients);
- `pp_train.step`: `build_forward_backward_func`, `schedule_placement`, `finalize_model_grads`,
  `train_step`, `NonFiniteError`, `ForwardBackwardFunc`;
- `pp_train.evaluation`: `evaluate`;
- `pp_train.run`: `TrainingConfig`, `TrainingProgress`, `ExitReason`;
- `pp_train.loop`: `train`; `pp_train.finetuning`: `finetune`.

Each piece takes the objects it works on as arguments (the `ParallelState`, model chunks,
optimizer, scheduler, forward-backward function): use them together through `train`, or call
`train_step` from a loop of your own.
"""

from __future__ import annotations

from pp_train.embeddings import TiedEmbeddingSync, tied_embedding_sync
from pp_train.evaluation import evaluate
from pp_train.finetuning import finetune
from pp_train.loop import train
from pp_train.models import (
    EncoderDecoderModelProvider,
    ModelProvider,
    ModelType,
    get_model,
    setup_model_and_optimizer,
)
from pp_train.run import ExitReason, TrainingConfig, TrainingProgress
from pp_train.step import (
    ForwardBackwardFunc,
    NonFiniteError,
    build_forward_backward_func,
    finalize_model_grads,
    schedule_placement,
    train_step,
)

# Not in __all__ (it never was), but `pp_train.pretrain` and users import it from here.
from pp_train.step import ForwardStepFunc as ForwardStepFunc  # noqa: PLC0414 - re-export

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
