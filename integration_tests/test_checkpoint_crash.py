"""kill -9 of one rank at 25 moments of a save: torch, torch_dist, asynchronous torch_dist.

Each case saves iteration 1, changes every weight, then saves iteration 2 while a patched
step of the save (`MOMENTS`: before or after a file write, a rename, the tracker, DCP's shard
write or ``.metadata``, the asynchronous finalisation) kills one rank with SIGKILL. The tracker
must name the last complete checkpoint (iteration 1, or 2 when the kill came after the
tracker moved), a new run must load exactly that iteration's weights, and a new save of
iteration 2 must succeed over what the crash left behind. The load removes the killed
writers' temporaries and names them. In the ``resave`` cases iteration 2 is complete and
tracked before the killed save writes it again (weights changed once more): the tracker names
2 throughout and the load must give the first iteration 2's weights, putting back the
directory moved aside (``iter_N.replaced``) when the kill came between the two renames.
25 cases of two 2-rank runs each: about 10-50 s a case on a loaded 2-core machine, almost all
of it starting ranks.
"""

from __future__ import annotations

import dataclasses
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
from pp_train.checkpoint import (
    CHECKPOINT_FILENAME,
    TRACKER_FILENAME,
    AsyncCheckpointSaver,
    CkptFormat,
    load_checkpoint,
    read_tracker,
)
from pp_train.checkpoint import async_save as async_save_module
from pp_train.checkpoint import torch_dist as torch_dist_module
from pp_train.checkpoint import torch_format as legacy

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


def _save(
    root: str, iteration: int, parts: tuple[Any, ...], fmt: CkptFormat, saver: Any = None
) -> None:
    state, model, optimizer, scheduler, _ = parts
    save_checkpoint(root, iteration, state=state, model=model, optimizer=optimizer,
                    scheduler=scheduler, args={}, consumed_train_samples=iteration,
                    ckpt_format=fmt, async_saver=saver)  # fmt: skip
    if saver is not None:
        saver.wait(state)


def _killer(original: Any, rank: int, when: Any = None, *, after: bool = False) -> Any:
    """`original`, but rank `rank` dies by SIGKILL before (or `after`) a call `when` accepts."""

    def patched(*args: Any, **kwargs: Any) -> Any:
        hit = dist.get_rank() == rank and (when is None or when(*args))
        if hit and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return patched


def _named(name: str) -> Any:
    return lambda path, *rest: Path(path).name == name


def _renamed_to(name: str) -> Any:
    return lambda source, target: Path(target).name == name


def _in_stage_directory(directory: Path) -> bool:  # synced after its file's rename
    return directory.name.startswith("mp_rank")


def _root_only(directory: Path) -> bool:  # publish syncs the .partial directory, then the root
    return not directory.name.endswith(".partial")


@dataclasses.dataclass(frozen=True)
class Moment:
    """Where one rank dies: `owner.attribute` replaced by a killer; what a new run resumes."""

    fmt: CkptFormat
    owner: Any
    attribute: str
    rank: int
    when: Any = None
    after: bool = False
    background: bool = False
    resumes: int = 1
    resave: bool = False
    """Iteration 2 is complete and tracked before the killed save writes it again."""

    def patch(self) -> Any:
        original = getattr(self.owner, self.attribute)
        killer = _killer(original, self.rank, self.when, after=self.after)
        return mock.patch.object(self.owner, self.attribute, killer)


_TRACKER, _FILE = TRACKER_FILENAME, CHECKPOINT_FILENAME
_WRITER, _DIST, _ASYNC = FileSystemWriter, torch_dist_module, async_save_module
_ASIDE = _renamed_to("iter_0000002.replaced")  # the old iter_0000002 moved aside, new not in
MOMENTS = {
    # torch format: rank 1 writes its stage's file, rank 0 the tracker.
    "torch_before_file": Moment("torch", legacy, "_atomic_write", 1, _named(_FILE)),
    "torch_file_written": Moment("torch", torch, "save", 1, after=True),
    "torch_before_file_rename": Moment("torch", os, "replace", 1, _renamed_to(_FILE)),
    "torch_after_file_rename": Moment("torch", legacy, "_fsync_directory", 1, _in_stage_directory),
    "torch_before_tracker": Moment("torch", legacy, "_atomic_write", 0, _named(_TRACKER)),
    "torch_before_tracker_rename": Moment("torch", os, "replace", 0, _renamed_to(_TRACKER)),
    "torch_resave_file_renamed": Moment(
        "torch", legacy, "_fsync_directory", 0, _in_stage_directory, resumes=2, resave=True
    ),
    "torch_resave_between_renames": Moment(
        "torch", os, "replace", 0, _ASIDE, after=True, resumes=2, resave=True
    ),
    "torch_after_tracker": Moment(
        "torch", os, "replace", 0, _renamed_to(_TRACKER), after=True, resumes=2
    ),
    # torch_dist, blocking: every rank writes its shard, rank 0 the rest.
    "before_common_files": Moment("torch_dist", _DIST, "_atomic_write", 0, _named("common.pt")),
    "after_common_files": Moment("torch_dist", _DIST, "writer_and_planner", 1),
    "shard_write": Moment("torch_dist", _WRITER, "write_data", 1),
    "after_shard_write": Moment("torch_dist", _WRITER, "write_data", 1, after=True),
    "before_metadata": Moment("torch_dist", _WRITER, "finish", 0),
    "after_metadata": Moment("torch_dist", _WRITER, "finish", 0, after=True),
    "after_directory_rename": Moment("torch_dist", _DIST, "_fsync_directory", 0, _root_only),
    "before_tracker": Moment("torch_dist", _DIST, "_atomic_write", 0, _named(_TRACKER)),
    "resave_between_renames": Moment(
        "torch_dist", os, "replace", 0, _ASIDE, after=True, resumes=2, resave=True
    ),
    "after_tracker": Moment(
        "torch_dist", os, "replace", 0, _renamed_to(_TRACKER), after=True, resumes=2
    ),
    # torch_dist, asynchronous: the shards are written in a background thread.
    "async_shard_write": Moment("torch_dist", _WRITER, "write_data", 1, background=True),
    "async_before_metadata": Moment("torch_dist", _WRITER, "finish", 0, background=True),
    "async_finalize_before_rename": Moment("torch_dist", _ASYNC, "publish", 0, background=True),
    "async_finalize_after_rename": Moment(
        "torch_dist", _DIST, "_fsync_directory", 0, _root_only, background=True
    ),
    "async_resave_between_renames": Moment(
        "torch_dist", os, "replace", 0, _ASIDE, after=True, background=True, resumes=2, resave=True
    ),
    "async_after_tracker": Moment(
        "torch_dist",
        os,
        "replace",
        0,
        _renamed_to(_TRACKER),
        after=True,
        background=True,
        resumes=2,
    ),
}


