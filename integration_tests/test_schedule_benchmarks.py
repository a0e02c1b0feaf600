"""pp-schedules' benchmarks still run and print their JSON lines (a quick pass; no timing judged)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "packages" / "pp-schedules" / "benchmarks"
# The `torchrun` fixture from conftest.py: (script, ranks, *args) -> finished process.
Torchrun = Callable[..., subprocess.CompletedProcess[str]]


def _records(done: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_schedules_against_torch_pipelining(
    torchrun: Torchrun, script_module: Callable[[Path], ModuleType]
) -> None:
    script = BENCHMARKS / "schedules_vs_torch.py"
    args = ["--steps", "1", "--width", "16", "--rows", "2", "--microbatches", "4", "--json"]
    args += ["--forward-ms", "1", "--backward-ms", "2", "--blocks", "4"]
    records = _records(torchrun(script, 2, *args))
    assert [(r["model"], r["schedule"]) for r in records] == [
        (model, name)
        for model in ("sleep", "mlp")
        for name in ("gpipe", "1f1b", "interleaved_1f1b")
    ]
    assert all(float(r["ours_vs_torch"]) > 0 for r in records)  # type: ignore[arg-type]
    # Sleep stages have a theoretical makespan: the plan's, with zero transfer time.
    sleep = [r for r in records if r["model"] == "sleep"]
    assert [r["nominal_ms"] for r in sleep] == [15.0, 15.0, 13.5]
    ms = [{k: float(v) for k, v in r.items() if k.endswith("_ms")} for r in sleep]  # type: ignore[arg-type]
    assert all(r["theory_ms"] >= r["nominal_ms"] for r in ms)
    # The simulated column adds the measured hop and exchange posting time to theory.
    assert all(r["exchange_ms"] > 0 and r["simulated_ms"] >= r["theory_ms"] for r in ms)
    # Without --json the script prints these records as a table with a goal and a verdict
    # per row (checked on the same records, without a second launch).
    table = script_module(script)
    assert table.HEADER.split()[:3] == ["configuration", "ours", "ms"]
    for record in records:
        line = table.render(record)
        assert line.startswith(f"{record['model']} {record['schedule']} pp2 vp{record['vp']} m4")
        assert line.split()[-1] == ("yes" if record["passed"] else "NO")
        assert str(record["goal"]) in line


def test_zero_bubble_against_torch_pipelining(torchrun: Torchrun) -> None:
    args = ["--steps", "1", "--microbatches", "4", "--json"]
    args += ["--forward-ms", "1", "--input-ms", "1", "--weight-ms", "1"]
    records = _records(torchrun(BENCHMARKS / "zero_bubble_vs_torch.py", 2, *args))
    assert [(r["schedule"], r["torch_schedule"], r["vp"]) for r in records] == [
        ("1f1b", "Schedule1F1B", 1),
        ("zb_h1", "ScheduleInterleavedZeroBubble", 1),
        ("zbv", "ScheduleZBVZeroBubble", 2),
    ]
    assert all(r["torch_error"] is None for r in records), records
    # The zero-bubble rows are also compared with our 1F1B at the same microbatch count.
    assert records[0]["ours_vs_1f1b"] is None
    ratios = [r[k] for r in records for k in ("ours_vs_torch", "ours_vs_theory")]
    ratios += [r["ours_vs_1f1b"] for r in records[1:]]
    assert all(float(x) > 0 for x in ratios), records  # type: ignore[arg-type]
    assert all(isinstance(r["passed"], bool) and r["goal"] for r in records)


def test_dualpipev_against_torch_pipelining(
    torchrun: Torchrun, script_module: Callable[[Path], ModuleType]
) -> None:
    script = BENCHMARKS / "dualpipev_vs_torch.py"
    args = ["--steps", "1", "--microbatches", "4", "--json", "--wait-ms", "0.5"]
    args += ["--forward-ms", "1", "--input-ms", "1", "--weight-ms", "1"]
    records = _records(torchrun(script, 2, *args))
    assert [(r["schedule"], r["fb_overlap"], r["torch_schedule"]) for r in records] == [
        ("1f1b", None, "Schedule1F1B"),
        ("zbv", None, "ScheduleZBVZeroBubble"),
        ("dualpipev", "threads", "ScheduleDualPipeV"),
        ("dualpipev", "sequential", "ScheduleDualPipeV"),
    ]
    ratios = [r[k] for r in records for k in ("ours_vs_torch", "ours_vs_theory")]
    ratios += [r["ours_vs_zbv"] for r in records[2:]]
    assert all(float(x) > 0 for x in ratios), records  # type: ignore[arg-type]
    # The sleeps' own makespan: DualPipeV's overlap hides a quarter of a forward per F&B step.
    assert [r["nominal_ms"] for r in records] == pytest.approx([14.0, 12.5, 11.75, 12.5])
    # Only the overlapped row is simulated with an F&B overlap (timed alone: 0 .. 1).
    assert [r["overlap"] for r in records if r["fb_overlap"] != "threads"] == [0.0] * 3
    assert 0.0 <= float(records[2]["overlap"]) <= 1.0  # type: ignore[arg-type]
    assert all(isinstance(r["passed"], bool) and r["goal"] for r in records)
    table = script_module(script)
    for record in records:
        line = table.render(record)
        assert line.startswith(f"{record['schedule']}")
        assert line.split()[-1] == ("yes" if record["passed"] else "NO")
