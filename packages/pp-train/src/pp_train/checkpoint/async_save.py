"""Asynchronous torch_dist saves: DCP writes in a background thread while training goes on.

At most one save is in flight. Its tensors are copied to CPU memory (DCP's staging) before
`AsyncCheckpointSaver.start` returns; the writing runs on a process group of its own (gloo),
so it never interleaves with the training's collectives. Global rank 0 publishes the
checkpoint (renames its directory, then moves the tracker) as soon as its write finished,
which is after every rank's: DCP's coordinator writes ``.metadata`` only once all ranks
reported their data written. `wait` (before the next save, at the end of training, on an
early exit) blocks until the save is done and raises on every rank if any rank failed.

Every wait follows one timeout, by default the run's (`ParallelConfig.timeout`, which
``pretrain`` sets from ``--distributed-timeout-minutes``): the save's group gives up after it,
and `wait` after one and a half times it, so a peer that died mid-save surfaces as the group's
`CollectiveError` (naming the save and its iteration) rather than as a bare wait that ran out.
"""

from __future__ import annotations

import dataclasses
import datetime
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from pp_state import CollectiveError, ParallelState
from pp_train.checkpoint.agreement import raise_if_any_failed
from pp_train.checkpoint.errors import CheckpointError
from pp_train.checkpoint.torch_dist import (
    SaveContent,
    dcp_failure,
    describe_dcp_error,
    prepare,
    publish,
    remove_failed_save,
    save_operation,
    writer_and_planner,
)

__all__ = ["AsyncCheckpointSaver"]


@dataclasses.dataclass
class _InFlight:
    future: Future[Any]
    root: Path
    iteration: int
    staging: Path


class AsyncCheckpointSaver:
    """Runs torch_dist saves in the background, one at a time (Megatron's ``--async-save``).

    Every rank makes one and uses it for every save of a run; `start`, `wait` are
    collectives, `poll` is not.
    """

    def __init__(self, *, timeout: datetime.timedelta | None = None) -> None:
        """A saver whose process group's collectives give up after `timeout`.

        Args:
            timeout: None takes the run's, ``state.config.timeout`` of the first save
                (``pretrain``: ``--distributed-timeout-minutes``). `wait` gives up on a
                write after one and a half times it.

        Raises:
            ValueError: `timeout` is not positive.
        """
        if timeout is not None and timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.timeout = timeout
        """The timeout of the saver's collectives (None until the first save sets the run's)."""
        self._group: dist.ProcessGroup | None = None
        self._in_flight: _InFlight | None = None
        self._error: BaseException | None = None
        self._unsettled = False  # a save started since the last wait (the same on every rank)
        self._staging: Path | None = None  # the directory of the save since the last wait
        self._iteration: int | None = None  # the iteration of that save
        self.published: list[int] = []
        """Iterations this rank published (global rank 0 only), in order."""

    @property
    def in_flight(self) -> bool:
        """Whether this rank's share of a save is still being written."""
        return self._in_flight is not None

    def _timeout(self) -> datetime.timedelta:
        assert self.timeout is not None  # set by the first `start`
        return self.timeout

    def _process_group(self) -> dist.ProcessGroup:
        if self._group is None:
            # Made at the first save, which every rank reaches together.
            group = dist.new_group(backend="gloo", timeout=self._timeout())
            assert group is not None
            self._group = group
        return self._group

    def start(
        self,
        content: SaveContent,
        *,
        root: Path,
        iteration: int,
        staging: Path,
        state: ParallelState,
    ) -> None:
        """Waits for the previous save, then starts writing `content`; a collective.

        Returns once the tensors are copied; writing goes on in the background.

        Raises:
            CheckpointError: On every rank when the previous save or the set-up failed.
        """
        self.wait(state)
        if self.timeout is None:
            self.timeout = state.config.timeout
        prepare(staging, content, state, iteration)
        writer, planner = writer_and_planner(staging, content.chunks)
        future = dcp.async_save(
            content.tensors,
            storage_writer=writer,
            planner=planner,
            process_group=self._process_group(),
        )
        assert isinstance(future, Future)
        self._in_flight = _InFlight(future, root, iteration, staging)
        self._staging, self._iteration = staging, iteration
        self._unsettled = True

    def poll(self, state: ParallelState) -> None:
        """Finishes a save whose write is done (rank 0 publishes it); never blocks or talks."""
        if self._in_flight is not None and self._in_flight.future.done():
            self._settle(state, block=False)

    def wait(self, state: ParallelState) -> None:
        """Blocks until the save in flight is written and published; a collective.

        Raises:
            CheckpointError: On every rank when any rank's write or the publishing failed
                (the tracker then still names the previous checkpoint), or a wait timed out.
            CollectiveError: A rank died or stopped answering during the save (every
                survivor, naming the save and its iteration); nothing was published.
        """
        if not self._unsettled:
            return
        if self._in_flight is not None:
            self._settle(state, block=True)
        error, self._error, self._unsettled = self._error, None, False
        iteration = self._iteration
        assert iteration is not None
        try:
            if isinstance(error, CollectiveError):
                raise error  # a peer is lost: an agreement would only wait for it
            raise_if_any_failed(
                state.rank,
                error,
                "could not finish an asynchronous torch_dist save",
                "the asynchronous save was not published; the tracker names the checkpoint before",
                operation=save_operation(iteration, background=True),
                iteration=iteration,
            )
        except (CheckpointError, CollectiveError):
            if self._staging is not None:  # every rank knows now: nobody writes there
                remove_failed_save(self._staging, state.rank)
            raise

    def _settle(self, state: ParallelState, *, block: bool) -> None:
        in_flight = self._in_flight
        assert in_flight is not None
        self._in_flight = None
        try:
            # Longer than the group's timeout, so a lost peer surfaces as the group's error.
            in_flight.future.result(timeout=1.5 * self._timeout().total_seconds() if block else 0)
            if state.rank == 0:
                publish(in_flight.root, in_flight.iteration)
                self.published.append(in_flight.iteration)
        except FutureTimeout as error:
            self._error = CheckpointError(
                f"rank {state.rank}: the asynchronous save of iteration {in_flight.iteration} "
                f"to {in_flight.staging} did not finish within {1.5 * self._timeout()}"
            )
            self._error.__cause__ = error
        except CheckpointError as error:
            self._error = error
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            self._error = dcp_failure(
                error,
                save_operation(in_flight.iteration, background=True),
                in_flight.iteration,
                f"rank {state.rank} could not finish the asynchronous save of iteration "
                f"{in_flight.iteration} to {in_flight.staging}: {describe_dcp_error(error)}; "
                "the asynchronous save was not published; the tracker names the checkpoint before",
            )
            self._error.__cause__ = error
