"""Grad scalers against Megatron's recorded trajectories and an independent float32 model."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pp_optim import ConstantGradScaler, DynamicGradScaler

ORACLE = json.loads((Path(__file__).parent / "data" / "megatron_grad_scaler.json").read_text())


def _state(scaler: DynamicGradScaler) -> list[float]:
    return [scaler.scale.item(), scaler.growth_tracker, scaler.hysteresis_tracker]


@pytest.mark.parametrize("case", ORACLE["cases"], ids=lambda c: c["sequence_name"])
def test_trajectory_equals_megatron(case: dict[str, Any]) -> None:
    scaler = DynamicGradScaler(**case["params"])
    assert _state(scaler) == case["initial"]
    for found_inf, expected in zip(case["found_inf"], case["after_each_update"], strict=True):
        scaler.update(found_inf)
        assert _state(scaler) == expected
    assert scaler.inv_scale.item() == case["inv_scale_final"]


@pytest.mark.parametrize("case", ORACLE["constructor_errors"], ids=str)
def test_refuses_what_megatron_refuses(case: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="invalid DynamicGradScaler"):
        DynamicGradScaler(**case["params"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"min_scale": 0.0}, "min_scale must be > 0"),
        ({"min_scale": 8.0}, "min_scale must be <= initial_scale"),
        ({"growth_factor": 0.5}, "growth_factor must be > 1"),
        ({"backoff_factor": 0.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"backoff_factor": 1.5}, r"backoff_factor must be in \(0, 1\)"),
        ({"growth_interval": -3}, "growth_interval must be > 0.*growth_interval=-3"),
        ({"hysteresis": 0}, "hysteresis must be > 0.*hysteresis=0"),
        ({"initial_scale": -1.0}, "initial_scale must be > 0, got -1.0"),
    ],
)
def test_errors_name_the_parameter_and_value(change: dict[str, float], message: str) -> None:
    params: dict[str, Any] = dict(
        initial_scale=4.0,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2,
        hysteresis=2,
    )
    params.update(change)
    with pytest.raises(ValueError, match=message):
        DynamicGradScaler(**params)


def test_counts_must_be_ints() -> None:
    with pytest.raises(TypeError, match="growth_interval must be an int"):
        DynamicGradScaler(4.0, 1.0, 2.0, 0.5, 2.5, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hysteresis must be an int"):
        DynamicGradScaler(4.0, 1.0, 2.0, 0.5, 2, True)


class Float32Model:
    """The rule written out with numpy float32 scalars, independent of the implementation."""

    def __init__(  # noqa: PLR0917 - mirrors the scaler's positional signature
        self,
        initial: float,
        minimum: float,
        growth: float,
        backoff: float,
        interval: int,
        hysteresis: int,
    ) -> None:
        self.scale = np.float32(initial)
        self.minimum, self.growth, self.backoff = (
            np.float32(minimum),
            np.float32(growth),
            np.float32(backoff),
        )
        self.interval, self.hysteresis = interval, hysteresis
        self.clean, self.budget = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.clean = 0
            self.budget -= 1
            if self.budget <= 0:
                self.scale = max(np.float32(self.scale * self.backoff), self.minimum)
        else:
            self.clean += 1
            if self.clean == self.interval:
                self.clean, self.budget = 0, self.hysteresis
                self.scale = np.float32(self.scale * self.growth)


@pytest.mark.parametrize("seed", range(20))
def test_random_parameters_follow_the_rule(seed: int) -> None:
    rng = random.Random(seed)
    factors = (
        rng.choice([2.0**k for k in range(0, 33, 4)]) * rng.choice([1.0, 1.3]),
        rng.choice([1e-3, 0.5, 1.0]),
        rng.choice([1.001, 1.5, 2.0, 3.7]),
        rng.choice([0.1, 0.5, 0.77, 0.999]),
    )
    counts = (rng.randint(1, 6), rng.randint(1, 4))
    scaler = DynamicGradScaler(*factors, *counts)
    model = Float32Model(*factors, *counts)
    for _ in range(300):
        found_inf = rng.random() < rng.choice([0.1, 0.5, 0.9])
        scaler.update(found_inf)
        model.update(found_inf)
        assert scaler.scale.item() == float(model.scale)
        assert scaler.growth_tracker == model.clean
        assert scaler.hysteresis_tracker == model.budget
        assert scaler.scale.item() >= float(np.float32(factors[1]))


def test_state_dict_resumes_the_same_trajectory_through_a_safe_load() -> None:
    pattern = [True, False, False, True, True, False, False, False, True] * 4
    unbroken = DynamicGradScaler(1024.0, 1.0, 2.0, 0.5, 3, 2)
    first = DynamicGradScaler(1024.0, 1.0, 2.0, 0.5, 3, 2)
    for found_inf in pattern[:13]:
        unbroken.update(found_inf)
        first.update(found_inf)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = DynamicGradScaler(1024.0, 1.0, 2.0, 0.5, 3, 2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert set(first.state_dict()) == {"scale", "growth_tracker", "hysteresis_tracker"}
    for found_inf in pattern[13:]:
        unbroken.update(found_inf)
        resumed.update(found_inf)
        assert _state(resumed) == _state(unbroken)


def test_refused_state_changes_nothing() -> None:
    scaler = DynamicGradScaler(1024.0, 1.0, 2.0, 0.5, 3, 2)
    scaler.update(True)
    before = _state(scaler)
    with pytest.raises(ValueError, match="lacks"):
        scaler.load_state_dict({"scale": torch.tensor([8.0])})
    with pytest.raises(ValueError, match="invalid scale"):
        scaler.load_state_dict(
            {"scale": torch.tensor([-8.0]), "growth_tracker": 0, "hysteresis_tracker": 1}
        )
    assert _state(scaler) == before


def test_constant_scaler_never_moves() -> None:
    scaler = ConstantGradScaler(128.0)
    for found_inf in [True, True, False, True]:
        scaler.update(found_inf)
    assert scaler.scale.item() == 128.0
    assert scaler.inv_scale.item() == 1 / 128.0
    other = ConstantGradScaler(1.0)
    other.load_state_dict(scaler.state_dict())
    assert other.scale.item() == 128.0
    with pytest.raises(ValueError, match="initial_scale must be > 0, got 0"):
        ConstantGradScaler(0)


def test_inv_scale_is_rounded_like_megatron() -> None:
    scaler = ConstantGradScaler(3.0)
    expected = torch.tensor([3.0], dtype=torch.float32).double().reciprocal().float()
    assert scaler.inv_scale.dtype == torch.float32
    assert torch.equal(scaler.inv_scale, expected)
