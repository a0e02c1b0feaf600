"""Early exits every rank takes together: SIGTERM, autoresume, a time limit, an exit interval.

Each rank notes its own reasons; one all-reduce per iteration ORs them over all ranks, so
every rank saves and stops at the same iteration.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from pp_state.collectives import at_iteration, collective, collective_device
from pp_train.arguments import TrainingArgs
from pp_train.run import ExitReason, every

__all__ = ["SigtermFlag", "any_rank", "exit_reason"]

# The reasons decided by all ranks together, in the order they are checked.
_AGREED_EXITS: tuple[ExitReason, ...] = ("signal", "autoresume", "exit_duration")


class SigtermFlag:
    """Records SIGTERM instead of dying, so the loop can save first; restores on exit.

    The handler only sets a flag: Python runs it in the main thread between bytecodes, late
    when that thread waits in a transfer. Publishing the rank's position for the stop report
    is done at once by `pp_train.live_dump.SignalWatcher`'s thread, which this handler's
    presence lets the signal reach (``signal.set_wakeup_fd``; the loop enters both).

    Args:
        enabled: Install the handler (`TrainingArgs.exit_signal_handler`); off, a no-op.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.received = False
        self._previous: Any = None

    def __enter__(self) -> SigtermFlag:
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)


def any_rank(flags: list[bool]) -> list[bool]:
    """Each flag ORed over every rank, in one collective."""
    values = torch.tensor(flags, dtype=torch.int32, device=collective_device())
    with collective("exit decision"):
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(value) for value in values.tolist()]


def exit_reason(
    training: TrainingArgs,
    iteration: int,
    *,
    started: float,
    signals: SigtermFlag,
    autoresume: Callable[[], bool] | None,
) -> ExitReason | None:
    """Why the run stops after `iteration`, or None; the same answer on every rank.

    Args:
        training: The exit settings (signal handler, autoresume interval, duration, interval).
        iteration: The iteration just trained (1-based).
        started: When training started (``time.monotonic()``).
        signals: Whether this rank received SIGTERM.
        autoresume: Asked every `adlr_autoresume_interval` iterations whether to stop.
    """
    asks = autoresume is not None and iteration % training.adlr_autoresume_interval == 0
    timed = training.exit_duration_in_mins is not None
    if training.exit_signal_handler or asks or timed:
        # The checks every rank must agree on share one all-reduce per iteration.
        local = [
            training.exit_signal_handler and signals.received,
            asks and autoresume is not None and autoresume(),
            timed and (time.monotonic() - started) / 60.0 > (training.exit_duration_in_mins or 0),
        ]
        with at_iteration(iteration):
            agreed = any_rank(local)
        for reason, flagged in zip(_AGREED_EXITS, agreed, strict=True):
            if flagged:
                return reason
    if every(training.exit_interval, iteration):
        return "exit_interval"
    return None
