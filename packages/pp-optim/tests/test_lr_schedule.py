from __future__ import annotations

import dataclasses
import io
import math
from typing import Any

import pytest
import torch

from pp_optim.lr_schedule import LRScheduleConfig, OptimizerParamScheduler


def _optimizer(*extra_groups: dict[str, Any]) -> torch.optim.SGD:
    groups: list[dict[str, Any]] = [{"params": [torch.nn.Parameter(torch.zeros(1))]}]
    for extra in extra_groups:
        groups.append({"params": [torch.nn.Parameter(torch.zeros(1))], **extra})
    return torch.optim.SGD(groups, lr=0.0)


def _scheduler(
    optimizer: torch.optim.Optimizer | None = None, **fields: Any
) -> OptimizerParamScheduler:
    fields.setdefault("max_lr", 1.0)
    fields.setdefault("lr_decay_steps", 100)
    return OptimizerParamScheduler(optimizer or _optimizer(), LRScheduleConfig(**fields))


def _lr_at(sched: OptimizerParamScheduler, steps: int) -> float:
    sched.num_steps = steps
    return sched.get_lr(sched.optimizer.param_groups[0])


def _wd_at(sched: OptimizerParamScheduler, steps: int) -> float:
    sched.num_steps = steps
    return sched.get_wd()


# --- learning-rate shapes --------------------------------------------------------------------


def test_warmup_rises_linearly_from_init_lr() -> None:
    sched = _scheduler(max_lr=1.0, init_lr=0.2, lr_warmup_steps=10, lr_decay_steps=100)
    assert _lr_at(sched, 0) == pytest.approx(0.2)
    assert _lr_at(sched, 5) == pytest.approx(0.6)  # half-way between 0.2 and 1.0
    assert _lr_at(sched, 10) == pytest.approx(1.0)


def test_warmup_from_zero_by_default() -> None:
    sched = _scheduler(max_lr=0.4, lr_warmup_steps=4, lr_decay_steps=100)
    assert [_lr_at(sched, n) for n in range(5)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_constant_holds_max_lr_after_warmup_and_past_decay_end() -> None:
    sched = _scheduler(max_lr=0.5, min_lr=0.1, lr_warmup_steps=10, lr_decay_style="constant")
    assert _lr_at(sched, 5) == pytest.approx(0.25)
    for n in (10, 11, 50, 100, 1000):
        assert _lr_at(sched, n) == 0.5


def test_linear_decay() -> None:
    # Warmup 20, decay ends at 120: the decay spans 100 steps from 1.0 to 0.2.
    sched = _scheduler(max_lr=1.0, min_lr=0.2, lr_warmup_steps=20, lr_decay_steps=120)
    assert _lr_at(sched, 20) == pytest.approx(1.0)
    assert _lr_at(sched, 45) == pytest.approx(0.8)  # a quarter down: 1 - 0.25 * 0.8
    assert _lr_at(sched, 70) == pytest.approx(0.6)  # midpoint
    assert _lr_at(sched, 120) == pytest.approx(0.2)


def test_cosine_decay() -> None:
    sched = _scheduler(
        max_lr=1.0, min_lr=0.2, lr_warmup_steps=20, lr_decay_steps=120, lr_decay_style="cosine"
    )
    assert _lr_at(sched, 20) == pytest.approx(1.0)
    assert _lr_at(sched, 70) == pytest.approx(0.6)  # half-way: the midpoint
    # A quarter of the way the cosine curve has fallen by (1 - 1/sqrt(2)) / 2 of the range.
    quarter = 1.0 - 0.8 * (1.0 - math.sqrt(0.5)) / 2.0
    assert _lr_at(sched, 45) == pytest.approx(quarter)
    assert _lr_at(sched, 95) == pytest.approx(1.2 - quarter)  # symmetric about the midpoint
    assert _lr_at(sched, 120) == pytest.approx(0.2)


def test_inverse_square_root() -> None:
    sched = _scheduler(
        max_lr=1.0, min_lr=0.0, lr_warmup_steps=25, lr_decay_steps=10_000,
        lr_decay_style="inverse-square-root",
    )  # fmt: skip
    assert _lr_at(sched, 25) == pytest.approx(1.0)
    assert _lr_at(sched, 100) == pytest.approx(0.5)  # 4x warmup
    assert _lr_at(sched, 2500) == pytest.approx(0.1)  # 100x warmup


def test_inverse_square_root_floors_at_min_lr_and_without_warmup() -> None:
    sched = _scheduler(
        max_lr=1.0, min_lr=0.3, lr_decay_steps=10_000, lr_decay_style="inverse-square-root"
    )
    assert _lr_at(sched, 0) == pytest.approx(1.0)  # no warmup: steps and warmup floor to 1
    assert _lr_at(sched, 1) == pytest.approx(1.0)
    assert _lr_at(sched, 4) == pytest.approx(0.5)
    assert _lr_at(sched, 100) == pytest.approx(0.3)  # 0.1 would be below the floor
    assert _lr_at(sched, 10_001) == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("wsd_style", "quarter", "half"),
    [
        ("linear", 0.75, 0.5),
        ("cosine", (1.0 + math.sqrt(0.5)) / 2.0, 0.5),
        ("exponential", 2.0 ** (3.0 / 4.0) - 1.0, math.sqrt(2.0) - 1.0),
        ("minus_sqrt", 0.5, 1.0 - math.sqrt(0.5)),
    ],
)
def test_wsd_holds_then_anneals(wsd_style: str, quarter: float, half: float) -> None:
    # Warmup 10, stable until 60, anneal over the last 40 steps to 100.
    sched = _scheduler(
        max_lr=1.0, min_lr=0.0, lr_warmup_steps=10, lr_decay_steps=100,
        lr_decay_style="WSD", wsd_decay_steps=40, lr_wsd_decay_style=wsd_style,
    )  # fmt: skip
    assert _lr_at(sched, 5) == pytest.approx(0.5)
    for n in (10, 30, 59, 60):
        assert _lr_at(sched, n) == 1.0
    assert _lr_at(sched, 70) == pytest.approx(quarter)
    assert _lr_at(sched, 80) == pytest.approx(half)
    assert _lr_at(sched, 100) == pytest.approx(0.0, abs=1e-12)
    assert _lr_at(sched, 101) == 0.0


