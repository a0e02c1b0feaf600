"""`collective`: a dead or silent peer becomes one `CollectiveError` naming rank and operation."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pp_state import CollectiveError, collective, is_lost_peer
from pp_testing import DistributedTestError, run_distributed

pytestmark = pytest.mark.reliability

_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:51099. This is typically caused by a remote worker crashing."
)
_TIMED_OUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "5000ms for recv operation to complete"
)


def test_lost_peer_texts_are_recognised_and_others_pass_through() -> None:
    assert is_lost_peer(RuntimeError(_CLOSED))
    assert is_lost_peer(RuntimeError(_TIMED_OUT))
    assert is_lost_peer(dist.DistBackendError("NCCL error"))
    assert not is_lost_peer(RuntimeError("Tensors must be contiguous"))
    assert not is_lost_peer(ValueError("timed out"))
    with pytest.raises(RuntimeError, match="contiguous"), collective("loss averaging"):
        raise RuntimeError("Tensors must be contiguous")


def test_the_error_names_operation_iteration_peer_address_and_cause() -> None:
    with pytest.raises(CollectiveError) as caught, collective("exit decision", iteration=7):
        raise RuntimeError(_CLOSED)
    error = caught.value
    assert (error.operation, error.iteration, error.timed_out) == ("exit decision", 7, False)
    assert error.peer_address == "[127.0.0.1]:51099"
    assert isinstance(error.__cause__, RuntimeError)
    message = str(error)
    assert message.startswith("rank -1: exit decision at iteration 7 over ranks []")
    assert "peer rank unknown (address [127.0.0.1]:51099) closed the connection" in message


def test_an_outer_wrapper_adds_the_iteration_once() -> None:
    outer = collective("train step", iteration=3)
    with pytest.raises(CollectiveError) as caught, outer, collective("gradient all-reduce"):
        raise RuntimeError(_TIMED_OUT)
    assert caught.value.operation == "gradient all-reduce"
    assert caught.value.iteration == 3
    assert caught.value.timed_out
    assert "did not answer in time" in str(caught.value)


def _lose_rank_two(marks: str, victim: int) -> tuple[str, str, float]:
    """Every rank all-reduces; `victim` is killed first. Survivors return what they saw."""
    rank = dist.get_rank()
    values = torch.ones(4)
    if rank == victim:
        Path(marks, "killed").write_text(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        with collective("test all-reduce", iteration=5):
            for _ in range(1000):
                dist.all_reduce(values)
                time.sleep(0.01)
    except CollectiveError as error:
        return type(error).__name__, str(error), time.monotonic()
    return "none", "", time.monotonic()


def test_every_survivor_names_the_lost_peer_within_twice_the_timeout(tmp_path: Path) -> None:
    timeout = 10.0
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_lose_rank_two, 4, str(tmp_path), 2, pg_timeout=timeout, timeout=60)
    killed_at = float((tmp_path / "killed").read_text())
    outcomes = caught.value.results
    assert sorted(outcomes) == [0, 1, 3]
    for rank, (kind, message, raised_at) in outcomes.items():
        assert kind == "CollectiveError", message
        assert message.startswith(f"rank {rank}: test all-reduce at iteration 5 over ranks")
        assert raised_at - killed_at < 2 * timeout
