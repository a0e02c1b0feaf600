"""resolve_schedule: one resolution per run, and the executor that runs it without re-planning."""

from __future__ import annotations

import datetime
from typing import Any, get_args

import pytest
import torch

import pp_schedules
from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import (
    Choice,
    PlanError,
    ResolvedSchedule,
    ScheduleConfig,
    get_forward_backward_func,
    parse_schedule,
    resolve_schedule,
)
from pp_schedules.planning import COMPUTE, ActionKind, default_prefetch, plan, validate
from pp_schedules.runtime._plan_walk import STEP_HANDLERS, handler_key
from pp_state import Placement
from pp_testing import (
    reference_run,
    run_distributed,
    stage_chunks,
    tiny_forward_step,
    tiny_layers,
    tiny_microbatches,
)

WIDTH, SEQ, BATCH, LAYERS = 8, 3, 2, 4


def test_a_named_schedule_is_planned_and_validated_for_every_count() -> None:
    resolved = resolve_schedule("1f1b", pp_size=4, microbatch_counts=[8, 4, 8])
    assert isinstance(resolved, ResolvedSchedule)
    assert (resolved.name, resolved.placement, resolved.microbatch_counts) == (
        "1f1b", Placement.looped(4, 1), (4, 8),
    )  # fmt: skip
    assert (resolved.pp_size, resolved.vp_size, resolved.transport) == (4, 1, "gloo")
    assert (resolved.choice, resolved.plan, resolved.prefetch) == (None, None, 1)
    for count in (4, 8):
        expected = validate(plan("1f1b", pp_size=4, num_microbatches=count), prefetch=1)
        assert resolved.report(count).steps == expected.steps
        assert resolved.actions(2, count) == list(
            plan("1f1b", pp_size=4, num_microbatches=count)[2]
        )
        forward = resolved.actions(2, count, forward_only=True)
        assert [a.kind for a in forward] == ["F"] * count


def test_no_schedule_resolves_to_the_registrys_default() -> None:
    assert resolve_schedule(pp_size=1, microbatch_counts=[2]).name == "no_pipelining"
    assert resolve_schedule(pp_size=2, vp_size=2, microbatch_counts=[4]).name == (
        "interleaved_1f1b"
    )
    on_v = resolve_schedule(pp_size=2, vp_size=2, microbatch_counts=[4], placement="v")
    assert (on_v.name, on_v.placement.name) == ("gpipe", "v")
    assert resolve_schedule("zbv", pp_size=2, vp_size=2, microbatch_counts=[4]).placement == (
        Placement.v_shape(2, 2)
    )


def test_a_count_not_resolved_is_named_with_the_resolved_ones() -> None:
    resolved = resolve_schedule("1f1b", pp_size=2, microbatch_counts=[2, 4])
    with pytest.raises(ValueError, match="no plan was resolved for 3 microbatches; resolved: 2, 4"):
        resolved.report(3)
    without = resolve_schedule("1f1b", pp_size=2, microbatch_counts=[2], include_forward_only=False)
    with pytest.raises(ValueError, match="no forward-only plan was resolved for 2 microbatches"):
        without.actions(0, 2, forward_only=True)


def test_a_given_plan_runs_its_own_count_only() -> None:
    given = parse_schedule("F0 B0 F1 B1")
    resolved = resolve_schedule(given, pp_size=1, microbatch_counts=[2])
    assert (resolved.name, resolved.plan) == (None, given)
    assert [str(a) for a in resolved.actions(0, 2, forward_only=True)] == ["F0", "F1"]
    assert resolve_schedule("F0 B0 F1 B1", pp_size=1, microbatch_counts=[2]).plan == given
    with pytest.raises(ValueError, match="the plan covers 2 microbatches, but this step runs 3"):
        resolve_schedule(given, pp_size=1, microbatch_counts=[3])
    with pytest.raises(
        ValueError, match="the plan covers 2 microbatches, but the run steps with 2, 4"
    ):
        resolve_schedule(given, pp_size=1, microbatch_counts=[2, 4])
    with pytest.raises(
        ValueError, match="the plan is for 1 ranks x 1 chunks, but the pipeline has 2"
    ):
        resolve_schedule(given, pp_size=2, microbatch_counts=[2])


def test_auto_keeps_its_choice_among_schedules_running_every_count() -> None:
    resolved = resolve_schedule("auto", pp_size=4, microbatch_counts=[2, 8])
    assert isinstance(resolved.choice, Choice)
    assert resolved.name == resolved.choice.chosen.name
    # zb_h1 needs at least pp_size microbatches, so it cannot run the step of 2.
    assert "zb_h1" not in [c.name for c in resolved.choice.candidates]
    assert sorted(resolved.reports) == [(2, False), (2, True), (8, False), (8, True)]
    assert resolved.report(8).steps == validate(resolved.choice.plan, prefetch=1).steps
    only_eight = resolve_schedule("auto", pp_size=4, microbatch_counts=[8], names=["zb_h1"])
    assert only_eight.name == "zb_h1"
    assert only_eight.actions(0, 8, forward_only=True) == list(
        plan("zb_h1", pp_size=4, num_microbatches=8, forward_only=True)[0]
    )
    on_v = resolve_schedule("auto", pp_size=4, vp_size=2, microbatch_counts=[8], placement="v")
    assert (on_v.name, on_v.placement.name) == ("zbv", "v")