def test_wsd_anneal_scales_between_min_and_max() -> None:
    sched = _scheduler(
        max_lr=2.0, min_lr=1.0, lr_decay_steps=100, lr_decay_style="WSD", wsd_decay_steps=50,
        lr_wsd_decay_style="linear",
    )  # fmt: skip
    assert _lr_at(sched, 0) == 2.0
    assert _lr_at(sched, 75) == pytest.approx(1.5)
    assert _lr_at(sched, 100) == pytest.approx(1.0)


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "WSD"])
def test_min_lr_floor_after_decay(style: str) -> None:
    sched = _scheduler(
        max_lr=1.0, min_lr=0.05, lr_warmup_steps=10, lr_decay_steps=100, lr_decay_style=style,
        wsd_decay_steps=20,
    )  # fmt: skip
    for n in (101, 200, 10**6):
        assert _lr_at(sched, n) == 0.05


# --- param groups ----------------------------------------------------------------------------


def test_per_group_max_min_lr_and_multipliers() -> None:
    opt = _optimizer(
        {"max_lr": 2.0, "min_lr": 1.0},
        {"lr_mult": 0.1, "wd_mult": 0.0},
        {"max_lr": 4.0, "lr_mult": 0.5, "wd_mult": 2.0},
    )
    sched = _scheduler(opt, max_lr=1.0, min_lr=0.0, lr_decay_steps=100, start_wd=0.1, end_wd=0.1)
    sched.step(50)
    lrs = [g["lr"] for g in opt.param_groups]
    wds = [g["weight_decay"] for g in opt.param_groups]
    assert lrs == pytest.approx([0.5, 1.5, 0.05, 1.0])
    assert wds == pytest.approx([0.1, 0.1, 0.0, 0.2])
    assert sched.current_lr == pytest.approx(0.5)


def test_per_group_max_lr_during_warmup() -> None:
    opt = _optimizer({"max_lr": 3.0})
    sched = _scheduler(opt, max_lr=1.0, init_lr=0.0, lr_warmup_steps=10, lr_decay_steps=100)
    sched.step(5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 1.5])


