"""The byte model's peak per rank against the probe's, over whole training steps.

Each rank runs the command's `main` for two iterations, the memory line printed after the
first logged one (the second: the optimizer state exists by then). The prediction is made
from one microbatch of each part of the model alone (the warm-up) and the plan, not from the
run itself, so the comparison is not circular: a model that drifts from what training holds
fails the 5% bound.
"""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest
import torch.distributed as dist

from pp_testing import run_distributed
from pp_train.app import main

FLAGS = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
    "--train-iters", "2", "--log-interval", "2", "--eval-iters", "0",
    "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
]  # fmt: skip

LINE = re.compile(
    r"\[Rank (\d+)\] \(after 2 iterations\) memory \(MB\) \| .*max allocated: ([\d.]+) \|"
    r".*predicted \(MB\): weight and optimizer: [\d.]+, activations: [\d.]+, total: ([\d.]+)"
)


def _launch(argv: list[str]) -> str:
    """The command's `main` on this rank; what it printed."""
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return printed.getvalue()


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zb_h1", "zbv"])
def test_the_predicted_peak_is_within_5_percent_of_the_measured_one(pp: int, schedule: str) -> None:
    chunks = ["--num-layers-per-virtual-pipeline-stage", str(8 // (2 * pp))]
    argv = [
        *FLAGS, "--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule,
        *(chunks if schedule in ("interleaved_1f1b", "zbv") else []),
    ]  # fmt: skip
    printed = run_distributed(_launch, pp, argv, timeout=180)
    found = {int(m[1]): (float(m[2]), float(m[3])) for m in LINE.finditer("".join(printed))}
    assert sorted(found) == list(range(pp)), printed  # every rank of the one replica prints
    for rank, (measured, predicted) in found.items():
        assert predicted / measured == pytest.approx(1.0, abs=0.05), (rank, measured, predicted)


def test_a_bf16_run_is_predicted_in_its_own_dtype() -> None:
    """bf16 halves most activations (and fp32 main copies join the optimizer state)."""
    argv = [*FLAGS, "--pipeline-model-parallel-size", "2", "--bf16"]
    printed = run_distributed(_launch, 2, argv, timeout=180)
    found = {int(m[1]): (float(m[2]), float(m[3])) for m in LINE.finditer("".join(printed))}
    assert sorted(found) == [0, 1], printed
    for rank, (measured, predicted) in found.items():
        assert predicted / measured == pytest.approx(1.0, abs=0.05), (rank, measured, predicted)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_dp_2_run_is_predicted_with_and_without_the_distributed_optimizer(sharded: bool) -> None:
    """With --use-distributed-optimizer each rank holds half the optimizer state at dp 2."""
    argv = [*FLAGS, "--pipeline-model-parallel-size", "2"]
    argv += ["--use-distributed-optimizer"] if sharded else []
    printed = run_distributed(_launch, 4, argv, timeout=180)
    found = {int(m[1]): (float(m[2]), float(m[3])) for m in LINE.finditer("".join(printed))}
    assert found, printed
    for rank, (measured, predicted) in found.items():
        assert predicted / measured == pytest.approx(1.0, abs=0.05), (rank, measured, predicted)
