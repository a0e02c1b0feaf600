"""The timer hooks communication reports to, as a protocol: no logging package is imported."""

from __future__ import annotations

from typing_extensions import Protocol

__all__ = ["NullTimers", "Timer", "Timers"]


class Timer(Protocol):
    """One named timer (Megatron's ``timers("forward-recv")``)."""

    def start(self) -> None:
        """Start timing."""

    def stop(self) -> None:
        """Stop timing."""


class Timers(Protocol):
    """A factory of named timers; Megatron's ``Timers`` object fits."""

    def __call__(self, name: str) -> Timer:
        """The timer called `name`."""


class _NullTimer:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class NullTimers:
    """Timers that record nothing: the default, so communication code needs no ``if``."""

    _TIMER = _NullTimer()

    def __call__(self, name: str) -> Timer:
        """A timer that does nothing."""
        return self._TIMER
