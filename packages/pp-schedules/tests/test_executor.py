"""The executor on real gloo pipelines: memory, loss scaling, no_sync, forward-only, timers."""

from __future__ import annotations

import contextlib
import datetime
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import (
    PlanError,
    ScheduleConfig,
    deallocate_output_tensor,
    get_forward_backward_func,
    parse_schedule,
)
from pp_schedules.planning import plan, validate
from pp_schedules.runtime import resolve_for
from pp_state import Placement
from pp_testing import (
    StageStack,
    reference_run,
    run_distributed,
    stage_chunks,
    tiny_forward_step,
    tiny_layers,
    tiny_microbatches,
)

WIDTH, SEQ, BATCH, LAYERS = 8, 3, 2, 8


def _chunks(
    layers: Sequence[torch.nn.Module], pp: int, vp: int, rank: int, **kwargs: Any
) -> list[StageStack]:
    """This rank's chunks under Megatron's looped placement."""
    placement = Placement.looped(pp, vp)
    return stage_chunks(
        layers, stages=placement.stages[rank], num_stages=placement.num_stages, **kwargs
    )


def _step(  # noqa: PLR0917 - run_distributed passes arguments by position
    vp: int,
    m: int,
    config: ScheduleConfig,
    forward_only: bool = False,
    collect: bool = False,
    comm_config: CommConfig | None = None,
    schedule: str | None = None,
) -> dict[str, Any]:
    comm_config = comm_config or CommConfig(timeout=datetime.timedelta(seconds=60))
    comm = P2PCommunicator(None, config=comm_config)
    chunks = _chunks(tiny_layers(LAYERS, WIDTH), comm.num_stages, vp, comm.stage)
    data = tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)
    if schedule is None:  # Megatron's choice for the sizes, resolved on demand
        forward_backward = get_forward_backward_func(comm, vp_size=vp, config=config)
    else:
        resolved = resolve_for(comm, schedule, vp_size=vp, microbatch_counts=[m])
        forward_backward = get_forward_backward_func(comm, resolved, config=config)
    store = forward_backward(
        forward_step_func=tiny_forward_step(),
        data_iterator=[iter(data) for _ in range(vp)],
        model=chunks,
        num_microbatches=m,
        seq_length=SEQ,
        micro_batch_size=BATCH,
        forward_only=forward_only,
        collect_non_loss_data=collect,
    )
    first_layer = chunks[0].layers[0]
    assert isinstance(first_layer, torch.nn.Linear)
    first_weight = first_layer.weight
    comm.destroy()
    return {
        "store": store,
        "peak": forward_backward.stats.peak_activations,
        "bytes": forward_backward.stats.peak_activation_bytes,
        "grad": None if first_weight.grad is None else first_weight.grad.clone(),
    }


@pytest.mark.parametrize(("pp", "vp", "m"), [(4, 1, 8), (2, 2, 4), (4, 2, 8)])
def test_measured_peak_activations_match_the_validator(pp: int, vp: int, m: int) -> None:
    name = "interleaved_1f1b" if vp > 1 else "1f1b"
    predicted = validate(
        plan(name, pp_size=pp, num_microbatches=m, vp_size=vp), num_microbatches=m, vp_size=vp
    )
    results = run_distributed(_step, pp, vp, m, ScheduleConfig(hidden_size=WIDTH), timeout=120)
    assert [r["peak"] for r in results] == predicted.peak_in_flight
    if vp == 1:
        assert predicted.peak_in_flight == [min(pp - rank, m) for rank in range(pp)]


def test_zero_bubble_holds_activations_from_f_until_w_as_validated() -> None:
    """ZB-H1 keeps a microbatch's outputs until its W; every rank holds min(p, m)."""
    pp, m = 4, 8
    predicted = validate(plan("zb_h1", pp_size=pp, num_microbatches=m))
    config = ScheduleConfig(hidden_size=WIDTH)
    results = run_distributed(_step, pp, 1, m, config, False, False, None, "zb_h1", timeout=120)
    assert [r["peak"] for r in results] == predicted.peak_in_flight == [pp] * pp


