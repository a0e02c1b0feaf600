"""docs/examples/own_trainer.py trains under torchrun and equals the whole model on one process."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The `torchrun` fixture from conftest.py: (script, ranks, *args) -> finished process.
Torchrun = Callable[..., subprocess.CompletedProcess[str]]

SCRIPT = ROOT / "docs" / "examples" / "own_trainer.py"
ITERS = 3
STEP = re.compile(r"^step (\d+) \| loss (\d+\.\d{6})$", re.MULTILINE)
MATCH = re.compile(r"matches the single-process run: max relative difference (\S+)")


@pytest.mark.parametrize(
    ("ranks", "sizes", "layout"),
    [
        (2, ["--pipeline-model-parallel-size", "2"], "pp 2 x dp 1, 1 chunk(s) per rank, 1f1b"),
        (4, ["--pipeline-model-parallel-size", "2"], "pp 2 x dp 2, 1 chunk(s) per rank, 1f1b"),
        (
            4,
            ["--pipeline-model-parallel-size", "2", "--virtual-stages", "2"],
            "pp 2 x dp 2, 2 chunk(s) per rank, interleaved_1f1b",
        ),
    ],
    ids=["pp2", "pp2-dp2", "pp2-vp2-dp2"],
)
def test_the_pipelined_run_matches_one_process(
    torchrun: Torchrun, ranks: int, sizes: list[str], layout: str
) -> None:
    done = torchrun(SCRIPT, ranks, *sizes, "--iters", str(ITERS), "--check", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert layout in done.stdout
    steps = STEP.findall(done.stdout)
    # Only the last rank prints, one line per step.
    assert [int(step) for step, _ in steps] == list(range(1, ITERS + 1))
    losses = [float(loss) for _, loss in steps]
    assert all(0 < loss < 10 for loss in losses)
    found = MATCH.search(done.stdout)
    assert found is not None, done.stdout
    assert float(found.group(1)) <= 1e-5


@pytest.mark.parametrize(
    ("ranks", "args", "message"),
    [
        (
            2,
            ["--pipeline-model-parallel-size", "3"],
            "pipeline_model_parallel_size 3 does not divide the world size 2; choose one of [1, 2]",
        ),
        (
            2,
            [
                "--pipeline-model-parallel-size",
                "2",
                "--virtual-stages",
                "2",
                "--num-microbatches",
                "3",
            ],
            "interleaved_1f1b cannot run 3 microbatches",
        ),
    ],
    ids=["world-not-divisible", "interleaved-microbatches"],
)
def test_bad_arguments_are_refused_before_training(
    torchrun: Torchrun, ranks: int, args: list[str], message: str
) -> None:
    done = torchrun(SCRIPT, ranks, *args, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr
    assert "step 1" not in done.stdout
