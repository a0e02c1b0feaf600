"""The bundled GPT under DualPipeV trains as one process does (pp, tp, dp and the distributed
optimizer, full recomputation on; F&B steps run one after the other and in pp's threads)."""

from __future__ import annotations

import contextlib
import io
import re
from typing import Any

import pytest
import torch.distributed as dist

from pp_testing import run_distributed
from pp_train.app import build_parser, validate_args
from pp_train.app.command import run

FLAGS = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
    "--eval-iters", "0", "--log-interval", "1", "--lr-warmup-iters", "1", "--train-iters", "3",
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1", "--make-vocab-size-divisible-by", "512",
]  # fmt: skip
DUALPIPEV = ["--pipeline-schedule", "dualpipev", "--num-layers-per-virtual-pipeline-stage"]


def _command(argv: list[str]) -> dict[str, Any]:
    """The command's training run on this rank (the harness made the process group)."""
    parser = build_parser()
    args = validate_args(parser, parser.parse_args(argv), dist.get_world_size())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        reason = run(args)
    return {"reason": reason, "stdout": printed.getvalue()}


def _losses(ranks: int, argv: list[str]) -> list[float]:
    results = run_distributed(_command, ranks, [*FLAGS, *argv], timeout=300)
    assert {r["reason"] for r in results} == {"train_iters"}
    stdout = "".join(r["stdout"] for r in results)
    found = re.findall(r"iteration\s+\d+/\s*\d+ \|.*? lm loss: (\S+) \|", stdout)
    assert len(found) == 3, stdout
    return [float(loss) for loss in found]


@pytest.fixture(scope="module")
def one_process() -> list[float]:
    return _losses(1, [])


@pytest.mark.parametrize(
    ("ranks", "flags"),
    [
        (2, ["--pipeline-model-parallel-size", "2", *DUALPIPEV, "2"]),
        (2, ["--pipeline-model-parallel-size", "2", *DUALPIPEV, "2", "--fb-overlap", "threads"]),
        (4, ["--pipeline-model-parallel-size", "4", *DUALPIPEV, "1"]),
        (4, ["--pipeline-model-parallel-size", "4", *DUALPIPEV, "1", "--fb-overlap", "threads"]),
        # 256 x tp 2 pads the vocabulary to the 512 rows of one process.
        (4, ["--pipeline-model-parallel-size", "2", *DUALPIPEV, "2",
             "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--make-vocab-size-divisible-by", "256"]),
        (4, ["--pipeline-model-parallel-size", "2", *DUALPIPEV, "2", "--global-batch-size", "16",
             "--use-distributed-optimizer", "--fb-overlap", "threads"]),
    ],
    ids=["pp2", "pp2-threads", "pp4", "pp4-threads", "tp2-pp2-sp", "dp2-pp2-distopt-threads"],
)  # fmt: skip
def test_dualpipev_trains_as_one_process(
    ranks: int, flags: list[str], one_process: list[float]
) -> None:
    """Losses equal within the 7 digits the log prints (each run at its own batch: dp 2 takes
    twice the sequences, so it is compared with one process at that batch)."""
    reference = one_process
    if "--use-distributed-optimizer" in flags:
        reference = _losses(1, ["--global-batch-size", "16"])
    assert _losses(ranks, flags) == pytest.approx(reference, rel=1e-6)


def test_threads_with_tensor_parallelism_are_refused_before_any_group(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    parser = build_parser()
    argv = [*FLAGS, "--pipeline-model-parallel-size", "2", *DUALPIPEV, "2",
            "--tensor-model-parallel-size", "2", "--fb-overlap", "threads"]  # fmt: skip
    with pytest.raises(SystemExit):
        validate_args(parser, parser.parse_args(argv), 4)
    error = capsys.readouterr().err
    assert "--fb-overlap threads with --tensor-model-parallel-size 2" in error