# --- weight decay ----------------------------------------------------------------------------


def test_constant_weight_decay() -> None:
    sched = _scheduler(start_wd=0.05, end_wd=0.05)
    assert [_wd_at(sched, n) for n in (0, 50, 500)] == [0.05, 0.05, 0.05]


def test_linear_weight_decay() -> None:
    sched = _scheduler(start_wd=0.0, end_wd=0.1, wd_incr_steps=40, wd_incr_style="linear")
    assert _wd_at(sched, 0) == pytest.approx(0.0)
    assert _wd_at(sched, 10) == pytest.approx(0.025)
    assert _wd_at(sched, 20) == pytest.approx(0.05)
    assert _wd_at(sched, 40) == pytest.approx(0.1)
    assert _wd_at(sched, 41) == 0.1


def test_cosine_weight_decay() -> None:
    sched = _scheduler(start_wd=0.1, end_wd=0.3, wd_incr_steps=40, wd_incr_style="cosine")
    assert _wd_at(sched, 0) == pytest.approx(0.1)
    assert _wd_at(sched, 20) == pytest.approx(0.2)  # half-way: the midpoint
    # A quarter of the way the cosine ramp has covered (1 - 1/sqrt(2)) / 2 of the range.
    assert _wd_at(sched, 10) == pytest.approx(0.1 + 0.2 * (1.0 - math.sqrt(0.5)) / 2.0)
    assert _wd_at(sched, 40) == pytest.approx(0.3)
    assert _wd_at(sched, 1000) == 0.3


def test_weight_decay_can_fall() -> None:
    sched = _scheduler(start_wd=0.2, end_wd=0.0, wd_incr_steps=10, wd_incr_style="linear")
    assert _wd_at(sched, 5) == pytest.approx(0.1)


# --- stepping --------------------------------------------------------------------------------


def test_constructor_applies_step_zero() -> None:
    opt = _optimizer()
    sched = _scheduler(
        opt, max_lr=1.0, init_lr=0.1, lr_warmup_steps=10, start_wd=0.0, end_wd=0.1,
        wd_incr_steps=10, wd_incr_style="linear",
    )  # fmt: skip
    assert sched.num_steps == 0
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.0)
    assert sched.current_lr == pytest.approx(0.1)


def test_steps_count_samples() -> None:
    opt = _optimizer()
    # Warmup over 128 samples, decay to 0 at 1024 samples; global batch of 32.
    sched = _scheduler(opt, max_lr=1.0, lr_warmup_steps=128, lr_decay_steps=1024)
    sched.step(increment=32)
    assert sched.num_steps == 32
    assert sched.current_lr == pytest.approx(0.25)
    for _ in range(3):
        sched.step(increment=32)
    assert sched.num_steps == 128
    assert sched.current_lr == pytest.approx(1.0)
    sched.step(increment=448)  # half of the 896-sample decay
    assert sched.current_lr == pytest.approx(0.5)
    sched.step()
    assert sched.num_steps == 577


def test_step_zero_reapplies() -> None:
    opt = _optimizer()
    sched = _scheduler(opt, max_lr=1.0, lr_decay_steps=100)
    sched.step(30)
    opt.param_groups[0]["lr"] = 123.0
    sched.step(0)
    assert sched.num_steps == 30
    assert sched.current_lr == pytest.approx(0.7)


def test_step_rejects_negative_and_non_int() -> None:
    sched = _scheduler()
    with pytest.raises(ValueError, match="-1"):
        sched.step(-1)
    with pytest.raises(TypeError, match=r"int.*1\.5"):
        sched.step(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="True"):
        sched.step(True)
    assert sched.num_steps == 0


def test_config_property_and_type_check() -> None:
    config = LRScheduleConfig(max_lr=1.0, lr_decay_steps=10)
    sched = OptimizerParamScheduler(_optimizer(), config)
    assert sched.config is config
    with pytest.raises(TypeError, match="LRScheduleConfig"):
        OptimizerParamScheduler(_optimizer(), {"max_lr": 1.0})  # type: ignore[call-overload]