def _dealloc(deallocate: bool) -> dict[str, Any]:
    # Stages end in a residual add, which keeps no reference to its output for backward:
    # once sent and deallocated, an output is kept alive only by its in-flight send.
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=60)))
    chunks = _chunks(
        tiny_layers(LAYERS, WIDTH),
        comm.num_stages,
        1,
        comm.stage,
        final_activation=False,
    )
    data = tiny_microbatches(8, seq=SEQ, batch=BATCH, width=WIDTH)
    config = ScheduleConfig(hidden_size=WIDTH, deallocate_pipeline_outputs=deallocate)
    forward_backward = get_forward_backward_func(comm, config=config)
    forward_backward(
        forward_step_func=tiny_forward_step(), data_iterator=iter(data), model=chunks,
        num_microbatches=8, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    layer = chunks[0].layers[0]
    assert isinstance(layer, torch.nn.Linear)
    assert layer.weight.grad is not None
    comm.destroy()
    stats = forward_backward.stats
    return {
        "bytes": stats.peak_activation_bytes,
        "in_flight": stats.peak_in_flight_bytes,
        "grad": layer.weight.grad,
    }


def test_deallocating_sent_outputs_cuts_the_bytes_held() -> None:
    kept = run_distributed(_dealloc, 4, False)
    freed = run_distributed(_dealloc, 4, True)
    output_bytes = SEQ * BATCH * WIDTH * 4
    for rank in range(3):  # every stage but the last sends its outputs
        # 1F1B holds at most 4 - rank outputs; freed ones shrink to one element each once
        # their send is posted (at the peak the newest is still whole, awaiting its send).
        assert kept[rank]["bytes"] - freed[rank]["bytes"] == (3 - rank) * (output_bytes - 4)
        # The in-flight sends still hold the buffers (gloo completes sends once waited).
        assert freed[rank]["in_flight"] > 0
    assert freed[3]["bytes"] == kept[3]["bytes"]
    # Gradients are the same either way (custom backward through the freed outputs).
    for rank in range(4):
        torch.testing.assert_close(freed[rank]["grad"], kept[rank]["grad"])


def _scale_by_8(loss: torch.Tensor) -> torch.Tensor:
    return loss * 8.0


def test_grad_scale_func_scales_every_gradient() -> None:
    plain = run_distributed(_step, 2, 1, 4, ScheduleConfig(hidden_size=WIDTH))
    scaled = run_distributed(
        _step, 2, 1, 4, ScheduleConfig(hidden_size=WIDTH, grad_scale_func=_scale_by_8)
    )
    for rank in range(2):
        torch.testing.assert_close(scaled[rank]["grad"], plain[rank]["grad"] * 8.0)
    # The reported losses are not scaled.
    assert [float(d["lm loss"]) for d in scaled[1]["store"]] == [
        float(d["lm loss"]) for d in plain[1]["store"]
    ]


def test_forward_only_returns_losses_and_leaves_no_gradient() -> None:
    results = run_distributed(_step, 2, 1, 4, ScheduleConfig(hidden_size=WIDTH), True)
    expected, _ = reference_run(
        tiny_layers(LAYERS, WIDTH), tiny_microbatches(4, seq=SEQ, batch=BATCH, width=WIDTH)
    )
    assert [float(d["lm loss"]) for d in results[1]["store"]] == pytest.approx(expected, rel=1e-6)
    assert results[0]["store"] == []
    assert all(r["grad"] is None and r["peak"] == 0 for r in results)


def test_collect_non_loss_data_in_forward_only() -> None:
    results = run_distributed(_step, 2, 1, 3, ScheduleConfig(hidden_size=WIDTH), True, True)
    assert len(results[1]["store"]) == 3
    assert all(
        isinstance(value, torch.Tensor) and value.dim() == 0 for value in results[1]["store"]
    )


class _Recorder:
    def __init__(self) -> None:
        self.active = False
        self.events: list[str] = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False


def _note_sync(flags: list[bool], recorder: _Recorder) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        flags.append(recorder.active)

    return hook


class _OwnSync(torch.nn.Module):
    """A chunk wrapper with a no_sync of its own, as a DDP wrapper has."""

    def __init__(self, module: torch.nn.Module, recorder: _Recorder) -> None:
        super().__init__()
        self.module = module
        self.no_sync = recorder.no_sync

    @property
    def input_tensor(self) -> Any:
        return self.module.input_tensor

    def forward(self, *inputs: Any) -> Any:
        return self.module(*inputs)


def _no_sync_pattern(vp: int, m: int, own: bool = False) -> dict[int, list[bool]]:
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=60)))
    chunks = _chunks(tiny_layers(LAYERS, WIDTH), comm.num_stages, vp, comm.stage)
    recorders = [_Recorder() for _ in range(vp)]
    seen: dict[int, list[bool]] = {chunk: [] for chunk in range(vp)}
    for chunk, stage in enumerate(chunks):
        # A gradient hook sees whether its chunk's no_sync was on during each backward.
        layer = stage.layers[0]
        assert isinstance(layer, torch.nn.Linear)
        layer.weight.register_hook(_note_sync(seen[chunk], recorders[chunk]))  # type: ignore[no-untyped-call]
    given = None if own else [r.no_sync for r in recorders]
    config = ScheduleConfig(hidden_size=WIDTH, no_sync_func=given)
    forward_backward = get_forward_backward_func(comm, vp_size=vp, config=config)
    data = tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)
    forward_backward(
        forward_step_func=tiny_forward_step(),
        data_iterator=[iter(data) for _ in range(vp)],
        model=[_OwnSync(c, r) for c, r in zip(chunks, recorders, strict=True)] if own else chunks,
        num_microbatches=m,
        seq_length=SEQ,
        micro_batch_size=BATCH,
    )
    comm.destroy()
    return seen


