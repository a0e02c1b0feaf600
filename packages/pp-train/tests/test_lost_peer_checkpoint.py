"""Kill one of 4 ranks inside a torch_dist save or load: every survivor raises one named error.

The save of iteration 4 (blocking and asynchronous) and the load of iteration 2 lose rank 2
while DCP writes or reads its shard. Every survivor must raise a `CollectiveError` naming
itself, the operation and the iteration, and the tracker must still name iteration 2.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from pp_state import CollectiveError, ParallelConfig, ParallelState
from pp_testing import DistributedTestError, run_distributed
from pp_train.checkpoint import AsyncCheckpointSaver, load_checkpoint, save_checkpoint
from pp_train.checkpointing import read_tracker

pytestmark = pytest.mark.reliability

_VICTIM = 2
_TIMEOUT_S = 6.0


class _Tiny(torch.nn.Linear):
    """One linear layer per rank, named by the rank (a layout-independent key)."""

    def __init__(self, rank: int) -> None:
        super().__init__(4, 4)
        self.rank = rank

    def sharded_state_keys(self) -> dict[str, str]:
        return {"weight": f"layers.{self.rank}.weight", "bias": f"layers.{self.rank}.bias"}


def _die(marks: str) -> None:
    Path(marks, "killed").write_text(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)


def _save(root: str, iteration: int, state: ParallelState, saver: Any = None) -> None:
    save_checkpoint(root, iteration, state=state, model=[_Tiny(state.rank)], optimizer=None,
                    scheduler=None, args={}, consumed_train_samples=iteration,
                    ckpt_format="torch_dist", async_saver=saver, report=None)  # fmt: skip
    if saver is not None:
        saver.wait(state)


def _scenario(root: str, marks: str, kind: str) -> tuple[str, str, float, dict[str, Any]]:
    state = ParallelState.create(ParallelConfig(timeout=datetime.timedelta(seconds=_TIMEOUT_S)))
    _save(root, 2, state)
    victim = dist.get_rank() == _VICTIM
    saver = AsyncCheckpointSaver() if kind == "async" else None
    owner: type = FileSystemReader if kind == "load" else FileSystemWriter
    method = "read_data" if kind == "load" else "write_data"
    original = getattr(owner, method)

    def killing(*args: Any, **kwargs: Any) -> Any:
        if victim:
            _die(marks)
        return original(*args, **kwargs)

    try:
        with mock.patch.object(owner, method, killing):
            if kind == "load":
                load_checkpoint(root, state=state, model=[_Tiny(state.rank)], optimizer=None,
                                scheduler=None, args={}, ckpt_format="torch_dist",
                                report=None)  # fmt: skip
            else:
                _save(root, 4, state, saver)
    except CollectiveError as error:
        named: dict[str, Any] = {"rank": error.rank, "peer": error.peer, "operation": error.operation,
                 "iteration": error.iteration}  # fmt: skip
        if saver is not None:  # its waits follow the run's timeout, not a fixed one
            named["saver_timeout_s"] = saver.timeout.total_seconds() if saver.timeout else None
        return type(error).__name__, str(error), time.monotonic(), named
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic(), {}
    return "none", "", time.monotonic(), {}


@pytest.mark.parametrize(
    ("kind", "operation", "iteration"),
    [
        ("sync", "torch_dist save of iteration 4", 4),
        ("async", "asynchronous torch_dist save of iteration 4", 4),
        ("load", "torch_dist load of iteration 2", 2),
    ],
)
def test_every_survivor_of_a_lost_peer_in_a_checkpoint_raises_one_named_error(
    tmp_path: Path, kind: str, operation: str, iteration: int
) -> None:
    root, marks = tmp_path / "ckpt", tmp_path / "marks"
    marks.mkdir()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(
            _scenario, 4, str(root), str(marks), kind, pg_timeout=_TIMEOUT_S, timeout=60
        )
    killed_at = float((marks / "killed").read_text())
    outcomes = caught.value.results
    assert sorted(outcomes) == [0, 1, 3], caught.value
    for rank, (name, message, raised_at, named) in outcomes.items():
        print(f"{kind}: rank {rank} {raised_at - killed_at:.2f} s: {name}: {message[:300]}")
        assert name == "CollectiveError", message
        expected: dict[str, Any] = {"rank": rank, "peer": None, "operation": operation,
                                    "iteration": iteration}  # fmt: skip
        if kind == "async":
            expected["saver_timeout_s"] = _TIMEOUT_S
        assert named == expected, message
        assert message.startswith(f"rank {rank}: {operation}"), message
        assert raised_at - killed_at < 2 * _TIMEOUT_S, message
    assert read_tracker(root) == 2
    assert not (root / "iter_0000004").exists()