def _add_one(model: list[torch.nn.Module]) -> None:
    with torch.no_grad():
        for chunk in model:
            for param in chunk.parameters():
                param.add_(1.0)


def _crash(root: str, name: str) -> None:
    moment = MOMENTS[name]  # looked up here: its functions do not pickle
    parts = _build()
    _save(root, 1, parts, moment.fmt)
    _add_one(parts[1])
    if moment.resave:  # iteration 2 holds weights 1 higher than 1; the killed save 2 higher
        _save(root, 2, parts, moment.fmt)
        _add_one(parts[1])
    saver = AsyncCheckpointSaver() if moment.background else None
    with moment.patch():
        _save(root, 2, parts, moment.fmt, saver)


def _leftovers(root: str) -> list[str]:
    found = Path(root).rglob("*")
    leftover = (".partial", ".replaced")
    return sorted(p.name for p in found if ".tmp-" in p.name or p.name.endswith(leftover))


def _resume(root: str, fmt: CkptFormat) -> dict[str, Any]:
    fresh = [p.detach().clone() for c in _build()[1] for p in c.parameters()]
    state, model, optimizer, scheduler, _ = _build()
    lines: list[str] = []
    result = load_checkpoint(root, state=state, model=model, optimizer=optimizer,
                             scheduler=scheduler, args={}, ckpt_format=fmt,
                             report=lines.append)  # fmt: skip
    left = _leftovers(root) if state.rank == 0 else []  # rank 0 removed them during the load
    dist.barrier()  # before rank 1's save below writes its temporaries
    loaded = [p.detach().clone() for c in model for p in c.parameters()]
    iteration = None if result is None else result.iteration
    shift = 0.0 if iteration is None else iteration - 1.0  # iteration 2's weights are 1 higher
    _save(root, 2, (state, model, optimizer, scheduler, result), fmt)
    return {
        "iteration": iteration,
        "equal": all(torch.equal(a + shift, b) for a, b in zip(fresh, loaded, strict=True)),
        "lines": lines,
        "left": left,
    }


@pytest.mark.parametrize("name", list(MOMENTS))
def test_a_killed_rank_never_leaves_the_tracker_on_an_incomplete_checkpoint(
    tmp_path: Path, name: str
) -> None:
    moment = MOMENTS[name]
    with pytest.raises(DistributedTestError):
        run_distributed(_crash, 2, str(tmp_path), name, pg_timeout=5.0, timeout=60)
    assert read_tracker(tmp_path) == moment.resumes
    crashed = _leftovers(str(tmp_path))
    # A directory moved aside whose replacement never came in: the load puts it back.
    aside = [n for n in crashed if n.endswith(".replaced") and not (tmp_path / n[:-9]).exists()]
    removed = [n for n in crashed if n not in aside]
    results = run_distributed(_resume, 2, str(tmp_path), moment.fmt)
    assert [r["iteration"] for r in results] == [moment.resumes] * 2
    assert all(r["equal"] for r in results)
    assert results[0]["left"] == []
    lines = results[0]["lines"]  # one line for what was put back, one for what was removed
    assert [line.split()[0] for line in lines] == ["restored"] * bool(aside) + ["removed"] * bool(
        removed
    ), lines
    if aside:
        assert lines[0].startswith(f"restored {len(aside)} checkpoint"), lines[0]
        assert all(f"{name} -> {name[:-9]}" in lines[0] for name in aside), lines[0]
    if removed:  # the killed writer's temporaries, named in one line by the load
        assert lines[-1].startswith(f"removed {len(removed)} stale checkpoint temporaries")
        assert all(name in lines[-1] for name in removed), lines[-1]
    assert read_tracker(tmp_path) == 2
    assert _leftovers(str(tmp_path)) == []
