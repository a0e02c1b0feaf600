"""Timers written to TensorBoard, the args as text, and evaluation's progress and time lines.

`Timers.write` is checked on two ranks with a recording writer; the command's runs (two ranks,
the harness's process group) are read back from their event files.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_testing import run_distributed
from pp_train.app import build_parser, validate_args
from pp_train.app.command import run
from pp_train.timers import Timers

# --- Timers.write -----------------------------------------------------------------------------


class _Writer:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int, /) -> None:
        self.scalars.append((tag, value, step))


def _write_on_two_ranks() -> dict[str, Any]:
    rank = dist.get_rank()
    timers = Timers()
    timers("step").start()
    time.sleep(0.2 if rank == 1 else 0.0)
    timers("step").stop()
    if rank == 0:
        timers("only-on-rank-0").start()
        timers("only-on-rank-0").stop()
    writer = _Writer() if rank == 0 else None
    names = ["step", "only-on-rank-0", "on-no-rank"]
    written = timers.write(names, writer, 7, normalizer=2.0, reset=False)
    # Not reset when asked not to: a read after still sees the interval.
    line = timers.log_string(["step"], group=dist.group.WORLD, reset=False)
    again = timers.write(names, None, 8, reset=True)
    return {
        "written": written,
        "scalars": None if writer is None else writer.scalars,
        "line": line,
        "after_reset": again,
        "emptied": timers.write(["step"], None, 9),
    }


def test_write_gives_the_maximum_over_the_ranks_as_name_time_scalars() -> None:
    first, second = run_distributed(_write_on_two_ranks, 2, timeout=60)
    assert first["written"] == second["written"]
    assert set(first["written"]) == {"step", "only-on-rank-0"}  # no rank has "on-no-rank"
    step = first["written"]["step"]
    assert step >= 0.2 / 2.0  # rank 1's time, over the normalizer
    assert [(tag, value, it) for tag, value, it in first["scalars"]] == [
        ("step-time", step, 7),
        ("only-on-rank-0-time", first["written"]["only-on-rank-0"], 7),
    ]
    assert second["scalars"] is None
    assert float(first["line"].removeprefix("step: ")) >= 200.0
    assert first["after_reset"]["step"] >= 0.2  # normalizer 1
    assert first["emptied"] == {"step": 0.0}


@pytest.mark.reliability
def test_write_refuses_a_normalizer_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="normalizer must be a positive finite number"):
        Timers().write(["step"], None, 1, normalizer=0.0)


# --- the command on two ranks -----------------------------------------------------------------

TINY_PP2 = [
    "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--log-interval", "1", "--train-iters", "4", "--pipeline-model-parallel-size", "2",
    "--eval-interval", "2", "--eval-iters", "2",
]  # fmt: skip

LEVEL_ONE = {
    "forward-backward-time",
    "grads-all-reduce-time",
    "optimizer-time",
    "optimizer-copy-to-main-grad-time",
    "optimizer-clip-main-grad-time",
    "optimizer-count-zeros-time",
    "optimizer-inner-step-time",
    "optimizer-copy-main-to-model-params-time",
}


def _command(argv: list[str]) -> str:
    parser = build_parser()
    args = validate_args(parser, parser.parse_args(argv), dist.get_world_size())
    args.device = torch.device("cpu")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert run(args) == "train_iters"
    return printed.getvalue()


def _train(tmp_path: Path, level: int) -> tuple[str, Any]:
    pytest.importorskip("tensorboard")
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    board = tmp_path / f"level-{level}"
    argv = [*TINY_PP2, "--tensorboard-dir", str(board), "--timing-log-level", str(level)]
    stdout = "".join(run_distributed(_command, 2, argv, timeout=180))
    accumulator = event_accumulator.EventAccumulator(str(board))
    accumulator.Reload()
    return stdout, accumulator


def _time_tags(accumulator: Any) -> set[str]:
    return {tag for tag in accumulator.Tags()["scalars"] if tag.endswith("-time")}


def test_level_one_writes_the_phases_and_the_optimizers_timers(tmp_path: Path) -> None:
    stdout, accumulator = _train(tmp_path, 1)
    # iteration-time was there before; fp32 has no loss scale to unscale; level 2 is not on.
    assert _time_tags(accumulator) == LEVEL_ONE | {"iteration-time"}
    for tag in LEVEL_ONE:
        events = accumulator.Scalars(tag)
        assert [event.step for event in events] == [1, 2, 3, 4]
        assert all(event.value >= 0.0 for event in events)
    # The log line shows the optimizer's phases too.
    assert re.search(r"optimizer-inner-step: \([\d.]+, [\d.]+\)", stdout)
    # Every setting once, as text, on the rank that writes.
    texts = set(accumulator.Tags()["tensors"])
    assert {"train_iters/text_summary", "timing_log_level/text_summary"} <= texts
    assert "pipeline_model_parallel_size/text_summary" in texts
    # Megatron's loop evaluates quietly, with its time; the final validation is verbose.
    assert len(re.findall(r"time across ranks \(ms\) \| evaluate: \(", stdout)) == 2
    progress = re.findall(r"^Evaluating iter (\d+)/(\d+)$", stdout, flags=re.MULTILINE)
    assert progress == [("1", "2"), ("2", "2")]


def test_level_two_adds_the_schedules_timers(tmp_path: Path) -> None:
    _, accumulator = _train(tmp_path, 2)
    tags = _time_tags(accumulator)
    assert LEVEL_ONE | {"forward-compute-time", "backward-compute-time"} <= tags
