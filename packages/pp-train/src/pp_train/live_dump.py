"""Signals a training rank answers at once, even while its main thread waits in a transfer.

Python runs a signal handler in the main thread only between bytecodes: a rank blocked in a p2p
wait (a C++ call that can last until the p2p timeout) would run it only when the wait ends.
`SignalWatcher` therefore has CPython's C-level handler write each signal's number to a socket
(`signal.set_wakeup_fd`; it runs in whichever thread the signal lands on) and a daemon thread
reads it:

- SIGTERM (when ``--exit-signal-handler`` installed pp-train's handler, `SigtermFlag`): publish
  this rank's position at once and, if the pipeline broke, print the stop report
  (`pp_train.stop_reports.report_on_sigterm`). A rank whose pipeline failed then leaves with
  status 1 instead of waiting out its p2p timeout; an intact pipeline stops in order (the loop
  saves and leaves), nothing printed.
- SIGUSR2: a live dump. The thread adds one to a counter in the default group's store; every
  rank's thread reads the counter every `poll_s` seconds and prints where it is now
  (`dump_line`: global rank, pipeline rank, training iteration, recorder head) once per
  request, on stderr. Training goes on. ``python -m pp_train.dump --pid <torchrun's pid>``
  sends the signal to one worker of a job (`pp_train.dump`).

This rank's liveness record (identity and heartbeat) and its answers to a stopped rank that
asks where it is are pp-schedules' `watch_pipeline`'s, which the loop enters first
(`pp_train.stop_reports.stop_evidence`). A store that fails costs one line per thing the
thread could not do, never a stack trace.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from pp_schedules import PipelineExecutor
from pp_schedules.runtime import first_line
from pp_state import liveness
from pp_state.store_channel import StoreChannel
from pp_train.stop_reports import report_on_sigterm, use_default_store, write_line

__all__ = ["DUMP_POLL_S", "SignalWatcher", "dump_line"]

DUMP_POLL_S = 0.5
"""How often each rank reads the job's dump-request counter."""
_REQUESTS = "dump/requests"
_JOIN_S = 2.0


def _waits(executor: PipelineExecutor, head: dict[str, Any], pipeline: list[int]) -> str:
    """The transfers the head waits for, each peer named by its global rank and place."""
    said = []
    for w in head.get("waiting_for") or []:
        stage = w["peer"]
        peer = _name(executor, pipeline[stage], pipeline) if stage < len(pipeline) else (
            f"pipeline stage {stage}")  # fmt: skip
        said.append(f"; waiting for {peer}: {w['what']} ({w['direction']})")
    return "".join(said)


def _in_collective(head: dict[str, Any]) -> str:
    collective = head.get("collective") or {}
    if collective.get("state") != "waiting":
        return ""
    return f"; in {collective['operation']} over ranks {collective['group']}"


def _name(executor: PipelineExecutor, global_rank: int, pipeline: list[int]) -> str:
    """``rank 1 (pipeline stage 0 of [1, 3], dp 1, tp 0)``, or by the pipeline alone."""
    if executor.coordinates is not None:
        with contextlib.suppress(ValueError, RuntimeError):
            return executor.coordinates(global_rank).describe()
    if global_rank in pipeline:
        return f"rank {global_rank} (pipeline stage {pipeline.index(global_rank)} of {pipeline})"
    return f"rank {global_rank}"


def _pipeline(executor: PipelineExecutor, global_rank: int) -> list[int]:
    """The global ranks of `global_rank`'s pipeline (this rank's), in stage order."""
    if executor.coordinates is not None:
        with contextlib.suppress(ValueError, RuntimeError):
            return list(executor.coordinates(global_rank).pipeline)
    comm = executor.communicator
    return comm.pipeline_ranks if comm is not None else [global_rank]


def dump_line(
    executor: PipelineExecutor | None, global_rank: int, iteration: int, request: int
) -> str:
    """One rank's live-dump line: where it is now, by its flight recorder's head.

    Every rank is named by its global rank: this one with its place, each peer it waits for
    with its pipeline stage.
    """
    if executor is None:
        return (
            f"pp-train dump {request}: rank {global_rank}, iteration {iteration}: no "
            "pipeline executor (its forward-backward function records no steps)"
        )
    head = executor.recorder.head()
    if head is None:
        where = "before its first plan step"
    elif head.get("step") is None:
        where = f"after call {head['iteration']}, before its first plan step"
    else:
        where = f"call {head['iteration']}, step {head['step']} ({head['action']}), {head['state']}"
    pipeline = _pipeline(executor, global_rank)
    if head is not None:
        where += _waits(executor, head, pipeline) + _in_collective(head)
    name = _name(executor, global_rank, pipeline)
    return f"pp-train dump {request}: {name}, iteration {iteration}, {where}"


def _ignore(signum: int, frame: FrameType | None) -> None:
    """SIGUSR2's Python handler: the watcher's thread does the work (see the module)."""


