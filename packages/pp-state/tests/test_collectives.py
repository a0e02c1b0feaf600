"""`collective`: a dead or silent peer becomes one `CollectiveError` naming rank and operation."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pp_state.collectives as collectives_module
from pp_state import (
    CollectiveError,
    collective,
    collective_error,
    is_lost_peer,
    set_address_book,
    set_peer_finder,
)
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


def _group_of_four(monkeypatch: pytest.MonkeyPatch) -> None:
    """Errors raised here come from rank -1 of a group of global ranks 0..3 (no process group)."""
    monkeypatch.setattr(collectives_module, "_group_ranks", lambda group: (0, 1, 2, 3))


def test_a_member_found_by_its_address_is_the_peer_with_its_evidence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _group_of_four(monkeypatch)
    asked: list[tuple[str, tuple[int, ...]]] = []

    def book(address: str, ranks: tuple[int, ...]) -> tuple[tuple[int, ...], str | None]:
        asked.append((address, ranks))
        return (2,), "left: it left after its own error: P2PError: rank 2 lost rank 3"

    previous = set_address_book(book)
    finder = set_peer_finder(lambda ranks: (1, "gone: never asked"))
    try:
        error = collective_error(RuntimeError(_CLOSED), "exit decision")
    finally:
        set_address_book(previous)
        set_peer_finder(finder)
    assert asked == [("[127.0.0.1]:51099", (0, 1, 2, 3))]
    assert (error.peer, error.peer_candidates) == (2, ())
    assert "peer rank 2 (left: it left after its own error: P2PError: rank 2 lost" in str(error)


def test_an_address_two_members_hold_names_both_and_the_finder_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _group_of_four(monkeypatch)
    previous = set_address_book(lambda address, ranks: ((1, 3), None))
    try:
        unknown = collective_error(RuntimeError(_CLOSED), "timer all-gather")
        finder = set_peer_finder(lambda ranks: (3, "gone: its process 9 on this host has exited"))
        try:
            found = collective_error(RuntimeError(_CLOSED), "timer all-gather")
        finally:
            set_peer_finder(finder)
    finally:
        set_address_book(previous)
    assert (unknown.peer, unknown.peer_candidates) == (None, (1, 3))
    assert (
        "peer rank unknown (address [127.0.0.1]:51099: rank 1 or 3; its port, read as printed "
        "or byte-swapped, is an endpoint of each)"
    ) in str(unknown)
    assert (found.peer, found.peer_candidates) == (3, ())
    assert "peer rank 3 (gone: its process 9 on this host has exited)" in str(found)


def test_a_failing_address_book_leaves_the_error_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    _group_of_four(monkeypatch)

    def book(address: str, ranks: tuple[int, ...]) -> tuple[tuple[int, ...], str | None]:
        raise RuntimeError("the store did not answer")

    previous = set_address_book(book)
    try:
        error = collective_error(RuntimeError(_CLOSED), "exit decision")
    finally:
        set_address_book(previous)
    assert error.peer is None
    assert "peer rank unknown (address [127.0.0.1]:51099) closed" in str(error)


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
