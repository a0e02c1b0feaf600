"""The byte model's peak per rank against every byte the real run allocates.

Each rank runs the command's `main` for three iterations, the memory line printed after the
last. Its max allocated is pp-schedules' probe: every storage the rank allocated over those
iterations, counted at the allocator level (the counter itself is checked against
torch.profiler in pp-schedules' tests). The prediction is made from one microbatch of each
part of the model alone (the warm-up) and the plan, not from the run itself, so the comparison
is not circular: a model that leaves out what training holds fails the 5% bound (pp-train
0.12's, which counted saved tensors only, was 0.46-1.0 times the measured peak). The goal:
within 5% on every rank, at pp 2 and 4, for every schedule, with and without recomputation, in bf16, and with data
parallelism with and without the distributed optimizer.
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

GPT = [
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--train-iters", "3",
    "--log-interval", "3", "--eval-iters", "0",
]  # fmt: skip
LINE = re.compile(
    r"\[Rank (\d+)\] \(after \d+ iterations\) memory \(MB\) \| allocated: \S+ \| "
    r"max allocated: ([\d.e+-]+) \|.* \| predicted \(MB\): weight and optimizer: ([\d.]+), "
    r"transfer buffers: ([\d.]+), activations: ([\d.]+), total: ([\d.]+)"
)
HOST = re.compile(r"\[Rank (\d+)\] host memory \(MB\) \| data: ([\d.]+) \| apart from allocated")


def _launch(argv: list[str]) -> tuple[int, str, str]:
    """The command on this rank: its exit status, what it printed and its errors."""
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def peaks(ranks: int, flags: list[str]) -> dict[int, tuple[float, float]]:
    """Each printing rank's (measured max allocated, predicted total) in MB."""
    results = run_distributed(_launch, ranks, [*GPT, *flags], timeout=240)
    assert [status for status, _, _ in results] == [0] * ranks, results
    printed = "".join(out for _, out, _ in results)
    found = {int(m[1]): (float(m[2]), float(m[6])) for m in LINE.finditer(printed)}
    hosts = {int(m[1]) for m in HOST.finditer(printed)}
    assert hosts == set(found), "a host memory line beside each memory line"
    return found


PP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"]
PP4 = ["--pipeline-model-parallel-size", "4", "--global-batch-size", "16"]
DP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "32"]
VP2 = ["--num-layers-per-virtual-pipeline-stage", "2"]
VP1 = ["--num-layers-per-virtual-pipeline-stage", "1"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]  # fmt: skip
SELECTIVE = ["--recompute-granularity", "selective", "--attention-dropout", "0.1"]
CASES = {
    "pp2-1f1b": (2, [*PP2, "--pipeline-schedule", "1f1b"]),
    "pp2-interleaved": (2, [*PP2, "--pipeline-schedule", "interleaved_1f1b", *VP2]),
    "pp2-zb_h1": (2, [*PP2, "--pipeline-schedule", "zb_h1"]),
    "pp2-zbv": (2, [*PP2, "--pipeline-schedule", "zbv", *VP2]),
    "pp2-1f1b-full": (2, [*PP2, "--pipeline-schedule", "1f1b", *FULL]),
    "pp2-1f1b-selective": (2, [*PP2, "--pipeline-schedule", "1f1b", *SELECTIVE]),
    "pp2-zb_h1-full": (2, [*PP2, "--pipeline-schedule", "zb_h1", *FULL]),
    "pp4-1f1b": (4, [*PP4, "--pipeline-schedule", "1f1b"]),
    "pp4-interleaved": (4, [*PP4, "--pipeline-schedule", "interleaved_1f1b", *VP1]),
    "pp4-zb_h1": (4, [*PP4, "--pipeline-schedule", "zb_h1"]),
    "pp4-zbv": (4, [*PP4, "--pipeline-schedule", "zbv", *VP1]),
    "pp4-1f1b-full": (4, [*PP4, "--pipeline-schedule", "1f1b", *FULL]),
    "pp4-zbv-selective": (4, [*PP4, "--pipeline-schedule", "zbv", *VP1, *SELECTIVE]),
    "pp2-bf16": (2, [*PP2, "--bf16"]),
    "dp2xpp2": (4, DP2),
    "dp2xpp2-distributed-optimizer": (4, [*DP2, "--use-distributed-optimizer"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_predicted_peak_is_within_five_percent_of_what_the_run_allocates(case: str) -> None:
    ranks, flags = CASES[case]
    found = peaks(ranks, flags)
    pipeline = int(flags[flags.index("--pipeline-model-parallel-size") + 1])
    assert len(found) == pipeline, "every stage of the first replica reports"
    for rank, (measured, predicted) in found.items():
        assert predicted == pytest.approx(measured, rel=0.05), (case, rank, measured, predicted)
