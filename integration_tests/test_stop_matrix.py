"""Under torchrun at pp 2 x dp 2 and tp 2 x pp 2 x dp 2: a killed or stopped rank is the cause.

Each case starts the bundled GPT under torchrun, waits for the third iteration, waits a random
moment more (up to 1.5 s, seeded by the case), then kill -9s one worker (or SIGSTOPs it) by
its global rank. Every report the survivors print or write and every survivor's one-line exit
must name that rank, with its pipeline coordinates, as the cause: never a live rank, and never
a stage index for a rank; no collective error may leave a peer's address unmapped ("peer rank
unknown (address ...)"). A loaded case runs two busy processes per core beside the job.

The default run takes three cases (a kill at each layout, one under load, and a stop):
``PP_STOP_MATRIX=1`` (``nox -s stop_matrix``) takes every rank of both layouts in turn, killed
and stopped, quiet and loaded (28 jobs, about 13 minutes on 2 cores).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pp_state import coordinates_in, rank_layout
from pp_train.dump import worker_ranks

pytestmark = pytest.mark.reliability

StartJob = Callable[..., Any]  # conftest's `torchrun_job`: (script, ranks, *args) -> Job

TINY = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--eval-iters", "2", "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "100000",
    "--log-interval", "1", "--eval-interval", "1000000",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    """One job: its layout, the victim's global rank, kill or stop, and whether loaded."""

    tp: int
    victim: int
    how: str  # "kill" (SIGKILL) or "stop" (SIGSTOP)
    loaded: bool

    @property
    def world(self) -> int:
        return 4 * self.tp  # pp 2 x dp 2 x tp

    @property
    def id(self) -> str:
        load = "loaded" if self.loaded else "quiet"
        return f"tp{self.tp}-pp2-dp2-{self.how}-rank{self.victim}-{load}"


def _cases() -> list[Case]:
    if os.environ.get("PP_STOP_MATRIX"):
        return [
            Case(tp, victim, how, loaded)
            for loaded in (False, True)
            for tp in (1, 2)
            for victim, how in [*((v, "kill") for v in range(4 * tp)), (tp + 1, "stop")]
        ]
    return [Case(1, 1, "kill", False), Case(2, 6, "kill", True), Case(1, 2, "stop", False)]


@contextlib.contextmanager
def _burner(loaded: bool) -> Iterator[None]:
    """Two busy processes per core while active (none unless `loaded`)."""
    count = 2 * (os.cpu_count() or 1) if loaded else 0
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


@dataclasses.dataclass
class Outcome:
    """What the job left: its stderr, the report files and the moment of the fault."""

    stderr: str
    reports: list[Path]
    delay: float
    load: float


def _run(case: Case, reports: Path, start: StartJob) -> Outcome:
    # A stopped rank is noticed when a transfer or collective times out: 15 s (30 s at 8 ranks,
    # whose start-up barrier takes longer on 2 cores).
    timeout_minutes = "0.25" if case.world == 4 else "0.5"
    flags = [
        *TINY, "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size",
        str(case.tp), "--stop-report-dir", str(reports), "--distributed-timeout-minutes",
        timeout_minutes,
    ]  # fmt: skip
    delay = random.Random(case.id).uniform(0.0, 1.5)
    job = start("-m pp_train", case.world, *flags)
    job.wait_for_output(r"iteration\s+3/", timeout=240)
    time.sleep(delay)
    load = os.getloadavg()[0]
    victim_pid = worker_ranks(job.process.pid)[case.victim]
    os.kill(victim_pid, signal.SIGKILL if case.how == "kill" else signal.SIGSTOP)
    deadline = time.monotonic() + 240
    while job.process.poll() is None and time.monotonic() < deadline:
        # A stopped rank never ends; torchrun's agent waits for it once the others left.
        if case.how == "stop" and len(_exit_lines(job.stderr)) == case.world - 1:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim_pid, signal.SIGKILL)
        time.sleep(0.1)
    if case.how == "stop":
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim_pid, signal.SIGKILL)
    job.end()
    return Outcome(job.stderr, sorted(reports.glob("pipeline-stop-*.txt")), delay, load)


def _named_first(cause: str) -> str:
    """The rank a cause names first, with its place: ``rank 5 (pipeline stage 1 of ...)``."""
    found = re.match(r"rank \d+ \([^)]*\)", cause)
    return found.group(0) if found else cause[:80]


def _exit_lines(stderr: str) -> dict[int, str]:
    """Each rank's one-line exit, by global rank: the reporter's, a stopped rank's, a leaver's."""
    lines: dict[int, str] = {}
    for line in stderr.splitlines():
        reporter = re.search(r"pp-train: error: the pipeline stopped .*: (rank .*) \(report: "
                             r".*pipeline-stop-iter\d+-rank(\d+)\.txt\)$", line)  # fmt: skip
        other = re.search(r"pp-train: rank (\d+) \(.*?\) (?:stopped: cause|leaves on SIGTERM: "
                          r"its pipeline stopped): (rank .*)$", line)  # fmt: skip
        if reporter is not None:
            lines[int(reporter.group(2))] = reporter.group(1)
        elif other is not None:
            lines[int(other.group(1))] = other.group(2)
    return lines


@pytest.mark.parametrize("case", _cases(), ids=lambda case: case.id)
def test_a_killed_or_stopped_rank_is_named_with_its_coordinates_by_every_survivor(
    case: Case, tmp_path: Path, torchrun_job: StartJob
) -> None:
    """Each case is one torchrun job: 15-30 s at 4 ranks, 30-60 s at 8 (start-up of 8 Python
    processes importing torch on 2 cores, under load twice that), 45-75 s for a stop (a
    transfer's timeout runs out first)."""
    layout = rank_layout(case.world, tensor_model_parallel_size=case.tp,
                         pipeline_model_parallel_size=2)  # fmt: skip
    victim = coordinates_in(layout, case.victim).describe()
    with _burner(case.loaded):
        outcome = _run(case, tmp_path / "reports", torchrun_job)
    text = outcome.stderr
    print(f"{case.id}: fault {outcome.delay:.2f} s after iteration 3, load {outcome.load:.1f}")
    print(text[-8000:])
    causes = re.findall(r"pipeline stopped \(call \d+\) in pipeline \[[\d, ]+\]: (.*)", text)
    assert causes, text[-6000:]
    for cause in causes:
        assert _named_first(cause) == victim, (victim, cause)
    for report in outcome.reports:
        first = report.read_text().splitlines()[0]
        assert _named_first(first.split("]: ", 1)[1]) == victim, (report, first)
    exits = _exit_lines(text)
    survivors = set(range(case.world)) - {case.victim}
    assert set(exits) == survivors, (sorted(exits), text[-6000:])
    for rank, cause in exits.items():
        assert _named_first(cause) == victim, (rank, victim, cause)
    # Every collective error that names a peer's address names its global rank too.
    assert "peer rank unknown (address" not in text, text[-6000:]
    assert text.count("Traceback") <= 1, text  # torchrun's own ChildFailedError only
