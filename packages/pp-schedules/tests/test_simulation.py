"""The simulator reproduces the known bubble formulas and draws what it computes."""

from __future__ import annotations

import json

import pytest

from pp_schedules import Costs
from pp_schedules.planning import bubble_formula, ideal_makespan, plan, simulate, validate


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (8, 8), (4, 1)])
def test_one_f_one_b_and_gpipe_take_m_plus_p_minus_1_slots(name: str, pp: int, m: int) -> None:
    costs = Costs(forward=1.0, backward=2.0)
    result = simulate(
        validate(plan(name, pp_size=pp, num_microbatches=m), num_microbatches=m), costs
    )
    assert result.makespan == pytest.approx((m + pp - 1) * 3.0)
    assert result.bubble_fraction == pytest.approx([bubble_formula(pp, m)] * pp)


@pytest.mark.parametrize(("pp", "vp", "m"), [(2, 2, 4), (4, 2, 8), (4, 4, 8), (8, 2, 16)])
def test_interleaving_shrinks_the_bubble_by_the_number_of_chunks(pp: int, vp: int, m: int) -> None:
    # Each chunk holds 1/vp of the layers: its steps cost 1/vp of a whole stage's.
    costs = Costs(forward=1.0 / vp, backward=2.0 / vp)
    actions = plan("interleaved_1f1b", pp_size=pp, num_microbatches=m, vp_size=vp)
    result = simulate(validate(actions, num_microbatches=m, vp_size=vp), costs)
    assert result.makespan == pytest.approx(3.0 * m + 3.0 * (pp - 1) / vp)
    assert result.bubble_fraction == pytest.approx([bubble_formula(pp, m, vp)] * pp)


def test_transfers_add_latency_between_stages() -> None:
    report = validate(plan("1f1b", pp_size=4, num_microbatches=4), num_microbatches=4)
    free = simulate(report, Costs(forward=1.0, backward=2.0))
    slow = simulate(report, Costs(forward=1.0, backward=2.0, transfer=0.5))
    # The first forward crosses 3 links, the last backward 3 more.
    assert slow.makespan >= free.makespan + 6 * 0.5 - 1e-9
    assert ideal_makespan(4, 1, Costs(forward=1.0, backward=2.0)) == 12.0


def test_peak_activations_come_from_the_plan() -> None:
    result = simulate(validate(plan("1f1b", pp_size=4, num_microbatches=8), num_microbatches=8))
    assert result.peak_activations == [4, 3, 2, 1]


def test_timeline_and_chrome_trace_draw_every_step() -> None:
    result = simulate(
        validate(plan("1f1b", pp_size=2, num_microbatches=2), num_microbatches=2), Costs()
    )
    # Makespan 9 = (m + p - 1) * (1 + 2): one cell per time unit.
    assert result.timeline(width=9).splitlines() == [
        "rank 0 |01..aa.bb| bubble 33%",
        "rank 1 |.0aa1bb..| bubble 33%",
    ]
    trace = json.loads(result.chrome_trace())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 8
    assert {e["name"] for e in spans} == {"F0", "F1", "B0", "B1"}
    assert {e["tid"] for e in spans} == {0, 1}


def test_costs_are_checked() -> None:
    with pytest.raises(ValueError, match="forward, backward and backward halves must be positive"):
        Costs(forward=0.0)
