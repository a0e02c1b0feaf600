"""Kill one of 4 ranks in a step or a save: every survivor raises one named CollectiveError."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pp_optim import DistributedDataParallel
from pp_state import CollectiveError, ParallelConfig, ParallelState, at_iteration
from pp_testing import DistributedTestError, run_distributed
from pp_train.exits import any_rank as _any_rank

pytestmark = pytest.mark.reliability

_VICTIM = 2
_TIMEOUT_S = 10.0


def _die(marks: str) -> None:
    Path(marks, "killed").write_text(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)


def _grad_sync(marks: str, victim: bool) -> None:
    state = ParallelState.create(ParallelConfig())
    ddp = DistributedDataParallel(torch.nn.Linear(4, 4), data_parallel_group=state.group("dp"))
    ddp(torch.ones(2, 4)).sum().backward()
    if victim:
        _die(marks)
    with at_iteration(3):
        ddp.finish_grad_sync()


def _exit_decision(marks: str, victim: bool) -> None:
    if victim:
        _die(marks)
    with at_iteration(3):
        _any_rank([False, False, False])


def _scenario(marks: str, name: str) -> tuple[str, str, float]:
    victim = dist.get_rank() == _VICTIM
    try:
        if name == "grad":
            _grad_sync(marks, victim)
        elif name == "exit":
            _exit_decision(marks, victim)
        else:
            raise ValueError(name)
    except CollectiveError as error:
        return type(error).__name__, str(error), time.monotonic()
    return "none", "", time.monotonic()


@pytest.mark.parametrize(
    ("name", "operation"),
    [
        ("grad", "gradient all-reduce over data parallel"),
        ("exit", "exit decision"),
    ],
)
def test_every_survivor_raises_one_named_error(tmp_path: Path, name: str, operation: str) -> None:
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_scenario, 4, str(tmp_path), name, pg_timeout=_TIMEOUT_S, timeout=60)
    killed_at = float((tmp_path / "killed").read_text())
    outcomes = caught.value.results
    assert sorted(outcomes) == [0, 1, 3], caught.value
    for rank, (kind, message, raised_at) in outcomes.items():
        assert kind in ("CollectiveError", "GradSyncError"), message
        assert message.startswith(f"rank {rank}: {operation}"), message
        assert "at iteration 3" in message
        elapsed = raised_at - killed_at
        print(f"{name}: rank {rank} raised {elapsed:.2f} s after the kill: {message[:160]}")
        assert elapsed < 2 * _TIMEOUT_S
