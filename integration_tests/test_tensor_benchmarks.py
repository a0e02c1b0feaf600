"""Tensor benchmarks still run and print their records (no timing judged).

pp-train's tensor-parallel layouts and pp-tensor's context-parallel attention.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "packages" / "pp-train" / "benchmarks" / "tp_bench.py"
# The `torchrun` fixture from conftest.py: (script, ranks, *args) -> finished process.
Torchrun = Callable[..., subprocess.CompletedProcess[str]]
HIDDEN = 32


def layer_bytes(hidden: int) -> int:
    """fp32 bytes of one unsplit block: qkv, proj, fc1, fc2 (weights, biases), two LayerNorms."""
    return 4 * (12 * hidden * hidden + 13 * hidden)


def test_ours_and_torchs_tensor_parallelism_side_by_side(
    torchrun: Torchrun, script_module: Callable[[Path], ModuleType]
) -> None:
    """Both layouts, with and without sequence parallelism: equal losses, half the bytes."""
    done = torchrun(
        SCRIPT, 4, "--quick", "--json", "--hidden", str(HIDDEN), "--heads", "4", "--seq", "8",
        "--micro-batch", "2", "--microbatches", "4", "--layers", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run, *records = [json.loads(line) for line in done.stdout.splitlines() if line[:1] == "{"]
    assert run["benchmark"] == "tp_bench_run"
    assert run["world"] == 4
    assert {"load_start", "load_end"} <= run.keys()
    assert [(r["layout"], r["pp"], r["dp"], r["sequence_parallel"]) for r in records] == [
        ("tp2xpp2", 2, 1, False), ("tp2xpp2", 2, 1, True),
        ("tp2xdp2", 1, 2, False), ("tp2xdp2", 1, 2, True),
    ]  # fmt: skip
    for record in records:
        layers = 2 // record["pp"]  # per rank
        assert record["same_loss"], record
        assert record["ours_param_bytes_tp1"] == layers * layer_bytes(HIDDEN)
        for side in ("ours", "torch"):
            assert record[f"{side}_param_bytes"] == record["ours_param_bytes"]
            assert abs(record[f"{side}_bytes_ratio"] / 0.5 - 1) <= 0.02
            assert record[f"{side}_ms"] > 0
        assert record["ours_vs_torch"] == record["ours_ms"] / record["torch_ms"]
    # Without --json the script prints these records as a table (checked on the same records).
    module = script_module(SCRIPT)
    header, *rows = module.table(records).splitlines()
    assert header.split()[-1] == "met"
    assert [row.split()[-1] for row in rows] == ["yes" if r["passed"] else "NO" for r in records]


CP_SCRIPT = ROOT / "packages" / "pp-tensor" / "benchmarks" / "cp_attention.py"


def test_context_parallel_ring_and_all_gather_side_by_side(torchrun: Torchrun) -> None:
    """Both ways of passing keys and values, checked equal and timed, at 256 and 512 tokens."""
    done = torchrun(CP_SCRIPT, 2, "--quick", "--json", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines() if line[:1] == "{"]
    assert [r["seq"] for r in records] == [256, 512]
    for record in records:
        assert record["benchmark"] == "cp_attention"
        for key in ("ring_ms", "all_gather_ms", "ratio", "sdpa_ms", "load_start", "load_end"):
            assert isinstance(record[key], float), (key, record)
            assert record[key] > 0, (key, record)
        # torch's own context_parallel is tried on the same inputs: it runs, or says why not.
        assert record["torch"].startswith(("runs", "NotImplementedError", "RuntimeError"))
