"""pp-schedules' flight-recorder benchmark still runs and prints its JSON line (no timing judged)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = (
    Path(__file__).resolve().parent.parent / "packages/pp-schedules/benchmarks/recorder_cost.py"
)


def test_the_recorder_benchmark_prints_its_cost_per_step() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--microbatches", "4", "--rounds", "2", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (record,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert record["steps_per_call"] > 2 * 4  # compute steps and exchanges of rank 1
    assert record["on_vs_off"] > 0
    assert record["bare_us_per_step"] > 0
    assert record["goal_us"] == 5.0
    assert isinstance(record["passed"], bool)
