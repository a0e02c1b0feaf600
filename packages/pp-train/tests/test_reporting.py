"""Timers, the Megatron-style log line, TensorBoard scalars and the memory line."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import pp_comm
from pp_testing import run_distributed
from pp_train import reporting
from pp_train import timers as timers_module
from pp_train.reporting import TrainingLogger, format_log_line
from pp_train.timers import Timer, Timers

# --- Timers -----------------------------------------------------------------------------------


class _FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _FakeClock:
    fake = _FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


def test_the_timer_names_are_importable_from_reporting_too() -> None:
    for name in timers_module.__all__:
        assert getattr(reporting, name) is getattr(timers_module, name), name
        assert name in reporting.__all__, name


def test_timers_fit_the_pp_comm_protocol() -> None:
    timers: pp_comm.Timers = Timers()
    timer: pp_comm.Timer = timers("forward-recv")
    timer.start()
    timer.stop()
    assert timer is timers("forward-recv")


def test_same_name_gives_the_same_timer() -> None:
    timers = Timers()
    assert timers("a") is timers("a")
    assert timers("a") is not timers("b")
    assert timers.names() == ["a", "b"]
    assert "a" in timers
    assert "c" not in timers


def test_starting_a_running_timer_names_it() -> None:
    timer = Timers()("forward-backward")
    timer.start()
    with pytest.raises(RuntimeError, match="timer 'forward-backward' is already running"):
        timer.start()


def test_stopping_a_stopped_timer_names_it() -> None:
    timer = Timers()("optimizer")
    with pytest.raises(RuntimeError, match="timer 'optimizer' is not running"):
        timer.stop()
    timer.start()
    timer.stop()
    with pytest.raises(RuntimeError, match="timer 'optimizer' is not running"):
        timer.stop()


def test_elapsed_accumulates_and_resets(clock: _FakeClock) -> None:
    timer = Timer("t")
    timer.start()
    clock.now += 2.0
    timer.stop()
    clock.now += 50.0  # not timed
    timer.start()
    clock.now += 0.5
    timer.stop()
    assert timer.elapsed(reset=False) == pytest.approx(2.5)
    assert timer.elapsed() == pytest.approx(2.5)
    assert timer.elapsed() == 0.0


def test_elapsed_of_a_running_timer_includes_now_and_keeps_running(clock: _FakeClock) -> None:
    timer = Timer("t")
    timer.start()
    clock.now += 1.0
    assert timer.elapsed(reset=True) == pytest.approx(1.0)
    assert timer.running
    clock.now += 3.0
    timer.stop()
    assert timer.elapsed() == pytest.approx(3.0)


def test_reset_stops_and_forgets(clock: _FakeClock) -> None:
    timer = Timer("t")
    timer.start()
    clock.now += 1.0
    timer.reset()
    assert not timer.running
    assert timer.elapsed() == 0.0


def test_log_string_in_ms_with_normalizer_and_unknown_names_left_out(clock: _FakeClock) -> None:
    timers = Timers()
    timers("forward-backward").start()
    clock.now += 0.1234
    timers("forward-backward").stop()
    timers("optimizer").start()
    clock.now += 0.012
    timers("optimizer").stop()
    line = timers.log_string(["forward-backward", "never-made", "optimizer"], normalizer=10.0)
    assert line == "forward-backward: 12.34 | optimizer: 1.20"
    # Megatron's log resets what it reports.
    assert timers.log_string(["optimizer"]) == "optimizer: 0.00"


def test_log_string_without_reset_keeps_the_time(clock: _FakeClock) -> None:
    timers = Timers()
    timers("x").start()
    clock.now += 0.002
    timers("x").stop()
    assert timers.log_string(["x"], reset=False) == "x: 2.00"
    assert timers.log_string(["x"]) == "x: 2.00"
    assert timers.log_string(["x"]) == "x: 0.00"
    assert timers.log_string([]) == ""


@pytest.mark.parametrize("normalizer", [0.0, -1.0, math.inf, math.nan])
def test_log_string_rejects_bad_normalizer(normalizer: float) -> None:
    with pytest.raises(ValueError, match="normalizer must be a positive finite number"):
        Timers().log_string(["x"], normalizer=normalizer)


def _max_across_ranks() -> tuple[float, float, str, str]:
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    timers = Timers(barrier_group=group)
    timers("step").start(barrier=True)
    time.sleep(0.25 if rank == 1 else 0.0)
    timers("step").stop()
    if rank == 0:
        timers("only-on-rank-0").start()
        timers("only-on-rank-0").stop()
    local = timers("step").elapsed(reset=False)
    only_rank_0 = timers("only-on-rank-0").elapsed(reset=False) if rank == 0 else -1.0
    local_line = timers.log_string(["step"], reset=False)
    line = timers.log_string(["step", "only-on-rank-0", "nowhere"], group=group)
    return local, only_rank_0, local_line, line


def test_log_string_takes_the_max_across_ranks() -> None:
    (local0, only0, local_line0, line0), (local1, _, local_line1, line1) = run_distributed(
        _max_across_ranks, 2, timeout=60
    )
    assert local1 > local0  # rank 1 slept, rank 0 did not
    expected = f"step: {local1 * 1000.0:.2f} | only-on-rank-0: {only0 * 1000.0:.2f}"
    assert line0 == line1 == expected
    assert local_line0 == f"step: {local0 * 1000.0:.2f}"
    assert local_line1 == f"step: {local1 * 1000.0:.2f}"


def _options_across_ranks() -> dict[str, str]:
    rank = dist.get_rank()
    lines = {}
    for option in ("max", "minmax", "all"):
        timers = Timers(log_option=option)
        timer = timers("step")
        timer.start()
        time.sleep(0.2 if rank == 1 else 0.0)
        timer.stop()
        if rank == 0:
            timers("only-on-rank-0").start()
            timers("only-on-rank-0").stop()
        lines[option] = timers.log_string(
            ["step", "only-on-rank-0"], group=dist.group.WORLD, header=True
        )
    return lines


def test_log_options_show_the_max_the_min_and_max_or_every_rank() -> None:
    lines = run_distributed(_options_across_ranks, 2, timeout=60)
    assert lines[0] == lines[1]
    found = lines[0]
    maximum = re.fullmatch(
        r"max time across ranks \(ms\) \| step: ([\d.]+) \| only-on-rank-0: [\d.]+",
        found["max"],
    )
    assert maximum
    assert float(maximum.group(1)) >= 200.0
    low_high = re.fullmatch(
        r"\(min, max\) time across ranks \(ms\) \| step: \(([\d.]+), ([\d.]+)\) \| "
        r"only-on-rank-0: \(([\d.]+), \3\)",
        found["minmax"],
    )
    assert low_high
    assert float(low_high.group(1)) < 200.0 <= float(low_high.group(2))
    every = re.fullmatch(
        r"times across ranks \(ms\) \| step: \[([\d.]+), ([\d.]+)\] \| "
        r"only-on-rank-0: \[[\d.]+, -\]",
        found["all"],
    )
    assert every
    assert float(every.group(1)) < 200.0 <= float(every.group(2))


def test_timers_above_the_log_level_measure_nothing() -> None:
    timers = Timers(log_level=1)
    assert timers.log_level == 1
    fine = timers("forward-compute")  # no level: the finest, 2
    fine.start()
    fine.stop()
    assert "forward-compute" not in timers
    with pytest.raises(RuntimeError, match="above the timing log level"):
        fine.elapsed()
    phase = timers("optimizer", log_level=1)
    assert phase is timers("optimizer") is timers("optimizer", log_level=1)
    assert timers.names() == ["optimizer"]
    with pytest.raises(ValueError, match="made with log level 1, asked for with 0"):
        timers("optimizer", log_level=0)
    assert timers.log_string(["forward-compute", "optimizer"]) == "optimizer: 0.00"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"log_level": 3}, "log_level must be 0, 1 or 2"),
        ({"log_level": -1}, "log_level must be 0, 1 or 2"),
        ({"log_option": "mean"}, "log_option must be one of max, minmax, all, got 'mean'"),
    ],
)
def test_bad_timing_settings_name_the_choices(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Timers(**kwargs)


def test_a_timer_waits_for_the_device_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[str] = []
    monkeypatch.setattr(timers_module, "_synchronize_cuda", lambda: waits.append("sync"))
    timer = Timers()("forward-backward", log_level=1)
    timer.start()
    timer.stop()
    assert waits == []
    timer.start(barrier=True)
    timer.stop(barrier=True)
    assert waits == ["sync", "sync"]


# --- the log line -----------------------------------------------------------------------------


def test_format_log_line_matches_megatrons_layout() -> None:
    line = format_log_line(
        iteration=40,
        train_iters=100,
        consumed_samples=640,
        elapsed_per_iteration=0.0123,
        learning_rate=2.5e-4,
        global_batch_size=16,
        loss_averages={"lm loss": 1.234567},
        loss_scale=65536.0,
        grad_norm=0.123,
        num_zeros_in_grad=None,
        skipped_iterations=0,
        nan_iterations=0,
    )
    assert line == (
        " iteration       40/     100 | consumed samples:          640 |"
        " elapsed time per iteration (ms): 12.3 | learning rate: 2.500000E-04 |"
        " global batch size:    16 | lm loss: 1.234567E+00 | loss scale: 65536.0 |"
        " grad norm: 0.123 | number of skipped iterations:   0 |"
        " number of nan iterations:   0 | [########............] 40%"
    )


def test_format_log_line_optional_fields() -> None:
    line = format_log_line(
        iteration=29,
        train_iters=100,
        consumed_samples=29,
        learning_rate=1.0,
        global_batch_size=1,
        loss_averages={},
        loss_scale=1.0,
        num_zeros_in_grad=12,
        params_norm=3.14159,
        skipped_iterations=2,
        nan_iterations=1,
    )
    assert line == (
        " iteration       29/     100 | consumed samples:           29 |"
        " learning rate: 1.000000E+00 | global batch size:     1 | loss scale: 1.0 |"
        " num zeros: 12.0 | params norm: 3.142 | number of skipped iterations:   2 |"
        " number of nan iterations:   1 | [#####...............] 29%"
    )


def test_progress_bar_full_and_past_the_end() -> None:
    common = {
        "train_iters": 10,
        "consumed_samples": 0,
        "learning_rate": 0.0,
        "global_batch_size": 1,
        "loss_averages": {},
        "loss_scale": 1.0,
        "skipped_iterations": 0,
        "nan_iterations": 0,
    }
    assert format_log_line(iteration=10, **common).endswith(" | [####################] 100%")  # type: ignore[arg-type]
    assert format_log_line(iteration=12, **common).endswith(" | [####################] 100%")  # type: ignore[arg-type]
    assert format_log_line(iteration=0, **common).endswith(" | [....................] 0%")  # type: ignore[arg-type]


def _log(
    logger: TrainingLogger, iteration: int, losses: dict[str, float], skipped: int
) -> str | None:
    return logger.training_log(
        losses,
        iteration=iteration,
        learning_rate=2.5e-4,
        loss_scale=65536.0,
        skipped_iter=skipped,
        grad_norm=0.123456,
        num_zeros_in_grad=None,
        consumed_samples=16 * iteration,
        global_batch_size=16,
        elapsed_per_iteration=0.0123,
    )


def test_scripted_sequence_counts_skipped_and_nan_and_averages() -> None:
    printed: list[str] = []
    logger = TrainingLogger(
        train_iters=10, log_interval=4, is_logging_rank=True, print_fn=printed.append
    )
    # Interval 1: iteration 2 is skipped, so its losses are not averaged.
    assert _log(logger, 1, {"lm loss": 2.0, "aux loss": 0.5}, 0) is None
    assert _log(logger, 2, {"lm loss": 3.0, "aux loss": 1.0}, 1) is None
    assert _log(logger, 3, {"lm loss": 4.0, "aux loss": 1.5}, 0) is None
    assert (logger.advanced_iterations, logger.skipped_iterations) == (2, 1)
    first = _log(logger, 4, {"lm loss": 6.0, "aux loss": 2.5}, 0)
    assert first == (
        " iteration        4/      10 | consumed samples:           64 |"
        " elapsed time per iteration (ms): 12.3 | learning rate: 2.500000E-04 |"
        " global batch size:    16 | lm loss: 4.000000E+00 | aux loss: 1.500000E+00 |"
        " loss scale: 65536.0 | grad norm: 0.123 | number of skipped iterations:   1 |"
        " number of nan iterations:   0 | [########............] 40%"
    )
    # The counters restart after a line.
    assert (logger.advanced_iterations, logger.skipped_iterations, logger.nan_iterations) == (
        0,
        0,
        0,
    )
    # Interval 2: an overflow iteration with an inf loss is skipped and counted as nan
    # (Megatron's case); "aux loss" is absent from this interval and so from the line.
    assert _log(logger, 5, {"lm loss": math.inf}, 1) is None
    assert _log(logger, 6, {"lm loss": 1.0}, 0) is None
    assert _log(logger, 7, {"lm loss": 2.0}, 0) is None
    second = _log(logger, 8, {"lm loss": 3.0}, 0)
    assert second == (
        " iteration        8/      10 | consumed samples:          128 |"
        " elapsed time per iteration (ms): 12.3 | learning rate: 2.500000E-04 |"
        " global batch size:    16 | lm loss: 2.000000E+00 | loss scale: 65536.0 |"
        " grad norm: 0.123 | number of skipped iterations:   1 |"
        " number of nan iterations:   1 | [################....] 80%"
    )
    assert printed == [first, second]


def test_nan_loss_on_an_advanced_iteration_poisons_the_average_only() -> None:
    # As Megatron: only a skipped iteration with a non-finite loss counts as a nan iteration.
    logger = TrainingLogger(
        train_iters=4, log_interval=2, is_logging_rank=True, print_fn=lambda _: None
    )
    _log(logger, 1, {"lm loss": math.nan}, 0)
    assert (logger.advanced_iterations, logger.nan_iterations) == (1, 0)
    line = _log(logger, 2, {"lm loss": 1.0}, 0)
    assert line is not None
    assert " lm loss: NAN |" in line
    assert " number of nan iterations:   0 |" in line


def test_an_interval_of_only_skipped_iterations_has_no_losses() -> None:
    logger = TrainingLogger(
        train_iters=4, log_interval=2, is_logging_rank=True, print_fn=lambda _: None
    )
    _log(logger, 1, {"lm loss": 1.0}, 1)
    line = _log(logger, 2, {"lm loss": 1.0}, 1)
    assert line is not None
    assert "lm loss" not in line
    assert " number of skipped iterations:   2 |" in line


def test_timers_line_is_printed_under_the_log_line() -> None:
    printed: list[str] = []
    logger = TrainingLogger(
        train_iters=1, log_interval=1, is_logging_rank=True, print_fn=printed.append
    )
    text = logger.training_log(
        {"lm loss": 1.0},
        iteration=1,
        learning_rate=0.1,
        loss_scale=1.0,
        skipped_iter=0,
        grad_norm=None,
        num_zeros_in_grad=None,
        consumed_samples=8,
        global_batch_size=8,
        timers_line="max time across ranks (ms) | forward-backward: 12.34 | optimizer: 1.20",
    )
    assert text is not None
    line, timers = text.split("\n")
    assert line.endswith(" number of nan iterations:   0 | [####################] 100%")
    assert " grad norm" not in line
    assert " elapsed time" not in line
    assert timers == "    max time across ranks (ms) | forward-backward: 12.34 | optimizer: 1.20"
    assert printed == [text]


def _logging_rank_prints() -> tuple[list[str], list[str | None]]:
    rank = dist.get_rank()
    printed: list[str] = []
    logger = TrainingLogger(
        train_iters=4,
        log_interval=2,
        is_logging_rank=rank == dist.get_world_size() - 1,
        print_fn=printed.append,
    )
    returned = [_log(logger, iteration, {"lm loss": 1.0}, 0) for iteration in range(1, 5)]
    return printed, returned


def test_only_the_logging_rank_prints_but_every_rank_gets_the_line() -> None:
    (printed0, returned0), (printed1, returned1) = run_distributed(_logging_rank_prints, 2)
    assert returned0 == returned1
    assert returned0[0] is None
    assert returned0[2] is None
    assert returned0[1] is not None
    assert returned0[3] is not None
    assert printed0 == []
    assert printed1 == [returned0[1], returned0[3]]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"train_iters": 0, "log_interval": 1}, ValueError, "train_iters must be >= 1, got 0"),
        ({"train_iters": 10, "log_interval": -1}, ValueError, "log_interval must be >= 1"),
        ({"train_iters": 10.0, "log_interval": 1}, TypeError, "train_iters must be an int"),
    ],
)
def test_logger_rejects_bad_counts(
    kwargs: dict[str, object], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        TrainingLogger(is_logging_rank=True, **kwargs)  # type: ignore[arg-type]


def test_skipped_iter_must_be_zero_or_one() -> None:
    logger = TrainingLogger(train_iters=4, log_interval=2, is_logging_rank=True)
    with pytest.raises(ValueError, match="skipped_iter must be 0 or 1, got 2"):
        _log(logger, 1, {"lm loss": 1.0}, 2)


def test_validation_log_frames_the_line_and_only_the_logging_rank_prints() -> None:
    printed: list[str] = []
    writer = _ListWriter()
    logger = TrainingLogger(
        train_iters=10, log_interval=5, writer=writer, is_logging_rank=True, print_fn=printed.append
    )
    text = logger.validation_log({"lm loss": 2.0}, iteration=5, consumed_samples=80)
    body = " validation loss at iteration 5 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 |"
    rule = "-" * (len(body) + 1)
    assert text == f"{rule}\n{body}\n{rule}"
    assert printed == [text]
    assert writer.scalars == [
        ("lm loss validation", 2.0, 5),
        ("lm loss validation vs samples", 2.0, 80),
        ("lm loss validation ppl", pytest.approx(math.exp(2.0)), 5),
        ("lm loss validation ppl vs samples", pytest.approx(math.exp(2.0)), 80),
    ]
    silent: list[str] = []
    other = TrainingLogger(
        train_iters=10, log_interval=5, is_logging_rank=False, print_fn=silent.append
    )
    assert other.validation_log(
        {"lm loss": 2.0}, iteration=5, consumed_samples=80, line="given"
    ) == ("-" * 42 + "\n validation loss at iteration 5 | given |\n" + "-" * 42)
    assert silent == []


def test_validation_perplexity_is_capped_at_exp_20() -> None:
    logger = TrainingLogger(train_iters=1, log_interval=1, is_logging_rank=False)
    text = logger.validation_log({"lm loss": 50.0}, iteration=1, consumed_samples=1)
    assert f"lm loss PPL: {math.exp(20.0):.6E} |" in text


# --- TensorBoard ------------------------------------------------------------------------------


class _ListWriter:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int, /) -> None:
        self.scalars.append((tag, value, step))


def test_scalars_per_call_and_optional_tags() -> None:
    writer = _ListWriter()
    logger = TrainingLogger(train_iters=10, log_interval=5, writer=writer, is_logging_rank=True)
    logger.training_log(
        {"lm loss": 2.5},
        iteration=3,
        learning_rate=0.01,
        loss_scale=4.0,
        skipped_iter=0,
        grad_norm=None,
        num_zeros_in_grad=7,
        consumed_samples=48,
        global_batch_size=16,
        elapsed_per_iteration=0.5,
        params_norm=9.0,
    )
    assert writer.scalars == [
        ("learning-rate", 0.01, 3),
        ("learning-rate vs samples", 0.01, 48),
        ("batch-size", 16.0, 3),
        ("batch-size vs samples", 16.0, 48),
        ("lm loss", 2.5, 3),
        ("lm loss vs samples", 2.5, 48),
        ("loss-scale", 4.0, 3),
        ("loss-scale vs samples", 4.0, 48),
        ("num-zeros", 7.0, 3),
        ("num-zeros vs samples", 7.0, 48),
        ("params-norm", 9.0, 3),
        ("params-norm vs samples", 9.0, 48),
        ("iteration-time", 0.5, 3),
    ]


def test_non_logging_rank_writes_nothing() -> None:
    writer = _ListWriter()
    logger = TrainingLogger(
        train_iters=10,
        log_interval=1,
        writer=writer,
        is_logging_rank=False,
        print_fn=lambda _: None,
    )
    assert _log(logger, 1, {"lm loss": 1.0}, 0) is not None
    assert writer.scalars == []


def test_tensorboard_event_files_hold_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    writer = SummaryWriter(log_dir=str(tmp_path))
    logger = TrainingLogger(
        train_iters=3, log_interval=3, writer=writer, is_logging_rank=True, print_fn=lambda _: None
    )
    losses = [1.5, 1.25, 1.0]
    for iteration, loss in enumerate(losses, start=1):
        logger.training_log(
            {"lm loss": loss},
            iteration=iteration,
            learning_rate=0.001 * iteration,
            loss_scale=2.0,
            skipped_iter=0,
            grad_norm=0.5 * iteration,
            num_zeros_in_grad=None,
            consumed_samples=32 * iteration,
            global_batch_size=32,
        )
    writer.close()

    accumulator = event_accumulator.EventAccumulator(str(tmp_path))
    accumulator.Reload()

    def read(tag: str) -> list[tuple[int, float]]:
        return [(event.step, event.value) for event in accumulator.Scalars(tag)]

    tags = set(accumulator.Tags()["scalars"])
    assert tags == {
        "learning-rate",
        "learning-rate vs samples",
        "batch-size",
        "batch-size vs samples",
        "lm loss",
        "lm loss vs samples",
        "loss-scale",
        "loss-scale vs samples",
        "grad-norm",
        "grad-norm vs samples",
    }
    assert read("lm loss") == [(1, 1.5), (2, 1.25), (3, 1.0)]
    assert read("lm loss vs samples") == [(32, 1.5), (64, 1.25), (96, 1.0)]
    assert read("grad-norm vs samples") == [(32, 0.5), (64, 1.0), (96, 1.5)]
    assert read("batch-size vs samples") == [(32, 32.0), (64, 32.0), (96, 32.0)]
    assert [step for step, _ in read("learning-rate vs samples")] == [32, 64, 96]
    assert [value for _, value in read("learning-rate")] == pytest.approx([0.001, 0.002, 0.003])


# --- memory -----------------------------------------------------------------------------------


def test_memory_report_on_this_machine() -> None:
    """The old summary, deprecated: pp-train prints Megatron's line (`pp_train.memory`)."""
    with pytest.deprecated_call(match="use pp_train.memory_report"):
        report = reporting.memory_report()
    fields = report.split(" | ")
    assert fields[0] == "memory (MB)"
    name, value = fields[1].split(": ")
    assert name == "max rss"
    assert float(value) > 0.0
    names = [field.split(": ")[0] for field in fields[2:]]
    if torch.cuda.is_available():
        assert names == ["allocated", "max allocated", "reserved", "max reserved"]
    else:
        assert names == []
