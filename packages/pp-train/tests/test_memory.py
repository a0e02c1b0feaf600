"""Memory: Megatron's report after the first log line, measured on CPU; --empty-unused-memory-level."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast
from unittest import mock

import pytest
import torch

from pp_optim import OptimizerConfig, get_megatron_optimizer
from pp_schedules import MemoryProbe, MemorySample, ScheduleConfig, get_forward_backward_func
from pp_state import ParallelState
from pp_testing import run_distributed
from pp_train import (
    LoggingArgs,
    MemoryReport,
    ModelArgs,
    ParallelArgs,
    PretrainConfig,
    TrainingArgs,
    add_pretrain_flags,
    memory_report,
    pretrain,
    pretrain_config_from_args,
    training_state_tensors,
)
from pp_train import memory as memory_module

WIDTH, LAYERS = 8, 4
MB = 1024 * 1024
LINE = re.compile(
    r"^\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: (\S+) \| "
    r"max allocated: (\S+) \| reserved: (\S+) \| max reserved: (\S+) \| "
    r"max saved for backward: (\S+)$"
)
HOST = re.compile(r"^\[Rank (\d+)\] host memory \(MB\) \| data: (\S+) \| apart from allocated")

# --- the line ----------------------------------------------------------------------------


def test_the_line_is_megatrons_with_the_probes_numbers_on_cpu() -> None:
    sample = MemorySample(
        "B3", static_bytes=MB, saved_bytes=0, peak_saved_bytes=MB, allocated_bytes=None
    )
    line = memory_report(sample, iteration=5, rank=3)
    (rank, after, allocated, peak, reserved, max_reserved, saved) = LINE.match(line).groups()  # type: ignore[union-attr]
    # Without live figures (a probe that did not count allocations): static and saved bytes.
    assert (rank, after, allocated, peak, saved) == ("3", "5", "1.0", "2.0", "1.0")
    assert 0 < float(reserved) <= float(max_reserved), "the resident set size, now and at most"
    assert memory_report(None, "predicted peak 3 MB", rank=0).startswith(
        "[Rank 0] memory (MB) | allocated: n/a | max allocated: n/a | reserved: "
    )
    assert memory_report(None, "predicted peak 3 MB").endswith(" | predicted peak 3 MB")


def test_a_probe_reports_its_live_bytes_and_its_largest_sample() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256)
    params = list(layer.parameters())
    probe = MemoryProbe(static=lambda: [*params, *(p.grad for p in params if p.grad is not None)])
    x = torch.randn(512, 256)  # made before counting: not counted
    hidden = 512 * 256 * 4
    with probe.counting():
        out = torch.tanh(layer(x))
        forward = probe.sample("F0")
        out.sum().backward()
        del out
        backward = probe.sample("B0")
    static = (256 * 256 + 256) * 4
    # The linear's output and tanh's both exist for a moment; tanh's stays (it saved it).
    assert (forward.live_bytes, forward.peak_live_bytes) == (static + hidden, static + 2 * hidden)
    # The saved figure has x too (saved, but made before the step) and tanh's output.
    assert forward.saved_bytes == 2 * hidden
    # Backward made the gradients (static from then on) and freed tanh's output.
    assert probe.static_bytes() == backward.live_bytes == 2 * static
    line = LINE.match(memory_report(probe, iteration=1, rank=0))
    assert line is not None
    assert float(line.group(3)) == 2 * static / MB
    most = max(sample.peak_live_bytes or 0 for sample in (forward, backward))
    assert float(line.group(4)) == most / MB
    assert float(line.group(7)) == 2 * hidden / MB


def test_training_state_is_parameters_gradients_and_optimizer_state() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    optimizer = get_megatron_optimizer(OptimizerConfig(), [model])
    probe = MemoryProbe(static=lambda: training_state_tensors([model], optimizer))
    parameters = 6 * 8 + 8 + 8 * 3 + 3
    assert probe.static_bytes() == parameters * 4
    model(torch.randn(5, 6)).pow(2).mean().backward()
    optimizer.step()
    # Parameters, gradients and Adam's two moments, in fp32.
    assert probe.static_bytes() == parameters * 4 * 4


class _State:
    """What `MemoryReport` reads of the parallel state: the data-parallel rank."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank

    def group_rank(self, name: str) -> int:
        assert name == "dp"
        return self.dp_rank


def test_the_report_counts_and_prints_on_replica_zero_only_and_takes_the_probe_off() -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = get_megatron_optimizer(OptimizerConfig(), [model])
    for dp_rank, expected in ((0, 1), (1, 0)):
        executor = get_forward_backward_func(None, config=ScheduleConfig(hidden_size=4))
        printed: list[str] = []
        state = cast("ParallelState", _State(dp_rank))
        report = MemoryReport(executor, [model], optimizer, state, print_fn=printed.append)
        # Only the replica that prints counts (counting costs every operator a call).
        assert executor.memory_probe is report.probe
        assert (report.probe is not None) == (dp_rank == 0)
        report.after_log(2)
        report.after_log(4)
        assert len(printed) == expected  # both lines in one print: the ranks share stdout
        for text in printed:
            memory, host = text.splitlines()
            assert memory.startswith("[Rank 0] (after 2 iterations) memory (MB)")
            assert HOST.match(host)
        assert executor.memory_probe is None


# --- the run -----------------------------------------------------------------------------


