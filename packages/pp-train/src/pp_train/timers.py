"""Named wall-clock timers, as Megatron's: ``timers("optimizer").start()``.

`Timers` measures wall-clock time under names such as "forward-backward", fits the
``Timers`` protocol that pp-comm reports to (and pp-optim's `OptimizerTimers`), and writes
its times to TensorBoard as Megatron's ``<name>-time`` scalars (`Timers.write`, to any
`ScalarWriter`). Each timer has a level (Megatron's ``--timing-log-level``); one above the
configured level measures nothing. `Timers.log_string` gathers the ranks' times into the
line printed under the training log line (Megatron's ``--timing-log-option``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, get_args

import torch
import torch.distributed as dist

from pp_state.collectives import collective

__all__ = [
    "TIMING_LOG_OPTIONS",
    "ScalarWriter",
    "Timer",
    "Timers",
    "TimingLogOption",
]

# Marks a timer a rank has never created; it is left out of the min, max and list of times.
_MISSING = -1.0
_MAX_LOG_LEVEL = 2

TimingLogOption = Literal["max", "minmax", "all"]
"""Megatron's ``--timing-log-option``: what a timer's line shows of the ranks' times."""
TIMING_LOG_OPTIONS: tuple[TimingLogOption, ...] = get_args(TimingLogOption)
_HEADERS: Mapping[str, str] = {
    "max": "max time across ranks (ms)",
    "minmax": "(min, max) time across ranks (ms)",
    "all": "times across ranks (ms)",
}


def _synchronize_cuda() -> None:
    # Kernels run asynchronously: without this a timer would measure their launch only. A
    # process that never touched CUDA is not made to create a context here.
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # unannotated in torch
        torch.cuda.synchronize()


def _distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


class Timer:
    """One named wall-clock timer that accumulates the time between `start` and `stop`."""

    def __init__(self, name: str, barrier_group: dist.ProcessGroup | None = None) -> None:
        """Makes a stopped timer with nothing accumulated.

        Args:
            name: The name used in messages and logs.
            barrier_group: The group ``start(barrier=True)`` and ``stop(barrier=True)`` wait
                for (None: the default group).
        """
        self._name = name
        self._barrier_group = barrier_group
        self._elapsed = 0.0
        self._started_at: float | None = None

    @property
    def name(self) -> str:
        """The timer's name."""
        return self._name

    @property
    def running(self) -> bool:
        """Whether the timer has been started and not stopped since."""
        return self._started_at is not None

    def _barrier(self) -> None:
        if _distributed_ready():
            with collective(f"timer barrier ({self.name})", group=self._barrier_group):
                dist.barrier(group=self._barrier_group)

    def start(self, barrier: bool = False) -> None:
        """Starts timing.

        Args:
            barrier: Wait for every rank of the barrier group first, so that the interval
                measured is the same on all of them, and for this rank's device (CUDA
                kernels run asynchronously). Without it the clock is read at once: nothing
                waits, so the timer adds no synchronisation to the step.

        Raises:
            RuntimeError: The timer is already running.
        """
        if self._started_at is not None:
            raise RuntimeError(f"timer {self._name!r} is already running; stop it first")
        if barrier:
            self._barrier()
            _synchronize_cuda()
        self._started_at = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        """Stops timing and adds the interval to the elapsed time.

        Args:
            barrier: Wait for every rank of the barrier group, and for this rank's device,
                before reading the clock.

        Raises:
            RuntimeError: The timer is not running.
        """
        if self._started_at is None:
            raise RuntimeError(f"timer {self._name!r} is not running; start it first")
        if barrier:
            self._barrier()
            _synchronize_cuda()
        self._elapsed += time.perf_counter() - self._started_at
        self._started_at = None

    def reset(self) -> None:
        """Stops the timer, if running, and forgets the accumulated time (as Megatron's)."""
        self._elapsed = 0.0
        self._started_at = None

    def elapsed(self, reset: bool = True) -> float:
        """The accumulated time, including the current interval of a running timer.

        Args:
            reset: Start accumulating again from zero after reading (a running timer keeps
                running).

        Returns:
            Seconds accumulated since the last reset.
        """
        was_running = self.running
        if was_running:
            self.stop()
        elapsed = self._elapsed
        if reset:
            self.reset()
        if was_running:
            self.start()
        return elapsed


