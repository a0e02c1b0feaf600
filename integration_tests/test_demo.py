"""The main job's example runs under torchrun and its probe passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TOUR = Path(__file__).resolve().parent.parent / "docs" / "examples" / "parallel_state_tour.py"


@pytest.mark.parametrize(
    "sizes",
    [
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-split-rank", "2"],
    ],
    ids=["tp2-pp2", "pp4-split2"],
)
def test_parallel_state_tour_under_torchrun(sizes: list[str]) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, str(TOUR), *sizes, "--timeout-seconds", "30"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every group reached exactly its ranks" in done.stdout
    assert "layout of 4 ranks" in done.stdout


def test_parallel_state_tour_refuses_a_world_that_does_not_fit() -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, str(TOUR), "--pipeline-model-parallel-size", "4", "--timeout-seconds", "30"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert done.returncode != 0
    assert "world size 2 is not divisible by tensor (1) x pipeline (4)" in done.stdout + done.stderr
