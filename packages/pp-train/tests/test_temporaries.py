"""Checkpoint temporaries: a failed save removes its own, the next save or load a dead writer's."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from pp_optim import LRScheduleConfig, OptimizerConfig
from pp_state import ParallelConfig, ParallelState
from pp_testing import run_distributed
from pp_train import save_checkpoint, setup_model_and_optimizer
from pp_train.app import GPTChunk, GPTConfig, chunk_layers
from pp_train.checkpoint import AsyncCheckpointSaver, CheckpointError, CkptFormat, read_tracker
from pp_train.checkpoint.torch_dist import publish, remove_failed_save
from pp_train.temporaries import STALE_AFTER, remove_stale_temporaries, restore_moved_aside

pytestmark = pytest.mark.reliability

HOST = socket.gethostname()
GPT = GPTConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4)


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _file(path: Path, size: int = 1000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return path


def _partial(root: Path, iteration: int, writer: str | None) -> Path:
    directory = root / f"iter_{iteration:07d}.partial"
    _file(directory / "__0_0.distcp", 2000)
    if writer is not None:
        (directory / ".writer").write_text(writer)
    return directory


def test_dead_writers_temporaries_are_removed_and_named_in_one_line(tmp_path: Path) -> None:
    dead = _dead_pid()
    _file(tmp_path / f"iter_0000003/mp_rank_00/model_optim_rng.pt.tmp-{HOST}-{dead}")
    _file(tmp_path / f"latest_checkpointed_iteration.txt.tmp-{HOST}-{dead}", 1)
    _partial(tmp_path, 4, f"{HOST} {dead}\n")
    lines: list[str] = []
    removed = remove_stale_temporaries(tmp_path, lines.append)
    assert removed == [
        f"latest_checkpointed_iteration.txt.tmp-{HOST}-{dead}",
        f"iter_0000003/mp_rank_00/model_optim_rng.pt.tmp-{HOST}-{dead}",
        "iter_0000004.partial/",
    ]
    assert lines == [
        "removed 3 stale checkpoint temporaries of dead writers (0.0 MB): " + ", ".join(removed)
    ]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["iter_0000003", "mp_rank_00"]


def test_a_live_writers_temporaries_are_left_alone(tmp_path: Path) -> None:
    mine = _file(tmp_path / f"iter_0000001/mp_rank_00/model_optim_rng.pt.tmp-{HOST}-{os.getpid()}")
    parent = _file(
        tmp_path / f"iter_0000001/mp_rank_01/model_optim_rng.pt.tmp-{HOST}-{os.getppid()}"
    )
    partial = _partial(tmp_path, 2, f"{HOST} {os.getpid()}")
    lines: list[str] = []
    assert (
        remove_stale_temporaries(tmp_path, lines.append, now=time.time() + 10 * STALE_AFTER) == []
    )
    assert lines == []
    assert all(p.exists() for p in (mine, parent, partial))


def test_another_hosts_temporaries_are_removed_only_when_unchanged_for_long(
    tmp_path: Path,
) -> None:
    other = _file(tmp_path / "iter_0000001/mp_rank_00/model_optim_rng.pt.tmp-elsewhere-7-12")
    legacy = _file(tmp_path / "iter_0000001/mp_rank_01/model_optim_rng.pt.tmp-12")
    unknown = _partial(tmp_path, 2, None)
    assert remove_stale_temporaries(tmp_path, None) == []
    assert all(p.exists() for p in (other, legacy, unknown))
    later = time.time() + STALE_AFTER + 60
    assert len(remove_stale_temporaries(tmp_path, None, now=later)) == 3
    assert not any(p.exists() for p in (other, legacy, unknown))


def test_a_directory_moved_aside_without_its_replacement_is_put_back(tmp_path: Path) -> None:
    _file(tmp_path / "iter_0000002.replaced/.metadata", 10)  # the tracked iteration 2
    _partial(tmp_path, 2, f"{HOST} {_dead_pid()}")  # its unpublished replacement
    lines: list[str] = []
    assert restore_moved_aside(tmp_path, lines.append) == ["iter_0000002"]
    assert lines == [
        "restored 1 checkpoint(s) moved aside by a save killed before renaming their "
        "replacement in: iter_0000002.replaced -> iter_0000002"
    ]
    assert (tmp_path / "iter_0000002/.metadata").is_file()
    assert remove_stale_temporaries(tmp_path, None) == ["iter_0000002.partial/"]
    assert restore_moved_aside(tmp_path, lines.append) == []
    assert len(lines) == 1


def test_a_directory_moved_aside_whose_replacement_came_in_is_removed(tmp_path: Path) -> None:
    new = _file(tmp_path / "iter_0000002/.metadata", 10)
    _file(tmp_path / "iter_0000002.replaced/.metadata", 10)
    assert restore_moved_aside(tmp_path, None) == []
    lines: list[str] = []
    assert remove_stale_temporaries(tmp_path, lines.append) == ["iter_0000002.replaced/"]
    assert lines == [
        "removed 1 stale checkpoint temporaries of dead writers (0.0 MB): iter_0000002.replaced/"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002"]
    assert new.is_file()


def test_a_published_directory_keeps_no_writer_marker(tmp_path: Path) -> None:
    """Renamed in, the staging directory loses its ``.writer``: it names a temporary's writer."""
    _file(tmp_path / "iter_0000002/.metadata", 10)  # an earlier save of the same iteration
    _partial(tmp_path, 2, f"{HOST} {os.getpid()}")
    (tmp_path / "iter_0000002.partial/.metadata").write_bytes(b"x" * 20)
    publish(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000002", "latest_checkpointed_iteration.txt",
    ]  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "iter_0000002").iterdir()) == [
        ".metadata", "__0_0.distcp",
    ]  # fmt: skip
    assert (tmp_path / "iter_0000002/.metadata").stat().st_size == 20


