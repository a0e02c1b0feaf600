"""The command at context-parallel size > 1: each sequence split over ranks, as Megatron does.

Flag errors are checked in-process through `main` (before any process group); training runs
call the command's `run` on ranks the test harness starts. The GPT is tiny and dropout is off,
so every layout gives one process's losses up to the order of floating-point sums: a wrong
split, a missing key/value exchange, a gradient reduced over data parallelism alone or
position embeddings at the wrong positions all move the losses far more than the bound.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_testing import run_distributed
from pp_train import get_batch_on_this_cp_rank
from pp_train.app import GPTChunk, GPTConfig, build_parser, main, validate_args
from pp_train.app.command import run
from pp_train.models import check_context_parallel_chunk

GPT = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--eval-iters", "0", "--log-interval", "1", "--lr-warmup-iters", "1",
    "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip
ITERS = ["--train-iters", "10"]
CP2 = ["--context-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
RELATIVE = 1e-5


# --- flag errors, before any process group ----------------------------------------------


def _refused(argv: list[str], world: int, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main([*GPT, *ITERS, *argv])
    assert exit_info.value.code == 2
    assert not dist.is_initialized()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("pp-train: error:")]
    assert len(lines) == 1
    return str(lines[0]).removeprefix("pp-train: error: ")


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        (
            ["--context-parallel-size", "3", "--seq-length", "32"],
            6,
            "--seq-length 32 is not divisible by 2 x --context-parallel-size 3 = 6: each "
            "context-parallel rank holds 2 of 6 equal chunks of the sequence; use a multiple "
            "of 6, such as 30 or 36",
        ),
        (
            [
                *CP2,
                "--tensor-model-parallel-size",
                "4",
                "--sequence-parallel",
                "--seq-length",
                "20",
            ],
            8,
            "--seq-length 20 is not divisible by 8 (--context-parallel-size 2 x 2 chunks, "
            "and each rank's part over --tensor-model-parallel-size 4 under sequence "
            "parallelism): each context-parallel rank holds 2 of 4 equal chunks of the "
            "sequence; use a multiple of 8, such as 16 or 24",
        ),
        (
            [*CP2, *PP2],
            6,
            "--context-parallel-size 2 x --pipeline-model-parallel-size 2 = 4 does not divide "
            "the 6 processes; choose sizes whose product is one of [1, 2, 3, 6]",
        ),
        (
            [*CP2, "--cp-comm-type", "a2a"],
            2,
            "argument --cp-comm-type: invalid choice: 'a2a' (choose from 'p2p', 'all_gather')",
        ),
        (
            [*CP2, "--attention-dropout", "0.1"],
            2,
            "--context-parallel-size 2 with --attention-dropout 0.1: context-parallel "
            "attention applies no dropout to the attention probabilities; add "
            "--attention-dropout 0",
        ),
    ],
    ids=["seq-vs-2cp", "seq-vs-2cp-tp-sp", "world", "comm-type", "attention-dropout"],
)
def test_bad_context_parallel_flags_are_refused_before_any_group(
    flags: list[str], world: int, message: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    assert message in _refused(flags, world, monkeypatch, capsys)


def test_a_chunk_that_does_not_split_its_attention_is_refused() -> None:
    """A model whose attention cannot see the other ranks' tokens would train wrong silently."""
    plain = torch.nn.Linear(2, 2)
    check_context_parallel_chunk(plain, 1)  # nothing to split at size 1
    with pytest.raises(ValueError, match="does not say that its attention is context-parallel"):
        check_context_parallel_chunk(plain, 2)
    gpt = GPTChunk(
        GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=8,
                  vocab_size=16),
        layers=range(1), pre_process=True, post_process=True, seed=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="says context_parallel_size 1, but the run splits"):
        check_context_parallel_chunk(gpt, 2)


# --- the batch split ----------------------------------------------------------------------


