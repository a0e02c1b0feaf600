"""DualPipeV as data: DeepSeek's phases (torch's order), F&B steps, validation and timing."""

from __future__ import annotations

import pytest

from pp_schedules import parse_schedule, resolve_schedule, schedule_spec
from pp_schedules.planning import (
    Action,
    Costs,
    MemoryModel,
    PairedActions,
    PlanOption,
    StageCosts,
    StageMemory,
    choose_fitting,
    dualpipev,
    fb_time,
    format_bytes,
    format_schedule,
    lower,
    plan,
    simulate,
    validate,
)
from pp_state import Placement

SIZES = [(d, m) for d in (2, 3, 4, 5) for m in (2 * d, 2 * d + 1, 3 * d, 4 * d + 3)]
UNIT = Costs(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0)


def _torch_order(pp: int, m: int) -> list[list[str]]:
    """torch.distributed.pipelining's ScheduleDualPipeV order, in our action strings."""
    from torch.distributed.pipelining import schedules as torch_schedules

    schedule = torch_schedules.ScheduleDualPipeV.__new__(torch_schedules.ScheduleDualPipeV)
    schedule.pp_group_size, schedule._n_microbatches = pp, m
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}
    names = {
        torch_schedules.FORWARD: "F",
        torch_schedules.FULL_BACKWARD: "B",
        torch_schedules.BACKWARD_INPUT: "I",
        torch_schedules.BACKWARD_WEIGHT: "W",
    }
    order: list[list[str]] = []
    for rank in range(pp):
        tokens = []
        for action in schedule._calculate_single_rank_operations(rank):
            assert action is not None
            parts = action.sub_actions or (action,)
            written = []
            for part in parts:
                chunk = 0 if part.stage_index == rank else 1
                kind = kinds[names[part.computation_type]]
                written.append(str(Action(kind, part.microbatch_index, chunk)))  # type: ignore[arg-type]
            tokens.append("&".join(written))
        order.append(tokens)
    return order


def _ours(pp: int, m: int) -> list[list[str]]:
    text = format_schedule(plan("dualpipev", pp_size=pp, num_microbatches=m, vp_size=2))
    return [line.split(": ", 1)[1].split() for line in text.splitlines()[1:]]


@pytest.mark.parametrize(("pp", "m"), SIZES)
def test_the_order_is_torchs_dualpipev_action_for_action(pp: int, m: int) -> None:
    assert _ours(pp, m) == _torch_order(pp, m)


@pytest.mark.parametrize(("pp", "m"), SIZES)
def test_every_plan_is_valid_on_both_transports_and_holds_2d_plus_1_chunks(pp: int, m: int) -> None:
    made = plan("dualpipev", pp_size=pp, num_microbatches=m, vp_size=2)
    assert made.placement == Placement.named("v", pp, 2)
    assert made.has_overlap
    for transport in ("gloo", "nccl"):
        for prefetch in (0, 1):
            report = validate(made, num_microbatches=m, transport=transport, prefetch=prefetch)
    assert report.peak_in_flight == [2 * pp + 1] * pp
    forward_only = plan("dualpipev", pp_size=pp, num_microbatches=m, vp_size=2, forward_only=True)
    assert not forward_only.has_overlap
    validate(forward_only, num_microbatches=m, forward_only=True, transport="nccl")


@pytest.mark.parametrize(("pp", "m"), SIZES)
def test_its_bubble_is_deepseeks_formula(pp: int, m: int) -> None:
    """DeepSeek's table: (D-1)(F&B + B - 3W) on D ranks, whatever the overlap.

    The bubble of the rank with the most F&B steps (the last, at the turn of the V): its
    makespan less its work, each F&B step counted at what it costs.
    """
    made = plan("dualpipev", pp_size=pp, num_microbatches=m, vp_size=2)
    report = validate(made, num_microbatches=m)
    assert made.overlapped is not None
    pairs = max(len(rank) for rank in made.overlapped)
    assert pairs == len(made.overlapped[-1])
    for overlap in (0.0, 0.5, 1.0):
        costs = Costs(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0,
                      overlap=overlap)  # fmt: skip
        fb = fb_time(1.0, 2.0, overlap)
        work = 2 * m * (1.0 + 2.0) - pairs * (3.0 - fb)
        bubble = (pp - 1) * (fb + 2.0 - 3 * 1.0)
        assert simulate(report, costs).makespan == pytest.approx(work + bubble), overlap


def test_an_fb_step_costs_what_its_overlap_achieves() -> None:
    assert fb_time(1.0, 2.0, 0.0) == 3.0
    assert fb_time(1.0, 2.0, 1.0) == 2.0
    assert fb_time(2.0, 1.0, 0.5) == 2.5
    report = validate(plan("dualpipev", pp_size=2, num_microbatches=4, vp_size=2))
    none, full = (simulate(report, Costs(forward=1, backward=2, overlap=o)) for o in (0.0, 1.0))
    assert full.makespan < none.makespan
    # Where a pair overlaps, its backward's span starts before its forward's ends.
    spans = full.spans[0]
    pair = next(i for i in range(len(spans) - 1) if spans[i].action == Action("F", 3))
    assert spans[pair + 1].start < spans[pair].end
    staged = StageCosts.from_stages([Costs(forward=1, backward=2, overlap=0.5)] * 4)
    assert staged.overlap == 0.5
    with pytest.raises(ValueError, match=r"overlap is the share .* from 0 .* to 1 .*, got 1.5"):
        Costs(overlap=1.5)