def test_a_failed_rename_in_puts_the_directory_moved_aside_back(tmp_path: Path) -> None:
    old = _file(tmp_path / "iter_0000002/.metadata", 10)
    _file(tmp_path / "iter_0000002.partial/.metadata", 20)
    original = os.replace

    def refuse_rename_in(source: Any, target: Any) -> None:
        if Path(source).name.endswith(".partial"):
            raise OSError("input/output error (injected)")
        original(source, target)

    with (
        mock.patch.object(os, "replace", refuse_rename_in),
        pytest.raises(OSError, match="injected"),
    ):
        publish(tmp_path, 2)
    assert old.stat().st_size == 10  # the tracked iteration 2, under its own name again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000002.partial"]
    assert read_tracker(tmp_path) is None


def _build(fmt: CkptFormat) -> tuple[Any, ...]:
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2))

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        layers = chunk_layers(GPT.num_layers, 2, 1, state.pipeline_model_parallel_rank, vp_stage)
        return GPTChunk(
            GPT, layers=layers, pre_process=pre_process, post_process=post_process, seed=5
        )

    model, optimizer, scheduler, _ = setup_model_and_optimizer(
        provider, state, optimizer_config=OptimizerConfig(lr=1e-3),
        lr_schedule=LRScheduleConfig(max_lr=1e-3, min_lr=0.0, lr_warmup_steps=0,
                                     lr_decay_steps=10, lr_decay_style="constant"),
        ckpt_format=fmt, checkpoint_args={},
    )  # fmt: skip
    return state, model, optimizer, scheduler


def _half_written(obj: Any, file: Any, *args: Any, **kwargs: Any) -> None:
    file.write(b"x" * 4096)
    raise OSError("no space left on device (injected)")


def _raising_write(self: Any, *args: Any, **kwargs: Any) -> Any:
    if torch.distributed.get_rank() == 1:
        raise OSError("no space left on device (injected)")
    return _ORIGINAL_WRITE(self, *args, **kwargs)


_ORIGINAL_WRITE = FileSystemWriter.write_data


def _failing_save(root: str, mode: str) -> str:
    fmt: CkptFormat = "torch" if mode == "torch" else "torch_dist"
    state, model, optimizer, scheduler = _build(fmt)
    saver = AsyncCheckpointSaver() if mode == "async" else None
    patch = (
        mock.patch.object(torch, "save", _half_written)
        if mode == "torch"
        else mock.patch.object(FileSystemWriter, "write_data", _raising_write)
    )
    with patch, pytest.raises(CheckpointError) as caught:
        _save_and_wait(root, fmt, saver, state, model, optimizer, scheduler)
    return str(caught.value)


def _save_and_wait(root: str, fmt: CkptFormat, saver: Any, state: Any, *parts: Any) -> None:
    model, optimizer, scheduler = parts
    save_checkpoint(root, 1, state=state, model=model, optimizer=optimizer, scheduler=scheduler,
                    args={}, consumed_train_samples=1, ckpt_format=fmt,
                    async_saver=saver)  # fmt: skip
    if saver is not None:
        saver.wait(state)


def test_a_rank_clears_its_files_after_rank_0_removed_the_directory(tmp_path: Path) -> None:
    """Rank 0 removes the staging directory while another rank still lists its files."""
    staging = tmp_path / "iter_0000001.partial"
    remove_failed_save(staging, 1)  # already gone: nothing raised
    staging.mkdir()
    (staging / "__1_0.distcp").write_bytes(b"x")
    (staging / "__0_0.distcp").write_bytes(b"x")
    remove_failed_save(staging, 1)
    assert [p.name for p in staging.iterdir()] == ["__0_0.distcp"]
    remove_failed_save(staging, 0)
    assert not staging.exists()


@pytest.mark.parametrize("mode", ["torch", "torch_dist", "async"])
def test_a_failed_save_leaves_no_temporaries(tmp_path: Path, mode: str) -> None:
    messages = run_distributed(_failing_save, 2, str(tmp_path), mode)
    assert all("injected" in m or "failed" in m for m in messages)
    assert read_tracker(tmp_path) is None
    left = [p for p in tmp_path.rglob("*") if ".tmp-" in p.name or p.name.endswith(".partial")]
    assert left == []


def _full_disk_save(root: str, mode: str) -> str:
    """A save on a disk that takes 2 KB per file (RLIMIT_FSIZE; Python ignores SIGXFSZ)."""
    fmt: CkptFormat = "torch" if mode == "torch" else "torch_dist"
    state, model, optimizer, scheduler = _build(fmt)
    saver = AsyncCheckpointSaver() if mode == "async" else None
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
    try:
        with pytest.raises(CheckpointError) as caught:
            _save_and_wait(root, fmt, saver, state, model, optimizer, scheduler)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return str(caught.value)


@pytest.mark.parametrize("mode", ["torch", "torch_dist", "async"])
def test_a_full_disk_fails_the_save_on_every_rank_and_leaves_nothing(
    tmp_path: Path, mode: str
) -> None:
    messages = run_distributed(_full_disk_save, 2, str(tmp_path), mode)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}")
        assert str(tmp_path) in message
        assert "\n" not in message  # one line, not DCP's tracebacks
        assert "not moved" in message or "not published" in message
        if mode != "torch":  # DCP keeps the OS's reason; torch's writer hides it
            assert "File too large" in message
    assert read_tracker(tmp_path) is None
    left = [p for p in tmp_path.rglob("*") if ".tmp-" in p.name or p.name.endswith(".partial")]
    assert left == []
