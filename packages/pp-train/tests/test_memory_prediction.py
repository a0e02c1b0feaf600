"""The byte model's peak per rank against every byte the real run allocates.

Each rank runs the command's `main` for three iterations, the memory line printed after the
last. Its max allocated is pp-schedules' probe: every storage the rank allocated over those
iterations, counted at the allocator level (the counter itself is checked against
torch.profiler in pp-schedules' tests, and here on a tensor- and sequence-parallel run). The
prediction is made from one microbatch of each part of the model alone (the warm-up) and the
plan, not from the run itself, so the comparison is not circular: a model that leaves out
what training holds fails the 2% bound (pp-train 0.12's, which counted saved tensors only,
was 0.46-1.0 times the measured peak; one that measured the parts whole at tensor-parallel
size 2 was 1.27-1.45 times it). The goal: within 2% on every rank, at pp 2 and 4, for every
schedule, with and without recomputation, in bf16, with data parallelism with and without
the distributed optimizer, and with tensor parallelism (with and without sequence
parallelism) beside pipeline or data parallelism.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from pp_testing import run_distributed
from pp_train.app import main
from pp_train.memory import MemoryReport

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
TP2 = ["--tensor-model-parallel-size", "2"]
SP = ["--sequence-parallel"]
TP2DP2 = [*TP2, "--global-batch-size", "16"]
CP2 = ["--context-parallel-size", "2", "--attention-dropout", "0", "--global-batch-size", "16"]
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
    "tp2xpp2": (4, [*TP2, *PP2]),
    "tp2xpp2-sp": (4, [*TP2, *PP2, *SP]),
    "tp2xpp2-sp-zbv": (4, [*TP2, *PP2, *SP, "--pipeline-schedule", "zbv", *VP2]),
    "tp2xdp2": (4, TP2DP2),
    "tp2xdp2-distributed-optimizer": (4, [*TP2DP2, "--use-distributed-optimizer"]),
    "cp2": (2, CP2),
    "cp2-all-gather": (2, [*CP2, "--cp-comm-type", "all_gather"]),
    "cp2xpp2": (4, [*CP2, "--pipeline-model-parallel-size", "2"]),
    "cp2xtp2-sp": (4, [*CP2, *TP2, *SP]),
}


def _size(flags: list[str], flag: str) -> int:
    return int(flags[flags.index(flag) + 1]) if flag in flags else 1


@pytest.mark.parametrize("case", list(CASES))
def test_the_predicted_peak_is_within_two_percent_of_what_the_run_allocates(case: str) -> None:
    ranks, flags = CASES[case]
    found = peaks(ranks, flags)
    pipeline = _size(flags, "--pipeline-model-parallel-size")
    tensor = _size(flags, "--tensor-model-parallel-size")
    context = _size(flags, "--context-parallel-size")
    assert len(found) == pipeline * tensor * context, "every rank of the first replica reports"
    for rank, (measured, predicted) in found.items():
        assert predicted == pytest.approx(measured, rel=0.02), (case, rank, measured, predicted)


# ------------------------------------------------------- a second instrument: torch.profiler
MARK = "pp-test: iteration 3"


def _profiled_rise(trace: Path) -> tuple[int, int]:
    """The most bytes allocated at once during the marked iteration, above its start.

    From torch.profiler's allocator events (``profile_memory=True``), in time order. The
    profiler records no free made on another thread: gloo's worker thread lets go of a
    collective's tensors just after it completes, and frees those the rank has already
    dropped (a tensor-parallel all-reduce's sum, once added to the residual). So the rise is
    bracketed: at most as the events add up (a missed free only adds), at least with the
    blocks whose free is missing left out (their address allocated again with no free
    between, or never freed). The profiler starts an iteration early, so that it sees what
    the step before left.

    Returns:
        The least and the most rise the events allow.
    """
    events = json.loads(trace.read_text())["traceEvents"]
    mark = next(e for e in events if e.get("name") == MARK and e.get("ph") == "X")
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    missed: set[int] = set()  # allocations whose free the profiler missed, by index
    live: dict[int, int] = {}
    for index, event in enumerate(memory):
        address = event["args"]["Addr"]
        if event["args"]["Bytes"] > 0:
            if address in live:
                missed.add(live[address])
            live[address] = index
        else:
            live.pop(address, None)
    missed |= set(live.values())  # never seen freed (or kept past the step)
    return _rise(memory, mark["ts"], missed), _rise(memory, mark["ts"], set())


def _rise(events: list[dict[str, Any]], mark: float, left_out: set[int]) -> int:
    """The peak of the events' running sum above its value at `mark`, the allocations at
    the indices `left_out` (and their frees) not counted."""
    counted: set[int] = set()  # addresses of counted blocks
    held, start, peak = 0, None, 0
    for index, event in enumerate(events):
        if start is None and event["ts"] >= mark:
            start = peak = held
        size, address = event["args"]["Bytes"], event["args"]["Addr"]
        if size > 0 and index not in left_out:
            counted.add(address)
            held += size
        elif size < 0 and address in counted:
            counted.discard(address)
            held += size
        peak = max(peak, held)
    assert start is not None, "no allocation in the marked iteration"
    return peak - start


def _profiling_iterations(
    folder: Path, found: dict[str, int]
) -> Callable[[MemoryReport], contextlib.AbstractContextManager[None]]:
    """`MemoryReport.measuring` that also runs torch.profiler over iterations 2 and 3.

    It notes the probe's live bytes as the third iteration starts (the static storages and
    what stayed from the iteration before), the probe's rise above them over that iteration,
    and the profiler's (`_profiled_rise`).
    """
    measuring = MemoryReport.measuring
    calls: list[int] = []
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    @contextlib.contextmanager
    def measured(report: MemoryReport) -> Iterator[None]:
        calls.append(1)
        probe = report.probe
        if len(calls) == 2:
            profiler.start()
        if probe is None or len(calls) != 3:
            with measuring(report):
                yield
            return
        with measuring(report):
            start, first = probe.live_bytes, len(probe.samples)
            assert start is not None
            with record_function(MARK):
                yield
        profiler.stop()
        trace = folder / "trace.json"
        profiler.export_chrome_trace(str(trace))
        counted = max(s.peak_live_bytes or 0 for s in probe.samples[first:])
        least, most = _profiled_rise(trace)
        found.update(start=start, counted=counted - start, least=least, most=most)

    return measured


def _profiled_launch(argv: list[str]) -> tuple[int, str, dict[str, int]]:
    """`_launch` with the third iteration also measured by torch.profiler (`found`)."""
    found: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as folder:
        original = MemoryReport.measuring
        MemoryReport.measuring = _profiling_iterations(Path(folder), found)  # type: ignore[method-assign, assignment]
        try:
            status, out, _ = _launch(argv)
        finally:
            MemoryReport.measuring = original  # type: ignore[method-assign]
    return status, out, found


def test_a_sequence_parallel_runs_peak_is_predicted_by_torch_profilers_count_too() -> None:
    """tp 2 x pp 2 with sequence parallelism, its last iteration under torch.profiler.

    The profiler's allocator events bracket the iteration's rise above what the rank held as
    it started (`_profiled_rise`: it misses the frees gloo's thread makes, 2-17% of the peak
    here). Without the blocks whose free it missed, its peak is the probe's within 1% and
    the predicted peak within 2%: the prediction agrees with an instrument other than the
    counter; the probe's is never above the profiler's events as they add up (the counter
    misses no allocation). Tensor-parallel all-reduces and sequence-parallel gathers and
    scatters are in the step.
    """
    flags = [*GPT, *TP2, *PP2, *SP]
    results = run_distributed(_profiled_launch, 4, flags, timeout=240)
    assert [status for status, _, _ in results] == [0] * 4, results
    for rank, (_, out, found) in enumerate(results):
        line = LINE.search(out)
        assert line is not None, out
        assert int(line[1]) == rank, out
        counted = found["start"] + found["counted"]
        least, most = found["start"] + found["least"], found["start"] + found["most"]
        assert counted <= most, (rank, found)
        assert least == pytest.approx(counted, rel=0.01), (rank, found)
        predicted = float(line[6]) * 2**20
        assert predicted == pytest.approx(least, rel=0.02), (rank, found, predicted)
