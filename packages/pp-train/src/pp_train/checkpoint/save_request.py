"""What a save is asked to write; shared by both formats, as `LoadRequest` is by loading."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from pp_optim import MegatronOptimizer, OptimizerParamScheduler
from pp_state import ParallelState
from pp_train.checkpoint.validation import check_save_arguments

if TYPE_CHECKING:  # the saver's module writes through torch_dist, which reads this one
    from pp_train.checkpoint.async_save import AsyncCheckpointSaver

__all__ = ["CKPT_FORMATS", "CkptFormat", "SaveRequest", "check_format"]

CkptFormat = Literal["torch", "torch_dist"]
"""Megatron's names of the two checkpoint formats (``--ckpt-format``)."""

CKPT_FORMATS: tuple[str, ...] = get_args(CkptFormat)


def check_format(ckpt_format: object) -> None:
    """Raises unless `ckpt_format` is one of `CKPT_FORMATS`.

    Raises:
        ValueError: Another format; the message names the valid ones.
    """
    if ckpt_format not in CKPT_FORMATS:
        raise ValueError(f"ckpt_format must be one of {list(CKPT_FORMATS)}, got {ckpt_format!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveRequest:
    """Where this run saves, what it writes and how (built once by `save_checkpoint`)."""

    root: Path
    """The checkpoint directory (Megatron's ``--save``)."""

    iteration: int
    """The iteration just completed."""

    state: ParallelState
    """The process groups (which position this rank writes, who writes)."""

    model: list[torch.nn.Module]
    """This rank's model chunks (one per virtual pipeline stage), wrapped or not."""

    optimizer: MegatronOptimizer | None
    """Saved unless None (None too when the save leaves the optimizer out)."""

    scheduler: OptimizerParamScheduler | None
    """Saved unless None (None too when the save leaves the optimizer out)."""

    args: dict[str, Any]
    """The run's configuration: plain Python values only."""

    consumed_train_samples: int
    """Training samples consumed so far."""

    consumed_valid_samples: int
    """Validation samples consumed so far."""

    save_rng: bool
    """Save the random generator states."""

    ckpt_format: CkptFormat
    """The format written."""

    async_saver: AsyncCheckpointSaver | None = None
    """Writes a torch_dist checkpoint in the background; None writes it before returning."""

    def __post_init__(self) -> None:
        """Checks the format and that only a torch_dist save is asynchronous.

        The counts, model and args are checked by each format's writer (`check_contents`),
        after `save_checkpoint` tidied the directory.

        Raises:
            ValueError: An unknown format, or an async saver with the torch format.
        """
        check_format(self.ckpt_format)
        if self.async_saver is not None and self.ckpt_format != "torch_dist":
            raise ValueError("asynchronous saving needs ckpt_format='torch_dist' (Megatron's too)")

    @property
    def consumed(self) -> tuple[int, int]:
        """The training and validation samples consumed so far."""
        return self.consumed_train_samples, self.consumed_valid_samples

    def check_contents(self) -> None:
        """Raises unless the iteration, the counts, the model and the args are well formed.

        Raises:
            TypeError: A count is not an int, `model` not a list of modules, or `args`
                holds something other than plain values.
            ValueError: A count is negative or `model` is empty.
        """
        check_save_arguments(self.iteration, self.consumed, self.model, self.args)
