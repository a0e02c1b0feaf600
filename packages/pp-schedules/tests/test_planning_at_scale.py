"""Planning at scale: the fast generators, validator and simulator do what 0.11.0's did.

The zero-bubble generators are compared action for action with 0.11.0's
(`_reference_generators`) at the sizes the other tests use and at random sizes up to pp 16.
Every built-in schedule's lowering, validation (gloo and NCCL rules, with and without
prefetch and shape headers, refusals included), simulation and memory walk are compared
with fingerprints 0.11.0 wrote (``data/planning_golden.json``; rewrite it with
``python tests/test_planning_at_scale.py --write`` only from a release known to be right).
0.11.0 checked the links of a plan in an order that changed with Python's string hashing,
so of several mis-paired links it named any; the fingerprints were written by 0.11.0 with
that one change: links in sorted order, as the validator checks them now.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pp_schedules import Costs, Plan, PlanError, resolve_schedule
from pp_schedules.planning import (
    Action,
    MemoryModel,
    PlanOption,
    ScheduleSpec,
    StageMemory,
    choose_fitting,
    format_plan,
    placement_for,
    plan,
    simulate,
    validate,
)
from pp_schedules.planning import _plan_cache as plan_cache
from pp_schedules.planning import _zero_bubble as zero_bubble
from pp_schedules.planning._nccl_rules import nccl_problem
from pp_schedules.planning._validation import Links, sends_delivered
from pp_state.placement import Placement

GOLDEN = Path(__file__).parent / "data" / "planning_golden.json"


def _reference() -> ModuleType:
    """0.11.0's zero-bubble generators, loaded by path (tests import no test modules)."""
    path = Path(__file__).parent / "_reference_generators.py"
    spec = importlib.util.spec_from_file_location("_reference_generators", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _reference()
UNEVEN = Costs(
    forward=1.5, backward=2.5, backward_input=1.0, backward_weight=1.5, transfer=0.3, exchange=0.1
)
# (name, vp_size, pp sizes, microbatch counts) fingerprinted.
GRID = [
    ("1f1b", 1, (1, 2, 3, 4, 8), (1, 2, 3, 5, 8, 16)),
    ("gpipe", 1, (1, 2, 4), (1, 4, 6)),
    ("gpipe", 2, (2, 4), (1, 4, 6)),
    ("interleaved_1f1b", 2, (2, 3, 4, 8), (2, 4, 6, 8, 16)),
    ("interleaved_1f1b", 3, (2, 4), (4, 8)),
    ("zb_h1", 1, (2, 3, 4, 8, 16), (2, 3, 4, 8, 9, 16, 32)),
    ("zbv", 2, (2, 3, 4, 8, 16), (2, 3, 4, 8, 9, 16, 32)),
]


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _validated(chosen: object, m: int, fo: bool, **options: object) -> tuple[str, object]:
    try:
        report = validate(chosen, num_microbatches=m, forward_only=fo, **options)  # type: ignore[arg-type]
    except PlanError as error:
        return "refused", str(error)
    return "ok", ([[str(s) for s in rank] for rank in report.steps], report.peak_in_flight)


def _simulated(chosen: object, m: int, fo: bool) -> object:
    report = validate(chosen, num_microbatches=m, forward_only=fo, prefetch=1)  # type: ignore[arg-type]
    found: list[object] = []
    for costs in (Costs(), UNEVEN):
        run = simulate(report, costs)
        spans = [[(str(s.action), s.start, s.end) for s in rank] for rank in run.spans]
        found.append((run.makespan, run.bubble_fraction, spans))
    if not fo:
        stages = tuple(
            StageMemory(parameters=100 + s, activation_bytes=1000 + 10 * s, output_bytes=64)
            for s in range(report.placement.num_stages)  # type: ignore[union-attr]
        )
        tracks = simulate(report, UNEVEN, memory=MemoryModel(stages=stages)).memory
        found.append(tracks)
    found.append(sends_delivered(report.steps))
    return found


def fingerprint(name: str, pp: int, vp: int, m: int, fo: bool) -> dict[str, str]:
    """What 0.11.0 made of one configuration, hashed part by part."""
    try:
        chosen = plan(name, pp_size=pp, num_microbatches=m, vp_size=vp, forward_only=fo)
    except ValueError as error:
        return {"refused": _digest(str(error))}
    return {
        "plan": _digest(format_plan(chosen)),
        "gloo": _digest(_validated(chosen, m, fo)),
        "gloo prefetch 2": _digest(_validated(chosen, m, fo, prefetch=2)),
        "nccl": _digest(_validated(chosen, m, fo, transport="nccl")),
        "nccl prefetch 1": _digest(_validated(chosen, m, fo, transport="nccl", prefetch=1)),
        "nccl shapes": _digest(_validated(chosen, m, fo, transport="nccl", exchanges_shapes=True)),
        "simulate": _digest(_simulated(chosen, m, fo)),
        "one nccl group": _digest(_one_group(chosen, m, fo)),
    }


def _one_group(chosen: object, m: int, fo: bool) -> object:
    """NCCL's verdict with one process group for the whole pipeline (many plans hang so)."""
    found = []
    for prefetch in (0, 1):
        steps = validate(chosen, num_microbatches=m, forward_only=fo, prefetch=prefetch).steps  # type: ignore[arg-type]
        found.append(nccl_problem(steps, Links(steps).consumer, stream_groups=False))
    return found


def mutated(name: str, pp: int, vp: int, m: int, seed: int) -> dict[str, str]:
    """What 0.11.0's validator said of a plan with one rank's steps moved (often refused)."""
    rng = random.Random(seed)
    actions = [list(rank) for rank in plan(name, pp_size=pp, num_microbatches=m, vp_size=vp)]
    rank = rng.randrange(pp)
    row = actions[rank]
    if seed % 2:  # a step moved ahead of steps of other kinds: pairs stay in order
        here = rng.choice([k for k in range(1, len(row)) if row[k].kind != row[k - 1].kind])
        for _ in range(rng.randint(1, 4)):
            if here and row[here - 1].kind != row[here].kind:
                row[here - 1], row[here] = row[here], row[here - 1]
                here -= 1
    else:
        row.insert(rng.randrange(len(row)), row.pop(rng.randrange(len(row))))
    chosen = Plan.of(actions, placement_for(name, pp, vp))
    return {
        transport: _digest(_validated(chosen, m, False, transport=transport, prefetch=prefetch))
        for transport, prefetch in (("gloo", 0), ("gloo", 1), ("nccl", 0))
    }


MUTATED = [
    (name, pp, vp, 8, seed)
    for name, pp, vp in (("1f1b", 4, 1), ("interleaved_1f1b", 4, 2), ("zb_h1", 4, 1), ("zbv", 4, 2))
    for seed in range(24)
]


def _configurations() -> list[tuple[str, int, int, int, bool]]:
    return [
        (name, pp, vp, m, fo)
        for name, vp, pps, ms in GRID
        for pp in pps
        for m in ms
        for fo in (False, True)
    ]


def _key(config: tuple[str, int, int, int, bool]) -> str:
    name, pp, vp, m, fo = config
    return f"{name} pp{pp} vp{vp} m{m}{' forward-only' if fo else ''}"


# The sizes the other tests plan zero-bubble schedules at, and random sizes up to pp 16.
SIZES_IN_TESTS = [(pp, t * pp) for pp in (2, 3, 4, 8) for t in (1, 2, 3)] + [
    (2, 2), (2, 4), (4, 8), (4, 16), (3, 7), (5, 11),
]  # fmt: skip
_DRAW = random.Random(39)
RANDOM_SIZES = [(pp, _DRAW.randint(pp, 3 * pp)) for pp in (_DRAW.randint(2, 16) for _ in range(10))]


@pytest.mark.parametrize(("pp", "m"), SIZES_IN_TESTS + RANDOM_SIZES)
def test_zero_bubble_plans_equal_0_11s(pp: int, m: int) -> None:
    """Action for action (the reference takes up to a second at pp 16: it is 0.11.0's)."""
    assert plan("zb_h1", pp_size=pp, num_microbatches=m).actions == tuple(
        tuple(rank) for rank in reference.zb_h1(pp, m)
    )
    assert plan("zbv", pp_size=pp, num_microbatches=m, vp_size=2).actions == tuple(
        tuple(rank) for rank in reference.zbv(pp, m)
    )


@pytest.mark.parametrize("pp", [1, 2, 3, 5])
@pytest.mark.parametrize(
    ("where", "limit", "prefer"),
    [("v", 2, "IFW"), ("v", 1, "FIW"), ("looped", 2, "WFI"), ("looped", 1, "IFW")],
)
def test_list_schedule_equals_0_11s_on_any_placement(
    pp: int, where: str, limit: int, prefer: str
) -> None:
    vp = 2 if where == "v" or limit == 2 else 1
    placement = Placement.named(where, pp, vp)
    for m in (1, pp, 2 * pp + 1):
        limits = [limit * min(pp, m)] * pp if pp > 1 else [1]
        outcomes = []
        for schedule in (zero_bubble.list_schedule, reference.list_schedule):
            try:
                outcomes.append(schedule(placement, m, limits, prefer))
            except ValueError as error:  # limits that leave no order: the same message
                outcomes.append(str(error))
        assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize(("name", "vp"), [("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 2)])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (5, 10)])
def test_unit_makespan_is_the_simulators(name: str, vp: int, pp: int, m: int) -> None:
    orders = [plan(name, pp_size=pp, num_microbatches=m, vp_size=vp)]
    orders += [
        Plan.of(reference.list_schedule(orders[0].placement, m, [vp * pp] * pp, p))
        for p in ("IFW", "FIW")
    ]
    orders.append(plan("zbv", pp_size=pp, num_microbatches=m, vp_size=2))
    for order in orders:
        simulated = simulate(validate(order), Costs(forward=1, backward=2)).makespan
        assert zero_bubble.unit_makespan(order, order.placement) == simulated
    assert (
        zero_bubble.unit_makespan([[Action("B", 0)], [Action("F", 0)]], Placement.looped(2)) is None
    )


@pytest.mark.parametrize("config", _configurations(), ids=_key)
def test_planning_is_what_0_11_made_of_it(config: tuple[str, int, int, int, bool]) -> None:
    assert fingerprint(*config) == json.loads(GOLDEN.read_text())[_key(config)]


@pytest.mark.parametrize("config", MUTATED, ids=lambda c: f"{c[0]}-seed{c[4]}")
def test_moved_steps_are_judged_as_0_11_judged_them(
    config: tuple[str, int, int, int, int],
) -> None:
    name, pp, vp, m, seed = config
    expected = json.loads(GOLDEN.read_text())[f"{name} pp{pp} vp{vp} m{m} moved {seed}"]
    assert mutated(*config) == expected


def test_a_plan_over_the_budget_is_refused_before_planning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        ScheduleSpec, "generate", lambda *a, **k: pytest.fail("planned over the budget")
    )
    message = (
        r"planning zbv for 4 ranks x 2 chunks with 1,000,000 microbatches makes 24,000,000 "
        r"compute steps \(3 per microbatch and chunk\), over the planning budget of 4,000,000 "
        r"steps .*raise max_plan_steps \(None: no limit\)"
    )
    with pytest.raises(ValueError, match=message):
        plan("zbv", pp_size=4, num_microbatches=1_000_000, vp_size=2)
    with pytest.raises(ValueError, match=r"makes 64 compute steps .* budget of 63 steps"):
        resolve_schedule("1f1b", pp_size=4, microbatch_counts=[8], max_plan_steps=63)
    with pytest.raises(ValueError, match=r"no schedule runs .*over the planning budget of 10"):
        resolve_schedule("auto", pp_size=2, microbatch_counts=[4], max_plan_steps=10)


def test_no_budget_plans_any_size() -> None:
    plan("1f1b", pp_size=2, num_microbatches=8, max_plan_steps=None)
    assert resolve_schedule("1f1b", pp_size=2, microbatch_counts=[4], max_plan_steps=32).name


def test_auto_plans_and_validates_each_candidate_once(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    validated: list[tuple[int, bool]] = []
    generate, check = ScheduleSpec.generate, vars(plan_cache)["validate"]

    def counted_generate(spec: ScheduleSpec, **options: Any) -> Any:
        made.append(f"{spec.name}{' forward' if options['forward_only'] else ''}")
        return generate(spec, **options)

    def counted_validate(chosen: Plan, **options: Any) -> Any:
        validated.append((chosen.num_microbatches, chosen.forward_only))
        return check(chosen, **options)

    monkeypatch.setattr(ScheduleSpec, "generate", counted_generate)
    monkeypatch.setattr(plan_cache, "validate", counted_validate)
    resolved = resolve_schedule("auto", pp_size=4, microbatch_counts=[8], transport="nccl")
    assert sorted(made) == sorted(
        f"{name}{forward}" for name in ("1f1b", "zb_h1", "gpipe") for forward in ("", " forward")
    )
    # Each candidate's training plan once (NCCL's rules, then simulated), and the chosen
    # schedule's forward-only plan.
    assert sorted(validated) == [(8, False)] * 3 + [(8, True)]
    assert resolved.report(8).steps


def test_the_memory_planner_plans_once_per_schedule_and_times_once_per_cost_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[str] = []
    timed: list[object] = []
    generate, timeline = ScheduleSpec.generate, vars(plan_cache)["simulate"]

    def counted_generate(spec: ScheduleSpec, **options: Any) -> Any:
        made.append(spec.name)
        return generate(spec, **options)

    def counted_simulate(report: Any, costs: Any) -> Any:
        timed.append(costs)
        return timeline(report, costs)

    monkeypatch.setattr(ScheduleSpec, "generate", counted_generate)
    monkeypatch.setattr(plan_cache, "simulate", counted_simulate)
    stages = tuple(StageMemory(parameters=100, activation_bytes=1000) for _ in range(4))
    options = [
        PlanOption(label, 1, Costs(forward=f, backward=2 * f), MemoryModel(stages=stages))
        for label, f in (("a", 1.0), ("b", 1.0), ("c", 1.5))
    ]
    choice = choose_fitting(options, pp_size=4, num_microbatches=8, memory_limit_bytes=None)
    assert sorted(made) == ["1f1b", "gpipe", "zb_h1"]
    assert len(timed) == 3 * 2  # three schedules, two cost sets
    assert len(choice.candidates) == 9


def test_the_benchmark_runs_in_a_cheap_mode(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).parent.parent / "benchmarks" / "planning_at_scale.py"
    spec = importlib.util.spec_from_file_location("planning_at_scale", path)
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    records = bench.main(["--sizes", "2", "4", "--json"])
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == records
    assert [(r["schedule"], r["pp"]) for r in records][:2] == [("1f1b", 2), ("1f1b", 4)]
    assert len(records) == 2 * (len(bench.SCHEDULES) + len(bench.AUTO))
    grown = [r for r in records if r["pp"] == 4 and r["schedule"] != "auto"]
    assert all(r["plan_validate_nccl_growth"] > 0 and "passed" in r for r in grown)
    assert all(r["resolve_nccl"] > 0 for r in records)
    assert bench.render(records[1]).startswith("1f1b                 4   32      256")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    table = {_key(c): fingerprint(*c) for c in _configurations()}
    table.update(
        {f"{n} pp{p} vp{v} m{m} moved {s}": mutated(n, p, v, m, s) for n, p, v, m, s in MUTATED}
    )
    GOLDEN.write_text(json.dumps(table, indent=0, sort_keys=True) + "\n")
