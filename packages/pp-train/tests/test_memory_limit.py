"""``--memory-limit-gb``: refused when it is no budget, fitted when it is one, one error when
nothing fits."""

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
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "2", "--log-interval", "2", "--eval-iters", "0",
    "--pipeline-model-parallel-size", "2",
]  # fmt: skip

PEAK = re.compile(r"\[Rank (\d+)\] .*max allocated: ([\d.]+) \|.*total: ([\d.]+)")


@pytest.mark.reliability
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_limit_that_is_no_budget_is_refused(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main([*FLAGS, "--memory-limit-gb", value])
    assert exit_info.value.code == 2
    assert "--memory-limit-gb must be a positive finite number" in capsys.readouterr().err
    assert not dist.is_initialized()


@pytest.mark.reliability
def test_a_limit_that_is_not_a_number_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        main([*FLAGS, "--memory-limit-gb", "lots"])
    assert "--memory-limit-gb: invalid float value: 'lots'" in capsys.readouterr().err


def _launch(argv: list[str]) -> tuple[int, str, str]:
    """The command on this rank: its exit status, what it printed and its errors."""
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def test_a_tight_limit_is_met_by_recomputing() -> None:
    """6 MB leaves no room for activations kept whole: 1F1B's rank 0 needs about 7.4 MB."""
    bigger = [
        "--num-layers", "8", "--hidden-size", "64", "--seq-length", "64",
        "--global-batch-size", "16",
    ]  # fmt: skip
    argv = [*FLAGS, *bigger, "--pipeline-schedule", "auto", "--memory-limit-gb", str(6 / 1024)]
    ranks = run_distributed(_launch, 2, argv, timeout=120)
    printed = "".join(out for _, out, _ in ranks)
    assert [status for status, _, _ in ranks] == [0, 0], ranks
    assert "chosen by simulation within --memory-limit-gb" in printed
    chosen = next(line for line in printed.splitlines() if line.startswith("* "))
    assert "recompute" in chosen
    assert "no recompute" not in chosen
    assert "fits" in chosen
    peaks = {int(m[1]): (float(m[2]), float(m[3])) for m in PEAK.finditer(printed)}
    assert sorted(peaks) == [0, 1]
    for measured, predicted in peaks.values():
        assert predicted <= 6.0
        assert measured <= 6.0 * 1.05


@pytest.mark.reliability
def test_nothing_fitting_is_one_error_before_training() -> None:
    argv = [*FLAGS, "--pipeline-schedule", "auto", "--memory-limit-gb", "0.0001"]
    ranks = run_distributed(_launch, 2, argv, timeout=120)
    assert [status for status, _, _ in ranks] == [1, 1]
    error = ranks[0][2]
    assert "pp-train: error: --memory-limit-gb 0.0001: no schedule fits" in error
    assert re.search(r"the smallest peak is [\d.]+ [KM]B on rank \d", error)
    assert "alone need" in error  # the static bytes alone exceed 0.1 MB
    assert "iteration" not in "".join(out for _, out, _ in ranks)
    assert ranks[1][2] == ""  # rank 0 says it for the job
