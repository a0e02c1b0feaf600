"""The shape of every library package's source, read from its files (no imports needed).

- no module is longer than 800 lines;
- no module imports a private (underscore) name of another module;
- no package has an import cycle between its modules, imports inside functions included
  (imports under ``if TYPE_CHECKING:`` never run and are left out).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    path for path in (ROOT / "packages").glob("*/src/*") if (path / "__init__.py").is_file()
)
MAX_LINES = 800


def _modules(package: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the package (``__init__`` as the package)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from (i for child in node.orelse for i in _imports_in(child))
            continue
        yield from _imports_in(node)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _targets(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """(imported module, imported name or '') for each import of `module`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ""
            continue
        source = _absolute(module, node, path.name == "__init__.py")
        for alias in node.names:
            yield source, alias.name


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for module, path in modules.items():
        for source, name in _targets(module, path, modules):
            target = f"{source}.{name}" if f"{source}.{name}" in modules else source
            if target in modules and target != module:
                edges[module].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", SOURCES, ids=[path.name for path in SOURCES])
def test_no_module_is_over_800_lines(package: Path) -> None:
    long = {
        name: count
        for name, path in _modules(package).items()
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("package", SOURCES, ids=[path.name for path in SOURCES])
def test_no_module_imports_a_private_name_of_another(package: Path) -> None:
    modules = _modules(package)
    private = [
        f"{module} imports {name} from {source}"
        for module, path in modules.items()
        for source, name in _targets(module, path, modules)
        if source.startswith("pp_") and name.startswith("_") and not name.startswith("__")
    ]
    assert not private, "\n".join(private)


@pytest.mark.parametrize("package", SOURCES, ids=[path.name for path in SOURCES])
def test_no_import_cycle_between_a_packages_modules(package: Path) -> None:
    assert _cycles(_edges(_modules(package))) == []


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    package = tmp_path / "pp_demo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pp_demo.b import g\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from pp_demo import a\n    return a\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pp_demo import a\n"
    )
    assert _cycles(_edges(_modules(package))) == [["pp_demo.a", "pp_demo.b"]]