def test_lowering_posts_both_halves_receives_before_and_both_sends_after() -> None:
    made = plan("dualpipev", pp_size=3, num_microbatches=6, vp_size=2)
    steps = lower(made)[1]  # the middle rank: every neighbour on another rank
    pairs = [i for i, s in enumerate(steps) if s.overlap]
    assert len(pairs) == len(made.overlapped[1])  # type: ignore[index]
    for index in pairs:
        forward, backward = steps[index - 1].compute, steps[index].compute
        assert forward is not None
        assert backward is not None
        assert (forward.kind, backward.kind, forward.chunk != backward.chunk) == ("F", "B", True)
        before, after = steps[index - 2].exchange, steps[index + 1].exchange
        assert before is not None
        assert after is not None
        received = {str(m.action) for m in before.messages if not m.is_send}
        sent = {str(m.action) for m in after.messages if m.is_send}
        assert {f"RECV_F{str(forward)[1:]}", f"RECV_B{str(backward)[1:]}"} == received
        assert {f"SEND_F{str(forward)[1:]}", f"SEND_B{str(backward)[1:]}"} <= sent


def test_the_text_form_round_trips_fb_steps() -> None:
    made = plan("dualpipev", pp_size=3, num_microbatches=7, vp_size=2)
    again = parse_schedule(format_schedule(made))
    assert again == made
    assert "F4&B1.1" in format_schedule(made)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "rank 0: F0&F1.1 B0 B1.1\nrank 1: F0 B0 F1.1 B1.1",
            "is not an F&B step: it pairs a forward",
        ),
        ("rank 0: F0.1&B0.1\nrank 1: F0", "is not an F&B step"),
        ("rank 0: F0&B0.1&F1\nrank 1: F0", "'&' joins two compute steps into an F&B step"),
        ("rank 0: F0&SEND_F0\nrank 1: F0", "'&' joins two compute steps"),
    ],
)
def test_a_malformed_fb_step_is_refused_naming_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_schedule(text)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pp_size": 4, "num_microbatches": 7, "vp_size": 2},
         r"dualpipev needs at least as many microbatches as its 8 stages \(2 x pp_size 4\), "
         r"got 7; use 8 or more microbatches, or 'zbv'"),
        ({"pp_size": 1, "num_microbatches": 4, "vp_size": 2},
         r"dualpipev needs 2 or more pipeline ranks .* got pp_size 1"),
        ({"pp_size": 2, "num_microbatches": 4, "vp_size": 1},
         r"dualpipev runs two model chunks per rank in a V, but vp_size is 1"),
        ({"pp_size": 2, "num_microbatches": 4, "vp_size": 2, "placement": "looped"},
         r"dualpipev runs on the V placement, not looped; leave placement unset"),
    ],
)  # fmt: skip
def test_bad_sizes_and_placements_are_refused_with_the_fix(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan("dualpipev", **kwargs)  # type: ignore[arg-type]


def test_it_is_a_named_schedule_auto_weighs() -> None:
    spec = schedule_spec("dualpipev")
    assert (spec.placement, spec.chunks, spec.split_backward) == ("v", 2, True)
    generated = dualpipev(pp_size=2, num_microbatches=4)
    assert isinstance(generated, PairedActions)
    resolved = resolve_schedule("auto", pp_size=2, vp_size=2, microbatch_counts=[8],
                                costs=Costs(forward=1, backward=2, overlap=1.0))  # fmt: skip
    assert resolved.choice is not None
    assert "dualpipev" in [c.name for c in resolved.choice.candidates]
    picked = resolve_schedule("dualpipev", pp_size=2, microbatch_counts=[4, 8])
    assert picked.vp_size == 2
    assert picked.report(8).peak_in_flight == [5, 5]


def test_the_planners_table_weighs_it_in_bytes_beside_zbv() -> None:
    """A V option: both schedules on the V are simulated, each rank's peak bytes shown."""
    model = MemoryModel.from_layers([1] * 4, layer=StageMemory(parameters=1_000,
                                                               activation_bytes=10_000))  # fmt: skip
    costs = Costs(forward=1, backward=2, overlap=1.0)
    option = PlanOption("vp 2, V", 2, costs, model, placement="v")
    choice = choose_fitting([option], pp_size=2, num_microbatches=8, memory_limit_bytes=None)
    rows = {c.name: c for c in choice.candidates}
    assert sorted(rows) == ["dualpipev", "zbv"]
    report = validate(plan("dualpipev", pp_size=2, num_microbatches=8, vp_size=2))
    peaks = simulate(report, costs, memory=model).peak_memory
    assert rows["dualpipev"].peak_bytes == tuple(peaks)
    # DualPipeV holds 2D + 1 = 5 chunks' activations at most, ZB-V here 4.
    assert rows["dualpipev"].peak_memory == 2.5
    line = next(row for row in choice.table().splitlines() if "dualpipev" in row)
    assert "v " in line
    assert all(format_bytes(peak) in line for peak in peaks)


def test_the_flight_recorder_and_the_stop_report_name_fb_steps() -> None:
    from pp_schedules.runtime import FlightRecorder
    from pp_schedules.runtime._stop_report import describe_step, paired_step

    steps = lower(plan("dualpipev", pp_size=2, num_microbatches=4, vp_size=2))
    index = next(i for i, s in enumerate(steps[0]) if s.overlap) - 1
    recorder = FlightRecorder()
    recorder.start_call(0, steps)
    recorder.begin(index, steps[0][index])
    head = recorder.head()
    assert head is not None
    assert (head["action"], head["kind"]) == ("F3&B1.1", "F&B")
    said = describe_step(steps[0][index], paired=paired_step(steps[0], index))
    assert said == "F&B: F mb 3 chunk 0 with B mb 1 chunk 1"
