"""The trainer's side of a stopped pipeline's report: where it is written, and its own stops.

pp-schedules' executor builds a `StopReport` when a call fails on two or more pipeline ranks
(a p2p timeout, a lost peer, a contract mismatch) and attaches it to the error as
``error.stop_report``. The trainer then:

- writes it beside the logs (`report_directory`: ``--stop-report-dir``, else
  ``--tensorboard-dir``, else ``--save``, else the working directory) as
  ``pipeline-stop-iter<N>-rank<R>.txt``, ``.json`` and ``.trace.json``, on the rank that
  printed it (the lowest pipeline rank that answered), and names the cause in its exit line
  (`exit_line`);
- on a non-finite loss or gradient norm (`NonFiniteError`), a stop no transfer saw, publishes
  every rank's position and prints the report with the non-finite value as its cause
  (`report_non_finite`);
- on a collective outside the pipeline that lost a peer (`CollectiveError`: the data-parallel
  gradient sync, loss averaging, the embedding all-reduce), publishes this rank's position with
  the error and prints the report with that error as its cause (`report_collective`);
- on SIGTERM (torchrun's agent terminates the survivors soon after a rank dies, long before any
  p2p timeout), publishes the position at once and, when the pipeline is broken, prints the
  report (`report_on_sigterm`, run by `pp_train.live_dump.SignalWatcher`'s thread).

The evidence a report reads while training (liveness records and the heartbeat, names by
global rank and place, the run token, collectives recorded, the leaving note) is
pp-schedules' `watch_pipeline`, which `stop_evidence` enters with pp-train's own reporting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from pp_schedules import PipelineExecutor
from pp_schedules.runtime import (
    PipelineWatch,
    SigtermOutcome,
    StopReport,
    first_line,
    report_stop,
    run_token,
)
from pp_schedules.runtime import report_on_sigterm as _sigterm_report
from pp_state.collectives import CollectiveError
from pp_state.state import ParallelState
from pp_state.store_channel import StoreChannel
from pp_train.arguments import PretrainConfig

__all__ = [
    "REPORT_STEM",
    "SigtermOutcome",
    "exit_line",
    "keep_report",
    "report_collective",
    "report_directory",
    "report_non_finite",
    "report_on_sigterm",
    "report_stem",
    "run_token",
    "stop_evidence",
    "use_default_store",
    "write_line",
]

REPORT_STEM = "pipeline-stop"
"""The report files' name: ``pipeline-stop-iter<N>-rank<R>`` and a suffix."""


def write_line(text: str) -> None:
    """`text` and a newline on stderr in one write, flushed.

    Every rank of a torchrun job shares one stderr, and under ``python -u`` `print` writes
    the text and the newline separately: two ranks' lines could run into one.
    """
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def report_directory(config: PretrainConfig) -> Path:
    """Where reports go: ``--stop-report-dir``, else ``--tensorboard-dir``, else ``--save``.

    Without any of them, the working directory.
    """
    for choice in (
        config.logging.stop_report_dir,
        config.logging.tensorboard_dir,
        config.checkpoint.save,
    ):
        if choice is not None:
            return Path(choice)
    return Path.cwd()


def report_stem(iteration: int, global_rank: int) -> str:
    """The report files' name without suffix, for training iteration `iteration`."""
    return f"{REPORT_STEM}-iter{iteration}-rank{global_rank}"


def _reports_here(report: StopReport, executor: PipelineExecutor) -> bool:
    """Whether this rank prints the report: the lowest stage of its pipeline that answered."""
    comm = executor.communicator
    return comm is not None and report.reporter == comm.rank


def keep_report(
    error: BaseException | None,
    report: StopReport,
    executor: PipelineExecutor,
    directory: Path,
    iteration: int,
) -> list[Path]:
    """Attach `report` to `error`; on the rank that printed it, write it under `directory`.

    `error` gets ``stop_report`` and ``stop_report_files`` (the paths written: empty on the
    other ranks, or when the directory cannot be written, which costs a note on stderr).

    Returns:
        The paths written.
    """
    paths: list[Path] = []
    if _reports_here(report, executor):
        assert executor.communicator is not None
        try:
            paths = report.write(directory, report_stem(iteration, executor.communicator.rank))
        except OSError as failure:  # the report was printed already; the error stands
            write_line(f"pp-train: the stop report was not written: {failure}")
    if error is not None:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(error, "stop_report", report)  # noqa: B010 - any exception type
            setattr(error, "stop_report_files", paths)  # noqa: B010
    return paths


