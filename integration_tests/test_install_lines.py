"""Every ``pip install ./packages/...`` line in the READMEs and docs works from a checkout.

The pp packages are on no package index yet, so pip finds a sibling only when the same command
names its folder: a line that installs a package must also name every pp-* package it depends
on, transitively, as the packages' pyproject.toml files declare them. Pure Python: nothing is
installed.
"""

from __future__ import annotations

import re
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib  # type: ignore[import-not-found]  # Python 3.10 only

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"
FOLDERS = sorted(path.name for path in PACKAGES.iterdir() if (path / "pyproject.toml").is_file())
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *(PACKAGES / folder / "README.md" for folder in FOLDERS),
]
# A package folder as an install argument: ./packages/pp-train, packages/pp-train/,
# "./packages/pp-train[tensorboard]" (shlex has removed the quotes).
PACKAGE_ARGUMENT = re.compile(r"^(?:\./)?packages/(?P<folder>[\w.-]+?)/?(?:\[[\w,.-]*\])?$")


@cache
def dist_of(folder: str) -> str:
    """The distribution name declared in ``packages/<folder>/pyproject.toml``."""
    with open(PACKAGES / folder / "pyproject.toml", "rb") as handle:
        return str(tomllib.load(handle)["project"]["name"])


@cache
def sibling_requirements(dist: str) -> frozenset[str]:
    """The pp-* distributions `dist` declares in its dependencies, directly."""
    folder = {dist_of(folder): folder for folder in FOLDERS}[dist]
    with open(PACKAGES / folder / "pyproject.toml", "rb") as handle:
        requirements = tomllib.load(handle)["project"].get("dependencies", [])
    names = (re.split(r"[<>=!~\[;@ ]", str(text), maxsplit=1)[0] for text in requirements)
    return frozenset(name for name in names if name.startswith("pp-"))


def closure(dists: set[str]) -> set[str]:
    """`dists` and every pp-* distribution they depend on, transitively."""
    found: set[str] = set()
    pending = list(dists)
    while pending:
        dist = pending.pop()
        if dist not in found:
            found.add(dist)
            pending.extend(sibling_requirements(dist))
    return found


def install_commands(text: str) -> list[tuple[int, str]]:
    """Each ``pip install`` command of a page with its line number, continuations joined.

    In inline code (an odd number of backticks before it on its line) a command ends at the
    closing backtick; in a code block, at the end of the line unless that ends with a backslash.
    """
    lines = text.splitlines()
    commands = []
    for index, line in enumerate(lines):
        start = line.find("pip install")
        if start < 0:
            continue
        command = line[start:]
        if line[:start].count("`") % 2:
            command = command.split("`", 1)[0]
        following = index + 1
        while command.rstrip().endswith("\\") and following < len(lines):
            command = command.rstrip()[:-1] + " " + lines[following]
            following += 1
        commands.append((index + 1, command))
    return commands


def named_folders(command: str) -> list[str]:
    """The package folders a ``pip install`` command names (``./packages/<folder>``)."""
    try:
        arguments = shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote in prose: plain words are enough here
        arguments = command.split()
    return [
        found.group("folder")
        for argument in arguments
        if (found := PACKAGE_ARGUMENT.match(argument)) is not None
    ]


def line_problem(folders: list[str]) -> str:
    """What a command naming these package folders lacks to install from a checkout, or ''."""
    unknown = sorted(set(folders) - set(FOLDERS))
    if unknown:
        return f"names {', '.join(unknown)}, which packages/ does not hold (it has {FOLDERS})"
    named = {dist_of(folder) for folder in folders}
    missing = sorted(closure(named) - named)
    if not missing:
        return ""
    folder_of = {dist_of(folder): folder for folder in FOLDERS}
    needs = "; ".join(
        f"{dist} needs {', '.join(sorted(closure({dist}) & set(missing)))}"
        for dist in sorted(named)
        if closure({dist}) & set(missing)
    )
    return (
        f"misses {' '.join(f'./packages/{folder_of[dist]}' for dist in missing)} ({needs}); "
        "siblings are on no package index, so the same command must name them"
    )


def page_problems(page: Path, text: str) -> list[str]:
    """One message per install line of `page` that names ./packages/... and lacks a sibling."""
    shown = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    problems = []
    for number, command in install_commands(text):
        folders = named_folders(command)
        problem = line_problem(folders) if folders else ""
        if problem:
            problems.append(f"{shown}:{number}: `{' '.join(command.split())}` {problem}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_install_lines_name_every_sibling(page: Path) -> None:
    problems = page_problems(page, page.read_text())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_package_readme_shows_how_to_install_it(folder: str) -> None:
    readme = PACKAGES / folder / "README.md"
    installed = {
        name
        for _, command in install_commands(readme.read_text())
        for name in named_folders(command)
    }
    assert folder in installed, (
        f"packages/{folder}/README.md has no `pip install ./packages/{folder} ...` line "
        "(with its pp-* dependencies, from the repository root)"
    )


def test_the_closure_follows_the_pyprojects() -> None:
    assert closure({"pp-schedules"}) == {"pp-schedules", "pp-comm", "pp-state"}
    assert closure({"pp-train"}) >= {"pp-tensor", "pp-optim", "pp-schedules", "pp-state"}
    assert closure({"pp-testing"}) == {"pp-testing"}


def test_a_line_that_misses_a_sibling_is_named_with_the_missing_packages() -> None:
    text = "\n".join(
        [
            "```bash",
            "pip install ./packages/pp-state ./packages/pp-comm   # + p2p",
            "pip install ./packages/pp-state ./packages/pp-comm \\",
            '            "./packages/pp-schedules[extra]"',
            "pip install ./packages/pp-schedules",
            "```",
            "Or `pip install ./packages/pp-tensor` in prose, and `pip install numpy`.",
            "pip install ./packages/pp-nothing",
        ]
    )
    problems = page_problems(Path("page.md"), text)
    assert problems == [
        "page.md:5: `pip install ./packages/pp-schedules` misses ./packages/pp-comm "
        "./packages/pp-state (pp-schedules needs pp-comm, pp-state); siblings are on no "
        "package index, so the same command must name them",
        "page.md:7: `pip install ./packages/pp-tensor` misses ./packages/pp-state "
        "(pp-tensor needs pp-state); siblings are on no package index, so the same command "
        "must name them",
        f"page.md:8: `pip install ./packages/pp-nothing` names pp-nothing, which packages/ "
        f"does not hold (it has {FOLDERS})",
    ]
