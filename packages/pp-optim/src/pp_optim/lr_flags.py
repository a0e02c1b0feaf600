"""Megatron's learning-rate flags, in iterations, and the schedule they mean in samples.

`LRScheduleArgs` is the learning-rate group of a training command: its fields are Megatron's
flag names (``--lr-warmup-iters``, ``--lr-decay-style``, ...) and count iterations, as a user
writes them. `LRScheduleArgs.in_samples` gives the `LRScheduleConfig` that
`OptimizerParamScheduler` steps through when it advances by each iteration's global batch, as
Megatron's ``get_optimizer_param_scheduler`` does: a length of N iterations is N global
batches of samples. The defaults shared with `LRScheduleConfig` are read from it, so each is
written once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pp_optim.lr_schedule import LRDecayStyle, LRScheduleConfig, WSDDecayStyle
from pp_state.numbers import is_int

__all__ = ["LRScheduleArgs"]

_SHARED: dict[str, Any] = {
    field.name: field.default for field in dataclasses.fields(LRScheduleConfig)
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LRScheduleArgs:
    """Learning-rate schedule (the peak rate is the optimizer's --lr)."""

    min_lr: float = _SHARED["min_lr"]
    """Learning rate at the end of the decay."""

    lr_decay_style: LRDecayStyle = _SHARED["lr_decay_style"]
    """Shape of the decay."""

    lr_warmup_iters: int = 0
    """Iterations of linear warm-up."""

    lr_decay_iters: int | None = None
    """Iterations of decay (None: --train-iters)."""

    lr_wsd_decay_iters: int | None = None
    """Iterations of the final anneal of a WSD schedule."""

    lr_wsd_decay_style: WSDDecayStyle = _SHARED["lr_wsd_decay_style"]
    """Shape of the WSD anneal."""

    use_checkpoint_opt_param_scheduler: bool = dataclasses.field(
        default=_SHARED["use_checkpoint_opt_param_scheduler"],
        metadata={"flag": "--use-checkpoint-opt_param-scheduler"},
    )
    """On resume, take the learning-rate schedule from the checkpoint."""

    override_opt_param_scheduler: bool = dataclasses.field(
        default=_SHARED["override_opt_param_scheduler"],
        metadata={"flag": "--override-opt_param-scheduler"},
    )
    """On resume, take the learning-rate schedule from these flags."""

    def __post_init__(self) -> None:
        """Checks lengths and the choices that exclude each other.

        Raises:
            ValueError: A length is not a whole number (decay lengths 1 or more, warm-up 0 or
                more), the floor is negative, WSD lacks its anneal length, or both checkpoint
                flags are set; the message names the flags.
        """
        lengths = (
            ("--lr-decay-iters", self.lr_decay_iters, 1),
            ("--lr-wsd-decay-iters", self.lr_wsd_decay_iters, 1),
            ("--lr-warmup-iters", self.lr_warmup_iters, 0),
        )
        for flag, value, least in lengths:
            if value is not None and not (is_int(value) and value >= least):
                raise ValueError(f"{flag} must be an integer {least} or more, got {value!r}")
        if not self.min_lr >= 0.0:
            raise ValueError(f"--min-lr must be 0 or more, got {self.min_lr}")
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_iters is None:
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters")
        if self.use_checkpoint_opt_param_scheduler and self.override_opt_param_scheduler:
            raise ValueError(
                "use at most one of --use-checkpoint-opt_param-scheduler and "
                "--override-opt_param-scheduler"
            )

    def decay_iters(self, train_iters: int) -> int:
        """The decay length in iterations: ``--lr-decay-iters``, else `train_iters`."""
        return self.lr_decay_iters or train_iters

    def in_samples(
        self, *, max_lr: float, weight_decay: float, global_batch_size: int, train_iters: int
    ) -> LRScheduleConfig:
        """The schedule in samples: each length in iterations times the global batch.

        Args:
            max_lr: The peak rate (the optimizer's ``--lr``).
            weight_decay: The constant weight decay (the optimizer's ``--weight-decay``).
            global_batch_size: Samples per iteration.
            train_iters: The run's length, the decay's when ``--lr-decay-iters`` is unset.

        Raises:
            OptimizerParamSchedulerError: The lengths or rates do not make a schedule (see
                `LRScheduleConfig`).
        """
        wsd = self.lr_wsd_decay_iters
        return LRScheduleConfig(
            max_lr=max_lr,
            min_lr=self.min_lr,
            lr_warmup_steps=self.lr_warmup_iters * global_batch_size,
            lr_decay_steps=self.decay_iters(train_iters) * global_batch_size,
            lr_decay_style=self.lr_decay_style,
            wsd_decay_steps=None if wsd is None else wsd * global_batch_size,
            lr_wsd_decay_style=self.lr_wsd_decay_style,
            start_wd=weight_decay,
            end_wd=weight_decay,
            use_checkpoint_opt_param_scheduler=self.use_checkpoint_opt_param_scheduler,
            override_opt_param_scheduler=self.override_opt_param_scheduler,
        )
