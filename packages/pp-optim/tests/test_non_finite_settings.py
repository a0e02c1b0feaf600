"""Settings that are inf or NaN are refused when built, naming the setting and the value."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pp_optim import ConstantGradScaler, DynamicGradScaler, OptimizerConfig

pytestmark = pytest.mark.reliability

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize(
    ("lr", "message"),
    [
        (INF, "lr must be a finite number, got inf (Megatron's --lr)"),
        (NAN, "lr must be a finite number, got nan (Megatron's --lr)"),
        (-INF, "lr must be a finite number, got -inf (Megatron's --lr)"),
        (-1.0, "lr must be >= 0, got -1.0 (Megatron's --lr)"),
    ],
)
def test_a_learning_rate_that_is_not_finite_or_negative_is_refused(lr: float, message: str) -> None:
    with pytest.raises(ValueError, match=r"^invalid OptimizerConfig: lr must be") as caught:
        OptimizerConfig(lr=lr)
    assert str(caught.value) == f"invalid OptimizerConfig: {message}"


def _dynamic(**change: Any) -> DynamicGradScaler:
    params: dict[str, Any] = dict(
        initial_scale=4.0, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
        growth_interval=2, hysteresis=2,
    )  # fmt: skip
    return DynamicGradScaler(**{**params, **change})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"initial_scale": INF}, "initial_scale must be a finite number, got inf"),
        ({"initial_scale": NAN}, "initial_scale must be a finite number, got nan"),
        ({"initial_scale": 0.0}, "initial_scale must be > 0, got 0.0"),
        (
            {"min_scale": INF},
            "min_scale must be <= initial_scale (got initial_scale=4.0, min_scale=inf",
        ),
        ({"min_scale": NAN}, "min_scale must be > 0; min_scale must be <= initial_scale (got"),
        ({"min_scale": -1.0}, "min_scale must be > 0 (got initial_scale=4.0, min_scale=-1.0"),
        ({"growth_factor": INF}, "growth_factor must be > 1 and finite (got initial_scale=4.0"),
    ],
)
def test_the_dynamic_scaler_refuses_non_finite_and_non_positive_scales(
    change: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=r"scale|growth_factor") as caught:
        _dynamic(**change)
    assert message in str(caught.value)


@pytest.mark.parametrize("scale", [INF, NAN, -INF])
def test_a_constant_scale_must_be_finite(scale: float) -> None:
    with pytest.raises(ValueError, match=f"initial_scale must be a finite number, got {scale}"):
        ConstantGradScaler(scale)
