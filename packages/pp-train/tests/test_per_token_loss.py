"""``--calculate-per-token-loss``: the loss does not depend on how the global batch is cut.

Samples carry a ``loss_mask`` that leaves out a different number of tokens in each, as packed
documents do. One process with micro-batches of 1 and four processes (data parallel 2 x
pipeline 2) with micro-batches of 2 see the same global batches; with per-token loss they
train the bundled GPT identically, without it they do not (each microbatch's mean is then
averaged), and the logged loss is the global batch's mean over its unmasked tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pp_optim import DDPConfig, OptimizerConfig
from pp_testing import run_distributed
from pp_train import (
    LoggingArgs,
    ModelArgs,
    ParallelArgs,
    PretrainConfig,
    TrainingArgs,
    add_pretrain_flags,
    pretrain,
    pretrain_config_from_args,
)
from pp_train.app import GPTChunk, GPTConfig, gpt_forward_step
from pp_train.data import ltor_masks_and_position_ids
from pp_train.step import average_losses

GPT = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=64)
GLOBAL, STEPS = 4, 3
REPORTED: list[list[float]] = []
"""What each microbatch's loss function reported on this rank: [loss_sum, token_count]."""


class MaskedSamples:
    """Sample i: random tokens, their next tokens, and a mask leaving out its first tokens."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        window = torch.randint(GPT.vocab_size, (GPT.seq_length + 1,), generator=generator)
        mask = torch.ones(GPT.seq_length)
        mask[: (index * 3) % GPT.seq_length] = 0.0  # 8, 5, 2, 7, 4, 1, 6, 3 tokens kept
        return {"tokens": window[:-1], "labels": window[1:], "loss_mask": mask}


EOD = 0


class PackedSamples:
    """Sample i: packed documents, ended by EOD at places that differ between samples.

    Megatron's three flags on: position ids restart and attention stays inside each document,
    and the EOD tokens carry no loss, so samples have different numbers of loss tokens.
    """

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        window = torch.randint(1, GPT.vocab_size, (GPT.seq_length + 1,), generator=generator)
        window[[(index * 3) % GPT.seq_length, (index * 5 + 2) % GPT.seq_length]] = EOD
        tokens = window[:-1]
        masks = ltor_masks_and_position_ids(
            tokens, eod_token=EOD, reset_position_ids=True, reset_attention_mask=True,
            eod_mask_loss=True,
        )  # fmt: skip
        return {"tokens": tokens, "labels": window[1:], **masks}


SAMPLES: dict[str, Any] = {"loss-mask": MaskedSamples, "packed-documents": PackedSamples}


def _provider(
    *, pre_process: bool, post_process: bool, vp_stage: int, layers: range, state: Any
) -> torch.nn.Module:
    cp = state.context_parallel_size
    return GPTChunk(
        GPT, layers=layers, pre_process=pre_process, post_process=post_process, seed=7,
        cp_group=state.group("cp") if cp > 1 else None,
    )  # fmt: skip


def _forward_step(data: Iterator[Any], model: torch.nn.Module) -> tuple[Any, Callable[..., Any]]:
    output, loss_func = gpt_forward_step(data, model)

    def recorded(out: torch.Tensor) -> Any:
        result = loss_func(out)
        REPORTED.append(result[2]["lm loss"].tolist())
        return result

    return output, recorded


def _config(pp: int, micro: int, per_token: bool, cp: int = 1) -> PretrainConfig:
    return PretrainConfig(
        parallel=ParallelArgs(pipeline_model_parallel_size=pp, context_parallel_size=cp),
        model=ModelArgs(
            num_layers=GPT.num_layers, hidden_size=GPT.hidden_size, seq_length=GPT.seq_length,
            num_attention_heads=GPT.num_attention_heads, hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
        training=TrainingArgs(
            train_iters=STEPS, micro_batch_size=micro, global_batch_size=GLOBAL, eval_iters=0
        ),
        ddp=DDPConfig(calculate_per_token_loss=per_token),  # --calculate-per-token-loss
        optimizer=OptimizerConfig(optimizer="sgd", lr=0.5),  # scale-sensitive, unlike Adam
        logging=LoggingArgs(log_interval=1),
    )  # fmt: skip


def _pretrain(config: PretrainConfig, samples: str) -> tuple[list[list[float]], str]:
    REPORTED.clear()

    def datasets(num_samples: tuple[int, int, int]) -> tuple[Any, None, None]:
        return SAMPLES[samples](), None, None

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pretrain(datasets, _provider, _forward_step, config=config, model_name="GPT")
    return list(REPORTED), printed.getvalue()


def _per_step_means(results: list[tuple[list[list[float]], str]]) -> list[float]:
    """The global batch's mean over its tokens at each step, from every rank's reports.

    Each rank holding the last stage reports its microbatches, step after step.
    """
    reported = [rows for rows, _ in results if rows]
    means = []
    for step in range(STEPS):
        rows = [row for ranks in reported for row in _step_rows(ranks, step)]
        assert sum(count for _, count in rows) > 0
        means.append(sum(total for total, _ in rows) / sum(count for _, count in rows))
    return means


def _step_rows(rows: list[list[float]], step: int) -> list[list[float]]:
    per_step = len(rows) // STEPS
    return rows[step * per_step : (step + 1) * per_step]


def _logged(results: list[tuple[list[list[float]], str]]) -> list[float]:
    printed = "".join(stdout for _, stdout in results)
    return [float(x) for x in re.findall(r" lm loss: (\S+) \|", printed)]


@pytest.mark.parametrize("samples", list(SAMPLES))
def test_per_token_loss_does_not_depend_on_how_the_batch_is_cut(samples: str) -> None:
    """Four runs of a 2-layer GPT, 3 steps each (two of them on 4 ranks): about 15 s here."""
    means = {}
    for per_token in (True, False):
        alone = run_distributed(_pretrain, 1, _config(1, 1, per_token), samples, timeout=180)
        split = run_distributed(_pretrain, 4, _config(2, 2, per_token), samples, timeout=240)
        means[per_token] = (_per_step_means(alone), _per_step_means(split))
        for results in (alone, split):
            # The logged loss is the batch's mean over its tokens (printed to 7 digits).
            assert _logged(results) == pytest.approx(_per_step_means(results), rel=2e-6)
    alone, split = means[True]
    assert split == pytest.approx(alone, rel=1e-6)
    # Same weights at the first step; without per-token loss the cuts then train apart.
    plain_alone, plain_split = means[False]
    assert plain_split[0] == pytest.approx(plain_alone[0], rel=1e-6)
    assert plain_split[-1] != pytest.approx(plain_alone[-1], rel=1e-4)  # 2.3e-3 apart here
    assert plain_alone[0] == pytest.approx(alone[0], rel=1e-6)


@pytest.mark.parametrize("per_token", [True, False], ids=["per-token", "per-microbatch"])
def test_packed_documents_at_context_parallel_2_train_as_at_1(per_token: bool) -> None:
    """dp 2 at cp 2 against cp 1, the same microbatches: each cp rank holds half of every
    packed sample (its position ids split, the document ids whole) and its loss mask leaves
    the two halves different token counts; the losses are cp 1's with either loss."""
    config = _config(1, 2, per_token)
    alone = run_distributed(_pretrain, 2, config, "packed-documents", timeout=180)
    split_config = _config(1, 2, per_token, cp=2)
    split = run_distributed(_pretrain, 4, split_config, "packed-documents", timeout=240)
    assert _logged(split) == pytest.approx(_logged(alone), rel=2e-6)
    assert len(_logged(split)) == STEPS
    counts = [count for rows, _ in split for _, count in rows]
    assert len(set(counts)) > 1, "the cp ranks' halves hold different numbers of loss tokens"