# --- state dict ------------------------------------------------------------------------------

_SCHEDULE: dict[str, Any] = {
    "max_lr": 1.0,
    "min_lr": 0.1,
    "init_lr": 0.01,
    "lr_warmup_steps": 64,
    "lr_decay_steps": 1024,
    "lr_decay_style": "cosine",
    "start_wd": 0.0,
    "end_wd": 0.1,
    "wd_incr_steps": 512,
    "wd_incr_style": "cosine",
}


def test_state_dict_contents_are_plain() -> None:
    sched = _scheduler(**_SCHEDULE)
    sched.step(96)
    sd = sched.state_dict()
    assert sd == {
        **_SCHEDULE,
        "wsd_decay_steps": None,
        "lr_wsd_decay_style": "exponential",
        "num_steps": 96,
    }
    assert all(v is None or type(v) in (int, float, str) for v in sd.values())


def test_state_dict_round_trip_through_torch_save() -> None:
    first_opt = _optimizer()
    first = _scheduler(first_opt, **_SCHEDULE)
    for _ in range(5):
        first.step(32)

    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    second_opt = _optimizer()
    second = _scheduler(second_opt, **_SCHEDULE)
    second.load_state_dict(loaded)
    assert second.num_steps == 160
    assert second_opt.param_groups[0]["lr"] == first_opt.param_groups[0]["lr"]
    assert second_opt.param_groups[0]["weight_decay"] == first_opt.param_groups[0]["weight_decay"]
    for _ in range(30):
        first.step(32)
        second.step(32)
        assert second.current_lr == first.current_lr
        assert second.get_wd() == first.get_wd()
    assert second.state_dict() == first.state_dict()


def _saved(**changes: Any) -> dict[str, Any]:
    sched = _scheduler(**{**_SCHEDULE, **changes})
    sched.step(100)
    return sched.state_dict()


def test_load_override_keeps_config_values() -> None:
    opt = _optimizer()
    sched = _scheduler(
        opt, **_SCHEDULE, use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )  # fmt: skip
    sched.load_state_dict(_saved(max_lr=2.0, lr_decay_steps=2048, lr_decay_style="linear"))
    assert sched.config.max_lr == 1.0
    assert sched.config.lr_decay_steps == 1024
    assert sched.config.lr_decay_style == "cosine"
    assert sched.num_steps == 100
    reference = _scheduler(**_SCHEDULE)
    reference.step(100)
    assert sched.current_lr == pytest.approx(reference.current_lr)


def test_load_use_checkpoint_takes_checkpoint_values() -> None:
    opt = _optimizer()
    sched = _scheduler(opt, **_SCHEDULE, use_checkpoint_opt_param_scheduler=True)
    saved = _saved(max_lr=2.0, min_lr=0.0, lr_decay_steps=2048, lr_decay_style="linear")
    sched.load_state_dict(saved)
    assert sched.config.max_lr == 2.0
    assert sched.config.min_lr == 0.0
    assert sched.config.lr_decay_steps == 2048
    assert sched.config.lr_decay_style == "linear"
    assert sched.config.use_checkpoint_opt_param_scheduler
    assert sched.num_steps == 100
    # Linear from 2.0 over samples 64..2048: 36 of 1984 samples into the decay.
    assert sched.current_lr == pytest.approx(2.0 * (1.0 - 36 / 1984))


def test_load_without_flags_accepts_equal_values() -> None:
    sched = _scheduler(**_SCHEDULE, use_checkpoint_opt_param_scheduler=False)
    sched.load_state_dict(_saved())
    assert sched.num_steps == 100


