"""``--memory-limit-gb``: refused when it is no budget, fitted when it is one, one error when
nothing fits."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import re

import pytest
import torch.distributed as dist

from pp_testing import run_distributed
from pp_train.app import build_parser, main, validate_args
from pp_train.app.auto_schedule import model_figures
from pp_train.app.command import _gpt_config
from pp_train.run_plan import Measurements, decide_run

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


GIB = 2**30
BIGGER = [
    "--num-layers", "8", "--hidden-size", "64", "--seq-length", "64",
    "--global-batch-size", "16", "--pipeline-schedule", "auto",
]  # fmt: skip


@functools.cache
def _candidate_peaks() -> dict[str, int]:
    """Every candidate's predicted peak (its fullest rank, bytes), as the command plans them.

    The planner in this process, with the command's warm-up figures: bytes do not depend on
    timing, so the ranks of a run predict the same ones.
    """
    parser = build_parser()
    args = validate_args(parser, parser.parse_args([*FLAGS, *BIGGER, "--memory-limit-gb", "1"]), 2)
    config = args.config
    gpt = _gpt_config(config)
    figures = model_figures(dataclasses.replace(gpt, recompute=None), micro_batch_size=2,
                            seed=config.training.seed, rounds=1)  # fmt: skip
    choice = decide_run(config, args.layout, Measurements(figures=figures)).choice
    assert choice is not None
    return {f"{c.name} ({c.option})": max(c.peak_bytes) for c in choice.candidates if c.peak_bytes}


def _limits() -> list[tuple[str, float]]:
    """Limits 0.3% above and below the peaks of a few candidates far apart."""
    peaks = sorted(_candidate_peaks().items(), key=lambda item: item[1])
    picked = [peaks[0], peaks[len(peaks) // 3], peaks[2 * len(peaks) // 3]]
    return [
        (f"{side} {name}", peak * factor)
        for name, peak in picked
        for side, factor in (("above", 1.003), ("below", 0.997))
    ]


@pytest.mark.parametrize("which", range(6))
def test_the_plan_chosen_under_a_limit_allocates_no_more_than_the_limit(which: int) -> None:
    """A limit just above or just below a candidate's predicted peak: whatever the planner
    picks, every rank's measured max allocated (every byte the run allocates) stays under it;
    below the smallest peak nothing fits and the run stops before training."""
    name, limit = _limits()[which]
    argv = [*FLAGS, *BIGGER, "--memory-limit-gb", repr(limit / GIB)]
    ranks = run_distributed(_launch, 2, argv, timeout=180)
    statuses = [status for status, _, _ in ranks]
    if limit < min(_candidate_peaks().values()):
        assert statuses == [1, 1], (name, ranks)
        assert "no schedule fits" in ranks[0][2]
        return
    assert statuses == [0, 0], (name, ranks)
    printed = "".join(out for _, out, _ in ranks)
    chosen = next(line for line in printed.splitlines() if line.startswith("* "))
    peaks = {int(m[1]): (float(m[2]), float(m[3])) for m in PEAK.finditer(printed)}
    assert sorted(peaks) == [0, 1]
    for measured, predicted in peaks.values():
        assert predicted * 2**20 <= limit, (name, chosen)
        assert measured * 2**20 <= limit, (name, chosen, measured, limit / 2**20)


TP2 = [
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
    "--train-iters", "3", "--log-interval", "3", "--eval-iters", "0",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--pipeline-schedule", "1f1b", "--recompute-granularity", "full",
    "--recompute-method", "uniform", "--recompute-num-layers", "1",
]  # fmt: skip
"""tp 2 x pp 2, 1F1B and recomputation fixed: a limit is checked, nothing else is chosen.
The byte model of parts measured whole predicted rank 0's peak at 3.11 MB, 1.10 times what
it allocates (2.82 MB)."""


@pytest.mark.parametrize(("limit_mb", "fits"), [(3.0, True), (2.7, False)])
def test_a_tensor_parallel_layout_fits_the_limit_its_true_peak_fits(
    limit_mb: float, fits: bool
) -> None:
    """Rank 0 allocates 2.82 MB at most (predicted 2.82 MB): a 3.0 MB limit, which the byte
    model of whole parts refused, passes and the run stays under it; 2.7 MB is below what the
    run needs, and the run is refused before it starts."""
    argv = [*TP2, "--memory-limit-gb", repr(limit_mb / 1024)]
    ranks = run_distributed(_launch, 4, argv, timeout=180)
    statuses = [status for status, _, _ in ranks]
    if not fits:
        assert statuses == [1] * 4, ranks
        assert "pp-train: error: --memory-limit-gb" in ranks[0][2], ranks[0][2]
        assert "no schedule fits" in ranks[0][2], ranks[0][2]
        return
    assert statuses == [0] * 4, ranks
    printed = "".join(out for _, out, _ in ranks)
    peaks = {int(m[1]): (float(m[2]), float(m[3])) for m in PEAK.finditer(printed)}
    assert sorted(peaks) == [0, 1, 2, 3]
    for measured, predicted in peaks.values():
        assert predicted <= limit_mb
        assert measured <= limit_mb