@pytest.mark.parametrize("own", [False, True], ids=["no-sync-func", "chunks-own-no-sync"])
@pytest.mark.parametrize("vp", [1, 2])
def test_gradient_sync_stays_off_until_the_last_microbatch_of_each_chunk(
    vp: int, own: bool
) -> None:
    """Given no_sync_func, or none when every chunk has a no_sync (a DDP wrapper's)."""
    for pattern in run_distributed(_no_sync_pattern, 2, vp, 4, own):
        for flags in pattern.values():
            assert flags == [True, True, True, False]


def _timed() -> dict[str, int]:
    counts: Counter[str] = Counter()

    class Timer:
        def __init__(self, name: str) -> None:
            self.name = name

        def start(self) -> None:
            counts[f"{self.name} start"] += 1

        def stop(self) -> None:
            counts[f"{self.name} stop"] += 1

    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=60)))
    chunks = _chunks(tiny_layers(LAYERS, WIDTH), comm.num_stages, 1, comm.stage)
    data = tiny_microbatches(3, seq=SEQ, batch=BATCH, width=WIDTH)
    forward_backward = get_forward_backward_func(
        comm, config=ScheduleConfig(hidden_size=WIDTH, timers=Timer)
    )
    forward_backward(
        forward_step_func=tiny_forward_step(), data_iterator=iter(data), model=chunks[0],
        num_microbatches=3, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    comm.destroy()
    return dict(counts)


def test_compute_timers_wrap_every_step() -> None:
    for counts in run_distributed(_timed, 2):
        assert counts == {
            "forward-compute start": 3, "forward-compute stop": 3,
            "backward-compute start": 3, "backward-compute stop": 3,
        }  # fmt: skip


def test_one_stage_runs_without_a_communicator() -> None:
    layers = tiny_layers(LAYERS, WIDTH)
    data = tiny_microbatches(3, seq=SEQ, batch=BATCH, width=WIDTH)
    (stage,) = _chunks(layers, 1, 1, 0)
    forward_backward = get_forward_backward_func(None, config=ScheduleConfig(hidden_size=WIDTH))
    assert forward_backward.schedule == "no_pipelining"
    store = forward_backward(
        forward_step_func=tiny_forward_step(), data_iterator=iter(data), model=[stage],
        num_microbatches=3, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    expected_losses, expected_grads = reference_run(tiny_layers(LAYERS, WIDTH), data)
    assert [float(d["lm loss"]) for d in store] == pytest.approx(expected_losses)
    torch.testing.assert_close(stage.layers[0].weight.grad, expected_grads[0][0])


def test_chunk_count_must_match_the_virtual_size() -> None:
    forward_backward = get_forward_backward_func(None, config=ScheduleConfig(hidden_size=WIDTH))
    with pytest.raises(
        ValueError, match=r"1 model chunks per rank expected \(vp_size\), got 2 chunks"
    ):
        forward_backward(
            forward_step_func=tiny_forward_step(), data_iterator=iter([]), model=[torch.nn.Linear(1, 1)] * 2,
            num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("pp", "vp", "debug"), [(2, 1, False), (4, 1, False), (2, 2, False), (4, 2, True)]
)
def test_variable_shapes_and_debug_checks_run_every_schedule(pp: int, vp: int, debug: bool) -> None:
    m = 8
    # Shapes travel with the data: a send must never wait for its receiver to post.
    comm_config = CommConfig(
        variable_seq_lengths=True, debug=debug, timeout=datetime.timedelta(seconds=60)
    )
    results = run_distributed(
        _step, pp, vp, m, ScheduleConfig(), False, False, comm_config, timeout=180
    )
    expected, _ = reference_run(
        tiny_layers(LAYERS, WIDTH), tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)
    )
    assert [float(d["lm loss"]) for d in results[-1]["store"]] == pytest.approx(expected, rel=1e-6)


def _null_context() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def test_interleaving_refuses_shared_iterators_and_a_single_no_sync() -> None:
    # Checked before any transfer, so a one-stage executor with virtual stages is enough.
    executor = get_forward_backward_func(None, vp_size=2, config=ScheduleConfig(hidden_size=WIDTH))
    shared: Iterator[Any] = iter([])
    with pytest.raises(ValueError, match="give each model chunk its own data iterator"):
        executor(
            forward_step_func=tiny_forward_step(), data_iterator=[shared, shared], model=[torch.nn.Linear(1, 1)] * 2,
            num_microbatches=2, seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip
    single = get_forward_backward_func(
        None, vp_size=2, config=ScheduleConfig(hidden_size=WIDTH, no_sync_func=_null_context)
    )
    with pytest.raises(
        ValueError, match="no_sync_func must be a list with one context factory per chunk"
    ):
        single(
            forward_step_func=tiny_forward_step(), data_iterator=[iter([]), iter([])], model=[torch.nn.Linear(1, 1)] * 2,
            num_microbatches=2, seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip


def _per_token_loss_and_failure() -> dict[str, Any]:
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=30)))
    chunks = _chunks(tiny_layers(LAYERS, WIDTH), comm.num_stages, 1, comm.stage)
    data = tiny_microbatches(2, seq=SEQ, batch=BATCH, width=WIDTH)
    plain = tiny_forward_step()

    def per_token(it: Iterator[Any], model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
        output, loss_func = plain(it, model)

        def three(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
            loss, reduced = loss_func(out)
            return loss * 4, torch.tensor(4.0), reduced  # a sum over 4 tokens, and the count

        return output, three

    forward_backward = get_forward_backward_func(comm, config=ScheduleConfig(hidden_size=WIDTH))
    kwargs: dict[str, Any] = {
        "model": chunks,
        "num_microbatches": 2,
        "seq_length": SEQ,
        "micro_batch_size": BATCH,
    }
    forward_backward(forward_step_func=per_token, data_iterator=iter(data), **kwargs)
    layer = chunks[0].layers[0]
    assert isinstance(layer, torch.nn.Linear)
    seen: dict[str, Any] = {"grad": layer.weight.grad}
    try:
        forward_backward(
            forward_step_func=per_token,
            data_iterator=iter(data),
            collect_non_loss_data=True,
            **kwargs,
        )
    except ValueError as error:
        seen["collect"] = str(error)

    def broken(it: Iterator[Any], model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
        raise RuntimeError("forward step failed")

    if comm.is_first_stage:
        with contextlib.suppress(RuntimeError):
            forward_backward(forward_step_func=broken, data_iterator=iter(data), **kwargs)
        try:
            comm.send_forward(torch.ones(1))
        except ValueError as error:
            seen["after_failure"] = str(error)
    return seen


def test_per_token_losses_bad_flags_and_a_failed_step() -> None:
    # Rank 1 finishes its first step and leaves; rank 0 then fails a step on its own.
    results = run_distributed(_per_token_loss_and_failure, 2, timeout=60)
    plain = run_distributed(_step, 2, 1, 2, ScheduleConfig(hidden_size=WIDTH))
    # (loss * 4) / 4 tokens is the plain loss: gradients match the plain run.
    for rank in range(2):
        torch.testing.assert_close(results[rank]["grad"], plain[rank]["grad"])
        assert "collect_non_loss_data needs forward_only=True" in results[rank]["collect"]
    assert (
        "broken by an earlier failure (a pipeline step failed: RuntimeError)"
        in results[0]["after_failure"]
    )


# ------------------------------------------------------------------------ the plan is what runs
class _SpyCommunicator(P2PCommunicator):
    """Records each pp-comm call as the slots and microbatches of its messages."""

    calls: list[list[tuple[str, int | None]]]

    def exchange(self, messages: Any, **kwargs: Any) -> Any:
        self.calls.append([(m.slot, m.microbatch) for m in messages])
        return super().exchange(messages, **kwargs)

    def communicate(self, **kwargs: Any) -> Any:  # nothing else may communicate
        self.calls.append([("communicate", None)])
        return super().communicate(**kwargs)


ONE_F_ONE_B = """\
rank 0: F0 SEND_F0 F1 SEND_F1+RECV_B0 B0 RECV_B1 B1
rank 1: RECV_F0 F0 B0 SEND_B0+RECV_F1 F1 B1 SEND_B1
"""
EDITS = {
    "as lowered": ONE_F_ONE_B,
    "split": ONE_F_ONE_B.replace("SEND_F1+RECV_B0", "SEND_F1 RECV_B0"),
    "merged": ONE_F_ONE_B.replace("SEND_F1+RECV_B0 B0 RECV_B1", "SEND_F1+RECV_B0+RECV_B1 B0"),
    "moved": ONE_F_ONE_B.replace("B0 SEND_B0+RECV_F1 F1 B1", "B0 RECV_F1 F1 SEND_B0 B1"),
}


def _spied_step(text: str, forward_only: bool = False) -> dict[str, Any]:
    comm = _SpyCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=30)))
    comm.calls = []
    written = parse_schedule(text)
    chunks = _chunks(tiny_layers(LAYERS, WIDTH), comm.num_stages, written.vp_size, comm.stage)
    data = tiny_microbatches(written.num_microbatches, seq=SEQ, batch=BATCH, width=WIDTH)
    try:
        # An invalid plan is refused here, by its resolution, before anything is sent.
        forward_backward = get_forward_backward_func(
            comm, resolve_for(comm, text, microbatch_counts=[written.num_microbatches]),
            config=ScheduleConfig(hidden_size=WIDTH),
        )  # fmt: skip
        forward_backward.record_timeline()
        store = forward_backward(
            forward_step_func=tiny_forward_step(), data_iterator=iter(data), model=chunks,
            num_microbatches=written.num_microbatches, seq_length=SEQ, micro_batch_size=BATCH,
            forward_only=forward_only,
        )  # fmt: skip
    except PlanError as error:
        return {"error": str(error), "calls": comm.calls}
    finally:
        comm.destroy()
    return {
        "calls": comm.calls,
        "losses": [float(d["lm loss"]) for d in store],
        "grads": [layer.weight.grad for chunk in chunks for layer in chunk.layers],
        "timeline": [(s.name, s.kind) for s in forward_backward.timeline],
    }


