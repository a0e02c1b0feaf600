"""A damaged newest checkpoint: every rank loads the newest complete one before it, and says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_optim import (
    LRScheduleConfig,
    OptimizerConfig,
    OptimizerParamScheduler,
    get_megatron_optimizer,
)
from pp_state import ParallelConfig, ParallelState
from pp_testing import run_distributed
from pp_train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

WIDTH = 4
ARGS: dict[str, Any] = {
    "num_layers": 2, "hidden_size": WIDTH, "num_attention_heads": 1, "seq_length": 8,
    "vocab_size": 16, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
    "virtual_pipeline_model_parallel_size": None,
}  # fmt: skip


class _Layer(torch.nn.Linear):
    """A stage's layer, named globally by its stage for torch_dist."""

    def __init__(self, stage: int) -> None:
        super().__init__(WIDTH, WIDTH)
        self.stage = stage

    def sharded_state_keys(self) -> dict[str, str]:
        return {key: f"layers.{self.stage}.{key}" for key in self.state_dict()}


class _Job:
    """One rank's layer, optimizer and scheduler."""

    def __init__(self, state: ParallelState, seed: int) -> None:
        torch.manual_seed(seed)
        self.state = state
        self.model: list[torch.nn.Module] = [_Layer(state.group_rank("pp"))]
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(lr=1e-2), self.model, parallel_state=state
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer.optimizer, LRScheduleConfig(max_lr=1e-2, lr_decay_steps=100)
        )

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.model[0](torch.ones(2, WIDTH)).square().mean().backward()
        self.optimizer.step()
        self.scheduler.step(1)

    def weight(self) -> torch.Tensor:
        return self.model[0].weight.detach().clone()  # type: ignore[operator]

    def io(self, ckpt_format: str) -> dict[str, Any]:
        """What save_checkpoint and load_checkpoint take besides the directory."""
        return {
            "state": self.state, "model": self.model, "optimizer": self.optimizer,
            "scheduler": self.scheduler, "args": ARGS, "ckpt_format": ckpt_format,
        }  # fmt: skip


def _damage(root: Path, iteration: int, ckpt_format: str) -> str:
    """Overwrite the end of one file of `iteration` (rank 1's own, or DCP's metadata)."""
    directory = root / f"iter_{iteration:07d}"
    target = (
        directory / ".metadata"
        if ckpt_format == "torch_dist"
        else sorted(directory.glob("*/model_optim_rng.pt"))[1]
    )
    with target.open("r+b") as out:
        out.seek(max(target.stat().st_size - 64, 0))
        out.write(b"\xff" * 64)
    return str(target.relative_to(root))


def _falls_back(base: str, ckpt_format: str) -> dict[str, Any]:
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2))
    job = _Job(state, seed=state.rank)
    root = Path(base) / ckpt_format
    saved = {}
    for iteration in (2, 4):
        job.step()
        saved[iteration] = job.weight()
        save_checkpoint(
            root, iteration, consumed_train_samples=iteration, report=None, **job.io(ckpt_format)
        )
    if state.rank == 1:
        _damage(root, 4, ckpt_format)
    dist.barrier()
    job.step()
    lines: list[str] = []
    loaded = load_checkpoint(root, report=lines.append, **job.io(ckpt_format))
    assert loaded is not None
    result: dict[str, Any] = {
        "iteration": loaded.iteration,
        "weights": torch.equal(job.weight(), saved[2]),
        "lines": [line for line in lines if "damaged" in line],
    }
    # A refusal for another reason (another model) never falls back: iteration 4 is named.
    other_model = {**ARGS, "hidden_size": 8}
    try:
        load_checkpoint(root, report=None, **{**job.io(ckpt_format), "args": other_model})
    except CheckpointError as error:
        result["other"] = str(error)
    return result


@pytest.mark.reliability
@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_damaged_newest_checkpoint_loads_the_one_before_it(
    tmp_path: Path, ckpt_format: str
) -> None:
    results = run_distributed(_falls_back, 2, str(tmp_path), ckpt_format, timeout=90)
    for rank, result in enumerate(results):
        assert (result["iteration"], result["weights"]) == (2, True), rank
    assert "hidden_size" in results[0]["other"]  # refused on every rank, naming iteration 4
    assert "iter_0000004" in results[1]["other"]
    (line,) = results[0]["lines"]
    assert line.startswith("checkpoint iteration 4 is damaged (")
    assert line.endswith("); loading iteration 2, the newest one before it")
    assert ("corrupt" if ckpt_format == "torch" else "unreadable") in line
    assert results[1]["lines"] == []  # said once, by global rank 0
