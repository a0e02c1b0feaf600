"""docs/porting.md lists Megatron names that exist, and every name of the facade."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "porting.md"


def _listed() -> dict[str, list[str]]:
    """Module -> the names its section lists (after "Names:")."""
    sections = re.split(r"^### `([\w.]+)`$", PAGE.read_text(), flags=re.MULTILINE)
    listed = {}
    for module, body in zip(sections[1::2], sections[2::2], strict=True):
        found = re.search(r"^Names: (.*?)\.$", body, flags=re.MULTILINE | re.DOTALL)
        assert found, f"the section of {module} has no 'Names:' list"
        listed[module] = re.findall(r"`([\w.]+)`", found.group(1))
    return listed


def test_the_page_lists_the_packages() -> None:
    assert set(_listed()) == {
        "pp_state.parallel_state",
        "pp_comm",
        "pp_schedules",
        "pp_optim",
        "pp_tensor",
        "pp_tensor.megatron",
        "pp_train",
    }


@pytest.mark.parametrize("module", sorted(_listed()))
def test_every_listed_name_exists(module: str) -> None:
    imported = importlib.import_module(module)
    for name in _listed()[module]:
        target: object = imported
        for part in name.split("."):
            assert hasattr(target, part), f"docs/porting.md lists {module}.{name}, which is missing"
            target = getattr(target, part)


def test_every_facade_name_is_listed() -> None:
    facade = importlib.import_module("pp_state.parallel_state")
    listed = set(_listed()["pp_state.parallel_state"])
    missing = sorted(set(facade.__all__) - listed)
    assert not missing, f"docs/porting.md does not list {missing}"


def test_every_tensor_parallel_facade_name_is_listed() -> None:
    facade = importlib.import_module("pp_tensor.megatron")
    missing = sorted(set(facade.__all__) - set(_listed()["pp_tensor.megatron"]))
    assert not missing, f"docs/porting.md does not list {missing}"