class Samples:
    """Sample i: random inputs and the sum of their sines."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = torch.randn(WIDTH, generator=torch.Generator().manual_seed(index))
        return {"tokens": x, "labels": torch.sin(x).sum(0, keepdim=True)}


class Stage(torch.nn.Module):
    """Some Linear + tanh layers of an MLP; the last stage adds a head and the loss."""

    def __init__(self, count: int, pre_process: bool, post_process: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(count))
        self.head = torch.nn.Linear(WIDTH, 1) if post_process else None
        self.pre_process, self.input = pre_process, None

    def set_input_tensor(self, tensors: list[Any]) -> None:
        self.input = tensors[0]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["tokens"].unsqueeze(0) if self.pre_process else self.input
        assert x is not None
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.head is None:
            return x
        loss: torch.Tensor = ((self.head(x)[0] - batch["labels"]) ** 2).mean()
        return loss


def _provider(
    *, pre_process: bool, post_process: bool, vp_stage: int, state: ParallelState
) -> torch.nn.Module:
    torch.manual_seed(state.pipeline_model_parallel_rank)
    return Stage(LAYERS // state.pipeline_model_parallel_size, pre_process, post_process)


def _forward_step(
    data: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[..., Any]]:
    loss = model(next(data))
    return loss, lambda out: (out, {"mse": out.detach()})


def _config(pp: int, level: int = 0, profile: str | None = None, **training: Any) -> PretrainConfig:
    return PretrainConfig(
        parallel=ParallelArgs(pipeline_model_parallel_size=pp),
        model=ModelArgs(num_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=1, seq_length=1),
        training=TrainingArgs(
            train_iters=4, micro_batch_size=2, global_batch_size=8, eval_iters=1,
            empty_unused_memory_level=level, **training,  # type: ignore[arg-type]
        ),
        logging=LoggingArgs(log_interval=2, profile_schedule=profile),
    )  # fmt: skip


def _pretrain(config: PretrainConfig) -> str:
    def datasets(num_samples: tuple[int, int, int]) -> tuple[Samples, Samples, None]:
        return Samples(), Samples(), None

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pretrain(datasets, _provider, _forward_step, config=config, model_name="MLP")
    return printed.getvalue()


def _memory_lines(stdout: str) -> list[re.Match[str]]:
    return [m for line in stdout.splitlines() if (m := LINE.match(line))]


def test_each_stage_of_the_first_replica_reports_after_the_first_log_line() -> None:
    pipelined = run_distributed(_pretrain, 2, _config(2), timeout=180)
    for rank, stdout in enumerate(pipelined):
        (line,) = _memory_lines(stdout)
        assert line.group(1, 2) == (str(rank), "2")
        allocated, peak = float(line.group(3)), float(line.group(4))
        assert 0 < allocated < peak, "the static bytes, then the most held during a step"
    logged = pipelined[1].splitlines()  # the last stage logs
    first_log = next(i for i, text in enumerate(logged) if "iteration        2/" in text)
    report = next(i for i, text in enumerate(logged) if LINE.match(text))
    second_log = next(i for i, text in enumerate(logged) if "iteration        4/" in text)
    assert first_log < report < second_log
    replicated = run_distributed(_pretrain, 2, _config(1), timeout=180)
    assert [len(_memory_lines(stdout)) for stdout in replicated] == [1, 0], "dp rank 0 only"


def _count_empty_cache(level: int) -> int:
    """A CPU run that takes its model for a CUDA one: how often it empties the cache."""
    with (
        mock.patch.object(memory_module, "uses_cuda", return_value=True),
        mock.patch.object(torch.cuda, "empty_cache") as empty_cache,
    ):
        _pretrain(_config(1, level, eval_interval=2))
    return empty_cache.call_count


def test_empty_unused_memory_level_empties_the_cache_where_megatron_does() -> None:
    counts = [run_distributed(_count_empty_cache, 1, level)[0] for level in (0, 1, 2)]
    # 4 steps; evaluation after iterations 2 and 4 and at the end, 1 batch each.
    assert counts == [0, 4 + 3, 2 * 4 + 3]


@pytest.mark.reliability
def test_empty_unused_memory_level_takes_megatrons_levels_only() -> None:
    with pytest.raises(ValueError, match=r"--empty-unused-memory-level must be 0, 1 or 2.*got 3"):
        TrainingArgs(empty_unused_memory_level=3)  # type: ignore[arg-type]
    parser = add_pretrain_flags(argparse.ArgumentParser(prog="test"))
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parser.parse_args(["--empty-unused-memory-level", "3"])
    parsed = parser.parse_args(["--empty-unused-memory-level", "2"])
    assert pretrain_config_from_args(parsed).training.empty_unused_memory_level == 2


def test_the_profiled_step_draws_measured_memory_beside_each_ranks_spans(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    run_distributed(_pretrain, 2, _config(2, profile=str(path)), timeout=180)
    events = json.loads(path.read_text())["traceEvents"]
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"memory (MB)"}
    for rank in (0, 1):
        computed = [e for e in events if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == rank
                    and e["cat"] != "exchange" and e["cat"] != "wait"]  # fmt: skip
        mine = [e for e in counters if e["id"] == rank]
        assert len(mine) == len(computed) == 8, "4 microbatches: a sample per F and B"
        assert all(e["args"]["measured"] > 0 for e in mine)
