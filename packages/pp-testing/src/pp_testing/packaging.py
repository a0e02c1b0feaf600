"""Checks that a package is installed the way users get it: alone, typed, versioned."""

from __future__ import annotations

import importlib.metadata
import re
from types import ModuleType

__all__ = ["check_installed_alone", "project_requirements"]

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_PROJECT_PREFIX = "pp-"
_TEST_HELPERS = "pp-testing"


def project_requirements(dist_name: str) -> set[str]:
    """The pp-* distributions `dist_name` needs at run time, transitively.

    Args:
        dist_name: An installed distribution, such as "pp-comm".

    Returns:
        Normalised names of the pp-* distributions it requires, directly or through others.
    """
    found: set[str] = set()
    pending = [dist_name]
    while pending:
        for requirement in importlib.metadata.requires(pending.pop()) or []:
            if ";" in requirement and "extra" in requirement.split(";", 1)[1]:
                continue
            match = _NAME.match(requirement)
            assert match is not None, requirement
            name = match.group(1).lower().replace("_", "-")
            if name.startswith(_PROJECT_PREFIX) and name not in found:
                found.add(name)
                pending.append(name)
    return found


def check_installed_alone(dist_name: str, module: ModuleType) -> None:
    """Assert that `module` is the installed `dist_name`, as a user would have it.

    Checks that the module comes from the installed distribution (not a source tree), that
    `__version__` is the distribution's version, that `__all__` names exist, that `py.typed`
    ships, and that no pp-* distribution other than the declared ones (and these test helpers)
    is installed beside it.

    Args:
        dist_name: The distribution name, such as "pp-state".
        module: The imported top-level module, such as ``pp_state``.

    Raises:
        AssertionError: One of the checks fails; the message says which.
    """
    distribution = importlib.metadata.distribution(dist_name)
    version = getattr(module, "__version__", None)
    assert version == distribution.version, (
        f"{module.__name__}.__version__ is {version!r}, "
        f"installed {dist_name} is {distribution.version}"
    )
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, list), f"{module.__name__} has no explicit __all__ list"
    assert exported, f"{module.__name__}.__all__ is empty"
    missing = [name for name in exported if not hasattr(module, name)]
    assert not missing, f"{module.__name__}.__all__ names missing attributes: {missing}"
    files = [str(path) for path in distribution.files or []]
    top = module.__name__.replace(".", "/")
    assert f"{top}/py.typed" in files, f"{dist_name} does not ship {top}/py.typed"
    module_file = str(module.__file__)
    located = str(distribution.locate_file(f"{top}/__init__.py"))
    assert module_file == located, f"{module.__name__} imported from {module_file}, not the install"
    installed = {
        (dist.metadata["Name"] or "").lower().replace("_", "-")
        for dist in importlib.metadata.distributions()
    }
    project = {name for name in installed if name.startswith(_PROJECT_PREFIX)}
    allowed = {dist_name, _TEST_HELPERS} | project_requirements(dist_name)
    assert project <= allowed, (
        f"{dist_name} is tested beside undeclared project packages {sorted(project - allowed)}"
    )
    assert allowed <= project, f"declared packages missing: {sorted(allowed - project)}"
