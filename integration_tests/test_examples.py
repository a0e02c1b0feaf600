"""The examples in docs/examples run under torchrun and check themselves."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The `torchrun` fixture from conftest.py: (script, ranks, *args) -> finished process.
Torchrun = Callable[..., subprocess.CompletedProcess[str]]

EXAMPLES = ROOT / "docs" / "examples"


@pytest.mark.parametrize(
    "sizes",
    [
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-split-rank", "2"],
    ],
    ids=["tp2-pp2", "pp4-split2"],
)
def test_parallel_state_tour_under_torchrun(torchrun: Torchrun, sizes: list[str]) -> None:
    done = torchrun(EXAMPLES / "parallel_state_tour.py", 4, *sizes, "--timeout-seconds", "30")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every group reached exactly its ranks" in done.stdout
    assert "layout of 4 ranks" in done.stdout


def test_parallel_state_tour_refuses_a_world_that_does_not_fit(torchrun: Torchrun) -> None:
    done = torchrun(EXAMPLES / "parallel_state_tour.py", 2, "--pipeline-model-parallel-size", "4")
    assert done.returncode != 0
    assert "world size 2 is not divisible by tensor (1) x pipeline (4)" in done.stdout + done.stderr


@pytest.mark.parametrize("ranks", [2, 4])
def test_p2p_pipeline_example_matches_a_single_process(torchrun: Torchrun, ranks: int) -> None:
    done = torchrun(EXAMPLES / "p2p_pipeline.py", ranks)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{ranks} stages: gradients equal the single-process run: True" in done.stdout
