"""A training loop's failure story in one step: ``with watch_pipeline(executor, state):``.

A custom loop built on pp-state, pp-comm, pp-schedules and pp-optim gets what pp-train's own
loop has when a rank dies or stops:

- **liveness records** (`pp_state.liveness`): this process's identity and endpoints,
  published once, and a heartbeat from a thread of its own every half second; the same
  thread answers another rank that asks where this one is (a rank busy in a long step shows
  its step instead of being placed by the plan), and publishes the endpoints again now and
  then;
- **names**: the executor names every rank by its global rank and place
  (`ParallelState.coordinates`), and tags what it publishes with a token the job's ranks
  share (`run_token`);
- **collectives**: pp-state's `collective(...)` is recorded beside the plan steps (the
  executor's flight recorder), and a collective's error names the member the liveness
  records show lost, or the member its address belongs to;
- **the stop report** for a failure outside the executor (the data-parallel gradient sync,
  a loss all-reduce): this rank publishes its position with the error and the lowest stage
  of its pipeline that answers prints the report; every other rank prints one line naming the
  cause. A failure inside the executor is reported by the executor itself;
- **a leaving note** when this rank stops on a failure it saw (a lost transfer or collective):
  the others never take it for the rank that was lost;
- **SIGTERM** (torchrun's agent terminates the survivors of a dead rank within a second): this
  rank publishes its position at once, from a thread, even while its main thread waits in a
  transfer; if its pipeline broke, the report is printed and the rank leaves with status 1;
  otherwise SIGTERM does what it did before (by default, end the process);
- **the store kept up**: without torchrun, rank 0's process hosts the job's store (torch's
  ``env://``). When it stops, it waits until every other rank has finished (or is gone)
  before it exits, so that they can still publish, read and report.

Everything is put back on leaving. Nothing here waits without a bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pp_comm import P2PError
from pp_schedules.runtime._executor import PipelineExecutor
from pp_schedules.runtime._stop_channel import answer_ask, first_line, read_position, report_stop
from pp_schedules.runtime._stop_report import StopReport
from pp_state import liveness
from pp_state.collectives import (
    CollectiveError,
    collective,
    collective_device,
    is_lost_peer,
    set_address_book,
    set_collective_hook,
    set_peer_finder,
)
from pp_state.coordinates import RankCoordinates
from pp_state.store_channel import StoreChannel, StoreGoneError

__all__ = [
    "PipelineWatch",
    "SigtermOutcome",
    "report_on_sigterm",
    "run_token",
    "watch_pipeline",
]

Note = Callable[[str, BaseException], None]
"""Says, once, that this rank could not do something (``what``, the error)."""
_ENDPOINTS_EVERY = 20  # beats between two publications of the endpoints (10 s)
_JOIN_S = 2.0
_SIGTERM_EXIT = 128 + signal.SIGTERM  # the status SIGTERM's default action leaves


class _HasCoordinates(Protocol):
    """A parallel state (pp-state's `ParallelState`): where any global rank sits."""

    def coordinates(self, rank: int | None = None) -> RankCoordinates:
        """The coordinates of global rank `rank`."""
        ...


def _say(line: str) -> None:
    """`line` on stderr in one write, flushed (ranks share one stderr under torchrun)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run_token() -> str:
    """A token every rank of this job shares and another job does not: rank 0's, broadcast.

    A collective over every rank (call it on each). Positions a stop publishes carry it, so
    documents another job left in a shared store are set aside.
    """
    if not dist.is_initialized():
        return f"{os.getpid()}"
    drawn = int.from_bytes(os.urandom(7), "little")
    token = torch.tensor([drawn], dtype=torch.int64, device=collective_device())
    with collective("run token broadcast"):
        dist.broadcast(token, src=0)
    return f"{int(token.item()):014x}"


@dataclasses.dataclass(frozen=True)
class SigtermOutcome:
    """What `report_on_sigterm` found.

    Attributes:
        published: This rank published its position.
        report: The report, when the pipeline is broken (a rank failed or did not answer).
        failed: A rank that answered had failed: the pipeline cannot finish the iteration.
    """

    published: bool
    report: StopReport | None = None
    failed: bool = False


def _own_error_published(executor: PipelineExecutor) -> bool:
    """Whether the executor has published this rank's failure in the current call already.

    Its failure path publishes with the error before it raises; a signal arriving then must
    not overwrite that position with one without the error.
    """
    channel, communicator = executor.channel, executor.communicator
    if channel is None or communicator is None:
        return False
    try:
        document = read_position(channel, communicator.rank)
    except Exception:  # a store that fails: publish anyway, it notes its own failure
        return False
    if document is None:
        return False
    return document.get("iteration") == executor.recorder.iteration and bool(document.get("error"))


def report_on_sigterm(executor: PipelineExecutor) -> SigtermOutcome:
    """On SIGTERM: publish this rank's position at once, and build the report if it broke.

    Waits at most the executor's ``report_wait`` for the other stages. A pipeline whose stages
    all answered without an error is stopping in order: no report. A rank whose executor is
    already reporting its own failure does nothing here. Nothing is printed.
    """
    if executor.communicator is None or _own_error_published(executor):
        return SigtermOutcome(published=False)
    report = report_stop(executor, None)
    if report is None:
        return SigtermOutcome(published=False)
    failed = any(head.get("error") for head in report.heads.values())
    if not failed and len(report.heads) == executor.pp_size:
        return SigtermOutcome(published=True)
    return SigtermOutcome(published=True, report=report, failed=failed)


def _default_channel(executor: PipelineExecutor | None, note: Note) -> StoreChannel | None:
    """The executor's channel, given it the default group's store when it had none."""
    if executor is not None and executor.channel is not None:
        return executor.channel
    if not dist.is_initialized():
        return None
    try:
        timeout = executor.report_wait if executor is not None else 10.0
        channel = StoreChannel.from_default_group(timeout=max(timeout, 10.0))
    except Exception as error:  # no store: no liveness record, reports say "unknown"
        note("reach the default group's store", error)
        return None
    if executor is not None:
        executor.channel = channel
    return channel


def _hosts_store(channel: StoreChannel | None) -> bool:
    """Whether this process hosts the channel's TCPStore (it listens on the store's port)."""
    address = None if channel is None else channel.address
    if address is None:
        return False
    port = int(address.rsplit(":", 1)[1])
    return any(p == port for _, p in liveness.own_endpoints(listening=True))


def _linger_default(executor: PipelineExecutor | None, state: object) -> float:
    """How long the store's host waits for the others: their longest wait, and two reports."""
    waits = [datetime.timedelta(minutes=1)]
    config = getattr(state, "config", None)
    if isinstance(getattr(config, "timeout", None), datetime.timedelta):
        waits.append(config.timeout)  # type: ignore[union-attr]
    comm = executor.communicator if executor is not None else None
    if comm is not None:
        waits.append(comm.config.timeout)
    report = executor.report_wait if executor is not None else 5.0
    return max(waits).total_seconds() + 2 * report + 10.0