def test_the_flag_is_megatrons_and_sums_the_gradients() -> None:
    parser = add_pretrain_flags(argparse.ArgumentParser())
    config = pretrain_config_from_args(parser.parse_args(["--calculate-per-token-loss"]))
    assert config.ddp == DDPConfig(calculate_per_token_loss=True)
    assert not pretrain_config_from_args(parser.parse_args([])).ddp.calculate_per_token_loss
    assert "mean per token" in " ".join(parser.format_help().split())


class _OneReplica:
    """The part of a parallel state `average_losses` reads, for one data-parallel replica."""

    def group_size(self, kind: str) -> int:
        return 1


def test_average_losses_takes_megatrons_two_forms_and_refuses_a_mix() -> None:
    state: Any = _OneReplica()
    per_token = [{"lm loss": torch.tensor([6.0, 2.0])}, {"lm loss": torch.tensor([3.0, 4.0])}]
    assert average_losses(per_token, state) == {"lm loss": pytest.approx(9.0 / 6.0)}
    means = [{"mse": torch.tensor(3.0)}, {"mse": torch.tensor([0.75])}]
    assert average_losses(means, state) == {"mse": pytest.approx(1.875)}
    mixed = [{"lm loss": torch.tensor([6.0, 2.0])}, {"lm loss": torch.tensor(3.0)}]
    with pytest.raises(ValueError, match=r"'lm loss' was reported with \[1, 2\] elements"):
        average_losses(mixed, state)
