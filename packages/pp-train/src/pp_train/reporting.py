"""What training reports: named timers, Megatron's per-interval log line, TensorBoard scalars.

`Timers` measures wall-clock time under names such as "forward-backward", fits the
``Timers`` protocol that pp-comm reports to (and pp-optim's `OptimizerTimers`), and writes
its times to TensorBoard as Megatron's ``<name>-time`` scalars. `TrainingLogger` keeps
Megatron's counters between log lines (advanced, skipped and nan iterations, loss sums),
writes the per-iteration scalars to a TensorBoard-like writer and, every ``log_interval``
iterations, prints one line in the format of Megatron's training log. Memory reports moved
to `pp_train.memory` (`memory_report` here is deprecated).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Protocol, get_args

import torch
import torch.distributed as dist

from pp_state.collectives import collective
from pp_state.numbers import check_at_least
from pp_train.memory import legacy_memory_report

__all__ = [
    "TIMING_LOG_OPTIONS",
    "ScalarWriter",
    "Timer",
    "Timers",
    "TimingLogOption",
    "TrainingLogger",
    "format_log_line",
    "memory_report",
]

_PROGRESS_BAR_WIDTH = 20
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


def _progress_bar(iteration: int, train_iters: int) -> str:
    # Integer arithmetic: 29 / 100 * 100 is 28.999... in floating point.
    done = min(max(iteration, 0), train_iters)
    filled = done * _PROGRESS_BAR_WIDTH // train_iters
    bar = "#" * filled + "." * (_PROGRESS_BAR_WIDTH - filled)
    return f"[{bar}] {done * 100 // train_iters}%"


def format_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    learning_rate: float,
    global_batch_size: int,
    loss_averages: Mapping[str, float],
    loss_scale: float,
    skipped_iterations: int,
    nan_iterations: int,
    elapsed_per_iteration: float | None = None,
    grad_norm: float | None = None,
    num_zeros_in_grad: int | None = None,
    params_norm: float | None = None,
) -> str:
    """One line of Megatron's training log, with a progress bar at the end.

    Args:
        iteration: The iteration just finished.
        train_iters: The number of iterations the run will train for.
        consumed_samples: Samples consumed by training so far.
        learning_rate: The current learning rate.
        global_batch_size: The current global batch size.
        loss_averages: Each loss averaged over the interval, in the order to print them.
        loss_scale: The current loss scale (1.0 without one).
        skipped_iterations: Iterations skipped in the interval.
        nan_iterations: Iterations with an inf or nan loss in the interval.
        elapsed_per_iteration: Seconds per iteration over the interval; None leaves the field
            out.
        grad_norm: The gradient norm of the last iteration; None leaves the field out.
        num_zeros_in_grad: The number of zeros in the gradient; None leaves the field out.
        params_norm: The parameter norm; None leaves the field out.

    Returns:
        The line, starting with a space and ending with the progress bar.

    Raises:
        ValueError: `train_iters` is not positive.
    """
    if train_iters <= 0:
        raise ValueError(f"train_iters must be >= 1, got {train_iters}")
    fields = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f" consumed samples: {consumed_samples:12d}",
    ]
    if elapsed_per_iteration is not None:
        fields.append(f" elapsed time per iteration (ms): {elapsed_per_iteration * 1000.0:.1f}")
    fields.append(f" learning rate: {learning_rate:.6E}")
    fields.append(f" global batch size: {global_batch_size:5d}")
    fields.extend(f" {name}: {average:.6E}" for name, average in loss_averages.items())
    fields.append(f" loss scale: {loss_scale:.1f}")
    fields.extend(_norm_fields(grad_norm, num_zeros_in_grad, params_norm))
    fields.append(f" number of skipped iterations: {skipped_iterations:3d}")
    fields.append(f" number of nan iterations: {nan_iterations:3d}")
    return "".join(field + " |" for field in fields) + " " + _progress_bar(iteration, train_iters)


def _norm_fields(
    grad_norm: float | None, num_zeros_in_grad: int | None, params_norm: float | None
) -> list[str]:
    # Each is computed only when asked for; one not computed is left out of the line.
    fields = []
    if grad_norm is not None:
        fields.append(f" grad norm: {grad_norm:.3f}")
    if num_zeros_in_grad is not None:
        fields.append(f" num zeros: {float(num_zeros_in_grad):.1f}")
    if params_norm is not None:
        fields.append(f" params norm: {params_norm:.3f}")
    return fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class _IterationScalars:
    """What one iteration reports: to the writer every iteration, in the log line at intervals."""

    iteration: int
    consumed_samples: int
    learning_rate: float
    global_batch_size: int
    loss_scale: float
    grad_norm: float | None
    num_zeros_in_grad: int | None
    params_norm: float | None
    elapsed_per_iteration: float | None


class TrainingLogger:
    """Megatron's ``training_log``: counters across iterations, TensorBoard, a periodic line.

    Call `training_log` once per iteration on every rank. Between two log lines it counts
    advanced iterations (not skipped; their losses are summed for the averages), skipped
    iterations, and nan iterations (any loss inf or nan, whether the iteration was skipped or
    not); the counters restart after each line. `validation_log` reports an evaluation.
    """

    def __init__(
        self,
        *,
        train_iters: int,
        log_interval: int,
        writer: ScalarWriter | None = None,
        is_logging_rank: bool,
        print_fn: Callable[[str], None] = print,
    ) -> None:
        """Makes a logger with empty counters.

        Args:
            train_iters: The number of iterations the run will train for.
            log_interval: Print a line every this many iterations.
            writer: Receives the per-iteration scalars (e.g. a TensorBoard
                ``SummaryWriter``); None writes none.
            is_logging_rank: Whether this rank prints and writes (Megatron: the last rank).
            print_fn: Receives each printed text.

        Raises:
            TypeError: `train_iters` or `log_interval` is not an int.
            ValueError: `train_iters` or `log_interval` is below 1.
        """
        self._train_iters = check_at_least("train_iters", train_iters, 1)
        self._log_interval = check_at_least("log_interval", log_interval, 1)
        self._writer = writer
        self._is_logging_rank = is_logging_rank
        self._print = print_fn
        self._advanced = 0
        self._skipped = 0
        self._nan = 0
        self._loss_sums: dict[str, float] = {}

    @property
    def writer(self) -> ScalarWriter | None:
        """Where this rank writes scalars: the writer on the logging rank, else None."""
        return self._writer if self._is_logging_rank else None

    @property
    def advanced_iterations(self) -> int:
        """Iterations that updated the model since the last log line."""
        return self._advanced

    @property
    def skipped_iterations(self) -> int:
        """Iterations skipped (e.g. on gradient overflow) since the last log line."""
        return self._skipped

    @property
    def nan_iterations(self) -> int:
        """Iterations with an inf or nan loss since the last log line."""
        return self._nan

    def training_log(
        self,
        loss_dict: Mapping[str, float],
        *,
        iteration: int,
        learning_rate: float,
        loss_scale: float,
        skipped_iter: int,
        grad_norm: float | None,
        num_zeros_in_grad: int | None,
        consumed_samples: int,
        global_batch_size: int,
        elapsed_per_iteration: float | None = None,
        timers_line: str | None = None,
        params_norm: float | None = None,
    ) -> str | None:
        """Records one iteration, writes its scalars and, at a log interval, the log line.

        Args:
            loss_dict: Each loss of this iteration, by name (reduced over the data-parallel
                ranks by the caller).
            iteration: The iteration just finished (counting from 1).
            learning_rate: The learning rate the iteration used.
            loss_scale: The current loss scale (1.0 without one).
            skipped_iter: 1 if the optimizer skipped the update, else 0.
            grad_norm: The gradient norm, or None when not computed.
            num_zeros_in_grad: The number of zeros in the gradient, or None.
            consumed_samples: Samples consumed by training, this iteration's included.
            global_batch_size: The global batch size of this iteration.
            elapsed_per_iteration: Seconds per iteration over the interval, or None.
            timers_line: A `Timers.log_string` line (with header), printed under the line.
            params_norm: The parameter norm, or None.

        Returns:
            At a log iteration (``iteration % log_interval == 0``) the text printed on the
            logging rank (the same text on every rank); otherwise None.

        Raises:
            ValueError: `skipped_iter` is not 0 or 1.
        """
        if skipped_iter not in (0, 1):
            raise ValueError(f"skipped_iter must be 0 or 1, got {skipped_iter!r}")
        losses = {name: float(value) for name, value in loss_dict.items()}
        self._count(losses, skipped=bool(skipped_iter))
        scalars = _IterationScalars(
            iteration=iteration,
            consumed_samples=consumed_samples,
            learning_rate=learning_rate,
            global_batch_size=global_batch_size,
            loss_scale=loss_scale,
            grad_norm=grad_norm,
            num_zeros_in_grad=num_zeros_in_grad,
            params_norm=params_norm,
            elapsed_per_iteration=elapsed_per_iteration,
        )
        if self._is_logging_rank and self._writer is not None:
            self._write_scalars(self._writer, losses, scalars)
        if iteration % self._log_interval != 0:
            return None
        return self._log_interval_line(scalars, timers_line)

    def _log_interval_line(self, scalars: _IterationScalars, timers_line: str | None) -> str:
        """Prints the interval's log line on the logging rank and restarts the counters."""
        line = format_log_line(
            iteration=scalars.iteration,
            train_iters=self._train_iters,
            consumed_samples=scalars.consumed_samples,
            elapsed_per_iteration=scalars.elapsed_per_iteration,
            learning_rate=scalars.learning_rate,
            global_batch_size=scalars.global_batch_size,
            loss_averages=self._loss_averages(),
            loss_scale=scalars.loss_scale,
            grad_norm=scalars.grad_norm,
            num_zeros_in_grad=scalars.num_zeros_in_grad,
            params_norm=scalars.params_norm,
            skipped_iterations=self._skipped,
            nan_iterations=self._nan,
        )
        text = line if not timers_line else f"{line}\n    {timers_line}"
        self._restart_interval()
        if self._is_logging_rank:
            self._print(text)
        return text

    def validation_log(
        self,
        losses: Mapping[str, float],
        *,
        iteration: int,
        consumed_samples: int,
        line: str | None = None,
    ) -> str:
        """Writes validation losses and prints them between two rules of dashes, as Megatron.

        Args:
            losses: Each validation loss, averaged over the evaluation, by name.
            iteration: The training iteration the evaluation follows.
            consumed_samples: Training samples consumed so far (the "vs samples" step).
            line: The body of the report; None makes ``"<name> value: ... | <name> PPL: ..."``
                from `losses`.

        Returns:
            The text printed on the logging rank (the same text on every rank).
        """
        values = {name: float(value) for name, value in losses.items()}
        if self._is_logging_rank and self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(f"{name} validation", value, iteration)
                self._writer.add_scalar(f"{name} validation vs samples", value, consumed_samples)
                self._writer.add_scalar(f"{name} validation ppl", _perplexity(value), iteration)
                self._writer.add_scalar(
                    f"{name} validation ppl vs samples", _perplexity(value), consumed_samples
                )
        if line is None:
            line = " | ".join(
                f"{name} value: {value:.6E} | {name} PPL: {_perplexity(value):.6E}"
                for name, value in values.items()
            )
        report = f" validation loss at iteration {iteration} | {line} |"
        rule = "-" * (len(report) + 1)
        text = f"{rule}\n{report}\n{rule}"
        if self._is_logging_rank:
            self._print(text)
        return text

    def _count(self, losses: Mapping[str, float], *, skipped: bool) -> None:
        if skipped:
            # Megatron's rule: a skipped iteration whose loss is inf or nan is a nan iteration
            # (the overflow came from the loss itself, not only from the gradients).
            self._skipped += 1
            self._nan += any(not math.isfinite(value) for value in losses.values())
            return
        self._advanced += 1
        for name, value in losses.items():
            self._loss_sums[name] = self._loss_sums.get(name, 0.0) + value

    def _loss_averages(self) -> dict[str, float]:
        iterations = max(1, self._advanced)
        return {name: total / iterations for name, total in self._loss_sums.items()}

    def _restart_interval(self) -> None:
        self._advanced = 0
        self._skipped = 0
        self._nan = 0
        # Cleared, not zeroed: a loss missing from the next interval must not print as 0.
        self._loss_sums = {}

    @staticmethod
    def _write_scalars(
        writer: ScalarWriter, losses: Mapping[str, float], scalars: _IterationScalars
    ) -> None:
        # Each quantity against iterations and, under "<tag> vs samples", against samples.
        num_zeros = scalars.num_zeros_in_grad
        by_iteration_and_samples: list[tuple[str, float | None]] = [
            ("learning-rate", scalars.learning_rate),
            ("batch-size", float(scalars.global_batch_size)),
            *losses.items(),
            ("loss-scale", scalars.loss_scale),
            ("grad-norm", scalars.grad_norm),
            ("num-zeros", None if num_zeros is None else float(num_zeros)),
            ("params-norm", scalars.params_norm),
        ]
        for tag, value in by_iteration_and_samples:
            if value is not None:
                writer.add_scalar(tag, value, scalars.iteration)
                writer.add_scalar(f"{tag} vs samples", value, scalars.consumed_samples)
        if scalars.elapsed_per_iteration is not None:
            writer.add_scalar("iteration-time", scalars.elapsed_per_iteration, scalars.iteration)


def _perplexity(loss: float) -> float:
    # Capped as Megatron does, so that an early loss of 50 does not print as inf.
    return math.exp(min(20.0, loss))


def memory_report() -> str:
    """Deprecated: the one-line max-RSS summary pp-train printed at the end of training.

    pp-train now prints Megatron's memory line after the first logged iteration:
    `pp_train.memory.memory_report` (``pp_train.memory_report``). This returns what it did
    (`pp_train.memory.legacy_memory_report`).
    """
    warnings.warn(
        "pp_train.reporting.memory_report is deprecated: use pp_train.memory_report "
        "(Megatron's memory line)",
        DeprecationWarning,
        stacklevel=2,
    )
    return legacy_memory_report()
