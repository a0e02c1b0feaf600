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

from pp_state import PipelineLayerLayout, Placement
from pp_testing import run_distributed
from pp_train import (
    CheckpointArgs,
    LoggingArgs,
    ModelArgs,
    ParallelArgs,
    PretrainConfig,
    TrainingArgs,
    check_world,
    get_num_layers_to_build,
    get_transformer_layer_offset,
    pretrain,
)
from pp_train.app import CorpusDataset, GPTChunk, GPTConfig, gpt_forward_step

GPT = GPTConfig(num_layers=6, hidden_size=32, num_attention_heads=4, seq_length=16)
ITERS = 3


# ----------------------------------------------------------------------------- pure
def test_megatron_layer_queries_follow_the_counts_and_the_placement() -> None:
    looped = PipelineLayerLayout.from_counts((1, 2, 2, 1), 2)  # rank 0: stages 0, 2
    held = {
        (rank, chunk): (
            get_transformer_layer_offset(looped, pp_rank=rank, vp_stage=chunk),
            get_num_layers_to_build(looped, pp_rank=rank, vp_stage=chunk),
        )
        for rank in range(2)
        for chunk in range(2)
    }
    assert held == {(0, 0): (0, 1), (1, 0): (1, 2), (0, 1): (3, 2), (1, 1): (5, 1)}
    v_shape = PipelineLayerLayout.from_counts((1, 2, 2, 1), 2, placement=Placement.v_shape(2))
    assert get_transformer_layer_offset(v_shape, pp_rank=0, vp_stage=1) == 5
    last_only = PipelineLayerLayout.from_counts((2, 2, 2, 0), 4)
    assert get_num_layers_to_build(last_only, pp_rank=3) == 0
    assert get_transformer_layer_offset(last_only, pp_rank=3) == 6
    first_only = PipelineLayerLayout.from_counts((0, 2, 2, 2), 4)
    assert get_transformer_layer_offset(first_only, pp_rank=1) == 0


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ((2, 0, 2, 2), r"stage 1 of 4 holds nothing: a stage needs a layer, E or L"),
        ((3, 3, -1, 1), r"stage 2 has -1 layers; a count must be 0 or more"),
        ((2, 2, 2), r"3 stages .* are not a multiple of the pipeline size 4"),
        ((2, 2, 2, 1), r"add up to 7 layers, but --num-layers is 6"),
    ],
)
def test_bad_counts_are_refused_naming_the_stage(counts: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_world(_config(4), 4, layer_counts=counts)


def _config(
    pp: int, *, schedule: str | None = None, layout: str | None = None, **checkpoint: Any
) -> PretrainConfig:
    model = ModelArgs(num_layers=GPT.num_layers, hidden_size=GPT.hidden_size,
                      num_attention_heads=GPT.num_attention_heads, seq_length=GPT.seq_length)  # fmt: skip
    exit_interval = checkpoint.pop("exit_interval", None)
    return PretrainConfig(
        parallel=ParallelArgs(
            pipeline_model_parallel_size=pp,
            pipeline_schedule=schedule,  # type: ignore[arg-type]
            pipeline_model_parallel_layout=layout,
        ),
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
    assert layout.layer_layout.layers(1, 1) == range(5, 6)
    even = check_world(_config(2), 2)
    assert even.layer_counts == (3, 3)
    assert (
        check_world(_config(4), 4, layer_counts=(2, 2, 2, 0)).virtual_pipeline_model_parallel_size
        is None
    )


@pytest.mark.parametrize(
    ("pp", "counts", "message"),
    [
        (4, (2, 2, 2), r"3 stages .* are not a multiple of the pipeline size 4: write 4 stages"),
        (2, (3, 3, 0), r"3 stages .* not a multiple of the pipeline size 2: write 2 or 4 stages"),
        (4, (1, 2, 2, 2), r"add up to 7 layers, but --num-layers is 6"),
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


@pytest.mark.parametrize(
    ("pp", "flags", "counts", "source"),
    [
        (2, {"pipeline_model_parallel_layout": "Ettt|tttL"}, (3, 3), "layout"),
        (4, {"pipeline_model_parallel_layout": "E|(tt|)*2,ttL"}, (0, 2, 2, 2), "layout"),
        (2, {"pipeline_model_parallel_layout": "Et|tt|tt|tL"}, (1, 2, 2, 1), "layout"),
        (4, {"decoder_first_pipeline_num_layers": 0}, (0, 2, 2, 2), "first/last"),
        (3, {"decoder_last_pipeline_num_layers": 2}, (2, 2, 2), "first/last"),
        (4, {}, None, "balanced"),
        (2, {"pipeline_model_parallel_layout": "auto"}, None, "balanced"),
        (2, {}, (3, 3), "even"),
    ],
)
def test_the_flags_choose_the_split_before_any_process_group(
    pp: int, flags: dict[str, Any], counts: tuple[int, ...] | None, source: str
) -> None:
    config = _config(pp)
    parallel = dataclasses.replace(config.parallel, **flags)
    layout = check_world(dataclasses.replace(config, parallel=parallel), pp)
    assert layout.layer_split.source == source
    assert sum(layout.layer_counts) == GPT.num_layers
    if counts is not None:
        assert layout.layer_counts == counts
    summary = layout.layer_split.summary(layout.layer_layout)
    if source == "balanced":
        balance = layout.layer_split.balance
        assert balance is not None
        assert balance.makespan <= balance.even_makespan
        assert summary is not None
        assert "chosen by simulation" in summary
        assert str(layout.layer_layout) in summary
    elif source == "even":
        assert summary is None
    else:
        assert summary is not None
        assert summary.startswith(f"layer layout {layout.layer_layout} (from --")


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("pp", "flags", "message"),
    [
        (4, {"pipeline_model_parallel_layout": "Ett|tt|tt|tL"},
         r"--pipeline-model-parallel-layout: layout 'Ett\|tt\|tt\|tL': the layout holds 7 "
         r"transformer layers \(t\) but num_layers is 6"),
        (4, {"pipeline_model_parallel_layout": "Et|t|t|t|t|tL"},
         r"6 stages \(split by '\|'\) are not a multiple of the pipeline size 4"),
        (2, {"pipeline_model_parallel_layout": "tEtt|tttL"}, r"E at character 1 .* must open"),
        (2, {"pipeline_model_parallel_layout": "Ettt|tLtt"}, r"L at character 6"),
        (4, {"decoder_first_pipeline_num_layers": 5, "decoder_last_pipeline_num_layers": 3},
         r"--decoder-first-pipeline-num-layers 5 and --decoder-last-pipeline-num-layers 3 with "
         r"--num-layers 6: "),
    ],
)  # fmt: skip
def test_bad_layout_flags_are_refused_naming_the_layout_and_the_rule(
    pp: int, flags: dict[str, Any], message: str
) -> None:
    config = _config(pp)
    parallel = dataclasses.replace(config.parallel, **flags)
    with pytest.raises(ValueError, match=message):
        check_world(dataclasses.replace(config, parallel=parallel), pp)


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"pipeline_model_parallel_layout": "Ettt|tttL", "num_layers_per_virtual_pipeline_stage": 1},
         r"--pipeline-model-parallel-layout Ettt\|tttL says which layers each stage holds, so "
         r"--num-layers-per-virtual-pipeline-stage 1 cannot be given with it"),
        ({"pipeline_model_parallel_layout": "Ettt|tttL", "decoder_first_pipeline_num_layers": 3},
         r"so --decoder-first-pipeline-num-layers 3 cannot be given with it"),
        ({"decoder_last_pipeline_num_layers": 1, "num_layers_per_virtual_pipeline_stage": 1},
         r"--decoder-last-pipeline-num-layers 1 with --num-layers-per-virtual-pipeline-stage 1"),
        ({"decoder_first_pipeline_num_layers": -1},
         r"--decoder-first-pipeline-num-layers must be an integer 0 or more, got -1"),
        ({"pipeline_layout_loss_cost": -2.0},
         r"--pipeline-layout-loss-cost must be a finite number 0 or more, got -2.0"),
    ],
)  # fmt: skip
def test_layout_flags_that_conflict_are_refused_by_the_config(
    flags: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelArgs(pipeline_model_parallel_size=2, **flags)


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
    ("pp", "layout", "counts", "schedule"),
    [
        (2, "Ettt|tttL", None, None),
        (4, "Ett|tt|tt|L", None, None),
        (2, "Et|tt|tt|tL", None, None),
        (4, None, (0, 2, 2, 2), None),
        (2, "Et|tt|tt|tL", None, "zbv"),
        (4, None, None, None),
    ],
    ids=["Ettt|tttL", "Ett|tt|tt|L", "Et|tt|tt|tL", "counts-E|tt|tt|ttL", "zbv-Et|tt|tt|tL",
         "balanced-6-on-4"],
)  # fmt: skip
def test_uneven_and_empty_stages_train_as_one_process(
    unpipelined: str,
    pp: int,
    layout: str | None,
    counts: tuple[int, ...] | None,
    schedule: str | None,
) -> None:
    """Each layout, 3 iterations and a final validation: pp 1's losses within 1e-4.

    The layouts come from --pipeline-model-parallel-layout, from the caller's counts, or (6
    layers on 4 ranks, which do not divide) from the balancer, whose choice is printed. The
    gradient and parameter norms (printed with 3 decimals) count every weight once: the output
    layer's copy of the word embedding on the last stage is left out.
    """
    reference = _losses(unpipelined)
    assert len(reference) == ITERS
    printed = _run(pp, _config(pp, schedule=schedule, layout=layout), counts)
    assert _losses(printed) == pytest.approx(reference, abs=1e-4)
    for name in ("grad", "params"):
        assert len(_norms(unpipelined, name)) == ITERS
        assert _norms(printed, name) == pytest.approx(_norms(unpipelined, name), abs=2e-3)
    assert _validation(printed) == pytest.approx(_validation(unpipelined), abs=1e-4)
    if layout is not None:
        assert f"layer layout {layout} (from --pipeline-model-parallel-layout)" in printed
    if layout is None and counts is None:
        assert re.search(r"layer layout E\S+L, chosen by simulation \(1f1b", printed), printed


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