class _DummyTimer:
    """What a timer above the timing log level is: it measures and reports nothing."""

    def __init__(self, name: str) -> None:
        self._name = name

    def start(self, barrier: bool = False) -> None:
        """Does nothing."""

    def stop(self, barrier: bool = False) -> None:
        """Does nothing."""

    def elapsed(self, reset: bool = True) -> float:
        """Refuses: the timer's level is above the timing log level.

        Raises:
            RuntimeError: Always.
        """
        raise RuntimeError(
            f"timer {self._name!r} is above the timing log level, so it measures nothing; "
            "raise the log level (Timers(log_level=...), --timing-log-level) to read it"
        )


class Timers:
    """Named timers made on first use: ``timers("optimizer").start()``, as in Megatron.

    Each timer has a level (Megatron's ``--timing-log-level``): 0 for what runs once per run
    or per iteration at no cost, 1 for phases run once per iteration (forward-backward, the
    gradient reduction, the optimizer), 2 for what runs many times per iteration (each
    forward and backward, each transfer). Timers above the configured level measure nothing.
    """

    def __init__(
        self,
        log_level: int = _MAX_LOG_LEVEL,
        log_option: TimingLogOption = "max",
        *,
        barrier_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Makes an empty set of timers.

        Args:
            log_level: Timers of a higher level are dummies (0, 1 or 2; 2 keeps all).
            log_option: What `log_string` reports of the ranks' times: "max", "minmax" or
                "all" (each rank's).
            barrier_group: The group the timers wait for when started or stopped with
                ``barrier=True`` (None: the default group).

        Raises:
            ValueError: A level or option outside the choices.
        """
        _check_level("log_level", log_level)
        if log_option not in TIMING_LOG_OPTIONS:
            raise ValueError(
                f"log_option must be one of {', '.join(TIMING_LOG_OPTIONS)}, got {log_option!r}"
            )
        self._log_level = log_level
        self._log_option: TimingLogOption = log_option
        self._barrier_group = barrier_group
        self._timers: dict[str, Timer] = {}
        self._levels: dict[str, int] = {}

    @property
    def log_level(self) -> int:
        """Timers above this level measure nothing."""
        return self._log_level

    @property
    def log_option(self) -> TimingLogOption:
        """What `log_string` reports of the ranks' times."""
        return self._log_option

    def __call__(self, name: str, log_level: int | None = None) -> Timer | _DummyTimer:
        """The timer called `name`, made stopped and empty if it does not exist yet.

        Args:
            name: The timer's name.
            log_level: Its level (by default 2, the finest); a timer above the configured
                level is a dummy that measures nothing.

        Raises:
            ValueError: A level outside 0 .. 2, or one that differs from the level the timer
                was made with.
        """
        if log_level is not None:
            _check_level("a timer's log_level", log_level)
        timer = self._timers.get(name)
        if timer is not None:
            if log_level is not None and log_level != self._levels[name]:
                raise ValueError(
                    f"timer {name!r} was made with log level {self._levels[name]}, "
                    f"asked for with {log_level}"
                )
            return timer
        level = _MAX_LOG_LEVEL if log_level is None else log_level
        if level > self._log_level:
            return _DummyTimer(name)
        timer = self._timers[name] = Timer(name, self._barrier_group)
        self._levels[name] = level
        return timer

    def __contains__(self, name: object) -> bool:
        """Whether a timer called `name` has been made (dummies are not)."""
        return name in self._timers

    def names(self) -> list[str]:
        """The names of the timers made so far, in order of creation.

        Returns:
            The timer names.
        """
        return list(self._timers)

    def log_string(
        self,
        names: Sequence[str],
        *,
        normalizer: float = 1.0,
        group: dist.ProcessGroup | None = None,
        reset: bool = True,
        header: bool = False,
    ) -> str:
        """The elapsed time of each timer in `names` over the ranks of `group`.

        Every rank of `group` must call this with the same `names`: the times meet in one
        all-gather. A name no rank has a timer for is left out of the line. What is shown
        of the ranks' times is the `log_option`: "max" (``"optimizer: 1.20"``), "minmax"
        (``"optimizer: (0.98, 1.20)"``) or "all" (``"optimizer: [1.20, 0.98]"``, ``-`` for
        a rank without the timer).

        Args:
            names: The timers to report, in the order to print them.
            normalizer: Divides every time (e.g. the number of iterations they cover).
            group: The ranks to report over; None (or no initialised torch.distributed)
                reports this rank's times.
            reset: Reset the timers after reading them, as Megatron's log does.
            header: Start with what the numbers are, e.g. ``"max time across ranks (ms) | "``.

        Returns:
            A line such as ``"forward-backward: 12.34 | optimizer: 1.20"`` in milliseconds.

        Raises:
            ValueError: `normalizer` is not a positive finite number.
        """
        _check_normalizer(normalizer)
        per_rank = self._seconds_per_rank(names, group, reset)
        parts = [
            f"{name}: {text}"
            for index, name in enumerate(names)
            if (text := _format_times(per_rank[:, index].tolist(), normalizer, self._log_option))
        ]
        body = " | ".join(parts)
        return f"{_HEADERS[self._log_option]} | {body}" if header and body else body

    def write(
        self,
        names: Sequence[str],
        writer: ScalarWriter | None,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = True,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, float]:
        """Writes each timer's maximum time over the ranks as the scalar ``<name>-time``.

        As Megatron's ``timers.write``: seconds divided by `normalizer`, at step `iteration`;
        a name no rank has a timer for is left out. Every rank of the group must call this
        with the same `names` (one all-gather); only the rank that writes needs a `writer`.

        Args:
            names: The timers to write.
            writer: A TensorBoard ``SummaryWriter`` or any `ScalarWriter`; None writes
                nothing (the ranks that only take part in the gather).
            iteration: The step the scalars are written at.
            normalizer: Divides every time (e.g. the iterations they cover).
            reset: Reset the timers after reading them (Megatron's default); the training
                loop passes False, so that the log line read after still sees them.
            group: The ranks to take the maximum over; None: every rank of the default group
                (this rank alone without torch.distributed).

        Returns:
            The seconds written, by timer name.

        Raises:
            ValueError: `normalizer` is not a positive finite number.
        """
        _check_normalizer(normalizer)
        ranks = group if group is not None or not _distributed_ready() else dist.group.WORLD
        per_rank = self._seconds_per_rank(names, ranks, reset)
        written = {}
        for index, name in enumerate(names):
            known = [value for value in per_rank[:, index].tolist() if value != _MISSING]
            if known:
                written[name] = max(known) / normalizer
                if writer is not None:
                    writer.add_scalar(f"{name}-time", written[name], iteration)
        return written

    def _seconds_per_rank(
        self, names: Sequence[str], group: dist.ProcessGroup | None, reset: bool
    ) -> torch.Tensor:
        """Each rank's seconds of each name, one row per rank (`_MISSING` where it has none)."""
        seconds = torch.tensor(
            [
                self._timers[name].elapsed(reset=reset) if name in self._timers else _MISSING
                for name in names
            ],
            dtype=torch.float64,
        )
        if group is not None and _distributed_ready() and len(names) > 0:
            return _gather_over_group(seconds, group)
        return seconds.unsqueeze(0)


def _check_normalizer(normalizer: object) -> None:
    if not (isinstance(normalizer, (int, float)) and 0.0 < normalizer < math.inf):
        raise ValueError(
            f"normalizer must be a positive finite number such as 1.0 or the number of "
            f"iterations timed, got {normalizer!r}"
        )


def _check_level(name: str, level: object) -> None:
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= _MAX_LOG_LEVEL:
        raise ValueError(f"{name} must be 0, 1 or 2 (Megatron's timing log levels), got {level!r}")


def _format_times(seconds: list[float], normalizer: float, option: TimingLogOption) -> str:
    """One timer's milliseconds over the ranks as the option shows them; '' if no rank has it."""
    known = [value * 1000.0 / normalizer for value in seconds if value != _MISSING]
    if not known:
        return ""
    if option == "max":
        return f"{max(known):.2f}"
    if option == "minmax":
        return f"({min(known):.2f}, {max(known):.2f})"
    shown = (
        "-" if value == _MISSING else f"{value * 1000.0 / normalizer:.2f}" for value in seconds
    )
    return "[" + ", ".join(shown) + "]"


def _gather_over_group(values: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `values`, one row per rank of `group`."""
    # NCCL gathers device tensors only; gloo (and the rest) take the CPU tensor as it is.
    device = torch.device("cuda") if dist.get_backend(group) == "nccl" else values.device
    local = values.to(device)
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    with collective("timer all-gather", group=group):
        dist.all_gather(rows, local, group=group)
    return torch.stack(rows).cpu()


class ScalarWriter(Protocol):
    """Where scalars go: ``torch.utils.tensorboard.SummaryWriter`` fits."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int, /) -> object:
        """Records `scalar_value` under `tag` at step `global_step`."""