@pytest.mark.parametrize(
    ("field", "mine", "theirs"),
    [
        ("max_lr", 1.0, 0.5),
        ("lr_decay_steps", 1024, 4096),
        ("lr_decay_style", "cosine", "linear"),
        ("end_wd", 0.1, 0.2),
    ],
)
def test_load_without_flags_refuses_mismatch_and_changes_nothing(
    field: str, mine: Any, theirs: Any
) -> None:
    opt = _optimizer()
    sched = _scheduler(opt, **_SCHEDULE, use_checkpoint_opt_param_scheduler=False)
    sched.step(32)
    before = (sched.num_steps, opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"])
    config_before = sched.config
    with pytest.raises(ValueError, match=rf"{field}.*{mine!r}.*{theirs!r}") as info:
        sched.load_state_dict(_saved(**{field: theirs}))
    assert "use_checkpoint_opt_param_scheduler" in str(info.value)
    assert "override_opt_param_scheduler" in str(info.value)
    after = (sched.num_steps, opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"])
    assert after == before
    assert sched.config is config_before


def test_load_refuses_invalid_merged_values_and_changes_nothing() -> None:
    opt = _optimizer()
    sched = _scheduler(opt, **_SCHEDULE, use_checkpoint_opt_param_scheduler=True)
    sched.step(10)
    lr_before = opt.param_groups[0]["lr"]
    bad = _saved()
    bad["lr_warmup_steps"] = 5000  # past the decay end
    with pytest.raises(ValueError, match=r"invalid.*5000.*1024"):
        sched.load_state_dict(bad)
    bad = _saved()
    bad["num_steps"] = -3
    with pytest.raises(ValueError, match="-3"):
        sched.load_state_dict(bad)
    bad = _saved()
    bad["num_steps"] = 1.5
    with pytest.raises(TypeError, match=r"1\.5"):
        sched.load_state_dict(bad)
    assert sched.num_steps == 10
    assert opt.param_groups[0]["lr"] == lr_before
    assert sched.config.lr_warmup_steps == 64


def test_load_names_missing_keys() -> None:
    sched = _scheduler(**_SCHEDULE)
    sd = sched.state_dict()
    del sd["min_lr"], sd["num_steps"]
    with pytest.raises(ValueError, match=r"'min_lr'.*'num_steps'"):
        sched.load_state_dict(sd)


def test_load_legacy_megatron_keys() -> None:
    opt = _optimizer()
    sched = _scheduler(opt, max_lr=1.0, lr_decay_steps=10, use_checkpoint_opt_param_scheduler=True)
    legacy = {
        "start_lr": 0.5,
        "min_lr": 0.1,
        "warmup_iter": 4,
        "end_iter": 20,
        "decay_style": "linear",
        "num_iters": 12,
    }
    sched.load_state_dict(legacy)
    cfg = sched.config
    assert (cfg.max_lr, cfg.min_lr, cfg.lr_warmup_steps, cfg.lr_decay_steps) == (0.5, 0.1, 4, 20)
    assert cfg.lr_decay_style == "linear"
    assert sched.num_steps == 12
    # Keys the legacy checkpoint lacks keep the config's values.
    assert (cfg.start_wd, cfg.end_wd, cfg.wd_incr_style) == (0.01, 0.01, "constant")
    assert sched.current_lr == pytest.approx(0.1 + 0.4 * (1.0 - 8 / 16))


def test_load_other_legacy_spellings() -> None:
    sched = _scheduler(max_lr=1.0, lr_decay_steps=10, use_checkpoint_opt_param_scheduler=True)
    sched.load_state_dict(
        {
            "max_lr": 1.0,
            "min_lr": 0.0,
            "warmup_steps": 2,
            "decay_steps": 30,
            "lr_decay_style": "cosine",
            "num_steps": 0,
        }
    )
    assert (sched.config.lr_warmup_steps, sched.config.lr_decay_steps) == (2, 30)


def test_load_refuses_conflicting_spellings() -> None:
    sched = _scheduler()
    sd = sched.state_dict()
    sd["start_lr"] = 0.5
    with pytest.raises(ValueError, match=r"'max_lr'=1\.0.*'start_lr'=0\.5"):
        sched.load_state_dict(sd)


def test_load_wsd_fields() -> None:
    wsd = {"lr_decay_style": "WSD", "wsd_decay_steps": 200, "lr_wsd_decay_style": "cosine"}
    sched = _scheduler(**_SCHEDULE, use_checkpoint_opt_param_scheduler=True)
    sched.load_state_dict(_saved(**wsd))
    assert sched.config.lr_decay_style == "WSD"
    assert sched.config.wsd_decay_steps == 200
    assert sched.config.lr_wsd_decay_style == "cosine"
    strict = _scheduler(**{**_SCHEDULE, **wsd}, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match=r"wsd_decay_steps.*200.*100"):
        strict.load_state_dict(_saved(**{**wsd, "wsd_decay_steps": 100}))


# --- config validation -----------------------------------------------------------------------


def _config(**changes: Any) -> LRScheduleConfig:
    return LRScheduleConfig(**{"max_lr": 1.0, "lr_decay_steps": 100, **changes})


def test_config_is_frozen_and_keyword_only() -> None:
    config = _config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_lr = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        LRScheduleConfig(1.0, 100)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="lr_decay_steps"):
        LRScheduleConfig(max_lr=1.0)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"min_lr": -0.5}, r"min_lr.*-0\.5"),
        ({"max_lr": 0.1, "min_lr": 0.2}, r"max_lr \(0\.1\).*min_lr \(0\.2\)"),
        ({"init_lr": 2.0}, r"init_lr \(2\.0\).*max_lr \(1\.0\)"),
        ({"init_lr": -1.0}, r"init_lr.*-1\.0"),
        ({"max_lr": math.nan}, r"max_lr.*finite.*nan"),
        ({"lr_decay_steps": 0}, r"lr_decay_steps.*> 0.*got 0"),
        ({"lr_warmup_steps": 100}, r"lr_warmup_steps=100.*lr_decay_steps=100"),
        ({"lr_warmup_steps": -1}, r"lr_warmup_steps=-1"),
        ({"lr_decay_style": "step"}, r"'step'.*'constant'.*'linear'.*'cosine'.*'WSD'"),
        ({"lr_wsd_decay_style": "sqrt"}, r"'sqrt'.*'exponential'.*'minus_sqrt'"),
        ({"lr_decay_style": "WSD"}, r"WSD.*wsd_decay_steps"),
        ({"lr_decay_style": "WSD", "wsd_decay_steps": 0}, r"wsd_decay_steps=0.*=100"),
        ({"lr_decay_style": "WSD", "wsd_decay_steps": 101}, r"wsd_decay_steps=101.*=100"),
        ({"start_wd": -0.1, "end_wd": -0.1}, r"start_wd.*-0\.1"),
        (
            {"start_wd": 0.0, "end_wd": -0.1, "wd_incr_style": "linear", "wd_incr_steps": 5},
            r"end_wd.*-0\.1",
        ),
        ({"start_wd": 0.0, "end_wd": 0.1}, r"constant.*start_wd=0\.0.*end_wd=0\.1"),
        ({"wd_incr_style": "linear"}, r"'linear'.*wd_incr_steps > 0.*got 0"),
        ({"wd_incr_style": "step"}, r"'step'.*'constant'.*'linear'.*'cosine'"),
        ({"wd_incr_steps": -2}, r"wd_incr_steps.*-2"),
        (
            {"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": True},
            r"at most one of override_opt_param_scheduler and use_checkpoint_opt_param_scheduler",
        ),
    ],
)
def test_config_value_errors(changes: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _config(**changes)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"lr_decay_steps": 100.0}, r"lr_decay_steps.*int.*100\.0"),
        ({"lr_warmup_steps": True}, r"lr_warmup_steps.*int.*True"),
        ({"wd_incr_steps": "5"}, r"wd_incr_steps.*int"),
        ({"lr_decay_style": "WSD", "wsd_decay_steps": 5.0}, r"wsd_decay_steps.*5\.0"),
        ({"max_lr": "1"}, r"max_lr.*real number"),
        ({"min_lr": False}, r"min_lr.*False"),
        ({"override_opt_param_scheduler": 1}, r"override_opt_param_scheduler.*bool"),
    ],
)
def test_config_type_errors(changes: dict[str, Any], pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern):
        _config(**changes)


def test_valid_edge_configs() -> None:
    _config(lr_warmup_steps=99)
    _config(lr_decay_style="WSD", wsd_decay_steps=100)
    _config(max_lr=0.0, min_lr=0.0)
    _config(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    _config(start_wd=0.0, end_wd=0.1, wd_incr_steps=1, wd_incr_style="cosine")
    _config(wsd_decay_steps=7)  # ignored outside WSD
