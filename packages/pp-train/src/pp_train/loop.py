"""The training loop: `train` runs iterations until `train_iters` or an early exit.

Each iteration updates the microbatch count, steps (`TrainingRun.step`), logs, evaluates and
saves at their intervals; `pp_train.exits` decides, on all ranks together, when to stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from pp_comm import NullTimers
from pp_optim import MegatronOptimizer, OptimizerParamScheduler
from pp_schedules import PipelineExecutor
from pp_schedules.planning import Simulation
from pp_schedules.runtime import StopReport
from pp_state import ParallelState, Placement
from pp_state.collectives import CollectiveError
from pp_train.arguments import PretrainConfig
from pp_train.evaluation import evaluate
from pp_train.exits import SigtermFlag, exit_reason
from pp_train.live_dump import SignalWatcher
from pp_train.memory import MemoryReport, prediction_line, training_state_tensors
from pp_train.norms import calc_params_l2_norm
from pp_train.num_microbatches_calculator import NumMicroBatchesCalculator
from pp_train.reporting import TrainingLogger
from pp_train.run import (
    ExitReason,
    TrainingConfig,
    TrainingProgress,
    TrainingRun,
    every,
    loop_config,
)
from pp_train.schedule_profile import ScheduleProfile
from pp_train.step import ForwardBackwardFunc, ForwardStepFunc, NonFiniteError, StepResult
from pp_train.step_log import log_step, timers_line, write_timers
from pp_train.stop_reports import (
    keep_report,
    report_collective,
    report_directory,
    report_non_finite,
    stop_evidence,
)
from pp_train.timers import Timers

__all__ = ["TrainLoop", "train"]


def train(  # noqa: PLR0917 - Megatron's positional order
    forward_step_func: ForwardStepFunc,
    model: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    train_data_iterator: Any,
    valid_data_iterator: Any,
    *,
    state: ParallelState,
    config: TrainingConfig | PretrainConfig,
    forward_backward_func: ForwardBackwardFunc,
    calculator: NumMicroBatchesCalculator,
    progress: TrainingProgress,
    logger: TrainingLogger,
    timers: Any = None,
    checkpoint_args: dict[str, Any] | None = None,
    autoresume: Callable[[], bool] | None = None,
    print_fn: Callable[[str], None] = print,
    placement: Placement | None = None,
    memory_print_fn: Callable[[str], None] | None = None,
    predicted_memory: Simulation | None = None,
    host_data_bytes: int | None = None,
) -> ExitReason:
    """Trains until ``train_iters`` or an early exit, as Megatron's ``train``.

    Each iteration: update the microbatch count from the consumed samples, `train_step`,
    count the samples, log; evaluate every `eval_interval`; save every `save_interval`;
    then stop, saving first, on SIGTERM, an autoresume request, `exit_duration_in_mins` or
    `exit_interval`; every rank takes each of these decisions together. With a profile
    path, one iteration's schedule is recorded as a Chrome trace, its summary line going to
    `print_fn`. With ``config.logging.tensorboard_dir`` each log line's timers also go to
    TensorBoard (`write_timers`). `config` is a `TrainingConfig` (Megatron's shape, handed on
    as `as_pretrain_config`'s sections) or the run's `PretrainConfig`, read as it is.
    `placement` is the one the run's resolved schedule runs (None: `schedule_placement` asks
    `forward_backward_func`). With a
    `memory_print_fn`, every rank of data-parallel replica 0 gives it Megatron's memory line
    after the first logged iteration (`pp_train.memory.MemoryReport`) with the prediction of
    `predicted_memory` (also drawn in the profile), and the data's `host_data_bytes`.

    Returns:
        Why training stopped.

    Raises:
        ValueError: The profile path cannot be written.
        TypeError: Profiling was asked for without pp-schedules' executor.
    """
    timers = timers if timers is not None else NullTimers()
    sections = loop_config(config)
    run = TrainingRun(
        state, model, optimizer, scheduler, sections, progress, checkpoint_args or {}, print_fn,
        placement,
    )  # fmt: skip
    known = (predicted_memory, host_data_bytes)
    profile, memory = _profile_and_memory(run, forward_backward_func, memory_print_fn, known)
    for chunk in model:
        chunk.train()
    loop = TrainLoop(
        run, forward_step_func, forward_backward_func, calculator, logger, timers, profile, memory
    )
    return loop.until_exit(train_data_iterator, valid_data_iterator, autoresume)


def _profile_and_memory(
    run: TrainingRun,
    forward_backward_func: ForwardBackwardFunc,
    memory_print_fn: Callable[[str], None] | None,
    known: tuple[Simulation | None, int | None],
) -> tuple[ScheduleProfile, MemoryReport]:
    """The schedule profile (its path checked first) and the memory report of a run.

    `known`: the predicted step (a simulation with a byte model) and the data's host bytes.
    """
    predicted, host_data_bytes = known
    config = run.config
    tracks = None if predicted is None else predicted.memory
    # While the batch ramps up, the profiled step may run another plan than the predicted one.
    steady = config.training.rampup_batch_size is None
    series = [list(track.after) for track in tracks] if tracks and steady else None
    profile = ScheduleProfile(
        config.logging, config.training.train_iters, forward_backward_func, run.state,
        start=run.progress.iteration, print_fn=run.print_fn,
        static=functools.partial(training_state_tensors, run.model, run.optimizer),
        predicted=series,
    )  # fmt: skip
    memory = MemoryReport(
        forward_backward_func, run.model, run.optimizer, run.state,
        print_fn=memory_print_fn,
        prediction=None if not tracks else prediction_line(
            tracks[run.state.pipeline_model_parallel_rank]
        ),
        host_data_bytes=host_data_bytes,
    )  # fmt: skip
    return profile, memory


@dataclasses.dataclass
class TrainLoop:
    """`train`'s iterations over one run, and the log interval they are timed over."""

    run: TrainingRun
    forward_step_func: ForwardStepFunc
    forward_backward_func: ForwardBackwardFunc
    calculator: NumMicroBatchesCalculator
    logger: TrainingLogger
    timers: Any
    profile: ScheduleProfile
    memory: MemoryReport
    """Megatron's memory line after the first logged iteration (measured until then)."""
    interval_started: float = dataclasses.field(default_factory=time.perf_counter, init=False)
    """When the current log interval started."""
    interval_iterations: int = dataclasses.field(default=0, init=False)
    """Iterations trained in the current log interval."""

    def until_exit(
        self,
        train_data_iterator: Any,
        valid_data_iterator: Any,
        autoresume: Callable[[], bool] | None,
    ) -> ExitReason:
        """Iterates to `train_iters` or an early exit, saving first; why it stopped."""
        run, config, progress = self.run, self.run.config, self.run.progress
        started = time.monotonic()
        training = config.training
        with (
            SigtermFlag(training.exit_signal_handler) as signals,
            stop_evidence(self.executor, run.state),
            self._watching(),
            self._measuring(),
        ):
            while progress.iteration < training.train_iters:
                # The exit decision is a collective too: a peer lost there is reported alike.
                with self._reporting_stops():
                    self.iteration(train_data_iterator, valid_data_iterator)
                    reason = exit_reason(
                        training,
                        progress.iteration,
                        started=started,
                        signals=signals,
                        autoresume=autoresume,
                    )
                if reason is not None:
                    return run.stop(reason)
        if not run.saved and progress.iteration > 0:
            run.save()  # the final state, unless the last iteration just saved it
        run.finish_saves()
        return "train_iters"

    @property
    def executor(self) -> PipelineExecutor | None:
        """The run's pipeline executor (None: a forward-backward function of the caller's)."""
        function = self.forward_backward_func
        return function if isinstance(function, PipelineExecutor) else None

    def _watching(self) -> SignalWatcher:
        """SIGTERM's position and SIGUSR2's live dump, answered by a thread (`SignalWatcher`)."""
        progress = self.run.progress
        return SignalWatcher(
            self.executor,
            iteration=lambda: progress.iteration + 1,
            directory=report_directory(self.run.config),
        )

    @contextlib.contextmanager
    def _reporting_stops(self) -> Iterator[None]:
        """An iteration and its exit decision; on failure, the stop report kept.

        The executor's report, a non-finite stop's, or one for a collective that lost a peer;
        named for the iteration the block began.
        """
        iteration = self.run.progress.iteration + 1
        try:
            yield
        except NonFiniteError as error:
            if self.executor is not None:
                directory = report_directory(self.run.config)
                report_non_finite(error, self.executor, directory, iteration)
            raise
        except Exception as error:
            report = getattr(error, "stop_report", None)
            if self.executor is not None:
                directory = report_directory(self.run.config)
                if isinstance(report, StopReport):
                    keep_report(error, report, self.executor, directory, iteration)
                elif isinstance(error, CollectiveError):
                    report_collective(error, self.executor, directory, iteration)
            raise

    @contextlib.contextmanager
    def _measuring(self) -> Iterator[None]:
        """Training iterations; the memory probe leaves the executor with them, in any case."""
        try:
            yield
        finally:
            self.memory.stop()

    def iteration(self, train_data_iterator: Any, valid_data_iterator: Any) -> None:
        """One iteration: the step (profiled at its turn), the log, evaluation and saving."""
        run, calculator = self.run, self.calculator
        config, progress = run.config, run.progress
        calculator.update(progress.consumed_train_samples, True)
        if self.executor is not None:  # its positions and collectives say the iteration
            self.executor.recorder.set_training_iteration(progress.iteration + 1)
        profiling = self.profile.starts(progress.iteration + 1)
        with self.memory.measuring():
            step = run.step(
                self.forward_step_func,
                train_data_iterator,
                self.forward_backward_func,
                num_microbatches=calculator.get(),
                timers=self.timers,
            )
        if profiling:
            run.print_fn(self.profile.finish(calculator.get()))
        progress.iteration += 1
        batch = calculator.get_current_global_batch_size()
        progress.consumed_train_samples += batch
        self._log(step, batch)
        if (
            every(config.training.eval_interval, progress.iteration)
            and valid_data_iterator is not None
            and config.training.eval_iters > 0
        ):
            self._evaluate(valid_data_iterator)
        run.save_on_interval()
        if run.async_saver is not None:
            run.async_saver.poll(run.state)

    def _log(self, step: StepResult, global_batch_size: int) -> None:
        """The iteration's log line, with time and timers averaged over the log interval."""
        run = self.run
        self.interval_iterations += 1
        log_now = run.progress.iteration % run.config.logging.log_interval == 0
        if log_now and run.config.logging.tensorboard_dir is not None:
            # Every rank takes part in the gather; the log line's read below resets the timers.
            iteration, iterations = run.progress.iteration, self.interval_iterations
            write_timers(self.timers, self.logger.writer, iteration, iterations)
        log_step(
            self.logger,
            run.optimizer,
            run.progress,
            step,
            global_batch_size=global_batch_size,
            elapsed_per_iteration=(time.perf_counter() - self.interval_started)
            / self.interval_iterations,
            timers_line=timers_line(self.timers, self.interval_iterations) if log_now else None,
            params_norm=calc_params_l2_norm(run.model, run.state)
            if run.config.logging.log_params_norm
            else None,
        )
        if log_now:
            self.interval_started, self.interval_iterations = time.perf_counter(), 0
            self.memory.after_log(run.progress.iteration)

    def _evaluate(self, valid_data_iterator: Any) -> None:
        """`evaluate` on the validation data; counts its samples and logs its losses."""
        run, calculator = self.run, self.calculator
        config, progress = run.config, run.progress
        losses = evaluate(
            self.forward_step_func,
            valid_data_iterator,
            run.model,
            forward_backward_func=self.forward_backward_func,
            state=run.state,
            eval_iters=config.training.eval_iters,
            num_microbatches=calculator.get(),
            micro_batch_size=config.training.micro_batch_size,
            seq_length=config.model.seq_length,
            decoder_seq_length=config.model.decoder_seq_length,
            placement=run.placement,
            # Megatron's loop evaluates quietly (verbose False): the time line only.
            log_interval=config.logging.log_interval,
            print_fn=run.print_fn,
            timers=self.timers if isinstance(self.timers, Timers) else None,
            empty_unused_memory_level=config.training.empty_unused_memory_level,
        )
        progress.consumed_valid_samples += (
            config.training.eval_iters * calculator.get_current_global_batch_size()
        )
        if losses:
            text = " | ".join(
                f"{key} value: {value:.6E} | {key} PPL: {math.exp(min(20.0, value)):.6E}"
                for key, value in losses.items()
            )
            self.logger.validation_log(
                losses,
                iteration=progress.iteration,
                consumed_samples=progress.consumed_train_samples,
                line=text,
            )
