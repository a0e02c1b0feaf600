"""Each package declares exactly the pp-* packages it imports, each one layer below it."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PACKAGES = Path(__file__).resolve().parent.parent / "packages"
DISTS = sorted(path.name for path in PACKAGES.iterdir() if (path / "pyproject.toml").is_file())
# The architecture: who may stand on whom (transitively closed).
LOWER = {
    "pp-state": set(),
    "pp-comm": {"pp-state"},
    "pp-schedules": {"pp-comm", "pp-state"},
    "pp-optim": {"pp-state"},
    "pp-tensor": {"pp-state"},
    "pp-train": {"pp-schedules", "pp-optim", "pp-tensor", "pp-comm", "pp-state"},
    "pp-testing": set(),
}
PLANNING = "Development Status :: 1 - Planning"
RANGE = re.compile(r"^(pp-[a-z]+)>=(\d+)\.(\d+),<(\d+)\.(\d+)$")


def project(dist: str) -> dict[str, object]:
    with open(PACKAGES / dist / "pyproject.toml", "rb") as handle:
        data: dict[str, object] = tomllib.load(handle)["project"]
    return data


def declared(dist: str) -> dict[str, str]:
    """pp-* requirement name -> requirement text."""
    requirements = project(dist).get("dependencies", [])
    assert isinstance(requirements, list)
    found = {}
    for requirement in requirements:
        name = re.split(r"[<>=!~\[; ]", str(requirement), maxsplit=1)[0]
        if name.startswith("pp-"):
            found[name] = str(requirement).replace(" ", "")
    return found


def imported(dist: str) -> set[str]:
    """pp-* distributions whose modules the package's source imports (its own excluded)."""
    own = dist.replace("-", "_")
    names: set[str] = set()
    for source in (PACKAGES / dist / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(), filename=str(source))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {name.replace("_", "-") for name in names if name.startswith("pp_") and name != own}


def modules(dist: str) -> list[str]:
    own = PACKAGES / dist / "src" / dist.replace("-", "_")
    return sorted(str(path.relative_to(own)) for path in own.rglob("*.py"))


def test_the_architecture_names_every_package() -> None:
    assert set(DISTS) == set(LOWER)


@pytest.mark.parametrize("dist", DISTS)
def test_imports_only_declared_lower_layers(dist: str) -> None:
    undeclared = imported(dist) - set(declared(dist))
    assert not undeclared, f"{dist} imports {sorted(undeclared)} without declaring them"
    upward = set(declared(dist)) - LOWER[dist]
    assert not upward, f"{dist} declares {sorted(upward)}, which are not below it"


@pytest.mark.parametrize("dist", DISTS)
def test_declares_only_what_it_imports(dist: str) -> None:
    unused = set(declared(dist)) - imported(dist)
    if not unused:
        return
    # A skeleton package (classified "Planning", nothing but __init__) declares the layers it
    # will stand on before it has code that imports them; once it has modules it must import
    # every layer it declares.
    classifiers = project(dist).get("classifiers", [])
    assert isinstance(classifiers, list)
    assert PLANNING in classifiers, f"{dist} declares {sorted(unused)} but never imports them"
    assert modules(dist) == ["__init__.py"], f"{dist} has code but is still classified Planning"
    assert set(declared(dist)) == LOWER[dist], f"skeleton {dist} must declare exactly {LOWER[dist]}"


@pytest.mark.parametrize("dist", DISTS)
def test_siblings_are_ranges_up_to_the_next_breaking_version(dist: str) -> None:
    for name, requirement in declared(dist).items():
        match = RANGE.match(requirement)
        assert match, (
            f"{dist}: {requirement!r} is not of the form '{name}>=X.Y,<X.(Y+1)' (0.x) or '<(X+1).0'"
        )
        low_major, low_minor, high_major, high_minor = map(int, match.groups()[1:])
        if low_major == 0:
            assert (high_major, high_minor) == (0, low_minor + 1), requirement
        else:
            assert (high_major, high_minor) == (low_major + 1, 0), requirement
        # The sibling's current version must satisfy the range, or the repo does not install.
        version = str(project(name)["version"])
        major, minor = (int(part) for part in version.split(".")[:2])
        assert (low_major, low_minor) <= (major, minor) < (high_major, high_minor), (
            f"{dist} requires {requirement} but {name} is {version}"
        )


@pytest.mark.parametrize("dist", DISTS)
def test_layout_of_a_package(dist: str) -> None:
    root = PACKAGES / dist
    own = root / "src" / dist.replace("-", "_")
    for required in ("README.md", "CHANGELOG.md", "pyproject.toml"):
        assert (root / required).is_file(), f"{dist} lacks {required}"
    assert (own / "py.typed").is_file(), f"{dist} lacks py.typed"
    assert (own / "__init__.py").is_file()
    version = str(project(dist)["version"])
    assert f"## {version}" in (root / "CHANGELOG.md").read_text(), (
        f"{dist} CHANGELOG has no {version} entry"
    )
    # One version literal, in pyproject: the code reads it from the installed metadata.
    init = (own / "__init__.py").read_text()
    assert f'_version("{dist}")' in init
    assert version not in init
    requirements = project(dist).get("dependencies", [])
    assert isinstance(requirements, list)
    torch_requirements = [str(r) for r in requirements if str(r).startswith("torch")]
    assert torch_requirements, f"{dist} must declare the torch range it supports"
    assert all("==" not in r for r in torch_requirements), (
        "packages declare a torch range, not a pin"
    )


def test_pp_train_library_never_imports_its_application() -> None:
    """The GPT, its corpus and the command (pp_train.app) use the library, never the reverse.

    import-linter's contract checks the modules under the package; this also covers the
    package's own ``__init__`` (a re-export would pull the application into every import).
    """
    root = PACKAGES / "pp-train" / "src" / "pp_train"
    for source in sorted(root.rglob("*.py")):
        relative = source.relative_to(root)
        if relative.parts[0] == "app" or relative.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(source.read_text(), filename=str(source))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("pp_train.app"), f"{relative} imports {name}"