def test_transport_and_prefetch_are_checked() -> None:
    assert (default_prefetch("gloo", False), default_prefetch("gloo", True)) == (1, 0)
    assert default_prefetch("nccl", False) == 0
    with pytest.raises(ValueError, match="unknown transport 'mpi'; valid: gloo, nccl"):
        resolve_schedule("1f1b", pp_size=2, microbatch_counts=[2], transport="mpi")
    with pytest.raises(ValueError, match="unknown transport 'ucc'; valid: gloo, nccl"):
        default_prefetch("ucc", False)
    with pytest.raises(ValueError, match="prefetch_receives=1 needs fixed shapes"):
        resolve_schedule(
            "1f1b", pp_size=2, microbatch_counts=[2], prefetch=1, exchanges_shapes=True
        )
    with pytest.raises(ValueError, match=r"prefetch_receives must be 0 .* got -1"):
        resolve_schedule("1f1b", pp_size=2, microbatch_counts=[2], prefetch=-1)
    headers = resolve_schedule("1f1b", pp_size=2, microbatch_counts=[2], exchanges_shapes=True)
    assert headers.prefetch == 0


def test_nccl_runs_every_placement_each_stream_on_its_own_group() -> None:
    # pp-comm gives each stream its own group on NCCL, so the V placement's link carrying
    # activations and gradients the same way resolves there too.
    for pp, m in ((2, 4), (4, 8)):
        on_nccl = resolve_schedule(
            "zbv", pp_size=pp, vp_size=2, microbatch_counts=[m], transport="nccl"
        )
        assert (on_nccl.name, on_nccl.prefetch, on_nccl.transport) == ("zbv", 0, "nccl")


@pytest.mark.reliability
def test_nccl_resolution_refuses_a_plan_its_rules_refuse() -> None:
    # Receives posted two exchanges early share a batch: the first waits for the second.
    assert resolve_schedule("1f1b", pp_size=4, microbatch_counts=[8], prefetch=2).prefetch == 2
    with pytest.raises(PlanError, match="the plan hangs on NCCL: rank 0 step 3"):
        resolve_schedule("1f1b", pp_size=4, microbatch_counts=[8], prefetch=2, transport="nccl")


def test_the_walk_dispatches_every_action_kind_through_its_table() -> None:
    assert set(STEP_HANDLERS) == set(COMPUTE) | {"exchange"}
    for kind in get_args(ActionKind):
        assert handler_key(kind) in STEP_HANDLERS


class _FakeComm:
    """Enough of a communicator to build an executor (no transfers)."""

    def __init__(self, stages: int, config: CommConfig | None = None) -> None:
        self.num_stages, self.stage, self.device = stages, 0, torch.device("cpu")
        self.config = config or CommConfig()
        self.transport = "gloo"


def test_an_executor_refuses_a_resolved_schedule_that_does_not_fit() -> None:
    resolved = resolve_schedule("1f1b", pp_size=2, microbatch_counts=[4])
    comm: Any = _FakeComm(2)
    executor = get_forward_backward_func(comm, resolved)
    assert (executor.resolved, executor.placement, executor.schedule) == (
        resolved, Placement.looped(2, 1), "1f1b",
    )  # fmt: skip
    assert executor.prefetch == 1
    cases: list[tuple[Any, dict[str, Any], str]] = [
        (_FakeComm(4), {}, "resolved schedule is for 2 pipeline ranks, but the communicator has 4"),
        (comm, {"vp_size": 2}, "has 1 model chunks per rank, but vp_size is 2"),
        (_FakeComm(2, CommConfig(variable_seq_lengths=True)), {}, "prefetch_receives=1 needs"),
    ]
    for communicator, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            get_forward_backward_func(communicator, resolved, **kwargs)
    # One way only: the executor takes a resolved schedule, not a name or a plan.
    for other in ("gpipe", parse_schedule("F0 B0")):
        with pytest.raises(TypeError, match="the executor runs a ResolvedSchedule, got"):
            get_forward_backward_func(comm, other)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'plan'"):
        get_forward_backward_func(comm, plan="F0 B0")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'schedule'"):
        ScheduleConfig(schedule="gpipe")  # type: ignore[call-arg]
    on_nccl = resolve_schedule("1f1b", pp_size=2, microbatch_counts=[4], transport="nccl")
    with pytest.raises(ValueError, match=r"resolved schedule is for nccl, but .* go over gloo"):
        get_forward_backward_func(comm, resolved=on_nccl)


