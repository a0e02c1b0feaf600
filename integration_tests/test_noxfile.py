"""The noxfile: torch's index, the test workers, and sessions skipped while nothing changed."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def noxfile() -> ModuleType:
    pytest.importorskip("nox")  # the integration session installs it
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_without_an_index_torch_installs_with_everything_else(noxfile: ModuleType) -> None:
    assert noxfile.torch_install_args({}) == []
    assert noxfile.torch_install_args({"PP_TORCH_INDEX_URL": "  "}) == []


def test_a_cpu_index_is_used_for_the_pinned_torch_alone(noxfile: ModuleType) -> None:
    index = "https://wheels.example.invalid/cpu"
    args = noxfile.torch_install_args({"PP_TORCH_INDEX_URL": index})
    assert args == [noxfile.TORCH, "--index-url", index]
    assert noxfile.TORCH == "torch==2.13.0"  # the README's pin: a +cpu build satisfies it


def test_tests_run_in_two_to_four_workers_unless_told(noxfile: ModuleType) -> None:
    assert noxfile.test_workers({}, 2) == ["-n", "2"]
    assert noxfile.test_workers({}, 1) == ["-n", "2"]
    assert noxfile.test_workers({}, None) == ["-n", "2"]
    assert noxfile.test_workers({}, 64) == ["-n", "4"]
    assert noxfile.test_workers({"PP_TEST_WORKERS": "0"}, 64) == ["-n", "0"]
    assert noxfile.test_workers({"PP_TEST_WORKERS": " 8 "}, 2) == ["-n", "8"]


@pytest.mark.reliability
def test_a_worker_count_that_is_not_a_number_is_refused(noxfile: ModuleType) -> None:
    with pytest.raises(
        ValueError, match=r"PP_TEST_WORKERS must be a whole number \(0 for none\), got 'auto'"
    ):
        noxfile.test_workers({"PP_TEST_WORKERS": "auto"}, 2)


def _environment(path: Path, *distributions: str) -> Path:
    """A virtualenv's outline: pyvenv.cfg and empty dist-info folders (pp-* ones with a RECORD)."""
    site = path / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (path / "pyvenv.cfg").write_text("version_info = 3.11.9\n")
    for name in distributions:
        (site / f"{name}.dist-info").mkdir()
        if name.startswith("pp_"):
            (site / f"{name}.dist-info" / "RECORD").write_text("pp_x/__init__.py,sha256=abc,10\n")
    return path


def test_the_fingerprint_follows_files_and_the_environment_but_not_caches(
    noxfile: ModuleType, tmp_path: Path
) -> None:
    root = tmp_path / "repo"
    (root / "packages" / "pp-x" / "src").mkdir(parents=True)
    (root / "packages" / "pp-x" / "src" / "x.py").write_text("A = 1\n")
    (root / "noxfile.py").write_text("")
    env = _environment(tmp_path / "venv", "torch-2.13.0", "pp_x-0.1.0")
    inputs = ["noxfile.py", "packages/pp-x"]
    first = noxfile.fingerprint(root, inputs, env)
    assert noxfile.fingerprint(root, inputs, env) == first
    # Caches, bytecode and build output are not inputs.
    for ignored in ["__pycache__/x.cpython-311.pyc", ".mypy_cache/x.json", "x.egg-info/PKG-INFO"]:
        (root / "packages" / "pp-x" / ignored).parent.mkdir(parents=True, exist_ok=True)
        (root / "packages" / "pp-x" / ignored).write_text("anything")
    (root / "packages" / "pp-x" / "src" / "x.pyc").write_bytes(b"\0")
    assert noxfile.fingerprint(root, inputs, env) == first
    # A file outside the inputs is not either.
    (root / "README.md").write_text("# elsewhere\n")
    assert noxfile.fingerprint(root, inputs, env) == first
    # An edit, a new file, a renamed file and a changed environment each are.
    seen = {first}
    (root / "packages" / "pp-x" / "src" / "x.py").write_text("A = 2\n")
    seen.add(noxfile.fingerprint(root, inputs, env))
    (root / "packages" / "pp-x" / "src" / "y.py").write_text("")
    seen.add(noxfile.fingerprint(root, inputs, env))
    (root / "packages" / "pp-x" / "src" / "y.py").rename(
        root / "packages" / "pp-x" / "src" / "z.py"
    )
    seen.add(noxfile.fingerprint(root, inputs, env))
    (env / "lib" / "python3.11" / "site-packages" / "numpy-2.0.0.dist-info").mkdir()
    seen.add(noxfile.fingerprint(root, inputs, env))
    record = env / "lib" / "python3.11" / "site-packages" / "pp_x-0.1.0.dist-info" / "RECORD"
    record.write_text("pp_x/__init__.py,sha256=def,10\n")  # reinstalled from other sources
    seen.add(noxfile.fingerprint(root, inputs, env))
    (env / "pyvenv.cfg").write_text("version_info = 3.12.1\n")
    seen.add(noxfile.fingerprint(root, inputs, env))
    assert len(seen) == 7


