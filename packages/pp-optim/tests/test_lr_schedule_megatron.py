"""OptimizerParamScheduler built and read the Megatron way: its arguments, attributes, errors.

The facts are those Megatron-LM's own scheduler tests check (values at given steps, weight-decay
increments, state-dict rules, constructor refusals), written here afresh.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pp_optim import (
    FP32Optimizer,
    LRScheduleConfig,
    OptimizerConfig,
    OptimizerParamScheduler,
    OptimizerParamSchedulerError,
    get_canonical_lr_for_logging,
    get_megatron_optimizer,
)

# Megatron's arguments in their order: init_lr, max_lr, min_lr, lr_warmup_steps,
# lr_decay_steps, lr_decay_style, start_wd, end_wd, wd_incr_steps, wd_incr_style.
ARGS: dict[str, Any] = {
    "init_lr": 0.01,
    "max_lr": 0.1,
    "min_lr": 0.001,
    "lr_warmup_steps": 100,
    "lr_decay_steps": 1000,
    "lr_decay_style": "linear",
    "start_wd": 0.0,
    "end_wd": 0.1,
    "wd_incr_steps": 1000,
    "wd_incr_style": "linear",
}


def _sgd(*groups: dict[str, Any]) -> torch.optim.SGD:
    if not groups:
        groups = ({},)
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))], **extra} for extra in groups], lr=0.0
    )


def _megatron(optimizer: Any = None, **changes: Any) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(optimizer or _sgd(), **{**ARGS, **changes})


def test_megatron_keywords_read_back_under_megatron_names_with_its_defaults() -> None:
    sched = _megatron()
    for name, value in ARGS.items():
        assert getattr(sched, name) == value, name
    assert sched.num_steps == 0
    # Megatron's defaults: take the checkpoint's schedule on load; no WSD.
    assert sched.use_checkpoint_opt_param_scheduler is True
    assert sched.override_opt_param_scheduler is False
    assert sched.wsd_decay_steps is None
    assert sched.config == LRScheduleConfig(**ARGS, use_checkpoint_opt_param_scheduler=True)


def test_positional_keyword_and_config_forms_agree() -> None:
    positional = OptimizerParamScheduler(
        _sgd(),
        0.01,
        0.1,
        0.001,
        100,
        1000,
        "linear",
        0.0,
        0.1,
        1000,
        "linear",
        False,
        True,
        50,
        "cosine",
    )
    keyword = _megatron(
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
        wsd_decay_steps=50,
        lr_wsd_decay_style="cosine",
    )
    config = LRScheduleConfig(
        **ARGS, override_opt_param_scheduler=True, wsd_decay_steps=50, lr_wsd_decay_style="cosine"
    )
    assert positional.config == keyword.config == config
    assert OptimizerParamScheduler(_sgd(), config=config).config is config
    # Megatron's flags are Optional[bool]: None reads as False.
    assert (
        _megatron(use_checkpoint_opt_param_scheduler=None).use_checkpoint_opt_param_scheduler
        is False
    )


def test_settings_are_read_only_views_of_the_config() -> None:
    sched = _megatron()
    with pytest.raises(AttributeError, match=r"max_lr is read-only.*config\.max_lr"):
        sched.max_lr = 1.0
    sched.num_steps = 7  # the step count stays an ordinary attribute
    assert sched.num_steps == 7


def test_lr_at_given_steps() -> None:
    group = {"max_lr": 0.1, "min_lr": 0.001}
    sched = _megatron()
    sched.step(50)  # warmup: half-way from init_lr to max_lr
    assert sched.get_lr(group) == pytest.approx(0.01 + (0.1 - 0.01) * 0.5)
    sched.step(450)  # linear decay, 400 of 900 steps in
    assert sched.get_lr(group) == pytest.approx(0.1 - (0.1 - 0.001) * 400 / 900)
    sched.step(501)  # past lr_decay_steps
    assert sched.get_lr(group) == pytest.approx(0.001)

    cosine = _megatron(lr_decay_style="cosine")
    cosine.step(500)
    expected = 0.001 + (0.1 - 0.001) * 0.5 * (math.cos(math.pi * 400 / 900) + 1.0)
    assert cosine.get_lr(group) == pytest.approx(expected)

    constant = _megatron(lr_decay_style="constant")
    constant.step(5000)
    assert constant.get_lr({}) == 0.1

    inverse = _megatron(lr_decay_style="inverse-square-root")
    inverse.step(400)  # max_lr * sqrt(warmup / steps)
    assert inverse.get_lr({}) == pytest.approx(0.1 * math.sqrt(100 / 400))


@pytest.mark.parametrize(
    ("style", "coeff"),
    [
        ("linear", 0.5),
        ("cosine", 0.5),
        ("exponential", 2.0 * 0.5**0.5 - 1.0),
        ("minus_sqrt", 1.0 - math.sqrt(0.5)),
    ],
)
def test_wsd_is_stable_then_anneals_over_its_last_steps(style: str, coeff: float) -> None:
    sched = _megatron(lr_decay_style="WSD", wsd_decay_steps=200, lr_wsd_decay_style=style)
    sched.step(800)  # the anneal starts at lr_decay_steps - wsd_decay_steps
    assert sched.get_lr({}) == pytest.approx(0.1)
    sched.step(100)  # half-way through the anneal
    assert sched.get_lr({}) == pytest.approx(0.001 + coeff * (0.1 - 0.001))


def test_weight_decay_increments() -> None:
    linear = _megatron()
    linear.step(500)
    assert linear.get_wd() == pytest.approx(0.05)
    cosine = _megatron(wd_incr_style="cosine")
    cosine.step(500)
    assert cosine.get_wd() == pytest.approx(0.05 * (math.cos(math.pi * 0.5) + 1.0))
    constant = _megatron(start_wd=0.1, end_wd=0.1, wd_incr_style="constant")
    constant.step(500)
    assert constant.get_wd() == 0.1
    # A group's own start_wd / end_wd replace the schedule's (Megatron's group overrides).
    assert linear.get_wd({"start_wd": 0.2, "end_wd": 0.4}) == pytest.approx(0.3)


def test_step_writes_every_group_even_an_empty_one() -> None:
    optimizer = _sgd(
        {"max_lr": 0.2, "min_lr": 0.001, "default_config": False},
        {"wd_mult": 0.0, "default_config": True},
    )
    optimizer.param_groups[1]["params"] = []  # a rank-alignment stub
    sched = _megatron(optimizer)
    sched.step(100)  # warmup done: every group at its max_lr, wd linear at 100 / 1000
    own, stub = optimizer.param_groups
    assert (own["lr"], stub["lr"]) == pytest.approx((0.2, 0.1))
    assert (own["weight_decay"], stub["weight_decay"]) == pytest.approx((0.01, 0.0))
    assert get_canonical_lr_for_logging(optimizer.param_groups) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ([{"lr": 0.05, "default_config": True}], 0.05),
        ([{"lr": 0.001, "default_config": True}, {"lr": 0.999}], 0.001),
        ([{"lr": 0.5}, {"lr": 0.01, "default_config": True}], 0.01),
        ([{"lr": 0.5}, {"lr": 0.01}], None),
        ([{"default_config": True}], None),
        ([], None),
        ([{"lr": 0.0, "default_config": True}], 0.0),
    ],
)
def test_canonical_lr_for_logging(groups: list[dict[str, Any]], expected: float | None) -> None:
    assert get_canonical_lr_for_logging(groups) == expected


def test_canonical_lr_of_our_optimizer_groups() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = get_megatron_optimizer(OptimizerConfig(), [model], grad_stats_group=None)
    # The scheduler drives the wrapper itself, as Megatron's does.
    sched = _megatron(optimizer)
    sched.step(50)
    assert get_canonical_lr_for_logging(optimizer.param_groups) == pytest.approx(0.055)
    assert isinstance(optimizer, FP32Optimizer)


# --- state dict: Megatron's use_checkpoint / override rules -----------------------------------

_SAVED = {
    "max_lr": 0.2,
    "min_lr": 0.0005,
    "lr_warmup_steps": 200,
    "lr_decay_steps": 2000,
    "lr_decay_style": "cosine",
    "num_steps": 500,
    "start_wd": 0.01,
    "end_wd": 0.2,
    "wd_incr_steps": 500,
    "wd_incr_style": "cosine",
}


def test_state_dict_holds_megatron_keys() -> None:
    state = _megatron().state_dict()
    for name in ("max_lr", "lr_warmup_steps", "lr_decay_style", "lr_decay_steps", "min_lr"):
        assert state[name] == ARGS[name]
    for name in ("start_wd", "end_wd", "wd_incr_style", "wd_incr_steps"):
        assert state[name] == ARGS[name]
    assert state["num_steps"] == 0


def test_load_by_default_takes_the_checkpoint_schedule() -> None:
    sched = _megatron()  # use_checkpoint_opt_param_scheduler=True, Megatron's default
    sched.load_state_dict(_SAVED)
    for name, value in _SAVED.items():
        assert getattr(sched, name) == value, name


def test_load_with_override_keeps_the_constructor_schedule() -> None:
    sched = _megatron(use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    sched.load_state_dict(_SAVED)
    assert (sched.max_lr, sched.lr_decay_style, sched.num_steps) == (0.1, "linear", 500)


def test_load_without_either_flag_refuses_a_different_schedule_as_megatron_asserts() -> None:
    sched = _megatron(use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(AssertionError, match=r"max_lr: the config has 0\.1 but the checkpoint"):
        sched.load_state_dict(_SAVED)
    with pytest.raises(ValueError, match="set use_checkpoint_opt_param_scheduler=True"):
        sched.load_state_dict(_SAVED)
    assert (sched.max_lr, sched.num_steps) == (0.1, 0)


def test_round_trip_continues_the_schedule() -> None:
    first = _megatron(use_checkpoint_opt_param_scheduler=False)
    first.step(640)
    second_optimizer = _sgd()
    second = _megatron(second_optimizer, use_checkpoint_opt_param_scheduler=False)
    second.load_state_dict(first.state_dict())
    assert second.num_steps == 640
    assert second_optimizer.param_groups[0]["lr"] == first.optimizer.param_groups[0]["lr"]


# --- the constructor's refusals ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"min_lr": -0.1}, r"min_lr must be >= 0, got -0\.1"),
        ({"min_lr": 0.2}, r"max_lr \(0\.1\) must be >= min_lr \(0\.2\)"),
        ({"init_lr": 0.5}, r"init_lr \(0\.5\) must be <= max_lr \(0\.1\)"),
        ({"lr_decay_steps": 0, "lr_warmup_steps": 0}, r"lr_decay_steps must be > 0, got 0"),
        ({"lr_warmup_steps": 1000}, r"lr_warmup_steps=1000, lr_decay_steps=1000"),
        ({"lr_decay_style": "WSD"}, r"WSD.*requires wsd_decay_steps"),
        (
            {"lr_decay_style": "WSD", "wsd_decay_steps": 10},
            r"WSD.*needs lr_wsd_decay_style.*'exponential'.*got None",
        ),
        ({"start_wd": -0.1}, r"start_wd must be >= 0, got -0\.1"),
        (
            {"override_opt_param_scheduler": True},  # use_checkpoint is True by default
            r"at most one of override_opt_param_scheduler and use_checkpoint",
        ),
    ],
)
def test_megatron_refusals_are_value_and_assertion_errors(
    changes: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(OptimizerParamSchedulerError, match=pattern) as caught:
        _megatron(**changes)
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, AssertionError)


def test_config_and_megatron_arguments_do_not_mix() -> None:
    config = LRScheduleConfig(max_lr=1.0, lr_decay_steps=10)
    with pytest.raises(TypeError, match="not both: got config and init_lr, max_lr"):
        OptimizerParamScheduler(_sgd(), config, 0.0, 1.0)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="not both: got config and lr_decay_style"):
        OptimizerParamScheduler(_sgd(), config=config, lr_decay_style="cosine")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"Megatron's arguments \(init_lr, .*missing.*max_lr"):
        OptimizerParamScheduler(_sgd(), init_lr=0.0)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="unexpected keyword argument 'warmup'"):
        OptimizerParamScheduler(_sgd(), **ARGS, warmup=3)  # type: ignore[call-overload]
