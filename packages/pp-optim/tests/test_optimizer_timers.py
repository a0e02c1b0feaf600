"""The optimizer step times its phases under Megatron's names through an injected timers object."""

from __future__ import annotations

import pytest
import torch

from pp_optim import (
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    NonFiniteGradError,
    OptimizerConfig,
)
from pp_optim.timing import (
    OPTIMIZER_TIMERS,
    NullOptimizerTimers,
    OptimizerTimer,
    OptimizerTimers,
    timed,
)


class _Recording:
    """Timers that write down each start and stop, with the level and barrier asked for."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int | None, bool]] = []

    def __call__(self, name: str, log_level: int | None = None) -> OptimizerTimer:
        return _RecordingTimer(self, name, log_level)


class _RecordingTimer:
    def __init__(self, timers: _Recording, name: str, level: int | None) -> None:
        self._timers, self._name, self._level = timers, name, level

    def start(self, barrier: bool = False) -> None:
        self._timers.events.append(("start", self._name, self._level, barrier))

    def stop(self, barrier: bool = False) -> None:
        self._timers.events.append(("stop", self._name, self._level, barrier))


def _timed_names(timers: _Recording) -> list[str]:
    """The phases in the order they ran, each checked to start and stop once, in turn."""
    starts = [event for event in timers.events if event[0] == "start"]
    stops = [event for event in timers.events if event[0] == "stop"]
    assert [e[1] for e in timers.events] == [n for e in starts for n in (e[1], e[1])]
    assert len(starts) == len(stops)
    return [name for _, name, _, _ in starts]


def _model(dtype: torch.dtype) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).to(dtype)


def _backward(model: torch.nn.Linear, scale: float = 1.0) -> None:
    loss = model(torch.ones(2, 4, dtype=model.weight.dtype)).float().sum() * scale
    loss.backward()


def _fp16(model: torch.nn.Module, config: OptimizerConfig) -> Float16OptimizerWithFloat16Params:
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicGradScaler(2.0**8, 1.0, 2.0, 0.5, growth_interval=1000, hysteresis=1)
    return Float16OptimizerWithFloat16Params(inner, config, scaler, grad_stats_group=None)


def test_an_fp16_step_times_every_phase_at_level_one_in_megatrons_order() -> None:
    model = _model(torch.float16)
    optimizer = _fp16(model, OptimizerConfig(log_num_zeros_in_grad=True))
    _backward(model)
    timers = _Recording()
    ok, _, zeros = optimizer.step(timers, barrier_with_l1_time=True)
    assert ok
    assert zeros is not None
    assert _timed_names(timers) == list(OPTIMIZER_TIMERS)
    # Megatron's calls: level 1, each start after a barrier, each stop without one.
    assert {(kind, level, barrier) for kind, _, level, barrier in timers.events} == {
        ("start", 1, True),
        ("stop", 1, False),
    }


def test_without_a_scaler_there_is_nothing_to_unscale() -> None:
    model = _model(torch.float32)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = FP32Optimizer(inner, OptimizerConfig(clip_grad=0.0), None, grad_stats_group=None)
    _backward(model)
    timers = _Recording()
    optimizer.step(timers)
    expected = [name for name in OPTIMIZER_TIMERS if name != "optimizer-unscale-and-check-inf"]
    assert _timed_names(timers) == expected
    assert all(not barrier for *_, barrier in timers.events)


def test_an_overflow_stops_after_the_unscale() -> None:
    model = _model(torch.float16)
    optimizer = _fp16(model, OptimizerConfig())
    _backward(model, scale=float("inf"))
    timers = _Recording()
    ok, norm, _ = optimizer.step(timers)
    assert (ok, norm) == (False, None)
    assert _timed_names(timers) == [
        "optimizer-copy-to-main-grad",
        "optimizer-unscale-and-check-inf",
    ]


@pytest.mark.reliability
def test_a_refused_step_still_stops_the_timer_it_started() -> None:
    model = _model(torch.float32)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = FP32Optimizer(inner, OptimizerConfig(), None, grad_stats_group=None)
    _backward(model, scale=float("nan"))
    timers = _Recording()
    with pytest.raises(NonFiniteGradError):
        optimizer.step(timers)
    # The clip phase found the NaN norm; it was stopped before the step refused.
    assert _timed_names(timers) == ["optimizer-copy-to-main-grad", "optimizer-clip-main-grad"]


def test_the_step_times_nothing_by_default_and_the_null_timers_fit() -> None:
    model = _model(torch.float32)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = FP32Optimizer(inner, OptimizerConfig(), None, grad_stats_group=None)
    _backward(model)
    assert optimizer.step()[0]
    null: OptimizerTimers = NullOptimizerTimers()
    with timed(null, "optimizer-inner-step", barrier=True):
        pass


@pytest.mark.reliability
def test_a_phase_that_raises_is_stopped() -> None:
    timers = _Recording()
    with pytest.raises(RuntimeError, match="inside"), timed(timers, "optimizer-inner-step"):
        raise RuntimeError("inside")
    assert _timed_names(timers) == ["optimizer-inner-step"]