def _split_batch(length: int) -> dict[str, Any]:
    group = dist.new_group(list(range(dist.get_world_size())))
    tokens = torch.arange(2 * length).reshape(2, length)
    documents = (torch.arange(length) // 5).expand(2, -1)
    given = {"tokens": tokens, "labels": tokens + 1, "document_ids": documents}
    part = get_batch_on_this_cp_rank(given, group=group)
    return {key: value.tolist() for key, value in part.items()}


def test_each_rank_gets_its_two_chunks_and_the_whole_documents() -> None:
    parts = run_distributed(_split_batch, 2, 8)
    # Chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert parts[0]["tokens"] == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert parts[1]["tokens"] == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert parts[1]["labels"] == [[3, 4, 5, 6], [11, 12, 13, 14]]
    assert parts[0]["position_ids"] == [[0, 1, 6, 7]] * 2
    assert parts[1]["position_ids"] == [[2, 3, 4, 5]] * 2
    assert parts[0]["document_ids"] == parts[1]["document_ids"] == [[0] * 5 + [1] * 3] * 2


# --- training equals one process ------------------------------------------------------------


def _command(argv: list[str]) -> str:
    parser = build_parser()
    args = validate_args(parser, parser.parse_args(argv), dist.get_world_size())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run(args)
    return printed.getvalue()


def _losses(ranks: int, flags: list[str], timeout: float = 300) -> list[float]:
    printed = "".join(run_distributed(_command, ranks, [*GPT, *flags], timeout=timeout))
    found = re.findall(r"iteration\s+\d+/\s*\d+ \|.*? lm loss: (\S+) \|", printed)
    return [float(x) for x in found]


@pytest.fixture(scope="module")
def one_process() -> list[float]:
    """Ten steps of the GPT on one process, the losses every layout must give."""
    losses = _losses(1, ITERS)
    assert len(losses) == 10
    return losses


LAYOUTS = {
    "cp2": (2, CP2),
    "cp4-all-gather": (4, ["--context-parallel-size", "4", "--cp-comm-type", "all_gather"]),
    "cp2-pp2-interleaved-selective": (
        4, [*CP2, *PP2, "--num-layers-per-virtual-pipeline-stage", "1",
            "--recompute-granularity", "selective"],
    ),
    "cp2-pp2-zbv-full-recompute": (
        4, [*CP2, *PP2, "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule",
            "zbv", "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1", "--cp-comm-type", "all_gather"],
    ),
    "cp2-pp2-dualpipev": (
        4, [*CP2, *PP2, "--num-layers-per-virtual-pipeline-stage", "1",
            "--pipeline-schedule", "dualpipev"],
    ),
    "cp2-pp2-dp2-distributed-optimizer": (8, [*CP2, *PP2, "--use-distributed-optimizer"]),
    "cp2-pp2-dp2-all-gather": (8, [*CP2, *PP2, "--cp-comm-type", "all_gather"]),
    "cp2-tp2-pp2-sp": (8, [*CP2, *PP2, "--tensor-model-parallel-size", "2",
                           "--sequence-parallel"]),
    "cp2-tp2-pp2-sp-all-gather": (
        8, [*CP2, *PP2, "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--cp-comm-type", "all_gather"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_training_equals_one_process(one_process: list[float], name: str) -> None:
    """Ten fp32 steps at every layout within 1e-5 of one process (the 8-rank cases take about
    20 s each on 2 cores: eight processes start and plan)."""
    ranks, flags = LAYOUTS[name]
    losses = _losses(ranks, [*ITERS, *flags])
    assert losses == pytest.approx(one_process, rel=RELATIVE)


# --- checkpoints reshard between context-parallel sizes -----------------------------------


@pytest.mark.parametrize(
    ("saved", "resumed", "fmt"),
    [((2, CP2), (1, []), "torch"), ((1, []), (2, CP2), "torch_dist")],
    ids=["cp2-to-cp1-torch", "cp1-to-cp2-torch-dist"],
)
def test_a_checkpoint_resumes_at_another_context_parallel_size(
    one_process: list[float],
    saved: tuple[int, list[str]],
    resumed: tuple[int, list[str]],
    fmt: str,
    tmp_path: Path,
) -> None:
    """Context parallelism splits no weight: a checkpoint is the same at every size."""
    formats = ["--ckpt-format", fmt, "--use-distributed-optimizer"]
    first = [*ITERS, "--exit-interval", "5", "--save", str(tmp_path), *formats]
    assert _losses(saved[0], [*first, *saved[1]]) == pytest.approx(one_process[:5], rel=RELATIVE)
    then = [*ITERS, "--load", str(tmp_path), *formats]
    assert _losses(resumed[0], [*then, *resumed[1]]) == pytest.approx(one_process[5:], rel=RELATIVE)
