"""The schedule registry: each record, the default rule, auto's candidates, and names."""

from __future__ import annotations

import pytest

import pp_schedules
from pp_schedules import SCHEDULES, schedule_spec
from pp_schedules.planning import (
    SCHEDULE_REGISTRY,
    PairedActions,
    ScheduleSpec,
    candidates_for,
    default_schedule,
    placement_for,
    plan,
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
    "dualpipev": ("v", 2, True),
}
# A size each schedule runs: (pp_size, vp_size).
RUNS = {
    "no_pipelining": (1, 1),
    "gpipe": (2, 3),
    "1f1b": (4, 1),
    "interleaved_1f1b": (2, 2),
    "zb_h1": (4, 1),
    "zbv": (4, 2),
    "dualpipev": (4, 2),
}


def test_the_registry_holds_the_seven_schedules_in_order() -> None:
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
    if isinstance(generated, PairedActions):  # a schedule with F&B steps marks them
        assert tuple(tuple(rank) for rank in generated.overlapped) == made.overlapped
        generated = generated.actions
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
        "zb_h1, zbv, dualpipev, auto"
    )


@pytest.mark.parametrize(
    ("vp", "expected"),
    [
        (1, [("1f1b", "looped"), ("zb_h1", "looped"), ("gpipe", "looped")]),
        (
            2,
            [("interleaved_1f1b", "looped"), ("zbv", "v"), ("dualpipev", "v"), ("gpipe", "looped")],
        ),
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


def test_every_schedule_has_a_title_for_people() -> None:
    titles = {name: spec.title for name, spec in SCHEDULE_REGISTRY.items()}
    assert titles == {
        "no_pipelining": "no pipelining",
        "gpipe": "GPipe",
        "1f1b": "1F1B",
        "interleaved_1f1b": "interleaved 1F1B",
        "zb_h1": "zero-bubble ZB-H1",
        "zbv": "zero-bubble ZB-V (V placement)",
        "dualpipev": "DualPipeV (V placement, F&B overlapped)",
    }
