from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pp_testing import preload_in_ranks

ROOT = Path(__file__).resolve().parent.parent

# Every rank run_distributed starts begins with pp-train and torch's checkpointing imported.
preload_in_ranks("pp_train.app", "pp_train.checkpoint", "torch.distributed.checkpoint")

Torchrun = Callable[..., subprocess.CompletedProcess[str]]


def _torchrun_command(script: Path | str, ranks: int, *args: str) -> list[str]:
    """torchrun on `ranks` local CPU ranks, of a script (a path) or a module (``"-m name"``)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
    ]
    target = script.split(" ", 1) if isinstance(script, str) else [str(script)]
    return [*command, *target, *args]


_RANK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def torchrun() -> Torchrun:
    """Run a script (a path) or a module (``"-m name"``) under torchrun on N local CPU ranks.

    Returns the finished process.
    """

    def run(
        script: Path | str, ranks: int, *args: str, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            _torchrun_command(script, ranks, *args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **_RANK_ENV},
            check=False,
        )

    return run


@dataclasses.dataclass
class Job:
    """A torchrun job running in the background, its output read line by line."""

    process: subprocess.Popen[str]
    out: list[str] = dataclasses.field(default_factory=list)
    err: list[str] = dataclasses.field(default_factory=list)
    readers: list[threading.Thread] = dataclasses.field(default_factory=list)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for_output(self, pattern: str, timeout: float) -> None:
        """Until a line of stdout matches `pattern` (the job must not end before)."""
        deadline = time.monotonic() + timeout
        while not any(re.search(pattern, line) for line in self.out):
            assert self.process.poll() is None, "".join(self.out + self.err)
            assert time.monotonic() < deadline, "".join(self.out + self.err)
            time.sleep(0.05)

    def end(self) -> None:
        """Kill the job if it still runs, and read the rest of its output."""
        self.process.kill()
        self.process.wait()
        for reader in self.readers:
            reader.join(5)


def _read_lines(stream: Any, lines: list[str]) -> threading.Thread:
    def read() -> None:
        for line in stream:
            lines.append(line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


StartJob = Callable[..., Job]


@pytest.fixture
def torchrun_job() -> Iterator[StartJob]:
    """Start a torchrun job in the background (script or ``"-m module"``, ranks, *args).

    Returns the running `Job`; every job started is ended when the test ends.
    """
    started: list[Job] = []

    def start(script: Path | str, ranks: int, *args: str) -> Job:
        process = subprocess.Popen(
            _torchrun_command(script, ranks, *args), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, **_RANK_ENV},
        )  # fmt: skip
        job = Job(process)
        job.readers = [_read_lines(process.stdout, job.out), _read_lines(process.stderr, job.err)]
        started.append(job)
        return job

    yield start
    for job in started:
        job.end()


@pytest.fixture
def script_module(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], ModuleType]:
    """Import a script (a benchmark, an example) in the test's process, by its path.

    Its folder goes on ``sys.path`` for the test's duration, so modules beside it import.
    """

    def load(path: Path) -> ModuleType:
        monkeypatch.syspath_prepend(str(path.parent))
        spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        # Registered while the test runs: dataclasses look their module up by name.
        monkeypatch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
        return module

    return load
