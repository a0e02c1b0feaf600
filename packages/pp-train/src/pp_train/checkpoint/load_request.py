"""What a load is asked to restore, and what it reports back; shared by both formats."""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from pp_optim import MegatronOptimizer, OptimizerParamScheduler
from pp_state import ParallelState
from pp_train.checkpoint.validation import check_count

__all__ = [
    "ABSENT",
    "DEFAULT_STRICT_ARGS",
    "STRICT_ARG_DEFAULTS",
    "LoadRequest",
    "LoadedCheckpoint",
]

DEFAULT_STRICT_ARGS: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "untie_embeddings_and_output_weights",
    "openai_gelu",
)
"""Settings a checkpoint must share with the run that loads it."""

ABSENT = "<absent>"
"""How a strict arg missing from the checkpoint or the run is shown (it counts as a value),
unless `STRICT_ARG_DEFAULTS` gives it a value."""

STRICT_ARG_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"untie_embeddings_and_output_weights": False, "openai_gelu": False}
)
"""What a strict arg that a checkpoint or a run does not record stands for: settings added
after checkpoints were first written (an older checkpoint tied its output layer to the word
embedding and used the exact GELU)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadedCheckpoint:
    """What `load_checkpoint` restored besides the model, optimizer, scheduler and RNG."""

    iteration: int
    """The iteration to resume after (0 when fine-tuning)."""

    consumed_train_samples: int
    """Training samples consumed before the checkpoint (0 when fine-tuning)."""

    consumed_valid_samples: int
    """Validation samples consumed before the checkpoint (0 when fine-tuning)."""

    args: dict[str, Any]
    """The configuration the checkpoint was saved with."""

    notes: tuple[str, ...] = ()
    """What the load left as it was, and why (e.g. RNG states saved at another layout)."""

    def __post_init__(self) -> None:
        """Checks the counts and the args.

        Raises:
            TypeError: A count is not an int, or `args` is not a dict.
            ValueError: A count is negative.
        """
        for name in ("iteration", "consumed_train_samples", "consumed_valid_samples"):
            check_count(name, getattr(self, name))
        if not isinstance(self.args, dict):
            raise TypeError(f"args must be a dict, got {type(self.args).__name__}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadRequest:
    """Where this run loads from, what it expects of the checkpoint and what it wants restored."""

    root: Path
    """The checkpoint directory (Megatron's ``--load``)."""

    state: ParallelState
    """The process groups."""

    model: list[torch.nn.Module]
    """This rank's model chunks, built as for the save."""

    optimizer: MegatronOptimizer | None
    """Restored when `load_optim` and not None."""

    scheduler: OptimizerParamScheduler | None
    """Restored when `load_optim` and not None."""

    args: dict[str, Any]
    """This run's configuration, compared with the saved one on `strict_args`."""

    strict_args: tuple[str, ...]
    """Keys whose saved value must equal `args`'s."""

    finetune: bool
    """Load only the model and count from iteration 0."""

    load_optim: bool
    """Restore the optimizer and scheduler states."""

    load_rng: bool
    """Restore the random generator states."""

    def strict_differences(
        self, saved: Mapping[str, Any], *, ignore: Container[str] = ()
    ) -> list[tuple[str, Any, Any]]:
        """The strict args on which the saved configuration differs from this run's.

        Args:
            saved: The checkpoint's args.
            ignore: Strict args not compared (e.g. the layout, for a format that reshards).

        Returns:
            ``(key, saved value, this run's value)`` for each difference, in `strict_args`
            order; a key one side does not record has its `STRICT_ARG_DEFAULTS` value there,
            else `ABSENT`.
        """
        differences = []
        for key in self.strict_args:
            if key in ignore:
                continue
            default = STRICT_ARG_DEFAULTS.get(key, ABSENT)
            was, now = saved.get(key, default), self.args.get(key, default)
            if was != now:
                differences.append((key, was, now))
        return differences
