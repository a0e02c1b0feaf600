"""The reliability tier's flag cases: each refused before any process group, one line, exit 2.

Every case runs the command in-process on a 4-process world that does not exist (as under
torchrun before the group starts) and asserts the exact error it prints.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

from pp_train.app import main

pytestmark = pytest.mark.reliability

Torchrun = Callable[..., subprocess.CompletedProcess[str]]

CASES: list[tuple[list[str], str]] = [
    (
        ["--global-batch-size", "10", "--micro-batch-size", "2"],
        "--global-batch-size 10 is not divisible by --micro-batch-size 2 x data-parallel size 4"
        " = 8; use a multiple of 8 such as 8 or 16",
    ),
    (
        ["--pipeline-model-parallel-size", "3"],
        "--pipeline-model-parallel-size 3 does not divide the 4 processes; use one of [1, 2, 4]",
    ),
    (
        ["--pipeline-model-parallel-size", "0"],
        "--pipeline-model-parallel-size must be an integer 1 or more, got 0",
    ),
    (
        [
            "--num-layers",
            "6",
            "--pipeline-model-parallel-size",
            "4",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ],
        "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4 (--num-layers-per-vi",
    ),
    (["--num-layers", "0"], "--num-layers must be an integer 1 or more, got 0"),
    (
        ["--hidden-size", "48", "--num-attention-heads", "5"],
        "--hidden-size 48 is not divisible by --num-attention-heads 5; use one of [1, 2, 3, 4, 6, 8",
    ),
    (["--seq-length", "0"], "--seq-length must be an integer 1 or more, got 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be an integer 1 or more, got 0"),
    (
        ["--global-batch-size", "30"],
        "--global-batch-size 30 is not divisible by --micro-batch-size 4 x data-parallel size 4 = 1",
    ),
    (["--train-iters", "0"], "--train-iters must be an integer 1 or more, got 0"),
    (["--eval-iters", "-1"], "--eval-iters must be an integer 0 or more, got -1"),
    (["--eval-interval", "0"], "--eval-interval must be an integer 1 or more, got 0"),
    (["--log-interval", "0"], "--log-interval must be an integer 1 or more, got 0"),
    (["--save-interval", "5"], "--save-interval needs --save DIR"),
    (["--exit-interval", "0"], "--exit-interval must be an integer 1 or more, got 0"),
    (
        ["--exit-duration-in-mins", "0"],
        "--exit-duration-in-mins must be a positive finite number, got 0.0",
    ),
    (
        ["--distributed-timeout-minutes", "0"],
        "--distributed-timeout-minutes must be a positive finite number, got 0.0",
    ),
    (["--lr", "-1"], "invalid OptimizerConfig: lr must be >= 0, got -1.0"),
    (
        ["--lr", "inf"],
        "invalid OptimizerConfig: lr must be a finite number, got inf (Megatron's --lr)",
    ),
    (
        ["--lr", "nan"],
        "invalid OptimizerConfig: lr must be a finite number, got nan (Megatron's --lr)",
    ),
    (
        ["--seq-length", "30000"],
        "--seq-length 30000 is longer than the bundled corpus allows: it holds 220124 tokens, "
        "22012 of them in the validation split, and a sample needs --seq-length + 1; use "
        "--seq-length 22011 or less, or train on --data-path",
    ),
    (["--min-lr", "0.1"], "--min-lr 0.1 is above --lr 0.003"),
    (
        ["--lr-warmup-iters", "500"],
        "--lr-warmup-iters 500 must be below the decay length 200 (--lr-decay-iters, default --trai",
    ),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (
        ["--lr-decay-style", "step"],
        "argument --lr-decay-style: invalid choice: 'step' (choose from 'constant', 'linear', 'cosi",
    ),
    (
        ["--optimizer", "lamb"],
        "argument --optimizer: invalid choice: 'lamb' (choose from 'adam', 'sgd')",
    ),
    (
        ["--clip-grad", "-1"],
        "invalid OptimizerConfig: clip_grad must be >= 0 and finite (0 disables), got -1.0",
    ),
    (["--adam-beta1", "1.5"], "invalid OptimizerConfig: adam_beta1 must be in [0, 1), got 1.5"),
    (["--adam-eps", "0"], "invalid OptimizerConfig: adam_eps must be > 0, got 0.0"),
    (["--weight-decay", "-0.1"], "invalid OptimizerConfig: weight_decay must be >= 0, got -0.1"),
    (["--fp16", "--bf16"], "invalid OptimizerConfig: set at most one of fp16 and bf16"),
    (
        ["--fp16", "--initial-loss-scale", "inf"],
        "invalid OptimizerConfig: initial_loss_scale must be a finite number > 0, got inf",
    ),
    (
        ["--fp16", "--initial-loss-scale", "0"],
        "invalid OptimizerConfig: initial_loss_scale must be a finite number > 0, got 0.0; min_loss",
    ),
    (
        ["--fp16", "--min-loss-scale", "2", "--initial-loss-scale", "1"],
        "invalid OptimizerConfig: min_loss_scale 2.0 is above initial_loss_scale 1.0; the dynamic s",
    ),
    (
        ["--fp16", "--hysteresis", "0"],
        "invalid OptimizerConfig: hysteresis must be an integer 1 or more, got 0",
    ),
    (
        ["--fp16", "--loss-scale-window", "0"],
        "invalid OptimizerConfig: loss_scale_window must be an integer 1 or more, got 0",
    ),
    (
        ["--loss-scale", "-1"],
        "invalid OptimizerConfig: loss_scale must be a finite number > 0, got -1.0",
    ),
    (
        ["--grad-norm-skip-threshold", "0"],
        "invalid OptimizerConfig: grad_norm_skip_threshold must be > 0 (inf disables), got 0.0",
    ),
    (
        ["--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"],
        "use at most one of --use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler",
    ),
    (
        ["--num-layers-per-virtual-pipeline-stage", "3", "--pipeline-model-parallel-size", "2"],
        "--num-layers-per-virtual-pipeline-stage 3 does not divide the 4 layers of each pipeline st",
    ),
    (
        ["--num-layers-per-virtual-pipeline-stage", "1"],
        "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size 2 or more",
    ),
    (
        ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettt|tttL"],
        "--pipeline-model-parallel-layout: layout 'Ettt|tttL': the layout holds 6 transformer lay",
    ),
    (
        ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "tEtt|ttttL"],
        "--pipeline-model-parallel-layout: layout 'tEtt|ttttL': E at character 1 is in stage 0 of",
    ),
    (
        ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout", "Ett|ttt|ttL"],
        "--pipeline-model-parallel-layout: layout 'Ett|ttt|ttL': 3 stages (split by '|') are not ",
    ),
    (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-model-parallel-layout",
            "Etttt|ttttL",
            "--num-layers-per-virtual-pipeline-stage",
            "2",
        ],
        "--pipeline-model-parallel-layout Etttt|ttttL says which layers each stage holds, so --nu",
    ),
    (
        [
            "--pipeline-model-parallel-size",
            "4",
            "--decoder-first-pipeline-num-layers",
            "6",
            "--decoder-last-pipeline-num-layers",
            "4",
        ],
        "--decoder-first-pipeline-num-layers 6 and --decoder-last-pipeline-num-layers 4 with --nu",
    ),
    (
        ["--pipeline-schedule", "interleaved_1f1b", "--pipeline-model-parallel-size", "2"],
        "--pipeline-schedule interleaved_1f1b with 1 chunk(s) per rank: interleaved_1f1b needs vp_s",
    ),
    (
        ["--pipeline-schedule", "zbv", "--pipeline-model-parallel-size", "2"],
        "--pipeline-schedule zbv with 1 chunk(s) per rank: zbv runs two model chunks per rank in a ",
    ),
    (
        ["--pipeline-schedule", "auto"],
        "--pipeline-schedule auto needs --pipeline-model-parallel-size 2 or more",
    ),
    (
        ["--pipeline-schedule", "gpipe", "--pipeline-schedule-file", "x.txt"],
        "--pipeline-schedule gpipe and --pipeline-schedule-file x.txt exclude each other; give one",
    ),
    (
        ["--pipeline-schedule-file", "/no/such/plan.txt"],
        "--pipeline-schedule-file /no/such/plan.txt: cannot be read: No such file or directory",
    ),
    (
        ["--profile-schedule-iteration", "2"],
        "--profile-schedule-iteration needs --profile-schedule PATH",
    ),
    (
        ["--rampup-batch-size", "4", "2", "100", "--micro-batch-size", "4"],
        "--rampup-batch-size 4 2 100: start global batch size 4 is smaller than micro batch size 4 ",
    ),
    (
        ["--data-path", "/no/such/prefix"],
        "/no/such/prefix.idx: no such file (data prefix /no/such/prefix)",
    ),
    (
        ["--split", "1,2,3,4"],
        "split '1,2,3,4' must be 1 to 3 non-negative numbers for train, valid and test, such as '96",
    ),
    (["--split", "0,0,0"], "split '0,0,0' adds up to 0; give train, valid or test a share"),
    (
        ["--tokenizer-type", "Word"],
        "tokenizer_type 'Word' is unknown; valid: ByteTokenizer, NullTokenizer, HuggingFaceTokenize",
    ),
    (
        ["--tokenizer-type", "HuggingFaceTokenizer"],
        "tokenizer_type HuggingFaceTokenizer needs tokenizer_model (--tokenizer-model PATH: a token",
    ),
    (
        ["--tokenizer-type", "NullTokenizer"],
        "tokenizer_type NullTokenizer needs vocab_size (--vocab-size N: the number of token ids in ",
    ),
    (
        ["--ckpt-format", "zip"],
        "argument --ckpt-format: invalid choice: 'zip' (choose from 'torch', 'torch_dist')",
    ),
    (["--async-save"], "--async-save needs --ckpt-format torch_dist, got --ckpt-format torch"),
    (
        ["--ckpt-convert-format", "torch_dist"],
        "--ckpt-convert-format needs --ckpt-convert-save DIR (conversion takes both flags)",
    ),
    (
        ["--timing-log-level", "3"],
        "argument --timing-log-level: invalid choice: 3 (choose from 0, 1, 2)",
    ),
    (
        ["--timing-log-option", "mean"],
        "argument --timing-log-option: invalid choice: 'mean' (choose from 'max', 'minmax', 'all')",
    ),
]


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_flag_is_one_line_before_any_process_group(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    # Not inside a job of this test's: rank 0 must not wait for a launcher's other ranks.
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert not dist.is_initialized()
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith(f"pp-train: error: {message}")


def test_a_tensorboard_folder_under_a_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes").write_text("a file")
    folder = tmp_path / "notes" / "tb"
    test_a_bad_flag_is_one_line_before_any_process_group(
        ["--tensorboard-dir", str(folder)],
        f"--tensorboard-dir {folder}: {tmp_path / 'notes'} is a file, so no folder can be made",
        monkeypatch,
        capsys,
    )
    assert not folder.exists()


# Rank 0 starts 5 s late: before pp-train 0.8 the other rank left after 3 s and torchrun tore
# rank 0 down before it printed anything ("exitcode: 2" and no message).
_SLOW_RANK_0 = """\
import os
import runpy
import sys
import time

if os.environ.get("RANK") == "0":
    time.sleep(5)
sys.argv[0] = "pp-train"
runpy.run_module("pp_train", run_name="__main__")
"""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizer", "lamb"], "argument --optimizer: invalid choice: 'lamb' (choose from"),
        (["--seq-length", "30000"], "--seq-length 30000 is longer than the bundled corpus"),
    ],
    ids=["argparse", "data"],
)
def test_under_torchrun_a_late_rank_0_prints_the_error_once(
    argv: list[str], message: str, tmp_path: Path, torchrun: Torchrun
) -> None:
    script = tmp_path / "slow_rank_0.py"
    script.write_text(_SLOW_RANK_0)
    done = torchrun(script, 2, *argv, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("pp-train: error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(f"pp-train: error: {message}")
    assert done.stderr.count("usage: pp-train") == 1
    # torchrun's summary: the first rank to leave left with the command's status 2 (which
    # one depends on the scheduling; the other may then be torn down by torchrun).
    assert "exitcode  : 2" in done.stderr.split("Root Cause")[1]
