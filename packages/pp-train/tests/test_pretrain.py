"""`pretrain` on real gloo groups with a model that is not GPT: a pipelined MLP regressor."""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pp_state import ParallelState
from pp_testing import run_distributed
from pp_train import (
    CheckpointArgs,
    LoggingArgs,
    ModelArgs,
    ParallelArgs,
    PretrainConfig,
    TrainingArgs,
    pretrain,
    train_valid_test_num_samples,
)

WIDTH, LAYERS = 8, 4
Batch = dict[str, torch.Tensor]


class Samples:
    """Sample i: random inputs and the sum of their sines (the same for every layout)."""

    def __getitem__(self, index: int) -> Batch:
        x = torch.randn(WIDTH, generator=torch.Generator().manual_seed(index))
        return {"tokens": x, "labels": torch.sin(x).sum(0, keepdim=True)}


class Stage(torch.nn.Module):
    """Layers `first .. first + count` of the MLP, each seeded by its global index."""

    def __init__(self, first: int, count: int, pre_process: bool, post_process: bool) -> None:
        super().__init__()
        layers = []
        for index in range(first, first + count):
            torch.manual_seed(index)
            layers.append(torch.nn.Linear(WIDTH, WIDTH))
        self.layers = torch.nn.ModuleList(layers)
        torch.manual_seed(100)
        self.head = torch.nn.Linear(WIDTH, 1) if post_process else None
        self.pre_process, self.input = pre_process, None

    def set_input_tensor(self, tensors: list[Any]) -> None:
        self.input = tensors[0]

    def forward(self, batch: Batch) -> torch.Tensor:
        x = batch["tokens"].unsqueeze(0) if self.pre_process else self.input
        assert x is not None
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.head is None:
            return x
        loss: torch.Tensor = ((self.head(x)[0] - batch["labels"]) ** 2).mean()
        return loss


def _provider(
    *, pre_process: bool, post_process: bool, vp_stage: int, state: ParallelState
) -> torch.nn.Module:
    per = LAYERS // state.pipeline_model_parallel_size
    first = state.pipeline_model_parallel_rank * per
    return Stage(first, per, pre_process, post_process)


def _forward_step(
    data: Iterator[Batch], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[..., Any]]:
    loss = model(next(data))
    return loss, lambda out: (out, {"mse": out.detach()})


def _config(pp: int, checkpoint: dict[str, Any] | None = None, **training: Any) -> PretrainConfig:
    return PretrainConfig(
        parallel=ParallelArgs(pipeline_model_parallel_size=pp),
        model=ModelArgs(num_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=1, seq_length=1),
        training=TrainingArgs(
            **{"train_iters": 6, "micro_batch_size": 2, "global_batch_size": 8, **training}
        ),
        checkpoint=CheckpointArgs(**(checkpoint or {})),
        logging=LoggingArgs(log_interval=1),
    )


def _pretrain(config: PretrainConfig) -> tuple[str, str, list[tuple[int, int, int]]]:
    samples, asked = Samples(), []  # the sample counts pretrain asks for

    def datasets(num_samples: tuple[int, int, int]) -> tuple[Samples, Samples, None]:
        asked.append(num_samples)
        return samples, Samples(), None

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        reason = pretrain(datasets, _provider, _forward_step, config=config, model_name="MLP")
    return reason, printed.getvalue(), asked


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r" mse: (\S+) \|", stdout)]


def test_pretrain_trains_the_same_mlp_on_any_pipeline_and_data_parallel_size() -> None:
    """One process, two stages, two replicas: the same losses from the same seed."""
    (reason, alone, asked), *_ = run_distributed(_pretrain, 1, _config(1), timeout=120)
    assert reason == "train_iters"
    # 6 x 8 to train; (6 // 100 + 1) x 4 x 8 to validate; 4 x 8 to test.
    assert asked == [train_valid_test_num_samples(_config(1))] == [(48, 32, 32)]
    assert (
        "pp-train: MLP on 1 processes (gloo): pipeline 1, data parallel 1, no pipelining" in alone
    )
    reference = _losses(alone)
    assert len(reference) == 6
    for pp in (1, 2):
        results = run_distributed(_pretrain, 2, _config(pp), timeout=180)
        printed = "".join(stdout for _, stdout, _ in results)
        assert f"pipeline {pp}, data parallel {2 // pp}" in printed
        assert _losses(printed) == pytest.approx(reference, rel=1e-5)
        assert "validation at the end of training | mse:" in printed


def test_pretrain_resumes_where_it_stopped(tmp_path: Path) -> None:
    save = str(tmp_path / "ckpt")
    checkpoint = {"save": save, "load": save, "save_interval": 3}
    first = run_distributed(
        _pretrain, 2, _config(2, exit_interval=3, checkpoint=checkpoint), timeout=180
    )
    assert {reason for reason, _, _ in first} == {"exit_interval"}
    second = run_distributed(_pretrain, 2, _config(2, checkpoint=checkpoint), timeout=180)
    resumed = "".join(stdout for _, stdout, _ in second)
    assert f"loaded checkpoint from {save} at iteration 3" in resumed
    unbroken = "".join(s for _, s, _ in run_distributed(_pretrain, 2, _config(2), timeout=180))
    assert _losses(resumed) == pytest.approx(_losses(unbroken)[3:], rel=1e-6)


def test_a_configuration_that_does_not_fit_is_refused_before_any_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(os.environ, "WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"--pipeline-model-parallel-size 2 does not divide the 3"):
        _pretrain(_config(2))
    assert not torch.distributed.is_initialized()
