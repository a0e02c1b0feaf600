"""pp-optim's benchmark still runs and prints its table and JSON lines (no timing judged)."""

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
    done = torchrun(script, 2, "--quick", "--layers", "2", "--hidden", "16", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert records[0]["buckets"] == 1
    assert records[1]["buckets"] > 1
    assert all(
        r["parameters"] == 24 and r["ratio_per_parameter_over_bucketed"] > 0 for r in records
    )


def test_the_benchmark_prints_a_table_against_its_goal(torchrun: Torchrun) -> None:
    script = ROOT / "packages" / "pp-optim" / "benchmarks" / "grad_allreduce.py"
    done = torchrun(script, 2, "--quick", "--layers", "2", "--hidden", "16")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("buckets"))
    assert header.split()[-2:] == ["goal", "pass"]
    rows = [line.split() for line in lines[lines.index(header) + 1 :] if line.strip()]
    assert len(rows) == 2
    assert all(row[-3:-1] == [">=", "1.00"] and row[-1] in ("yes", "NO") for row in rows)