class SignalWatcher:
    """A daemon thread that answers SIGTERM and SIGUSR2 for a training rank (see the module).

    Use as a context manager around training, inside `SigtermFlag` (its handler makes SIGTERM
    reach the thread). Outside the main thread no signal can be watched; dump requests from
    other ranks are still answered.

    Args:
        executor: The run's executor (None: a forward-backward function of its own).
        iteration: The training iteration in progress.
        directory: Where a SIGTERM's stop report is written.
        poll_s: Seconds between reads of the dump-request counter.
        leave: Called with the exit status when a SIGTERM finds the pipeline failed.
    """

    def __init__(
        self,
        executor: PipelineExecutor | None,
        *,
        iteration: Callable[[], int],
        directory: Path,
        poll_s: float = DUMP_POLL_S,
        leave: Callable[[int], Any] = os._exit,
    ) -> None:
        self.executor = executor
        self.iteration = iteration
        self.directory = directory
        self.poll_s = poll_s
        self.leave = leave
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dumps = 0
        """Dump lines this rank printed."""
        self.sigterm_seen = False
        self._channel: StoreChannel | None = None
        self._seen = 0
        self._stop = threading.Event()
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._previous: tuple[int, Any] | None = None
        self._thread: threading.Thread | None = None
        self._noted: set[str] = set()

    def __enter__(self) -> SignalWatcher:
        if self.executor is not None:
            use_default_store(self.executor)
        self._channel = self._dump_channel()
        self._seen = self._requests()
        if threading.current_thread() is threading.main_thread():
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            reader.settimeout(self.poll_s)
            self._sockets = (reader, writer)
            old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._previous = (old_fd, signal.signal(signal.SIGUSR2, _ignore))
        self._thread = threading.Thread(target=self._watch, name="pp-train-signals", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_JOIN_S)
        if self._previous is not None:
            old_fd, old_handler = self._previous
            signal.set_wakeup_fd(old_fd)
            signal.signal(signal.SIGUSR2, old_handler)
        for end in self._sockets or ():
            end.close()

    def _dump_channel(self) -> StoreChannel | None:
        if not dist.is_initialized():
            return None
        try:
            return StoreChannel.from_default_group(prefix="pp-train", timeout=10.0)
        except Exception as error:  # no store: dumps stay on the signalled rank
            self._note("reach the default group's store", error)
            return None

    def _note(self, what: str, error: BaseException) -> None:
        """One line per thing this rank could not do, however often it fails.

        The error's first line only: a store's error carries a C++ stack trace.
        """
        if what not in self._noted:
            self._noted.add(what)
            write_line(
                f"pp-train: rank {self.rank} could not {what} ({first_line(error)}); "
                "live dumps and stop reports may miss this rank"
            )

    def _requests(self, add: int = 0) -> int:
        """The job's dump-request counter (after adding `add`); 0 without a store."""
        if self._channel is None:
            return 0
        try:
            return self._channel.add(_REQUESTS, add)  # a gone store: no call of torch's
        except Exception as error:  # the store is gone: the job is ending anyway
            self._note("read the dump requests", error)
            return self._seen

    def _watch(self) -> None:
        try:
            self._watch_until_stopped()
        except Exception as error:  # one line, not a thread's traceback
            self._note("go on watching signals", error)

    def _watch_until_stopped(self) -> None:
        while not self._stop.is_set():
            for signum in self._signals():
                if signum == signal.SIGTERM:
                    self._on_sigterm()
                elif signum == signal.SIGUSR2:
                    self._on_dump_request()
            count = self._requests()
            if count > self._seen:
                self._seen = count
                self._dump(count)

    def _signals(self) -> bytes:
        """The signals that arrived (waits up to `poll_s`)."""
        if self._sockets is None:
            self._stop.wait(self.poll_s)
            return b""
        try:
            return self._sockets[0].recv(64)
        except (TimeoutError, OSError):
            return b""

    def _on_dump_request(self) -> None:
        if self._channel is None:
            self._seen += 1
            self._dump(self._seen)
        else:
            self._requests(add=1)

    def _dump(self, request: int) -> None:
        self.dumps += 1
        line = dump_line(self.executor, self.rank, self.iteration(), request)
        write_line(line)

    def _on_sigterm(self) -> None:
        if self.sigterm_seen or self.executor is None:
            return
        self.sigterm_seen = True
        outcome = report_on_sigterm(self.executor, self.directory, self.iteration())
        if outcome.failed and outcome.report is not None:
            names = {p.rank: p.name for p in outcome.report.positions}
            write_line(
                f"pp-train: {names.get(self.rank, f'rank {self.rank}')} leaves on SIGTERM: "
                f"its pipeline stopped: {outcome.report.cause}"
            )
            sys.stdout.flush()
            channel = self.executor.channel
            if channel is not None:  # the others' evidence: this rank left on its own
                liveness.leave(channel, self.rank, f"SIGTERM: {outcome.report.cause}")
            # The main thread waits for a rank that is gone; no save can follow.
            self.leave(1)