def exit_line(error: BaseException, rank: int) -> str | None:
    """The one line global rank `rank` leaves with after a stop the trainer reported, or None.

    Every rank names the cause its report found (ranks by global rank, with their place);
    the rank that wrote the report adds the file, the others their own error (its first
    line, without the backend's words).
    """
    report = getattr(error, "stop_report", None)
    files = getattr(error, "stop_report_files", None)
    if not isinstance(report, StopReport) or files is None:
        return None
    pipeline = f" in pipeline {list(report.pipeline)}" if report.pipeline else ""
    if files:
        return (
            f"pp-train: error: the pipeline stopped (call {report.iteration}){pipeline}: "
            f"{report.cause} (report: {files[0]})"
        )
    names = {p.rank: p.name for p in report.positions}
    lines = str(error).strip().splitlines()
    first = lines[0].split(" Cause: ")[0][:300] if lines else ""
    return (
        f"pp-train: {names.get(rank, f'rank {rank}')} stopped: cause: {report.cause}; "
        f"its own error: {type(error).__name__}: {first}"
    )


def report_non_finite(
    error: BaseException, executor: PipelineExecutor, directory: Path, iteration: int
) -> StopReport | None:
    """Publish this rank's position, gather the others' and print where every rank stopped.

    Every rank raises the `NonFiniteError` together, so every stage answers at once; the
    report's cause is the non-finite value, not a lost rank.

    Returns:
        The report (kept as `keep_report` does), or None with a single stage or no store.
    """
    report = report_stop(executor, None)
    if report is None:
        return None
    lines = str(error).strip().splitlines()
    value = lines[0] if lines else type(error).__name__
    cause = f"a non-finite value stopped training, no rank is lost: {value}"
    return _print_and_keep(
        error, report, cause, executor=executor, directory=directory, iteration=iteration
    )


def report_collective(
    error: CollectiveError, executor: PipelineExecutor, directory: Path, iteration: int
) -> StopReport | None:
    """A collective outside the pipeline failed: print where every stage of the pipeline was.

    The lost peer is named by the error (its global rank, in a group of two); the stages of
    this pipeline that did not answer within ``report_wait`` (blocked in another collective
    with this rank, or lost too) are placed by the plan and listed.

    Returns:
        The report (kept as `keep_report` does), or None with a single stage or no store.
    """
    report = report_stop(executor, error)
    if report is None:
        return None
    return _print_and_keep(
        error, report, report.cause, executor=executor, directory=directory, iteration=iteration
    )


def _print_and_keep(
    error: BaseException,
    report: StopReport,
    cause: str,
    *,
    executor: PipelineExecutor,
    directory: Path,
    iteration: int,
) -> StopReport:
    """`report` with `cause`, printed by the rank that reports and kept (`keep_report`)."""
    report = dataclasses.replace(report, cause=cause)
    if _reports_here(report, executor):
        write_line(report.render())
    keep_report(error, report, executor, directory, iteration)
    return report


def use_default_store(executor: PipelineExecutor) -> None:
    """Give the executor the default group's store as its channel (unless it has one).

    Called before training, so that its failure path and a signal's publish use one channel.
    """
    if executor.channel is None and dist.is_initialized():
        with contextlib.suppress(Exception):  # no store: the executor notes it when it tries
            executor.channel = StoreChannel.from_default_group(timeout=executor.report_wait)


def report_on_sigterm(
    executor: PipelineExecutor, directory: Path, iteration: int
) -> SigtermOutcome:
    """On SIGTERM: publish this rank's position at once, then the report if the pipeline broke.

    Waits at most the executor's ``report_wait`` for the other stages. A pipeline whose stages
    all answered without an error is stopping in order (the loop saves and leaves): no report.
    Otherwise the lowest pipeline rank that answered prints and writes it. A rank whose
    executor is already reporting its own failure does nothing here.
    """
    outcome = _sigterm_report(executor)
    report = outcome.report
    if report is not None:
        if _reports_here(report, executor):
            write_line(report.render())
        keep_report(None, report, executor, directory, iteration)
    return outcome


def _note(rank: int) -> Callable[[str, BaseException], None]:
    """pp-train's line for a thing a rank could not do (a store that does not answer)."""

    def note(what: str, error: BaseException) -> None:
        write_line(
            f"pp-train: rank {rank} could not {what} ({first_line(error)}); live dumps and "
            "stop reports may miss this rank"
        )

    return note


@contextlib.contextmanager
def stop_evidence(executor: PipelineExecutor | None, state: ParallelState) -> Iterator[None]:
    """While training: what a stop report needs beyond the plan steps.

    pp-schedules' `watch_pipeline`, pp-train's reports aside (the loop writes its own, and
    `pp_train.live_dump.SignalWatcher` answers SIGTERM): the executor names ranks by their
    place in `state` (``rank 1 (pipeline stage 0 of [1, 3], dp 1, tp 0)``) and tags its
    positions with the job's `run_token`; this rank's liveness record and heartbeat are kept;
    pp-state's collectives are recorded beside the plan steps and a collective's error names
    the member the liveness records show lost, or its address belongs to; a rank that stops
    on a failure it saw leaves a note. Everything is put back on leaving.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    with PipelineWatch(
        executor, state, sigterm=False, report_errors=False, note=_note(rank), program="pp-train"
    ):
        yield
