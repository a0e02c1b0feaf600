"""The soak script (packages/pp-train/benchmarks/soak.py): its flags, its fault plan, a tiny run.

The full soak (1,000 steps, every fault kind) is ``python3 -m nox -s soak``; here a 30-step run
with one killed rank shows the whole loop works: inject, restart, resume, compare.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOAK = ROOT / "packages" / "pp-train" / "benchmarks" / "soak.py"
VALID = "kill, term, stop, disk, corrupt"


@pytest.fixture
def soak(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module, registered (its dataclasses look their module up by name)."""
    spec = importlib.util.spec_from_file_location("soak_under_test", SOAK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SOAK), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_a_fault_list_parses_in_order_with_repeats(soak: ModuleType) -> None:
    assert soak.parse_faults("kill, term,kill") == ("kill", "term", "kill")
    assert soak.parse_faults("corrupt") == ("corrupt",)


@pytest.mark.reliability
@pytest.mark.parametrize("text", ["", "kill,", "kill,,term", "segv", "kill,oom"])
def test_a_fault_list_that_does_not_parse_names_the_valid_faults(
    soak: ModuleType, text: str
) -> None:
    with pytest.raises(ValueError, match=f"valid: {VALID}|list of {VALID}") as caught:
        soak.parse_faults(text)
    assert repr(text) in str(caught.value) or "unknown fault(s)" in str(caught.value)


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--faults", "kill,segv"], f"--faults: unknown fault(s) segv; valid: {VALID}"),
        (["--seed", "one"], "--seed must be a whole number 0 or more, got 'one'"),
        (["--seed", "-3"], "--seed must be a whole number 0 or more, got '-3'"),
        (["--steps", "0"], "--steps must be a whole number 1 or more, got '0'"),
        (["--ckpt-format", "zip"], "argument --ckpt-format: invalid choice: 'zip'"),
        (["--timeout-minutes", "nan"], "--timeout-minutes must be a positive number, got 'nan'"),
        (
            ["--steps", "100", "--save-interval", "50"],
            "--steps 100 is too short for 5 fault(s) with --save-interval 50: each needs a "
            "slice of 2 save intervals after the first save; use --steps 550 or more",
        ),
    ],
)
def test_bad_flags_are_refused_with_one_line_before_anything_runs(
    args: list[str], message: str
) -> None:
    done = _run(*args, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr.replace('"', "'")
    assert done.stdout == ""


def test_the_plan_is_seeded_one_fault_per_slice_after_the_first_save(soak: ModuleType) -> None:
    config = soak.parse_args(["--seed", "7", "--steps", "1000", "--save-interval", "50"])
    plan = soak.plan_faults(config)
    assert plan == soak.plan_faults(config)
    other = soak.plan_faults(soak.parse_args(["--seed", "8"]))
    assert [f.step for f in plan] != [f.step for f in other]
    assert [f.kind for f in plan] == list(soak.FAULT_KINDS)
    slice_ = (1000 - 50) // 5
    for index, fault in enumerate(plan):
        low = 50 + index * slice_
        assert low < (fault.save or fault.step) <= low + slice_
        assert (fault.rank is None) == (fault.kind == "disk")
        assert fault.rank is None or 0 <= fault.rank < 4
    disk = plan[soak.FAULT_KINDS.index("disk")]
    assert disk.save % 50 == 0
    assert disk.step == disk.save - soak.DISK_LEAD


@pytest.mark.reliability
def test_a_tiny_soak_recovers_from_a_killed_rank_with_equal_parameters(tmp_path: Path) -> None:
    """30 steps on 4 ranks twice (reference and faulted) with one restart: 30 to 45 s."""
    args = ["--steps", "30", "--save-interval", "10", "--faults", "kill", "--seed", "3"]
    done = _run(*args, "--workdir", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["faults_injected"] == summary["recovered"] == 1
    assert summary["hangs"] == summary["stale_files_left"] == 0
    assert summary["params_equal"] == "yes"
    assert 0 <= summary["steps_lost"] < 10  # at most the steps since the last save
    assert "fault     step  rank  named" in done.stdout
