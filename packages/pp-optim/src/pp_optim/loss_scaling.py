"""Loss scalers for fp16 training: a constant scale, or Megatron's dynamic scale with hysteresis.

The scale is kept as a one-element float32 tensor and every update is computed in float32, so
the trajectory is the same number for number as Megatron's ``DynamicGradScaler``, whatever the
growth and backoff factors.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import torch

__all__ = ["ConstantGradScaler", "DynamicGradScaler", "GradScaler"]


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


def _checked_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


class GradScaler(abc.ABC):
    """A loss scale: the loss is multiplied by `scale` and the gradients by `inv_scale`."""

    def __init__(self, initial_scale: float) -> None:
        """Starts at `initial_scale`.

        Args:
            initial_scale: The first scale; must be positive and finite.

        Raises:
            ValueError: `initial_scale` is not positive, or is inf or NaN.
        """
        initial = _checked_number("initial_scale", initial_scale)
        if not math.isfinite(initial):
            raise ValueError(f"initial_scale must be a finite number, got {initial_scale}")
        if not initial > 0.0:
            raise ValueError(f"initial_scale must be > 0, got {initial_scale}")
        self._scale = _scalar(initial)

    @property
    def scale(self) -> torch.Tensor:
        """The current scale, a one-element float32 tensor on the CPU."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """1 / scale, computed in float64 and rounded to float32 as Megatron does."""
        return self._scale.double().reciprocal().float()

    @abc.abstractmethod
    def update(self, found_inf: bool) -> None:
        """Adjusts the scale after a step whose gradients did (True) or did not overflow."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """What `load_state_dict` needs to resume the same trajectory."""

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a state written by `state_dict`."""


class ConstantGradScaler(GradScaler):
    """A fixed loss scale (Megatron's ``--loss-scale``); `update` never changes it."""

    def update(self, found_inf: bool) -> None:
        """Does nothing: the scale is constant."""

    def state_dict(self) -> dict[str, Any]:
        """Returns ``{"scale": tensor}``."""
        return {"scale": self._scale.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes the saved scale.

        Raises:
            ValueError: The state has no positive "scale".
        """
        self._scale = _loaded_scale(state_dict)


def _loaded_scale(state_dict: dict[str, Any]) -> torch.Tensor:
    if "scale" not in state_dict:
        raise ValueError(f"grad scaler state has no 'scale'; keys: {sorted(state_dict)}")
    scale = torch.as_tensor(state_dict["scale"], dtype=torch.float32).reshape(-1)
    if scale.numel() != 1 or not bool(scale[0] > 0):
        raise ValueError(f"grad scaler state holds an invalid scale {state_dict['scale']!r}")
    return scale.clone()


class DynamicGradScaler(GradScaler):
    """Megatron's dynamic loss scale.

    After `hysteresis` overflowing steps the scale is multiplied by `backoff_factor` (never
    below `min_scale`); after `growth_interval` clean steps in a row it is multiplied by
    `growth_factor`. As in Megatron, the hysteresis budget is refilled only when the scale
    grows, so once it is spent every further overflow backs off at once.
    """

    def __init__(  # noqa: PLR0917 - Megatron passes these positionally
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
    ) -> None:
        """Checks the parameters Megatron checks.

        Args:
            initial_scale: The first scale (Megatron's default ``2**32``).
            min_scale: Floor of the scale, > 0 and <= `initial_scale` (so finite too).
            growth_factor: Multiplier on growth, > 1 and finite.
            backoff_factor: Multiplier on overflow, strictly between 0 and 1.
            growth_interval: Clean steps in a row before the scale grows, > 0
                (Megatron's ``--loss-scale-window``).
            hysteresis: Overflowing steps tolerated before backing off, > 0.

        Raises:
            ValueError: A parameter is out of its range; the message names it and its value.
            TypeError: A parameter is not a number (the two counts must be ints).
        """
        super().__init__(initial_scale)
        checks = [
            (_checked_number("min_scale", min_scale) > 0.0, "min_scale must be > 0"),
            (float(min_scale) <= float(initial_scale), "min_scale must be <= initial_scale"),
            (
                1.0 < _checked_number("growth_factor", growth_factor) < math.inf,
                "growth_factor must be > 1 and finite",
            ),
            (
                0.0 < _checked_number("backoff_factor", backoff_factor) < 1.0,
                "backoff_factor must be in (0, 1)",
            ),
        ]
        for name, count in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if isinstance(count, bool) or not isinstance(count, int):
                raise TypeError(f"{name} must be an int, got {count!r}")
            checks.append((count > 0, f"{name} must be > 0"))
        failed = [message for ok, message in checks if not ok]
        if failed:
            raise ValueError(
                f"invalid DynamicGradScaler: {'; '.join(failed)} (got initial_scale="
                f"{initial_scale}, min_scale={min_scale}, growth_factor={growth_factor}, "
                f"backoff_factor={backoff_factor}, growth_interval={growth_interval}, "
                f"hysteresis={hysteresis})"
            )
        self.min_scale = _scalar(float(min_scale))
        self.growth_factor = _scalar(float(growth_factor))
        self.backoff_factor = _scalar(float(backoff_factor))
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    @property
    def growth_tracker(self) -> int:
        """Clean steps since the last overflow or growth."""
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """Overflows still tolerated before backing off (negative once spent, as in Megatron)."""
        return self._hysteresis_tracker

    def update(self, found_inf: bool) -> None:
        """Backs off or grows the scale after one step.

        Args:
            found_inf: Whether any gradient of the step (on any model-parallel rank) was
                inf or nan.
        """
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """Returns Megatron's keys: ``scale``, ``growth_tracker``, ``hysteresis_tracker``."""
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores scale and trackers; the parameters stay those given to the constructor.

        Raises:
            ValueError: A key is missing or the scale is not positive; nothing is changed.
        """
        missing = {"growth_tracker", "hysteresis_tracker"} - set(state_dict)
        if missing:
            raise ValueError(
                f"grad scaler state lacks {sorted(missing)}; keys: {sorted(state_dict)}"
            )
        scale = _loaded_scale(state_dict)
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
        self._scale = scale
