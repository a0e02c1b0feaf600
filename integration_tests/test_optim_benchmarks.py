"""pp-optim's benchmark still runs and prints its JSON lines (a quick pass; no timing judged)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The `torchrun` fixture from conftest.py: (script, ranks, *args) -> finished process.
Torchrun = Callable[..., subprocess.CompletedProcess[str]]


def test_bucketed_against_per_parameter_all_reduce(torchrun: Torchrun) -> None:
    script = ROOT / "packages" / "pp-optim" / "benchmarks" / "grad_allreduce.py"
    done = torchrun(script, 2, "--quick", "--layers", "2", "--hidden", "16")
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert records[0]["buckets"] == 1
    assert records[1]["buckets"] > 1
    assert all(
        r["parameters"] == 24 and r["ratio_per_parameter_over_bucketed"] > 0 for r in records
    )