def _expected_calls(text: str, rank: int) -> list[list[tuple[str, int | None]]]:
    steps = validate(parse_schedule(text)).steps[rank]
    return [
        [(m.slot, m.action.microbatch) for m in step.exchange.messages]
        for step in steps
        if step.exchange is not None
    ]


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_each_exchange_of_the_plan_is_one_pp_comm_call(edit: str) -> None:
    text = EDITS[edit]
    results = run_distributed(_spied_step, 2, text, timeout=120)
    for rank, result in enumerate(results):
        # The executed transfers are exactly the plan's exchanges, in order, nothing else.
        assert result["calls"] == _expected_calls(text, rank)
        # Every compute step and exchange shows in the measured timeline, in plan order.
        steps = validate(parse_schedule(text)).steps[rank]
        steps_run = [name for name, kind in result["timeline"] if kind != "wait"]
        assert steps_run == [str(step) for step in steps]
    data = tiny_microbatches(2, seq=SEQ, batch=BATCH, width=WIDTH)
    expected_losses, expected_grads = reference_run(tiny_layers(LAYERS, WIDTH), data)
    assert results[1]["losses"] == pytest.approx(expected_losses, rel=1e-6)
    grads = results[0]["grads"] + results[1]["grads"]
    for got, (weight, _) in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, weight, rtol=1e-5, atol=1e-7)


