"""``torchrun -m pp_train`` with tensor (and sequence) parallelism, as a user starts it."""

from __future__ import annotations

import math
import re
import subprocess
from collections.abc import Callable

# The `torchrun` fixture from conftest.py: (script or "-m module", ranks, *args) -> process.
Torchrun = Callable[..., subprocess.CompletedProcess[str]]

TINY = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--eval-iters", "1", "--log-interval", "1", "--lr-warmup-iters", "1", "--train-iters", "3",
]  # fmt: skip


def _losses(stdout: str) -> list[float]:
    found = re.findall(r"iteration\s+\d+/\s*\d+ \|.*? lm loss: (\S+) \|", stdout)
    return [float(loss) for loss in found]


def test_tp2_pp2_with_sequence_parallelism_under_torchrun(torchrun: Torchrun) -> None:
    done = torchrun(
        "-m pp_train", 4, *TINY, "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--sequence-parallel",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("> padded vocab (size: 256) with 0 dummy tokens (new size: 256)") == 1
    assert "tensor parallel 2 with sequence parallelism, pipeline 2, data parallel 1, 1F1B" in (
        done.stdout
    )
    losses = _losses(done.stdout)
    assert len(losses) == 3
    assert all(math.isfinite(loss) for loss in losses)
    assert "validation at the end of training | lm loss:" in done.stdout


def test_sequence_parallel_without_tensor_parallelism_is_turned_off_once(
    torchrun: Torchrun,
) -> None:
    done = torchrun("-m pp_train", 2, *TINY, "--pipeline-model-parallel-size", "2",
                    "--sequence-parallel")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    warning = (
        "pp-train: warning: --sequence-parallel is turned off: it needs "
        "--tensor-model-parallel-size 2 or more, got 1"
    )
    assert done.stdout.count(warning) == 1
    assert "pipeline 2, data parallel 1, 1F1B" in done.stdout
    assert len(_losses(done.stdout)) == 3
