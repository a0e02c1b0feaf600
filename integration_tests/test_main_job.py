"""The main job: ``torchrun -m pp_train`` trains the bundled GPT, saves, stops and resumes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# The `torchrun` fixture from conftest.py: (script or "-m module", ranks, *args) -> process.
Torchrun = Callable[..., subprocess.CompletedProcess[str]]

TINY = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--eval-iters",
    "2",
    "--log-interval",
    "5",
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "2",
]


def _losses(stdout: str) -> dict[int, float]:
    found = re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|", stdout)
    return {int(iteration): float(loss) for iteration, loss in found}


def test_trains_stops_and_resumes_on_four_processes(torchrun: Torchrun, tmp_path: Path) -> None:
    save = str(tmp_path / "ckpt")
    board = tmp_path / "tb"
    flags = [
        *TINY,
        "--pipeline-model-parallel-size",
        "2",
        "--train-iters",
        "20",
        "--save",
        save,
        "--load",
        save,
        "--tensorboard-dir",
        str(board),
    ]
    first = torchrun("-m pp_train", 4, *flags, "--exit-interval", "10")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "no checkpoint in" in first.stdout
    assert "pipeline 2, data parallel 2, 1F1B" in first.stdout
    assert "exiting at iteration 10: exit_interval" in first.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    second = torchrun("-m pp_train", 4, *flags)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "loaded checkpoint from" in second.stdout
    assert "at iteration 10 (80 samples consumed)" in second.stdout
    losses = {**_losses(first.stdout), **_losses(second.stdout)}
    assert sorted(losses) == [5, 10, 15, 20]
    assert losses[20] < losses[5]  # the loss falls
    assert "[####################] 100%" in second.stdout  # the progress display
    assert "validation at the end of training | lm loss:" in second.stdout
    assert list(board.glob("events.out.tfevents.*"))


def test_interleaved_on_two_processes(torchrun: Torchrun) -> None:
    done = torchrun(
        "-m pp_train",
        2,
        *TINY,
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--train-iters",
        "5",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pipeline 2 x 2 virtual stages, data parallel 1, interleaved 1F1B" in done.stdout
    assert 5 in _losses(done.stdout)


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        (
            [
                "--num-layers",
                "6",
                "--pipeline-model-parallel-size",
                "4",
                "--pipeline-model-parallel-layout",
                "Ett|tt|tt|tL",
            ],
            4,
            "--pipeline-model-parallel-layout: layout 'Ett|tt|tt|tL': the layout holds 7",
        ),
        (
            ["--rampup-batch-size", "4", "2", "100", "--micro-batch-size", "4"],
            1,
            "passes through global batch sizes [6, 10, 14, 18, 22, 26, 30]",
        ),
    ],
)
def test_bad_flags_get_an_argparse_error(flags: list[str], world: int, message: str) -> None:
    """``python -m pp_train`` exits 2 with its usage and the error.

    Two cases through a real interpreter; test_reliability_flags checks every flag error's
    exact line in-process (a fresh interpreter per case would cost seconds of imports each).
    """
    env = {**os.environ, "WORLD_SIZE": str(world)}
    done = subprocess.run(
        [sys.executable, "-m", "pp_train", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert "usage: pp-train" in done.stderr


@pytest.mark.reliability
def test_a_corrupt_checkpoint_is_refused_with_one_clear_line(
    torchrun: Torchrun, tmp_path: Path
) -> None:
    save = tmp_path / "ckpt"
    flags = [*TINY, "--pipeline-model-parallel-size", "2", "--train-iters", "3"]
    assert torchrun("-m pp_train", 2, *flags, "--save", str(save)).returncode == 0
    target = save / "iter_0000003" / "mp_rank_00_001" / "model_optim_rng.pt"
    target.write_bytes(b"not a checkpoint")
    done = torchrun("-m pp_train", 2, *flags, "--load", str(save))
    assert done.returncode != 0
    assert "pp-train: error:" in done.stderr
    assert "mp_rank_00_001" in done.stderr


@pytest.mark.reliability
@pytest.mark.parametrize(
    "flags",
    [
        [
            "--num-layers",
            "3",
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-model-parallel-layout",
            "Ett|ttL",
        ],
        ["--distributed-timeout-minutes", "0"],
    ],
    ids=["layers", "timeout"],
)
def test_a_flag_error_under_torchrun_is_one_line_whichever_rank_exits_first(
    torchrun: Torchrun, flags: list[str]
) -> None:
    done = torchrun("-m pp_train", 4, *flags)
    errors = [
        line for line in (done.stdout + done.stderr).splitlines() if "pp-train: error:" in line
    ]
    assert len(errors) == 1, done.stdout + done.stderr
    assert done.returncode != 0