def test_a_session_is_skipped_only_when_its_record_matches(
    noxfile: ModuleType, tmp_path: Path
) -> None:
    record = tmp_path / noxfile.PASSED_RECORD
    assert not noxfile.passed_unchanged(record, "abc", {}, [])  # never passed
    record.write_text("abc 2026-12-01 20:00:00\n")
    assert noxfile.passed_unchanged(record, "abc", {}, [])
    assert noxfile.passed_unchanged(record, "abc", {"PP_RERUN": "0"}, [])
    assert not noxfile.passed_unchanged(record, "abd", {}, [])  # something changed
    assert not noxfile.passed_unchanged(record, "abc", {"PP_RERUN": "1"}, [])
    assert not noxfile.passed_unchanged(record, "abc", {}, ["-k", "layout"])  # asked for a run


@pytest.mark.reliability
def test_a_rerun_setting_other_than_0_or_1_is_refused(noxfile: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"PP_RERUN must be 0 or 1 \(1 runs every session\), got 'yes'"
    ):
        noxfile.passed_unchanged(tmp_path / "record", "abc", {"PP_RERUN": "yes"}, [])


def test_a_second_run_skips_a_session_that_passed_on_the_same_files(tmp_path: Path) -> None:
    """The lint session, run by nox in a copy of the repository: it passes and records; with
    its environment reused it is skipped; an edit or PP_RERUN=1 runs it again."""
    pytest.importorskip("nox")
    copy = tmp_path / "repo"
    shutil.copytree(
        ROOT, copy, ignore=shutil.ignore_patterns(".git", ".nox", "*_cache", "__pycache__")
    )
    env = {key: value for key, value in os.environ.items() if key != "PP_RERUN"}

    def lint(*flags: str, returncode: int = 0, **extra: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "nox", "-s", "lint", *flags],
            cwd=copy, capture_output=True, text=True, env={**env, **extra}, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == returncode, done.stdout + done.stderr
        return done.stdout + done.stderr

    assert "Session lint was successful" in lint()
    assert (copy / ".nox" / "lint" / "pp-passed.txt").is_file()
    skipped = lint("-R")
    assert "Session lint skipped: unchanged since it passed at" in skipped
    assert "PP_RERUN=1 runs it again" in skipped
    assert "Session lint was successful" in lint("-R", PP_RERUN="1")
    (copy / "docs" / "notes.md").write_text("# A new page\n")
    assert "Session lint was successful" in lint("-R")
    assert "Session lint skipped" in lint("-R")
    # A failure leaves no record: once fixed, the session runs again rather than being skipped.
    (copy / "docs" / "badly_formatted.py").write_text("x=1\n")
    assert "Session lint failed" in lint("-R", returncode=1)
    assert not (copy / ".nox" / "lint" / "pp-passed.txt").exists()
    (copy / "docs" / "badly_formatted.py").unlink()
    assert "Session lint was successful" in lint("-R")
