"""The schedule registry: each record, the default rule, auto's candidates, and names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import pp_schedules
from pp_schedules import (
    SCHEDULE_REGISTRY,
    SCHEDULES,
    ScheduleSpec,
    candidates_for,
    default_schedule,
    placement_for,
    plan,
    schedule_spec,
    schedules_for,
)

RECORDS = {
    # name: (placement, chunks per rank, split backward)
    "no_pipelining": ("looped", 1, False),
    "gpipe": ("looped", None, False),
    "1f1b": ("looped", 1, False),
    "interleaved_1f1b": ("looped", None, False),
    "zb_h1": ("looped", 1, True),
    "zbv": ("v", 2, True),
}
# A size each schedule runs: (pp_size, vp_size).
RUNS = {
    "no_pipelining": (1, 1),
    "gpipe": (2, 3),
    "1f1b": (4, 1),
    "interleaved_1f1b": (2, 2),
    "zb_h1": (4, 1),
    "zbv": (4, 2),
}


def test_the_registry_holds_the_six_schedules_in_order() -> None:
    assert list(SCHEDULE_REGISTRY) == list(RECORDS)
    assert list(SCHEDULES) == list(RECORDS)


@pytest.mark.parametrize("name", list(RECORDS))
def test_each_record_says_where_it_runs_and_how(name: str) -> None:
    spec = schedule_spec(name)
    assert isinstance(spec, ScheduleSpec)
    assert (spec.name, spec.placement, spec.chunks, spec.split_backward) == (name, *RECORDS[name])


@pytest.mark.parametrize("name", list(RECORDS))
def test_each_records_plan_matches_the_record(name: str) -> None:
    spec = schedule_spec(name)
    pp, vp = RUNS[name]
    made = plan(name, pp_size=pp, num_microbatches=8, vp_size=vp)
    assert made.placement.name == spec.placement == placement_for(name, pp, vp).name
    assert spec.chunks in (None, made.vp_size)
    split = any(a.kind in ("I", "W") for rank in made for a in rank)
    assert split == spec.split_backward
    generated = SCHEDULES[name](pp_size=pp, num_microbatches=8, vp_size=vp)
    assert [tuple(rank) for rank in generated] == list(made)


@pytest.mark.parametrize(
    ("pp", "vp", "placement", "expected"),
    [
        (1, 1, None, "no_pipelining"),
        (4, 1, None, "1f1b"),
        (1, 2, None, "interleaved_1f1b"),
        (4, 2, None, "interleaved_1f1b"),
        (4, 2, "looped", "interleaved_1f1b"),
        (4, 2, "v", "gpipe"),
        (2, 1, "looped", "1f1b"),
    ],
)
def test_the_default_schedule_is_megatrons_choice(
    pp: int, vp: int, placement: str | None, expected: str
) -> None:
    assert default_schedule(pp, vp, placement) == expected
    if placement is not None:
        where = pp_schedules.Placement.named(placement, pp, vp)
        assert default_schedule(pp, vp, where) == expected


def test_placement_for_puts_zbv_on_the_v_and_the_rest_looped() -> None:
    assert placement_for("zbv", 4, 2) == pp_schedules.Placement.v_shape(4, 2)
    for name in ("gpipe", "interleaved_1f1b"):
        assert placement_for(name, 4, 2) == pp_schedules.Placement.looped(4, 2)
    with pytest.raises(ValueError, match="unknown schedule 'v'"):
        placement_for("v", 4, 2)


def test_an_unknown_name_lists_the_valid_ones_and_auto() -> None:
    with pytest.raises(ValueError, match="unknown schedule") as caught:
        schedule_spec("zero_bubble")
    assert str(caught.value) == (
        "unknown schedule 'zero_bubble'; valid: no_pipelining, gpipe, 1f1b, interleaved_1f1b, "
        "zb_h1, zbv, auto"
    )


@pytest.mark.parametrize(
    ("vp", "expected"),
    [
        (1, [("1f1b", "looped"), ("zb_h1", "looped"), ("gpipe", "looped")]),
        (2, [("interleaved_1f1b", "looped"), ("zbv", "v"), ("gpipe", "looped")]),
        (4, [("interleaved_1f1b", "looped"), ("gpipe", "looped")]),
    ],
)
def test_autos_candidates_come_from_the_registry(vp: int, expected: list[tuple[str, str]]) -> None:
    assert schedules_for(vp) == expected
    assert candidates_for(vp) == expected


@pytest.mark.parametrize(
    ("name", "vp", "message"),
    [
        ("1f1b", 2, "1f1b runs one model chunk per rank, but vp_size is 2; use 'interleaved_1f1b'"),
        ("zb_h1", 2, "zb_h1 runs one model chunk per rank, but vp_size is 2; use 'zbv' or"),
        ("zbv", 1, "zbv runs two model chunks per rank in a V, but vp_size is 1; use vp_size=2"),
    ],
)
def test_chunk_refusals_name_the_record_and_an_alternative(
    name: str, vp: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        schedule_spec(name).check(pp_size=4, num_microbatches=8, vp_size=vp)


def test_a_v_schedule_runs_on_the_v_only() -> None:
    with pytest.raises(ValueError, match="zbv runs on the V placement, not looped"):
        plan("zbv", pp_size=4, num_microbatches=8, vp_size=2, placement="looped")


def test_planning_modules_import_no_torch() -> None:
    code = (
        "import sys, pp_schedules; "
        "r = pp_schedules.resolve_schedule('auto', pp_size=4, vp_size=2, "
        "microbatch_counts=[4, 8]); "
        "assert r.report(8).steps; "
        "assert 'torch' not in sys.modules, 'the registry or resolution pulled in torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _imports(path: Path, package: str) -> set[str]:
    """The package modules `path` imports anywhere in it (function level and TYPE_CHECKING too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n == package or n.startswith(package + "."))
    return found


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


def test_the_package_has_no_import_cycle() -> None:
    """Every import of a module counts, function-level and TYPE_CHECKING ones included."""
    root = Path(pp_schedules.__file__).parent
    graph: dict[str, set[str]] = {}
    modules = {f"pp_schedules.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__"}
    for path in root.glob("*.py"):
        name = "pp_schedules" if path.stem == "__init__" else f"pp_schedules.{path.stem}"
        # `from pp_schedules.x import y` names module x (y is a name in it, or a submodule).
        graph[name] = {
            n if n in modules or n == "pp_schedules" else n.rsplit(".", 1)[0]
            for n in _imports(path, "pp_schedules")
        } - {name}
    assert {"pp_schedules.registry", "pp_schedules.resolution"} <= set(graph)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_every_schedule_has_a_title_for_people() -> None:
    titles = {name: spec.title for name, spec in SCHEDULE_REGISTRY.items()}
    assert titles == {
        "no_pipelining": "no pipelining",
        "gpipe": "GPipe",
        "1f1b": "1F1B",
        "interleaved_1f1b": "interleaved 1F1B",
        "zb_h1": "zero-bubble ZB-H1",
        "zbv": "zero-bubble ZB-V (V placement)",
    }
