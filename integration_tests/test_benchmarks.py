"""The benchmarks still run and print their JSON lines (a quick pass; no timing is judged)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The `torchrun` fixture from conftest.py: (script, ranks, *args) -> finished process.
Torchrun = Callable[..., subprocess.CompletedProcess[str]]


@pytest.mark.parametrize("mode", [[], ["--unbatched"]], ids=["batched", "unbatched"])
def test_p2p_overhead_benchmark_reports_every_operation(
    torchrun: Torchrun, mode: list[str]
) -> None:
    script = ROOT / "packages" / "pp-comm" / "benchmarks" / "p2p_overhead.py"
    done = torchrun(script, 2, "--quick", "--rounds", "1", "--json", *mode)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 12  # 6 operation pairs x 2 sizes
    assert {r["size"] for r in records} == {"4KB", "4MB"}
    assert all(r["ratio"] > 0 and r["pp_comm_us"] > 0 and r["raw_us"] > 0 for r in records)
    # The spread of per-round ratios, and the goal each median is judged against.
    assert all(r["ratio_q1"] <= r["ratio"] <= r["ratio_q3"] for r in records)
    assert all(r["goal"] == 1.10 and r["met"] == (round(r["ratio"], 2) <= 1.10) for r in records)
    assert {r["mode"] for r in records} == {"unbatched" if mode else "batched"}
