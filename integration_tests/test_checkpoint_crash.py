"""kill -9 of one rank at several moments of a torch_dist save (blocking and async).

Each case saves iteration 1, changes every weight, then saves iteration 2 while a patched
step of the save kills one rank with SIGKILL. The tracker must still name iteration 1, a new
run must load exactly the iteration-1 weights, and a new save of iteration 2 must succeed over
what the crash left behind. The load removes the killed writers' temporaries and names them.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from pp_optim import LRScheduleConfig, OptimizerConfig
from pp_state import ParallelConfig, ParallelState
from pp_testing import run_distributed
from pp_testing.distributed import DistributedTestError
from pp_train import save_checkpoint, setup_model_and_optimizer
from pp_train.app import GPTChunk, GPTConfig, chunk_layers
from pp_train.checkpoint import AsyncCheckpointSaver, load_checkpoint
from pp_train.checkpoint import torch_dist as torch_dist_module
from pp_train.checkpointing import read_tracker

pytestmark = pytest.mark.reliability

GPT = GPTConfig(num_layers=4, hidden_size=16, num_attention_heads=2, seq_length=8)


def _build(load: str | None = None) -> tuple[Any, ...]:
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2))

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        layers = chunk_layers(GPT.num_layers, 2, 1, state.pipeline_model_parallel_rank, vp_stage)
        return GPTChunk(
            GPT, layers=layers, pre_process=pre_process, post_process=post_process, seed=5
        )

    model, optimizer, scheduler, loaded = setup_model_and_optimizer(
        provider, state, optimizer_config=OptimizerConfig(lr=1e-3),
        lr_schedule=LRScheduleConfig(max_lr=1e-3, min_lr=0.0, lr_warmup_steps=0,
                                     lr_decay_steps=100, lr_decay_style="constant"),
        load=load, ckpt_format="torch_dist", checkpoint_args={},
    )  # fmt: skip
    return state, model, optimizer, scheduler, loaded


def _save(root: str, iteration: int, parts: tuple[Any, ...], saver: Any = None) -> None:
    state, model, optimizer, scheduler, _ = parts
    save_checkpoint(root, iteration, state=state, model=model, optimizer=optimizer,
                    scheduler=scheduler, args={}, consumed_train_samples=iteration,
                    ckpt_format="torch_dist", async_saver=saver)  # fmt: skip
    if saver is not None:
        saver.wait(state)


def _killer(original: Any, rank: int, when: Any = None) -> Any:
    def patched(*args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == rank and (when is None or when(*args)):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    return patched


def _patch(moment: str) -> Any:
    if moment == "after_common_files":
        return mock.patch.object(torch_dist_module, "writer_and_planner",
                                 _killer(torch_dist_module.writer_and_planner, 1))  # fmt: skip
    if moment in ("shard_write", "async_shard_write"):
        return mock.patch.object(FileSystemWriter, "write_data",
                                 _killer(FileSystemWriter.write_data, 1))  # fmt: skip
    if moment in ("before_metadata", "async_before_metadata"):
        return mock.patch.object(FileSystemWriter, "finish", _killer(FileSystemWriter.finish, 0))
    assert moment == "before_tracker"
    is_tracker = lambda path, write: path.name == "latest_checkpointed_iteration.txt"  # noqa: E731
    return mock.patch.object(torch_dist_module, "_atomic_write",
                             _killer(vars(torch_dist_module)["_atomic_write"], 0, is_tracker))  # fmt: skip


def _crash(root: str, moment: str) -> None:
    parts = _build()
    _save(root, 1, parts)
    with torch.no_grad():
        for chunk in parts[1]:
            for param in chunk.parameters():
                param.add_(1.0)
    saver = AsyncCheckpointSaver() if moment.startswith("async") else None
    with _patch(moment):
        _save(root, 2, parts, saver)


def _leftovers(root: str) -> list[str]:
    found = Path(root).rglob("*")
    return sorted(p.name for p in found if ".tmp-" in p.name or p.name.endswith(".partial"))


def _resume(root: str) -> dict[str, Any]:
    fresh = [p.detach().clone() for c in _build()[1] for p in c.parameters()]
    state, model, optimizer, scheduler, _ = _build()
    lines: list[str] = []
    result = load_checkpoint(root, state=state, model=model, optimizer=optimizer,
                             scheduler=scheduler, args={}, ckpt_format="torch_dist",
                             report=lines.append)  # fmt: skip
    left = _leftovers(root) if state.rank == 0 else []  # rank 0 removed them during the load
    loaded = [p.detach().clone() for c in model for p in c.parameters()]
    _save(root, 2, (state, model, optimizer, scheduler, result))
    return {
        "iteration": None if result is None else result.iteration,
        "equal": all(torch.equal(a, b) for a, b in zip(fresh, loaded, strict=True)),
        "lines": lines,
        "left": left,
    }


@pytest.mark.parametrize(
    "moment",
    [
        "after_common_files",
        "shard_write",
        "before_metadata",
        "before_tracker",
        "async_shard_write",
        "async_before_metadata",
    ],
)
def test_a_killed_rank_never_leaves_the_tracker_on_an_incomplete_checkpoint(
    tmp_path: Path, moment: str
) -> None:
    with pytest.raises(DistributedTestError):
        run_distributed(_crash, 2, str(tmp_path), moment, pg_timeout=5.0, timeout=60)
    assert read_tracker(tmp_path) == 1
    crashed = _leftovers(str(tmp_path))
    results = run_distributed(_resume, 2, str(tmp_path))
    assert [r["iteration"] for r in results] == [1, 1]
    assert all(r["equal"] for r in results)
    assert results[0]["left"] == []
    if crashed:  # the killed writer's temporaries, named in one line by the load
        (line,) = results[0]["lines"]
        assert line.startswith(f"removed {len(crashed)} stale checkpoint temporaries"), line
        assert all(name in line for name in crashed), line
    assert read_tracker(tmp_path) == 2
    assert _leftovers(str(tmp_path)) == []
