"""Tables of configuration fields in docs/*.md are generated from their dataclasses.

A page marks a table with ``<!-- config-table: pp_optim.OptimizerConfig -->`` and
``<!-- end config-table -->``; between them lies one row per field of that dataclass: its name,
its default and the docstring under it, read by pp-train's `field_docs` (the reader that writes
the command's ``--help``). Each field, default and docstring is thus written once, in its class.
The tests fail when a table differs from its rendering; to regenerate every table, run

    python integration_tests/test_config_tables.py
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import re
from pathlib import Path
from typing import Any

import pytest

from pp_optim import OptimizerConfig
from pp_train.flags import field_docs

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REGENERATE = "python integration_tests/test_config_tables.py"
TABLE = re.compile(
    r"(<!-- config-table: (?P<target>[\w.]+) -->\n)(?P<table>.*?)(<!-- end config-table -->)",
    re.DOTALL,
)
OPTIM_PAGE = DOCS / "pp-optim.md"


def default_text(field: dataclasses.Field[Any]) -> str:
    """A field's default as the table shows it (large powers of two as ``2.0**k``)."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, float) and value >= 2.0**16 and math.log2(value).is_integer():
        return f"`2.0**{int(math.log2(value))}`"
    return f"`{value!r}`"


def render_table(cls: type) -> str:
    """The markdown table of a dataclass's fields: name, default, docstring (one row each).

    Raises:
        TypeError: `cls` is not a dataclass.
        ValueError: A field has no docstring to show.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    docs = field_docs(cls)
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for field in dataclasses.fields(cls):
        if field.name not in docs:
            raise ValueError(f"{cls.__qualname__}.{field.name} has no docstring to show")
        meaning = docs[field.name].replace("|", "\\|")
        rows.append(f"| `{field.name}` | {default_text(field)} | {meaning} |")
    return "\n".join(rows) + "\n"


def resolve(target: str) -> type:
    """The class a marker names, ``module.Class``.

    Raises:
        ValueError: The name is not a module and a class in it.
    """
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None) if module else None
    if not isinstance(cls, type):
        raise ValueError(f"config-table marker names {target!r}, which is not a class")
    return cls


def marked_tables() -> list[tuple[Path, str]]:
    """Every (page, ``module.Class``) pair that a docs page marks for a table."""
    return [
        (page, found.group("target"))
        for page in sorted(DOCS.glob("*.md"))
        for found in TABLE.finditer(page.read_text())
    ]


def regenerate(page: Path) -> bool:
    """Rewrites every marked table of `page` from its dataclass; True when the page changed."""
    text = page.read_text()

    def rendered(found: re.Match[str]) -> str:
        table = render_table(resolve(found.group("target")))
        return found.group(1) + table + found.group(4)

    new = TABLE.sub(rendered, text)
    if new != text:
        page.write_text(new)
    return new != text


def shown_table(page: Path, target: str) -> str:
    """The table that `page` shows between the markers of `target`."""
    for found in TABLE.finditer(page.read_text()):
        if found.group("target") == target:
            return found.group("table")
    raise AssertionError(f"{page.relative_to(ROOT)} has no config-table marker for {target}")


def staleness(page: Path, target: str, rendered: str) -> str:
    """Why `page`'s table of `target` is not `rendered` (a diff), or '' when it is."""
    shown = shown_table(page, target)
    if shown == rendered:
        return ""
    diff = difflib.unified_diff(
        shown.splitlines(), rendered.splitlines(), "the page", "the dataclass", lineterm=""
    )
    return (
        f"{page.relative_to(ROOT)}: the table of {target} differs from the dataclass; "
        f"run `{REGENERATE}` to regenerate it\n" + "\n".join(diff)
    )


def test_the_optimizer_page_has_the_optimizer_config_table() -> None:
    assert (OPTIM_PAGE, "pp_optim.OptimizerConfig") in marked_tables(), (
        "docs/pp-optim.md must show the table of pp_optim.OptimizerConfig between "
        "'<!-- config-table: pp_optim.OptimizerConfig -->' and '<!-- end config-table -->'"
    )


@pytest.mark.parametrize(
    ("page", "target"),
    marked_tables(),
    ids=[f"{page.name}:{target}" for page, target in marked_tables()],
)
def test_each_table_equals_its_dataclass(page: Path, target: str) -> None:
    problem = staleness(page, target, render_table(resolve(target)))
    assert not problem, problem


@dataclasses.dataclass(frozen=True, kw_only=True)
class _WithANewField(OptimizerConfig):
    """OptimizerConfig as it would be with one more field."""

    new_setting: int = 3
    """A setting added after the page was generated."""


def test_a_new_field_makes_the_table_stale() -> None:
    rendered = render_table(_WithANewField)
    assert "| `new_setting` | `3` | A setting added after the page was generated. |" in rendered
    problem = staleness(OPTIM_PAGE, "pp_optim.OptimizerConfig", rendered)
    assert "+| `new_setting` | `3` |" in problem
    assert REGENERATE in problem


def test_every_optimizer_config_field_is_a_row() -> None:
    shown = shown_table(OPTIM_PAGE, "pp_optim.OptimizerConfig")
    rows = re.findall(r"^\| `(\w+)` \|", shown, flags=re.MULTILINE)
    fields = [field.name for field in dataclasses.fields(OptimizerConfig)]
    assert rows == fields, (
        f"docs/pp-optim.md lists {rows}, but OptimizerConfig has {fields}; run `{REGENERATE}`"
    )


def test_the_optimizer_page_says_where_clipping_and_weight_decay_happen() -> None:
    """The note beside the table quotes today's defaults."""
    text = " ".join(OPTIM_PAGE.read_text().split())
    defaults = OptimizerConfig()
    clipping = f"`clip_grad`, default `{defaults.clip_grad!r}`) happens inside `optimizer.step()`"
    assert clipping in text, f"docs/pp-optim.md no longer says: {clipping}"
    assert "must not call `clip_grad_norm` itself" in text
    decay = f"`weight_decay`, default `{defaults.weight_decay!r}`) applies to matrices only"
    assert decay in text, f"docs/pp-optim.md no longer says: {decay}"


def test_a_marker_for_something_else_than_a_class_is_refused() -> None:
    with pytest.raises(
        ValueError, match=re.escape("'pp_optim.no_such_class', which is not a class")
    ):
        resolve("pp_optim.no_such_class")
    with pytest.raises(TypeError, match="is not a dataclass"):
        render_table(int)


if __name__ == "__main__":
    for changed_page in sorted({page for page, _ in marked_tables()}):
        if regenerate(changed_page):
            print(f"regenerated the tables of {changed_page.relative_to(ROOT)}")