def test_an_executor_without_one_resolves_each_count_once() -> None:
    """Megatron's argument-free choice: a schedule resolved on demand, one count at a time."""
    executor = get_forward_backward_func(_FakeComm(2), vp_size=2)  # type: ignore[arg-type]
    empty = executor.resolved
    assert (empty.on_demand, empty.microbatch_counts, executor.schedule) == (
        True, (), "interleaved_1f1b",
    )  # fmt: skip
    executor.plan_for(4, forward_only=False)
    first = executor.resolved
    assert first.microbatch_counts == (4,)
    executor.plan_for(4, forward_only=True)
    assert executor.resolved is first
    executor.plan_for(6, forward_only=False)
    assert executor.resolved is not first
    assert executor.resolved.microbatch_counts == (4, 6)
    # The count a schedule refuses is refused when first run, with the schedule's message.
    with pytest.raises(ValueError, match="5 microbatches"):
        executor.plan_for(5, forward_only=False)
    # A resolution made for its counts refuses any other, naming those it has.
    fixed = get_forward_backward_func(
        _FakeComm(2),  # type: ignore[arg-type]
        resolve_schedule("1f1b", pp_size=2, microbatch_counts=[4]),
    )
    with pytest.raises(ValueError, match="no plan was resolved for 6 microbatches; resolved: 4"):
        fixed.plan_for(6, forward_only=False)


class _Counter:
    """Counts the calls of what it replaces, and fails them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def fail(self, name: str) -> Any:
        def called(*args: object, **kwargs: object) -> None:
            self.calls.append(name)
            raise AssertionError(f"{name} called while running a resolved schedule")

        return called


def _run_resolved() -> dict[str, Any]:
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=60)))
    resolved = resolve_schedule("1f1b", pp_size=comm.num_stages, microbatch_counts=[2, 4])
    placement = resolved.placement
    chunks = stage_chunks(
        tiny_layers(LAYERS, WIDTH), stages=placement.stages[comm.stage],
        num_stages=placement.num_stages,
    )  # fmt: skip
    counter = _Counter()
    targets = [
        (pp_schedules.planning, "plan"), (pp_schedules.planning, "validate"),
        (pp_schedules, "resolve_schedule"), (pp_schedules.planning, "resolve_schedule"),
        (pp_schedules.planning._resolution, "plan"), (pp_schedules.planning._plan_cache, "validate"),
        (pp_schedules.planning._resolution, "resolve_schedule"), (pp_schedules.planning._validation, "validate"),
        (pp_schedules.runtime._executor, "resolve_schedule"), (pp_schedules.planning._registry.ScheduleSpec, "plan"),
        (pp_schedules.planning._registry.ScheduleSpec, "generate"),
    ]  # fmt: skip
    losses = []
    with pytest.MonkeyPatch.context() as patch:
        for owner, name in targets:
            patch.setattr(owner, name, counter.fail(f"{getattr(owner, '__name__', owner)}.{name}"))
        executor = get_forward_backward_func(
            comm, resolved, config=ScheduleConfig(hidden_size=WIDTH)
        )
        for m, forward_only in ((4, False), (2, False), (4, True)):
            data = tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)
            store = executor(
                forward_step_func=tiny_forward_step(), data_iterator=iter(data), model=chunks,
                num_microbatches=m, seq_length=SEQ, micro_batch_size=BATCH,
                forward_only=forward_only,
            )  # fmt: skip
            losses.append([float(d["lm loss"]) for d in store])
    comm.destroy()
    return {"calls": counter.calls, "losses": losses, "resolved": executor.resolved is resolved}


def test_an_executor_given_a_resolved_schedule_never_plans_or_validates() -> None:
    results = run_distributed(_run_resolved, 2, timeout=120)
    for result in results:
        assert result["calls"] == []
        assert result["resolved"]
    expected = [
        reference_run(tiny_layers(LAYERS, WIDTH), tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH))[0]
        for m in (4, 2, 4)
    ]  # fmt: skip
    assert results[0]["losses"] == [[], [], []]
    for got, want in zip(results[1]["losses"], expected, strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_auto_on_nccl_passes_over_a_schedule_nccl_cannot_run() -> None:
    # With receives posted two exchanges early, 1F1B and ZB-H1 would hang on NCCL (a batch
    # holds a receive whose sender needs this rank first): auto takes what NCCL runs.
    options = {"pp_size": 4, "microbatch_counts": [8], "prefetch": 2}
    on_gloo = resolve_schedule("auto", **options)  # type: ignore[arg-type]
    on_nccl = resolve_schedule("auto", transport="nccl", **options)  # type: ignore[arg-type]
    assert on_gloo.name in ("1f1b", "zb_h1")
    assert on_nccl.name == "gpipe"
    assert on_nccl.choice is not None
    assert [candidate.name for candidate in on_nccl.choice.candidates] == ["gpipe"]