def _check_arguments(executor: object, linger_s: float | None) -> None:
    """Refuse what cannot be watched, naming it and the fix.

    Raises:
        TypeError: `executor` is neither a `PipelineExecutor` nor None.
        ValueError: `linger_s` is not a number of seconds of 0 or more.
    """
    if executor is not None and not isinstance(executor, PipelineExecutor):
        raise TypeError(
            f"watch_pipeline watches pp-schedules' executor, got {type(executor).__name__}; "
            "pass what get_forward_backward_func(...) returned (None: a loop without one)"
        )
    if linger_s is not None and (
        isinstance(linger_s, bool) or not isinstance(linger_s, (int, float)) or not linger_s >= 0
    ):
        raise ValueError(
            f"linger_s must be a number of seconds of 0 or more, got {linger_s!r}; it bounds "
            "how long the store's host waits for the other ranks (None: the longest timeout "
            "of the state's groups and the communicator, two reports and 10 s)"
        )


class PipelineWatch:
    """The failure story of a training loop, as a context manager (see the module).

    Enter it on every rank, around the loop, after the executor and the parallel state exist
    (entering makes a collective over every rank: the run token). `watch_pipeline` builds it.

    Args:
        executor: The run's executor (None: a loop without one; liveness and names only).
        state: The parallel state (pp-state's `ParallelState`, or anything with its
            ``coordinates``), to name every rank with its place; None: by pipeline stage.
        sigterm: Answer SIGTERM with this rank's position and, when its pipeline broke, the
            report (then leave with status 1); otherwise SIGTERM does what it did before.
            Only in the main thread, and not while another part of the program owns
            `signal.set_wakeup_fd`.
        report_errors: On an error outside the executor, publish this rank's position with
            it and print the report (the lowest stage that answers) or, on other ranks, one
            line naming the cause. A trainer that reports its own errors passes False.
        linger_s: How long the rank hosting the job's store waits, when it leaves, for the
            others to finish with it. None: the longest timeout of the state's groups and of
            the communicator, two report waits and 10 s (at least a minute and a half).
        note: Says, once per thing, that this rank could not do something (a store that
            does not answer): ``note(what, error)``. By default one line on stderr.
        program: The name each printed line starts with.

    Attributes:
        channel: Where liveness records and positions go (the default group's store).
        run_token: The token the job's ranks share, once entered.
        stop_report: The report of the failure this rank stopped on, when one was made.
        hosts_store: Whether this process hosts the job's store (it waits when it leaves).

    Raises:
        TypeError: `executor` is not pp-schedules' executor.
        ValueError: `linger_s` is not a number of seconds of 0 or more.
    """

    def __init__(
        self,
        executor: PipelineExecutor | None,
        state: _HasCoordinates | None = None,
        *,
        sigterm: bool = True,
        report_errors: bool = True,
        linger_s: float | None = None,
        note: Note | None = None,
        program: str = "pp-schedules",
    ) -> None:
        _check_arguments(executor, linger_s)
        self.executor = executor
        self.state = state
        self.sigterm = sigterm
        self.report_errors = report_errors
        self.linger_s = _linger_default(executor, state) if linger_s is None else float(linger_s)
        self.program = program
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.channel: StoreChannel | None = None
        self.run_token: str | None = None
        self.stop_report: StopReport | None = None
        self.hosts_store = False
        self._note = note
        self._noted: set[str] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._hooks: tuple[Any, Any, Any] | None = None
        self._signals: tuple[socket.socket, socket.socket, int, Any] | None = None
        self._answered: bytes | None = None
        self._beating: StoreChannel | None = None
        self._handled = threading.Event()  # the main thread is done with its failure
        self._store_host: liveness.Identity | None = None  # read while the store was there

    # ------------------------------------------------------------------ entering and leaving
    def __enter__(self) -> PipelineWatch:
        self.channel = _default_channel(self.executor, self.note)
        self.hosts_store = _hosts_store(self.channel)
        self._publish_records()
        self.run_token = run_token()  # after every rank published its identity
        self._store_host = self._read_store_host()
        executor = self.executor
        if executor is not None:
            executor.coordinates = getattr(self.state, "coordinates", None)
            executor.run_token = self.run_token
        self._set_hooks()
        self._start(self._beat, "pp-heartbeat")
        if self.sigterm:
            self._watch_sigterm()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if isinstance(error, Exception):
                self._stopped_on(error)
        finally:
            self._handled.set()
        try:
            self._finish()
        finally:
            self._close()

    def _publish_records(self) -> None:
        """This rank's identity and endpoints; a store that fails costs one note."""
        channel = self.channel
        if channel is None:
            return
        if liveness.publish_identity(channel, self.rank):
            liveness.publish_endpoints(channel, self.rank)
            self._beating = channel
            if self.hosts_store:
                with contextlib.suppress(Exception):  # then nobody can name it: no more
                    channel.set(_STORE_HOST, str(self.rank))
        else:
            self.note("publish its liveness record", RuntimeError("the store did not answer"))

    def _read_store_host(self) -> liveness.Identity | None:
        """The identity of the rank whose process hosts the store, if a rank does."""
        channel = self.channel
        if channel is None or self.hosts_store:
            return None
        try:
            text = channel.read(_STORE_HOST)
        except Exception:  # a store that fails: nothing to remember
            return None
        return None if text is None else liveness.read_identity(channel, int(text))

    def _set_hooks(self) -> None:
        """Collectives recorded by the executor, lost members named by the records."""
        executor, channel = self.executor, self.channel
        hook = executor.recorder.collective_hook() if executor is not None else None
        finder = liveness.peer_finder(channel) if channel is not None else None
        book = liveness.address_book(channel) if channel is not None else None
        previous = (
            set_collective_hook(hook) if hook is not None else _KEEP,
            set_peer_finder(finder) if finder is not None else _KEEP,
            set_address_book(book) if book is not None else _KEEP,
        )
        self._hooks = previous

    def _close(self) -> None:
        """Stop the threads, put back the hooks and SIGTERM's handler."""
        self._stop.set()
        for thread in self._threads:
            thread.join(_JOIN_S)
        if self._hooks is not None:
            hook, finder, book = self._hooks
            if hook is not _KEEP:
                set_collective_hook(hook)
            if finder is not _KEEP:
                set_peer_finder(finder)
            if book is not _KEEP:
                set_address_book(book)
            self._hooks = None
        if self._signals is not None:
            reader, writer, old_fd, previous = self._signals
            self._signals = None
            signal.set_wakeup_fd(old_fd)
            signal.signal(signal.SIGTERM, previous)
            reader.close()
            writer.close()

    def _finish(self) -> None:
        """Mark this rank finished; the store's host waits for the others' marks."""
        channel, token = self.channel, self.run_token or ""
        if channel is None:
            return
        liveness.finish(channel, self.rank, token)
        if self.hosts_store and dist.is_initialized():
            others = [r for r in range(dist.get_world_size()) if r != self.rank]
            liveness.wait_until_finished(channel, others, self.linger_s, run=token)

    # ------------------------------------------------------------------ a failure
    def _stopped_on(self, error: Exception) -> None:
        """Leave a note for a failure this rank saw; report one outside the executor."""
        channel = self.channel
        seen = isinstance(error, (P2PError, CollectiveError)) or is_lost_peer(error)
        if seen and channel is not None:
            # A rank that stops on a failure it saw says so, so it is not taken for the lost
            # one; a rank failing on its own error (out of memory, a bad batch) leaves no
            # note: the others name it.
            liveness.leave(channel, self.rank, first_line(error))
        if not self.report_errors:
            return
        report = getattr(error, "stop_report", None)
        if not isinstance(report, StopReport) and self.executor is not None:
            report = self.executor.report_stop(error)  # printed whole by the reporting rank
        if not isinstance(report, StopReport):
            self._store_host_gone(error)
            return
        self.stop_report = report
        if report.reporter != self._global_rank():
            _say(
                f"{self.program}: {self._name(report)} stopped: cause: {report.cause}; its own "
                f"error: {first_line(error)}"
            )

    def _store_host_gone(self, error: Exception) -> None:
        """No report (the store is gone): name the rank whose exit took it, if it exited.

        Without torchrun rank 0's process hosts the store; killed, it takes every record and
        position with it. Its identity, read at the start, still tells from /proc that its
        process has exited.
        """
        host, channel = self._store_host, self.channel
        if host is None or channel is None or not channel.gone():
            return
        seen = liveness.by_process(host)
        if seen is None or seen.state != "gone":
            return
        name = self._describe(host.rank)
        _say(
            f"{self.program}: {self._describe(self.rank)} stopped: cause: {name} is gone "
            f"({seen.evidence}; it hosted the job's store, so no report could be gathered); "
            f"its own error: {first_line(error)}"
        )

    def _describe(self, rank: int) -> str:
        """``rank 1 (pipeline stage 0 of [1, 3], dp 1, tp 0)``, or ``rank 1`` without a state."""
        coordinates = getattr(self.state, "coordinates", None)
        if coordinates is not None:
            with contextlib.suppress(Exception):
                return str(coordinates(rank).describe())
        return f"rank {rank}"

    def _global_rank(self) -> int:
        comm = self.executor.communicator if self.executor is not None else None
        return comm.rank if comm is not None else self.rank

    def _name(self, report: StopReport) -> str:
        names = {p.rank: p.name for p in report.positions}
        return names.get(self.rank, f"rank {self.rank}")

    # ------------------------------------------------------------------ threads
    def note(self, what: str, error: BaseException) -> None:
        """One line per thing this rank could not do, however often it fails."""
        if what in self._noted:
            return
        self._noted.add(what)
        if self._note is not None:
            self._note(what, error)
            return
        _say(
            f"{self.program}: rank {self.rank} could not {what} ({first_line(error)}); stop "
            "reports may miss this rank"
        )

    def _start(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _beat(self) -> None:
        """Beat every `pp_state.liveness.HEARTBEAT_S` seconds, answer asks, renew endpoints.

        Until the watch ends, or the store fails (one line, and no more beats).
        """
        beats = 0
        while self._beating is not None and not self._stop.is_set():
            if not liveness.beat(self._beating, self.rank):
                gone = self._beating.gone()
                self.note(
                    "publish its heartbeat",
                    StoreGoneError(str(self._beating.address))
                    if gone
                    else RuntimeError("the store did not answer"),
                )
                return
            self._answer_ask()
            beats += 1
            if beats % _ENDPOINTS_EVERY == 0:  # a group made since opened new sockets
                liveness.publish_endpoints(self._beating, self.rank)
            self._stop.wait(liveness.HEARTBEAT_S)

    def _answer_ask(self) -> None:
        """Publish this rank's position when a stopped rank asks for it (it is busy, not lost)."""
        what = "answer a request for its position"
        if self.executor is None or self.executor.channel is None or what in self._noted:
            return
        try:
            self._answered = answer_ask(self.executor, self._answered)
        except Exception as error:  # a gone store: the report places this rank by the plan
            self.note(what, error)

    # ------------------------------------------------------------------ SIGTERM
    def _watch_sigterm(self) -> None:
        """Have SIGTERM reach a thread of this watch (see the module)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous in (signal.SIG_IGN, None):  # ignored, or set outside Python: left alone
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        reader.settimeout(liveness.HEARTBEAT_S)
        old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if old_fd != -1:  # another part of the program reads the signals: leave them to it
            signal.set_wakeup_fd(old_fd)
            reader.close()
            writer.close()
            return
        signal.signal(signal.SIGTERM, self._on_sigterm_in_main)
        self._signals = (reader, writer, old_fd, previous)
        self._start(self._read_signals, "pp-sigterm")

    def _on_sigterm_in_main(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM's Python handler: a handler of the program's own runs here, as before.

        The default action is taken by the watch's thread once it has published (or here,
        when the watch is closing and its thread is gone).
        """
        previous = self._signals[3] if self._signals is not None else signal.SIG_DFL
        if callable(previous):
            previous(signum, frame)
        elif self._stop.is_set():
            _leave(_SIGTERM_EXIT)

    def _read_signals(self) -> None:
        while not self._stop.is_set() and self._signals is not None:
            try:
                arrived = self._signals[0].recv(64)
            except (TimeoutError, OSError):
                continue
            if signal.SIGTERM in arrived:
                self._on_sigterm()
                return

    def _on_sigterm(self) -> None:
        """Publish, report a broken pipeline, then leave as SIGTERM would (see the module).

        A rank whose main thread is reporting its own failure lets it finish (the failure
        then ends the process) instead of cutting its report short.
        """
        executor = self.executor
        if executor is not None and (self._handled.is_set() or _own_error_published(executor)):
            self._handled.wait(2 * executor.report_wait + 10.0)
            return
        outcome = report_on_sigterm(executor) if executor is not None else SigtermOutcome(False)
        report = outcome.report
        previous = self._signals[3] if self._signals is not None else signal.SIG_DFL
        if not outcome.published and executor is not None and _own_error_published(executor):
            self._handled.wait(2 * executor.report_wait + 10.0)  # its failure came meanwhile
            return
        if report is not None:
            self.stop_report = report
            if report.reporter == self._global_rank():
                _say(report.render())
            _say(
                f"{self.program}: {self._name(report)} leaves on SIGTERM: its pipeline stopped: "
                f"{report.cause}"
            )
            if self.channel is not None:  # the others' evidence: this rank left on its own
                liveness.leave(self.channel, self.rank, f"SIGTERM: {report.cause}")
            self._finish()
            _leave(1)
        elif not callable(previous):  # SIG_DFL: end the process, as SIGTERM did before
            if self.channel is not None:  # not lost: it left on SIGTERM, its pipeline whole
                liveness.leave(self.channel, self.rank, "SIGTERM, its pipeline whole")
            self._finish()
            _leave(_SIGTERM_EXIT)


_KEEP = object()
"""A hook this watch did not set, so leaves as it is."""
_STORE_HOST = "watch/store-host"
"""The key under which the rank hosting the store says so."""


def _leave(status: int) -> None:
    """End the process now with `status` (the main thread may wait in a transfer)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def watch_pipeline(
    executor: PipelineExecutor | None,
    state: _HasCoordinates | None = None,
    *,
    sigterm: bool = True,
    report_errors: bool = True,
    linger_s: float | None = None,
    note: Note | None = None,
    program: str = "pp-schedules",
) -> PipelineWatch:
    """The failure story of a training loop, in one ``with`` (see `PipelineWatch`).

    ::

        forward_backward = get_forward_backward_func(comm, resolved=resolved)
        with watch_pipeline(forward_backward, state):
            for step in range(steps):
                ...

    Args:
        executor: What `get_forward_backward_func` returned (None: a loop without it).
        state: The `ParallelState` (ranks are then named with their place).
        sigterm: See `PipelineWatch`.
        report_errors: See `PipelineWatch`.
        linger_s: See `PipelineWatch`.
        note: See `PipelineWatch`.
        program: See `PipelineWatch`.

    Raises:
        TypeError: `executor` is not pp-schedules' executor.
        ValueError: `linger_s` is not a number of seconds of 0 or more.
    """
    return PipelineWatch(
        executor, state, sigterm=sigterm, report_errors=report_errors, linger_s=linger_s,
        note=note, program=program,
    )  # fmt: skip
