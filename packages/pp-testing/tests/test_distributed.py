from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pp_testing import DistributedTestError, preload_in_ranks, run_distributed


def _sum_of_ranks() -> tuple[int, int, float]:
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return dist.get_rank(), torch.get_num_threads(), value.item()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_rank_runs_and_returns_in_rank_order(world_size: int) -> None:
    results = run_distributed(_sum_of_ranks, world_size)
    expected_sum = float(sum(range(world_size)))
    assert results == [(rank, 1, expected_sum) for rank in range(world_size)]


def _echo(a: int, b: str) -> str:
    return f"{dist.get_rank()}:{a}:{b}:{os.environ['PP_TESTING_PROBE']}"


def test_arguments_and_environment_reach_every_rank() -> None:
    results = run_distributed(_echo, 2, 7, "x", env={"PP_TESTING_PROBE": "yes"})
    assert results == ["0:7:x:yes", "1:7:x:yes"]


def _rank_one_raises() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank one broke on purpose")
    time.sleep(3600)  # the others would wait for rank one forever


def test_a_raising_rank_fails_the_run_with_its_traceback_and_others_stop() -> None:
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_rank_one_raises, 3, pg_timeout=60, timeout=60)
    message = str(caught.value)
    assert "failed on rank(s)" in message
    assert "--- rank 1: raised ---" in message
    assert "rank one broke on purpose" in message
    statuses = {failure.rank: failure.status for failure in caught.value.failures}
    assert statuses[1] == "raised"
    # The others are killed after the grace period ("killed", not "killed at timeout"), and
    # the report says where they were stuck.
    assert statuses[0] == "killed"
    assert statuses[2] == "killed"
    assert "_rank_one_raises" in caught.value.failures[0].detail


def _sleep_forever(pid_dir: str) -> None:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(3600)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_hang_is_killed_at_the_timeout_with_each_rank_stack(tmp_path: Path) -> None:
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_sleep_forever, 2, str(tmp_path), timeout=5)
    message = str(caught.value)
    assert "did not finish within 5 s" in message
    for failure in caught.value.failures:
        assert failure.status == "killed at timeout"
        assert "_sleep_forever" in failure.detail
    # Every rank's process is gone (its parent, the forkserver, may take a moment to reap it).
    pids = [int(Path(tmp_path, f"{rank}.pid").read_text()) for rank in range(2)]
    for _ in range(500):
        if all(_gone(pid) for pid in pids):
            break
        time.sleep(0.01)
    assert all(_gone(pid) for pid in pids), pids


def _unmatched_receive() -> None:
    if dist.get_rank() == 0:
        dist.recv(torch.empty(1), src=1)
    else:
        time.sleep(6)  # alive, but never sends: rank 0 must time out, not see a closed peer


def test_the_process_group_timeout_turns_a_lost_receive_into_an_error() -> None:
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_unmatched_receive, 2, pg_timeout=2, timeout=60)
    rank0 = caught.value.failures[0]
    assert rank0.status == "raised"
    assert "timed out" in rank0.detail.lower()


def _hard_exit() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def test_a_rank_that_dies_is_reported_with_its_exit_code() -> None:
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_hard_exit, 2, timeout=30)
    assert caught.value.failures[1].status == "exited with code 3"


def test_bad_arguments_are_refused() -> None:
    def local() -> None:
        pass

    with pytest.raises(ValueError, match="module-level function"):
        run_distributed(local, 2)
    with pytest.raises(ValueError, match="world_size must be 1 or more, got 0"):
        run_distributed(_sum_of_ranks, 0)
    with pytest.raises(ValueError, match="timeouts must be positive"):
        run_distributed(_sum_of_ranks, 2, timeout=0)


@dataclass(frozen=True)
class _Payload:
    """A class that lives in this test module: ranks must load the module to unpickle it."""

    value: int


def _double(payload: _Payload) -> int:
    return payload.value * 2


def test_arguments_of_test_module_classes_reach_the_ranks() -> None:
    assert run_distributed(_double, 2, _Payload(21)) == [42, 42]


def _refuse_to_unpickle() -> None:
    raise RuntimeError("this argument cannot be unpickled in a rank")


class _Unpicklable:
    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_refuse_to_unpickle, ())


def _never_called(_: object) -> None:
    raise AssertionError("the argument should not have unpickled")


def test_an_argument_that_fails_to_unpickle_is_reported_with_its_traceback() -> None:
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_never_called, 2, _Unpicklable(), timeout=30)
    for failure in caught.value.failures:
        assert failure.status == "raised"
        assert "this argument cannot be unpickled in a rank" in failure.detail


def _preloaded() -> list[bool]:
    # Neither this module nor torch imports these; only the forkserver preload does.
    return ["xml.dom.minidom" in sys.modules, "torch._dynamo" in sys.modules]


def test_ranks_start_with_the_preloaded_modules_imported() -> None:
    assert "xml.dom.minidom" not in sys.modules  # the test process never imported it
    assert run_distributed(_preloaded, 2) == [[True, True]] * 2


def test_a_preload_after_the_first_run_is_refused() -> None:
    run_distributed(_sum_of_ranks, 1)  # the forkserver is running from here on
    with pytest.raises(RuntimeError, match=r"preload_in_ranks\('json',\) came after the first"):
        preload_in_ranks("json")
