"""The package's shape: two rooms (planning, runtime), private modules, one small public face."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pp_schedules
from pp_schedules import planning, runtime

ROOT = Path(pp_schedules.__file__).parent
FACE_LIMIT = 40


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports anywhere in it (function level and TYPE_CHECKING too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _sources() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def test_the_face_is_small_and_every_name_resolves() -> None:
    names = set(pp_schedules.__all__)
    assert len(names) <= FACE_LIMIT, f"{len(names)} public names, at most {FACE_LIMIT}"
    for name in names:
        assert hasattr(pp_schedules, name), name
    # Everything the face shows lives in a room: the face adds nothing of its own.
    rooms = set(planning.__all__) | set(runtime.__all__)
    own = names - rooms - {"__version__", "planning", "runtime"}
    assert not own, f"names of the face found in no room: {sorted(own)}"


def test_no_package_loads_names_lazily() -> None:
    for name, path in _sources().items():
        tree = ast.parse(path.read_text())
        lazy = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
        assert not lazy, f"{name} defines a module-level __getattr__"


def test_each_room_names_its_api_and_hides_its_modules() -> None:
    for room in (planning, runtime):
        folder = Path(str(room.__file__)).parent
        modules = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        assert modules, room
        assert all(m.startswith("_") for m in modules), modules
        for name in room.__all__:
            assert hasattr(room, name), f"{room.__name__}.{name}"
    assert not [p for p in ROOT.glob("*.py") if p.stem != "__init__"], "a module outside the rooms"


def test_planning_imports_nothing_of_the_runtime_comm_or_distributed() -> None:
    forbidden = ("pp_schedules.runtime", "pp_comm", "torch.distributed")
    for name, path in _sources().items():
        if not name.startswith("pp_schedules.planning"):
            continue
        bad = sorted(i for i in _imports(path) if i.startswith(forbidden) or i == "pp_schedules")
        assert not bad, f"{name} imports {bad}"


def test_planning_runs_without_torch() -> None:
    """The planning room alone, its parent's face left out and torch made unimportable."""
    code = (
        "import sys, types; "
        "sys.modules['torch'] = None; "  # any `import torch` now raises ImportError
        f"parent = types.ModuleType('pp_schedules'); parent.__path__ = [{str(ROOT)!r}]; "
        "sys.modules['pp_schedules'] = parent; "
        "from pp_schedules.planning import resolve_schedule, simulate; "
        "r = resolve_schedule('auto', pp_size=4, vp_size=2, microbatch_counts=[4, 8]); "
        "simulate(r.report(8)); "
        "z = resolve_schedule('zbv', pp_size=4, microbatch_counts=[8], transport='nccl'); "
        "assert z.report(8).steps"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return [*path, module, target]
            if target in graph and target not in state:
                found = visit(target, [*path, module])
                if found:
                    return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [])
            if found:
                return found
    return None


def test_no_import_cycle_between_modules() -> None:
    """Module to module, function-level and TYPE_CHECKING imports included.

    A package's ``__init__`` only gathers its room's names, so the graph is taken between the
    modules themselves: `from pp_schedules.planning import x` counts as an edge to the module
    that defines x.
    """
    sources = _sources()
    defined: dict[str, str] = {}
    for room in (planning, runtime):
        for name in room.__all__:
            value = getattr(room, name)
            defined[f"{room.__name__}.{name}"] = getattr(value, "__module__", room.__name__)
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        if name.endswith(("planning", "runtime")) or name == "pp_schedules":
            continue
        targets = set()
        for imported in _imports(path):
            if imported in defined:
                targets.add(defined[imported])
            elif imported in sources:
                targets.add(imported)
        graph[name] = targets - {name}
    assert "pp_schedules.planning._resolution" in graph
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"
