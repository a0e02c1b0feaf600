"""What training reports: named timers, Megatron's per-interval log line, TensorBoard scalars.

`TrainingLogger` keeps Megatron's counters between log lines (advanced, skipped and nan
iterations, loss sums), writes the per-iteration scalars to a TensorBoard-like writer and,
every ``log_interval`` iterations, prints one line in the format of Megatron's training log
(`format_log_line`). The timers (`Timer`, `Timers`, `TimingLogOption`, `TIMING_LOG_OPTIONS`)
and `ScalarWriter` live in `pp_train.timers` and are importable from here too. Memory
reports moved to `pp_train.memory` (`memory_report` here is deprecated).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping

from pp_state.numbers import check_at_least
from pp_train.memory import legacy_memory_report
from pp_train.timers import TIMING_LOG_OPTIONS, ScalarWriter, Timer, Timers, TimingLogOption

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
