"""Megatron's learning-rate flags in iterations, and the schedule they mean in samples."""

from __future__ import annotations

import dataclasses

import pytest

from pp_optim import LRScheduleArgs, LRScheduleConfig


def test_the_shared_defaults_are_the_schedulers() -> None:
    flags, schedule = LRScheduleArgs(), LRScheduleConfig(max_lr=1.0, lr_decay_steps=10)
    for name in ("min_lr", "lr_decay_style", "lr_wsd_decay_style",
                 "use_checkpoint_opt_param_scheduler", "override_opt_param_scheduler"):  # fmt: skip
        assert getattr(flags, name) == getattr(schedule, name), name


def test_lengths_in_iterations_become_samples_of_the_global_batch() -> None:
    flags = LRScheduleArgs(
        min_lr=0.1, lr_warmup_iters=3, lr_decay_iters=20, lr_decay_style="WSD",
        lr_wsd_decay_iters=5, override_opt_param_scheduler=True,
    )  # fmt: skip
    schedule = flags.in_samples(max_lr=1.0, weight_decay=0.05, global_batch_size=8, train_iters=99)
    assert (schedule.lr_warmup_steps, schedule.lr_decay_steps, schedule.wsd_decay_steps) == (
        24, 160, 40,
    )  # fmt: skip
    assert (schedule.max_lr, schedule.min_lr, schedule.start_wd, schedule.end_wd) == (
        1.0, 0.1, 0.05, 0.05,
    )  # fmt: skip
    assert schedule.lr_decay_style == "WSD"
    assert schedule.override_opt_param_scheduler


def test_the_decay_defaults_to_the_runs_length() -> None:
    flags = LRScheduleArgs(lr_warmup_iters=1)
    assert flags.decay_iters(50) == 50
    assert flags.in_samples(max_lr=1.0, weight_decay=0.0, global_batch_size=4,
                            train_iters=50).lr_decay_steps == 200  # fmt: skip
    assert dataclasses.replace(flags, lr_decay_iters=7).decay_iters(50) == 7


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"lr_decay_iters": 0}, "--lr-decay-iters must be an integer 1 or more, got 0"),
        ({"lr_warmup_iters": -1}, "--lr-warmup-iters must be an integer 0 or more, got -1"),
        ({"lr_wsd_decay_iters": True}, "--lr-wsd-decay-iters must be an integer 1 or more"),
        ({"min_lr": -0.5}, "--min-lr must be 0 or more, got -0.5"),
        ({"lr_decay_style": "WSD"}, "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        ({"use_checkpoint_opt_param_scheduler": True, "override_opt_param_scheduler": True},
         "use at most one of"),
    ],
)  # fmt: skip
def test_bad_flags_are_refused_by_name(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LRScheduleArgs(**values)  # type: ignore[arg-type]
