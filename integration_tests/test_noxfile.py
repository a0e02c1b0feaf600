"""The noxfile's install settings: a CPU torch index is passed through for torch alone."""

from __future__ import annotations

import importlib.util
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