def test_the_calls_change_with_the_plan() -> None:
    assert _expected_calls(EDITS["split"], 0) != _expected_calls(EDITS["as lowered"], 0)
    assert len(_expected_calls(EDITS["merged"], 0)) == len(_expected_calls(ONE_F_ONE_B, 0)) - 1
    assert _expected_calls(EDITS["moved"], 1) != _expected_calls(ONE_F_ONE_B, 1)


def test_an_invalid_plan_is_refused_with_the_grid_before_any_transfer() -> None:
    stuck = "rank 0: F0 RECV_B0 B0 SEND_F0\nrank 1: RECV_F0 F0 B0 SEND_B0\n"
    results = run_distributed(_spied_step, 2, stuck, timeout=60)
    for result in results:
        assert result["calls"] == []
        assert result["error"].startswith("the plan deadlocks: rank 0 waits at step 1 (RECV_B0)")
        assert "rank 1: [RECV_F0]" in result["error"]


def test_forward_only_runs_the_plans_forward_steps() -> None:
    results = run_distributed(_spied_step, 2, EDITS["moved"], True, timeout=60)
    assert results[0]["calls"] == [[("send_next", 0)], [("send_next", 1)]]
    assert results[1]["calls"] == [[("recv_prev", 0)], [("recv_prev", 1)]]
    assert all(kind in ("F", "exchange", "wait") for _, kind in results[1]["timeline"])


