"""The timers the optimizer step reports to, as a protocol: no logging package is imported.

pp-train's ``Timers`` fits `OptimizerTimers`: ``timers(name, log_level=1)`` gives a timer that
starts with an optional barrier, as Megatron's optimizer calls its timers. `NullOptimizerTimers`
is the default, so the step needs no ``if`` around each phase.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

__all__ = [
    "OPTIMIZER_TIMERS",
    "OPTIMIZER_TIMER_LEVEL",
    "NullOptimizerTimers",
    "OptimizerTimer",
    "OptimizerTimers",
    "timed",
]

OPTIMIZER_TIMER_LEVEL = 1
"""Megatron's timing log level of the step's phases (``--timing-log-level 1`` shows them)."""

OPTIMIZER_TIMERS = (
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
)
"""The step's phases in the order they run, under Megatron's names."""


class OptimizerTimer(Protocol):
    """One named timer; pp-train's ``Timer`` fits."""

    def start(self, barrier: bool = False) -> None:
        """Starts timing (after a barrier across ranks when `barrier`)."""

    def stop(self, barrier: bool = False) -> None:
        """Stops timing."""


class OptimizerTimers(Protocol):
    """A factory of levelled timers, as Megatron's ``Timers``; pp-train's ``Timers`` fits."""

    def __call__(self, name: str, log_level: int | None = None) -> OptimizerTimer:
        """The timer called `name`, of level `log_level`."""


class _NullTimer:
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


class NullOptimizerTimers:
    """Timers that record nothing: the optimizer step's default."""

    _TIMER = _NullTimer()

    def __call__(self, name: str, log_level: int | None = None) -> OptimizerTimer:
        """A timer that does nothing."""
        return self._TIMER


@contextlib.contextmanager
def timed(timers: OptimizerTimers, name: str, *, barrier: bool = False) -> Iterator[None]:
    """Times the block under `name` at `OPTIMIZER_TIMER_LEVEL`; stopped even when it raises.

    Args:
        timers: Where the time goes.
        name: The phase, one of `OPTIMIZER_TIMERS`.
        barrier: Start after a barrier (Megatron's ``--barrier-with-L1-time``).
    """
    timer = timers(name, log_level=OPTIMIZER_TIMER_LEVEL)
    timer.start(barrier=barrier)
    try:
        yield
    finally:
        timer.stop()
