"""Checkpoints when a rank dies or the disk turns read-only in the middle of a save or load.

Lost peer: the save of iteration 4 (blocking and asynchronous) and the load of iteration 2
lose rank 2 of 4 while DCP writes or reads its shard. Every survivor must raise a
`CollectiveError` naming itself, the operation and the iteration, and the tracker must still
name iteration 2.

Read-only disk: the disk is a real one, a tmpfs mounted in a private user and mount namespace
(``unshare -rm``, no root needed) and remounted read-only by rank 1 just before it writes its
part of iteration 2 (after the common files of a torch_dist save). Running as root does not help a writer here (the kernel refuses every
write to a read-only mount), unlike a read-only directory. Every rank must raise one
`CheckpointError` naming a path on that disk and the OS error, the tracker must still name
iteration 1, and iteration 1's files must be unchanged. The ranks run in a child process
started inside the namespace (so they share the mount); it writes each case's outcome to a
JSON file the test reads.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
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
from pp_train.checkpoint import (
    AsyncCheckpointSaver,
    CheckpointError,
    CkptFormat,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)
from pp_train.checkpoint import async_save as async_save_module
from pp_train.checkpoint import torch_dist as torch_dist_module
from pp_train.checkpoint import torch_format as legacy

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


_CASES: dict[str, tuple[CkptFormat, bool]] = {
    "torch": ("torch", False),
    "torch_dist": ("torch_dist", False),
    "async": ("torch_dist", True),
}


def _save_pp2(root: str, iteration: int, fmt: CkptFormat, saver: Any = None) -> None:
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2))
    save_checkpoint(root, iteration, state=state, model=[_Tiny(state.rank)], optimizer=None,
                    scheduler=None, args={}, consumed_train_samples=iteration,
                    ckpt_format=fmt, async_saver=saver, report=None)  # fmt: skip
    if saver is not None:
        saver.wait(state)


def _remounting(original: Any, mountpoint: str) -> Any:
    """`original`, but first rank 1 makes `mountpoint` read-only while no rank writes.

    A remount to read-only fails (EBUSY) while any file there is open for writing: every
    rank waits at a barrier before and after it, at a moment when none has a file open.
    """

    def patched(*args: Any, **kwargs: Any) -> Any:
        dist.barrier()
        if dist.get_rank() == 1:
            subprocess.run(["mount", "-o", "remount,ro", mountpoint], check=True)
        dist.barrier()
        return original(*args, **kwargs)

    return patched


def _case(root: str, case: str) -> tuple[str, str]:
    fmt, background = _CASES[case]
    # torch: before each rank writes its stage's file; torch_dist: after the common files,
    # before DCP writes the shards (the same function in the blocking and the async path).
    owner = legacy if fmt == "torch" else async_save_module if background else torch_dist_module
    name = "_atomic_write" if fmt == "torch" else "writer_and_planner"
    patch = mock.patch.object(owner, name, _remounting(getattr(owner, name), root))
    try:
        with patch:
            _save_pp2(root, 2, fmt, AsyncCheckpointSaver() if background else None)
    except CheckpointError as error:
        return type(error).__name__, str(error)
    return "none", ""


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def main(workdir: str) -> None:
    """Inside the namespace: each case on a fresh tmpfs; outcomes to ``results.json``."""
    results: dict[str, Any] = {}
    for case in _CASES:
        root = Path(workdir, case)
        root.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(root)], check=True)
        run_distributed(_save_pp2, 2, str(root), 1, _CASES[case][0])
        before = _digest(root / "iter_0000001")
        outcomes = run_distributed(_case, 2, str(root), case, pg_timeout=10.0, timeout=120)
        results[case] = {
            "outcomes": outcomes,
            "tracker": read_tracker(root),
            "intact": _digest(root / "iter_0000001") == before,
        }
    Path(workdir, "results.json").write_text(json.dumps(results))


def test_a_disk_turning_read_only_mid_save_fails_on_every_rank_and_keeps_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    unshare = shutil.which("unshare")
    assert unshare is not None, "this test needs util-linux's unshare (a private mount)"
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    code += f"import test_checkpoint_failures as t; t.main({str(tmp_path)!r})"
    done = subprocess.run(
        [unshare, "-rm", sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for case, result in results.items():
        root = tmp_path / case
        for rank, (kind, message) in enumerate(result["outcomes"]):
            print(f"{case}: rank {rank}: {kind}: {message}")
            assert kind == "CheckpointError", message
            assert message.startswith(f"rank {rank}"), message
            assert "Read-only file system" in message, message
            assert str(root) in message, message
        assert result["tracker"] == 1, case
        assert result["intact"], case