def test_timeline_is_off_unless_asked() -> None:
    forward_backward = get_forward_backward_func(None, config=ScheduleConfig(hidden_size=WIDTH))
    (stage,) = _chunks(tiny_layers(LAYERS, WIDTH), 1, 1, 0)
    data = tiny_microbatches(2, seq=SEQ, batch=BATCH, width=WIDTH)
    arguments: dict[str, Any] = {
        "forward_step_func": tiny_forward_step(), "model": [stage], "num_microbatches": 2,
        "seq_length": SEQ, "micro_batch_size": BATCH,
    }  # fmt: skip
    forward_backward(data_iterator=iter(data), **arguments)
    assert forward_backward.timeline == []
    forward_backward.record_timeline()
    forward_backward(data_iterator=iter(data), **arguments)
    assert [s.name for s in forward_backward.timeline] == ["F0", "B0", "F1", "B1"]
    assert all(s.end >= s.start for s in forward_backward.timeline)


def test_a_plan_for_other_microbatches_is_refused() -> None:
    with pytest.raises(ValueError, match="the plan covers 2 microbatches, but this step runs 3"):
        resolve_for(None, "F0 B0 F1 B1", microbatch_counts=[3])


def _prefetched_step(vp: int, m: int, prefetch: int | None) -> dict[str, Any]:
    comm = _SpyCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=30)))
    comm.calls = []
    chunks = _chunks(tiny_layers(LAYERS, WIDTH), comm.num_stages, vp, comm.stage)
    data = tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)
    resolved = resolve_for(comm, vp_size=vp, microbatch_counts=[m], prefetch=prefetch)
    forward_backward = get_forward_backward_func(
        comm, resolved, config=ScheduleConfig(hidden_size=WIDTH)
    )
    store = forward_backward(
        forward_step_func=tiny_forward_step(), data_iterator=[iter(data) for _ in range(vp)],
        model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    comm.destroy()
    steps = forward_backward.plan_for(m, forward_only=False)[1].steps[comm.stage]
    return {
        "calls": comm.calls,
        "planned": [
            [(msg.slot, msg.action.microbatch) for msg in step.exchange.messages]
            for step in steps
            if step.exchange is not None
        ],
        "first_receives": [str(step) for step in steps if step.exchange][:1],
        "losses": [float(d["lm loss"]) for d in store],
        "grads": [layer.weight.grad for chunk in chunks for layer in chunk.layers],
        "in_flight": forward_backward.stats.peak_in_flight_bytes,
    }


@pytest.mark.parametrize(("vp", "prefetch"), [(1, 0), (1, None), (2, None), (2, 3)])
def test_receives_posted_early_run_as_planned_and_change_nothing(
    vp: int, prefetch: int | None
) -> None:
    """gloo's default posts each receive one exchange early; 0 and 3 run as validated too."""
    m = 4
    results = run_distributed(_prefetched_step, 2, vp, m, prefetch, timeout=120)
    early = 1 if prefetch is None else prefetch
    name = "interleaved_1f1b" if vp > 1 else "1f1b"
    where_needed = validate(plan(name, pp_size=2, num_microbatches=m, vp_size=vp)).steps
    for rank, result in enumerate(results):
        # Exactly the validated (moved) exchanges ran, and they moved unless prefetch is 0.
        assert result["calls"] == result["planned"]
        unmoved = [
            [(msg.slot, msg.action.microbatch) for msg in step.exchange.messages]
            for step in where_needed[rank]
            if step.exchange is not None
        ]
        assert (result["planned"] == unmoved) == (early == 0)
        assert result["in_flight"] > 0
    if vp == 1:  # rank 1's first exchange receives the activations of early + 1 microbatches
        assert results[1]["first_receives"][0].count("RECV_F") == early + 1
    expected_losses, expected_grads = reference_run(
        tiny_layers(LAYERS, WIDTH), tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)
    )
    assert results[1]["losses"] == pytest.approx(expected_losses, rel=1e-6)
    placement = Placement.looped(2, vp)
    for rank, result in enumerate(results):
        layers = [i for c in range(vp) for i in placement.layers(rank, c, LAYERS)]
        for got, index in zip(result["grads"], layers, strict=True):
            torch.testing.assert_close(got, expected_grads[index][0], rtol=1e-5, atol=1e-7)


