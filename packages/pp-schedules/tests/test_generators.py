"""Generators against Megatron's recorded schedules, the schedules' rules, and bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pp_schedules import ScheduleConfigError
from pp_schedules.planning import (
    Action,
    format_plan,
    interleaved_table,
    parse_action,
    parse_plan,
    plan,
)

GOLDEN = json.loads(
    gzip.decompress((Path(__file__).parent / "data" / "megatron_schedules.json.gz").read_bytes())
)
NAMES = {"1f1b": "1f1b", "interleaved": "interleaved_1f1b", "no_pipelining": "no_pipelining"}


def _args(config: dict[str, object]) -> dict[str, object]:
    return {
        "pp_size": config["pp"],
        "num_microbatches": config["num_microbatches"],
        "vp_size": config["vp"] or 1,
        "microbatch_group_size_per_vp_stage": config["microbatch_group_size_per_vp_stage"],
        "forward_only": config["forward_only"],
    }


ACCEPTED = [c for c in GOLDEN["configs"] if "error" not in c]
REFUSED = [c for c in GOLDEN["configs"] if "error" in c]


def _id(config: dict[str, object]) -> str:
    return (
        f"{config['schedule']}-pp{config['pp']}-vp{config['vp']}-m{config['num_microbatches']}"
        f"-g{config['microbatch_group_size_per_vp_stage']}{'-fwd' if config['forward_only'] else ''}"
    )


def test_golden_file_holds_both_accepted_and_refused_configurations() -> None:
    assert len(ACCEPTED) == 426
    assert len(REFUSED) == 414


@pytest.mark.parametrize("config", ACCEPTED, ids=_id)
def test_order_equals_megatron(config: dict[str, object]) -> None:
    got = plan(NAMES[str(config["schedule"])], **_args(config))  # type: ignore[arg-type]
    assert [[[a.kind, a.microbatch, a.chunk] for a in rank] for rank in got] == config["compute"]


@pytest.mark.parametrize("config", REFUSED, ids=_id)
def test_refuses_what_megatron_refuses_and_says_what_would_work(config: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="Megatron's rule") as caught:
        plan(NAMES[str(config["schedule"])], **_args(config))  # type: ignore[arg-type]
    message = str(caught.value)
    assert (
        "valid microbatch_group_size_per_vp_stage values" in message
        or "no microbatch_group_size_per_vp_stage works" in message
    )


@pytest.mark.parametrize("pp", [4, 5, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_one_f_one_b_rules_beyond_the_golden_sizes(pp: int, m: int) -> None:
    for rank, row in enumerate(plan("1f1b", pp_size=pp, num_microbatches=m)):
        actions = list(row)
        warmup = min(pp - rank - 1, m)
        assert actions[:warmup] == [Action("F", i) for i in range(warmup)]
        # Then strict alternation F, B while forwards remain, then the remaining backwards.
        steady = actions[warmup : warmup + 2 * (m - warmup)]
        assert steady[0::2] == [Action("F", warmup + i) for i in range(m - warmup)]
        assert steady[1::2] == [Action("B", i) for i in range(m - warmup)]
        assert actions[warmup + 2 * (m - warmup) :] == [
            Action("B", i) for i in range(m - warmup, m)
        ]


@pytest.mark.parametrize(
    ("pp", "vp", "m", "group"), [(4, 2, 8, None), (4, 3, 12, 6), (8, 2, 16, 8), (5, 2, 13, 8)]
)
def test_interleaved_rules_beyond_the_golden_sizes(
    pp: int, vp: int, m: int, group: int | None
) -> None:
    got = plan(
        "interleaved_1f1b",
        pp_size=pp,
        num_microbatches=m,
        vp_size=vp,
        microbatch_group_size_per_vp_stage=group,
    )
    table = interleaved_table(m, vp, group or pp)
    for rank, actions in enumerate(got):
        forwards = [(a.microbatch, a.chunk) for a in actions if a.kind == "F"]
        backwards = [(a.microbatch, vp - 1 - a.chunk) for a in actions if a.kind == "B"]
        assert forwards == table
        assert backwards == table
        warmup = min((pp - rank - 1) * 2 + (vp - 1) * (group or pp), m * vp)
        assert all(a.kind == "F" for a in actions[:warmup])
        if warmup < m * vp:
            assert actions[warmup].kind == "F"
            assert actions[warmup + 1].kind == "B"


def test_gpipe_and_no_pipelining() -> None:
    assert format_plan(plan("gpipe", pp_size=2, num_microbatches=3)) == ["F0 F1 F2 B0 B1 B2"] * 2
    assert (
        format_plan(plan("gpipe", pp_size=2, num_microbatches=2, forward_only=True))
        == ["F0 F1"] * 2
    )
    assert format_plan(plan("no_pipelining", pp_size=1, num_microbatches=2)) == ["F0 B0 F1 B1"]


def test_string_form_round_trips() -> None:
    lines = format_plan(plan("interleaved_1f1b", pp_size=2, num_microbatches=4, vp_size=2))
    assert lines[0].startswith("F0 F1 F0.1 F1.1 F2 B0.1")
    assert format_plan(parse_plan(lines)) == lines
    assert parse_action("SEND_F3.1") == Action("SEND_F", 3, 1)
    assert str(Action("RECV_B", 0)) == "RECV_B0"
    with pytest.raises(ValueError, match="'X3' is not an action"):
        parse_action("X3")


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        (
            "zero_bubble",
            {},
            "unknown schedule 'zero_bubble'; valid: no_pipelining, gpipe, 1f1b, interleaved_1f1b",
        ),
        ("1f1b", {"num_microbatches": 0}, "num_microbatches must be 1 or more, got 0"),
        (
            "1f1b",
            {"vp_size": 2},
            "1f1b runs one model chunk per rank, but vp_size is 2; use 'interleaved_1f1b'",
        ),
        ("no_pipelining", {"pp_size": 2}, "no_pipelining runs one stage, but pp_size is 2"),
        (
            "interleaved_1f1b",
            {"vp_size": 1},
            "needs vp_size of 2 or more, got 1; with one chunk use '1f1b'",
        ),
        ("interleaved_1f1b", {"pp_size": 1, "vp_size": 2}, "needs pp_size of 2 or more, got 1"),
        (
            "interleaved_1f1b",
            {"vp_size": 2, "num_microbatches": 7, "microbatch_group_size_per_vp_stage": 2},
            r"microbatch_group_size_per_vp_stage 2 must lie between the pipeline size 4 and the "
            r"number of microbatches 7 \(Megatron's rule\); valid "
            r"microbatch_group_size_per_vp_stage values for 7 microbatches: \[7\]$",
        ),
        (
            "interleaved_1f1b",
            {"vp_size": 2, "num_microbatches": 9},
            r"9 microbatches in groups of 4 leave 1: the last group must be empty or hold at least "
            r"pp_size=4 microbatches",
        ),
        ("1f1b", {"microbatch_group_size_per_vp_stage": 4}, "applies to 'interleaved_1f1b' only"),
    ],
)
def test_bad_configurations_say_why(name: str, kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"pp_size": 4, "num_microbatches": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan(name, **arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sizes", "hint", "groups", "counts"),
    [
        ((2, 3, None), "valid microbatch_group_size_per_vp_stage values for 3 microbatches: [3]; "
         "or keep microbatch_group_size_per_vp_stage=2 and use 2 or 4 microbatches", [3], [2, 4]),
        ((4, 9, None), "valid microbatch_group_size_per_vp_stage values for 9 microbatches: "
         "[5, 9]; or keep microbatch_group_size_per_vp_stage=4 and use 8 or 12 microbatches",
         [5, 9], [8, 12]),
        ((4, 7, 9), "valid microbatch_group_size_per_vp_stage values for 7 microbatches: [7]; or "
         "keep microbatch_group_size_per_vp_stage=9 and use 9 microbatches", [7], [9]),
        ((4, 2, None), "no microbatch_group_size_per_vp_stage works for 2 microbatches; use at "
         "least 4 microbatches", [], []),
    ],
)  # fmt: skip
def test_interleaving_refusals_name_the_group_size_and_counts_that_work(
    sizes: tuple[int, int, int | None], hint: str, groups: list[int], counts: list[int]
) -> None:
    """The hint names the parameter, and every value and count it offers runs."""
    pp, m, group = sizes  # pipeline size, microbatches, group size (None: the pipeline size)
    with pytest.raises(ScheduleConfigError) as refused:
        plan("interleaved_1f1b", pp_size=pp, vp_size=2, num_microbatches=m,
             microbatch_group_size_per_vp_stage=group)  # fmt: skip
    assert str(refused.value).endswith(f"(Megatron's rule); {hint}"), str(refused.value)
    for size in groups:
        plan("interleaved_1f1b", pp_size=pp, vp_size=2, num_microbatches=m,
             microbatch_group_size_per_vp_stage=size)  # fmt: skip
    for count in counts:
        plan("interleaved_1f1b", pp_size=pp, vp_size=2, num_microbatches=count,
             microbatch_group_size_per_vp_stage=group)  # fmt: skip


def test_interleaving_refusals_are_megatrons_runtime_errors_too() -> None:
    # Megatron's interleaved schedule raises RuntimeError; ported tests expecting it hold.
    with pytest.raises(RuntimeError, match="9 microbatches in groups of 4 leave 1"):
        plan("interleaved_1f1b", pp_size=4, num_microbatches=9, vp_size=2)
    with pytest.raises(ScheduleConfigError):
        plan("interleaved_1f1b", pp_size=1, num_microbatches=4, vp_size=2)
