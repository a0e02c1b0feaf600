from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from pp_testing import preload_in_ranks

ROOT = Path(__file__).resolve().parent.parent

# Every rank run_distributed starts begins with pp-train and torch's checkpointing imported.
preload_in_ranks("pp_train.app", "pp_train.checkpoint", "torch.distributed.checkpoint")

Torchrun = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def torchrun() -> Torchrun:
    """Run a script (a path) or a module (``"-m name"``) under torchrun on N local CPU ranks.

    Returns the finished process.
    """

    def run(
        script: Path | str, ranks: int, *args: str, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
        ]
        target = script.split(" ", 1) if isinstance(script, str) else [str(script)]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        return subprocess.run(
            [*command, *target, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )

    return run


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
        spec.loader.exec_module(module)
        return module

    return load