class _FakeComm:
    """Enough of a communicator to build an executor (no transfers)."""

    num_stages, stage, device = 2, 0, torch.device("cpu")  # no transport: judged by device

    def __init__(self, config: CommConfig) -> None:
        self.config = config


def test_prefetch_needs_fixed_shapes_and_is_not_negative() -> None:
    fixed = _FakeComm(CommConfig())
    headers = _FakeComm(CommConfig(variable_seq_lengths=True))
    with pytest.raises(ValueError, match=r"prefetch_receives must be 0 .* got -1"):
        resolve_for(fixed, microbatch_counts=[2], prefetch=-1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefetch_receives=1 needs fixed shapes"):
        resolve_for(headers, microbatch_counts=[2], prefetch=1)  # type: ignore[arg-type]
    # A schedule resolved for fixed shapes is refused by an executor whose shapes travel.
    early = resolve_for(fixed, microbatch_counts=[2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefetch_receives=1 needs fixed shapes"):
        get_forward_backward_func(headers, early)  # type: ignore[arg-type]
    assert get_forward_backward_func(headers).prefetch == 0  # type: ignore[arg-type]
    assert get_forward_backward_func(fixed).prefetch == 1  # type: ignore[arg-type]
    assert get_forward_backward_func(fixed, early).prefetch == 1  # type: ignore[arg-type]


def test_deallocate_output_tensor_has_megatrons_signature() -> None:
    output = torch.ones(3, 4, requires_grad=True) * 2.0
    deallocate_output_tensor(output)  # Megatron's default: nothing happens
    before = output.numel()
    deallocate_output_tensor(output, deallocate_pipeline_outputs=True)
    assert (before, output.numel()) == (12, 1)
    assert output.grad_fn is not None  # the graph stays for backward


def _on_stream_groups(pp: int, vp: int, name: str, headers: bool) -> dict[str, Any]:
    # No GPUs here: run what NCCL gets (a two-rank group per stream, batches per group,
    # headers ahead of data) over gloo, by telling pp-comm that tags do not separate streams.
    import pp_comm.communicator
    import pp_comm.transport

    for module in (pp_comm.transport, pp_comm.communicator):
        module.__dict__["matches_by_tag"] = lambda device: False
    config = CommConfig(variable_seq_lengths=headers, timeout=datetime.timedelta(seconds=60))
    comm = P2PCommunicator(None, config=config)
    m = 2 * pp
    forward_backward = get_forward_backward_func(
        comm, resolve_for(comm, name, vp_size=vp, microbatch_counts=[m]),
        config=ScheduleConfig(hidden_size=WIDTH),
    )  # fmt: skip
    chunks = stage_chunks(
        tiny_layers(LAYERS, WIDTH),
        stages=forward_backward.placement.stages[comm.stage],
        num_stages=pp * vp,
    )
    store = forward_backward(
        forward_step_func=tiny_forward_step(),
        data_iterator=[iter(tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)) for _ in chunks],
        model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    groups = len(comm._topology.stream_groups)
    comm.destroy()
    return {
        "transport": (comm.transport, forward_backward.transport, forward_backward.prefetch),
        "groups": groups,
        "losses": [float(d["lm loss"]) for d in store],
    }


@pytest.mark.parametrize(
    ("pp", "vp", "name", "headers"),
    [(4, 2, "zbv", False), (4, 2, "interleaved_1f1b", True), (2, 2, "zbv", True)],
)
def test_zbv_and_interleaving_run_on_a_group_per_stream_as_on_nccl(
    pp: int, vp: int, name: str, headers: bool
) -> None:
    """ZB-V beyond two ranks and interleaving were refused on NCCL; they validate under its
    rules now and run on pp-comm's stream groups (emulated over gloo)."""
    results = run_distributed(_on_stream_groups, pp, pp, vp, name, headers, timeout=180)
    expected, _ = reference_run(
        tiny_layers(LAYERS, WIDTH), tiny_microbatches(2 * pp, seq=SEQ, batch=BATCH, width=WIDTH)
    )
    for result in results:
        assert result["transport"] == ("nccl", "nccl", 0)
        assert result["groups"] == (8 if pp > 2 else 4)  # to and from each neighbour, 2 channels
    last = results[0] if name == "zbv" else results[-1]  # where the loss is computed
    assert last["losses"] == pytest.approx(expected, rel=1e-6)


def _argument_free_step() -> dict[str, Any]:
    """Ported Megatron code: the parallel state set once, then `get_forward_backward_func()`."""
    from pp_state import parallel_state as mpu

    mpu.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    try:
        forward_backward = get_forward_backward_func(config=ScheduleConfig(hidden_size=WIDTH))
        rank, m = mpu.get_pipeline_model_parallel_rank(), 4
        chunks = _chunks(tiny_layers(LAYERS, WIDTH), 2, 2, rank)
        data = tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)
        store = forward_backward(
            forward_step_func=tiny_forward_step(), data_iterator=[iter(data) for _ in chunks],
            model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip
        assert forward_backward.communicator is not None
        forward_backward.communicator.destroy()
        return {
            "schedule": forward_backward.schedule,
            "counts": forward_backward.resolved.microbatch_counts,
            "losses": [float(d["lm loss"]) for d in store],
        }
    finally:
        mpu.destroy_model_parallel()


def test_megatrons_argument_free_call_takes_its_choice_from_the_parallel_state() -> None:
    results = run_distributed(_argument_free_step, 2, timeout=120)
    assert [(r["schedule"], r["counts"]) for r in results] == [("interleaved_1f1b", (4,))] * 2
    expected, _ = reference_run(
        tiny_layers(LAYERS, WIDTH), tiny_microbatches(4, seq=SEQ, batch=BATCH, width=WIDTH)
    )
    assert results[1]["losses"] == pytest.approx(expected, rel=1e-6)
