"""Uneven and empty pipeline stages: layer counts per virtual stage, trained end to end.

The counts name the transformer layers of each virtual stage; the embedding (E) is on the
first and the output layer and loss (L) on the last, so ``(2, 2, 2, 0)`` is Megatron's layout
``Ett|tt|tt|L``. Every layout trains the tiny GPT through `pretrain` and must give the losses
of one unpipelined process; a torch_dist checkpoint saved with one layout resumes with another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from pp_state import Placement
from pp_testing import run_distributed
from pp_train import (
    CheckpointArgs,
    LoggingArgs,
    ModelArgs,
    ParallelArgs,
    PretrainConfig,
    TrainingArgs,
    check_layer_counts,
    check_world,
    chunk_layer_range,
    get_num_layers_to_build,
    get_transformer_layer_offset,
    pretrain,
)
from pp_train.app import CorpusDataset, GPTChunk, GPTConfig, gpt_forward_step

GPT = GPTConfig(num_layers=6, hidden_size=32, num_attention_heads=4, seq_length=16)
ITERS = 3


# ----------------------------------------------------------------------------- pure
def test_chunk_layers_follow_the_counts_and_the_placement() -> None:
    looped = Placement.looped(2, 2)  # rank 0: stages 0, 2; rank 1: stages 1, 3
    counts = (1, 2, 2, 1)
    held = {
        (rank, chunk): chunk_layer_range(counts, looped, pp_rank=rank, vp_stage=chunk)
        for rank in range(2)
        for chunk in range(2)
    }
    assert held == {(0, 0): range(0, 1), (1, 0): range(1, 3), (0, 1): range(3, 5),
                    (1, 1): range(5, 6)}  # fmt: skip
    v_shape = Placement.v_shape(2)  # rank 0: stages 0, 3; rank 1: stages 1, 2
    assert chunk_layer_range(counts, v_shape, pp_rank=0, vp_stage=1) == range(5, 6)
    last_only = (2, 2, 2, 0)
    pp4 = Placement.looped(4)
    assert get_num_layers_to_build(last_only, pp4, pp_rank=3) == 0
    assert get_transformer_layer_offset(last_only, pp4, pp_rank=3) == 6
    assert get_transformer_layer_offset((0, 2, 2, 2), pp4, pp_rank=1) == 0


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ((2, 0, 2, 2), r"stage 1 of 4 holds nothing \(layer counts \(2, 0, 2, 2\)\)"),
        ((3, 3, -1, 1), r"stage 2 of 4 has -1 layers"),
        ((2, 2, 2), r"3 layer counts \(2, 2, 2\) for 4 virtual stages"),
        ((2, 2, 2, 1), r"add up to 7 layers, but the model has 6"),
    ],
)
def test_bad_counts_are_refused_naming_the_stage(counts: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_layer_counts(counts, Placement.looped(4), num_layers=6)


def _config(pp: int, *, schedule: str | None = None, **checkpoint: Any) -> PretrainConfig:
    model = ModelArgs(num_layers=GPT.num_layers, hidden_size=GPT.hidden_size,
                      num_attention_heads=GPT.num_attention_heads, seq_length=GPT.seq_length)  # fmt: skip
    exit_interval = checkpoint.pop("exit_interval", None)
    return PretrainConfig(
        parallel=ParallelArgs(pipeline_model_parallel_size=pp, pipeline_schedule=schedule),  # type: ignore[arg-type]
        model=model,
        training=TrainingArgs(
            train_iters=ITERS,
            micro_batch_size=2,
            global_batch_size=8,
            eval_iters=1,
            eval_interval=1000,
            exit_interval=exit_interval,
        ),
        checkpoint=CheckpointArgs(**checkpoint),
        logging=LoggingArgs(log_interval=1, log_params_norm=True),
    )


def test_check_world_takes_counts_that_do_not_divide_and_gives_the_virtual_size() -> None:
    layout = check_world(_config(2), 2, layer_counts=(1, 2, 2, 1))
    assert layout.virtual_pipeline_model_parallel_size == 2
    assert layout.layer_counts == (1, 2, 2, 1)
    assert layout.chunk_layers(6, 1, 1) == range(5, 6)
    even = check_world(_config(2), 2)
    assert even.layer_counts == (3, 3)
    assert (
        check_world(_config(4), 4, layer_counts=(2, 2, 2, 0)).virtual_pipeline_model_parallel_size
        is None
    )


@pytest.mark.parametrize(
    ("pp", "counts", "message"),
    [
        (4, (2, 2, 2), r"3 layer counts \(2, 2, 2\) do not fill --pipeline-model-parallel-size 4"),
        (2, (3, 3, 0), r"give a multiple of 2 counts"),
        (1, (3, 3), r"give virtual stages, which need --pipeline-model-parallel-size 2"),
        (4, (1, 2, 2, 2), r"add up to 7 layers, but the model has 6"),
    ],
)
def test_check_world_refuses_counts_before_any_process_group(
    pp: int, counts: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_world(_config(pp), 4, layer_counts=counts)
    config = _config(2)
    per_chunk = dataclasses.replace(config.parallel, num_layers_per_virtual_pipeline_stage=1)
    with pytest.raises(ValueError, match=r"--num-layers-per-virtual-pipeline-stage 1 both say"):
        check_world(dataclasses.replace(config, parallel=per_chunk), 2, layer_counts=(3, 3))


# ----------------------------------------------------------------------------- training
def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    base = torch.arange(64).repeat(100) % 50 + 40
    return (base + torch.randint(0, 5, base.shape, generator=generator)).to(torch.int64)


def _provider(
    *, pre_process: bool, post_process: bool, vp_stage: int, layers: range
) -> torch.nn.Module:
    return GPTChunk(GPT, layers=layers, pre_process=pre_process, post_process=post_process, seed=7)


def _pretrain(config: PretrainConfig, counts: tuple[int, ...] | None) -> str:
    def datasets(num_samples: tuple[int, int, int]) -> tuple[Any, Any, None]:
        tokens = _tokens()
        return (
            CorpusDataset(tokens, GPT.seq_length, seed=3),
            CorpusDataset(tokens, GPT.seq_length, seed=4),
            None,
        )

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pretrain(datasets, _provider, gpt_forward_step, config=config, layer_counts=counts)
    return printed.getvalue()


def _run(ranks: int, config: PretrainConfig, counts: tuple[int, ...] | None) -> str:
    return "".join(run_distributed(_pretrain, ranks, config, counts, timeout=120))


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r" lm loss: (\S+) \|", stdout)]


def _norms(stdout: str, name: str) -> list[float]:
    return [float(x) for x in re.findall(rf" {name} norm: (\S+) \|", stdout)]


def _validation(stdout: str) -> float:
    found = re.findall(r"validation at the end of training \| lm loss: (\S+)", stdout)
    assert len(found) == 1, stdout
    return float(found[0])


@pytest.fixture(scope="module")
def unpipelined() -> str:
    """One process, all six layers: the losses every layout must give."""
    return _run(1, _config(1), None)


@pytest.mark.parametrize(
    ("pp", "counts", "schedule"),
    [
        (2, (3, 3), None),
        (4, (2, 2, 2, 0), None),
        (2, (1, 2, 2, 1), None),
        (4, (0, 2, 2, 2), None),
        (2, (1, 2, 2, 1), "zbv"),
    ],
    ids=["Ettt|tttL", "Ett|tt|tt|L", "Et|tt|tt|tL", "E|tt|tt|ttL", "zbv-Et|tt|tt|tL"],
)
def test_uneven_and_empty_stages_train_as_one_process(
    unpipelined: str, pp: int, counts: tuple[int, ...], schedule: str | None
) -> None:
    """Each layout, 3 iterations and a final validation: pp 1's losses within 1e-4.

    The gradient and parameter norms (printed with 3 decimals) count every weight once: the
    output layer's copy of the word embedding on the last stage is left out.
    """
    reference = _losses(unpipelined)
    assert len(reference) == ITERS
    printed = _run(pp, _config(pp, schedule=schedule), counts)
    assert _losses(printed) == pytest.approx(reference, abs=1e-4)
    for name in ("grad", "params"):
        assert len(_norms(unpipelined, name)) == ITERS
        assert _norms(printed, name) == pytest.approx(_norms(unpipelined, name), abs=2e-3)
    assert _validation(printed) == pytest.approx(_validation(unpipelined), abs=1e-4)


def test_a_torch_dist_checkpoint_resumes_with_other_layer_counts(
    unpipelined: str, tmp_path: Path
) -> None:
    """Saved at pp 2 as Ettt|tttL after 2 iterations, resumed at pp 4 as Ett|tt|tt|L."""
    save = str(tmp_path / "ckpt")
    checkpoint: dict[str, Any] = {"save": save, "load": save, "save_interval": 2,
                                  "ckpt_format": "torch_dist"}  # fmt: skip
    first = _run(2, _config(2, exit_interval=2, **checkpoint), (3, 3))
    assert _losses(first) == pytest.approx(_losses(unpipelined)[:2], abs=1e-4)
    resumed = _run(4, _config(4, **checkpoint), (2, 2, 2, 0))
    assert f"loaded checkpoint from {save} at iteration 2" in resumed
    assert _losses(resumed) == pytest.approx(_losses(unpipelined)[2:], abs=1e-4)


def test_a_torch_checkpoint_resumes_with_the_same_uneven_counts(
    unpipelined: str, tmp_path: Path
) -> None:
    """The torch format keeps one file per pipeline rank: resumed with the counts it had."""
    save = str(tmp_path / "ckpt")
    checkpoint: dict[str, Any] = {"save": save, "load": save, "save_interval": 2}
    _run(2, _config(2, exit_interval=2, **checkpoint), (1, 2, 2, 1))
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir()
    resumed = _run(2, _config(2, **checkpoint), (1, 2, 2, 1))
    assert f"loaded checkpoint from {save} at iteration 2" in resumed
    assert _losses(resumed) == pytest.approx(_losses(unpipelined)[2:], abs=1e-4)
