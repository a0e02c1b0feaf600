"""The memory probe: saved-for-backward bytes by hand, and samples after each compute step."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import (
    MemoryProbe,
    MemorySample,
    ScheduleConfig,
    get_forward_backward_func,
    write_schedule_trace,
)
from pp_state import Placement
from pp_testing import (
    requires_gpus,
    run_distributed,
    stage_chunks,
    tiny_forward_step,
    tiny_layers,
    tiny_microbatches,
)

WIDTH, SEQ, BATCH, LAYERS = 8, 3, 2, 8
FLOAT = 4
MB = 1024 * 1024


def _linear_tanh() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.randn(4, 8)


def test_saved_bytes_are_the_input_and_the_tanh_output_counted_once() -> None:
    model, x = _linear_tanh()
    probe = MemoryProbe(static=model.parameters)
    with probe.saved_tensors():
        loss = model(x).sum()
    # The first linear saves x (and weight.t(), a parameter's view: left out); tanh saves its
    # output and the second linear saves the same storage as its input: counted once.
    assert probe.saved_bytes == (4 * 8 + 4 * 16) * FLOAT
    assert probe.static_bytes() == sum(p.numel() for p in model.parameters()) * FLOAT
    sample = probe.sample("F0")
    static = probe.static_bytes()
    # Sampled outside counting: nothing allocated was counted, so everything live is static.
    assert sample == MemorySample("F0", static, 384, 384, None, static, static)
    assert sample.total_bytes == static + 384
    loss.backward()
    assert probe.saved_bytes == 0, "backward frees the graph and its saved tensors"
    assert probe.peak_saved_bytes == 384


def test_parameters_and_static_storage_are_left_out() -> None:
    weight = torch.nn.Parameter(torch.randn(8, 8))
    buffer = torch.randn(8)
    x = torch.randn(2, 8, requires_grad=True)
    plain = MemoryProbe()
    with plain.saved_tensors():
        product = x @ weight  # saves x and the parameter itself
    assert plain.saved_bytes == x.numel() * FLOAT
    del product
    static = MemoryProbe(static=lambda: [weight, buffer])
    with static.saved_tensors():
        scaled = torch.tanh(x * buffer)  # saves the static buffer and tanh's output
    assert static.saved_bytes == scaled.numel() * FLOAT
    assert static.static_bytes() == (64 + 8) * FLOAT
    del scaled
    assert static.saved_bytes == 0


def test_two_saves_of_one_storage_count_once_and_peaks_follow_samples() -> None:
    a = torch.randn(10, requires_grad=True)
    probe = MemoryProbe()
    assert probe.saved_by(lambda: a * a) == 10 * FLOAT  # mul saves a twice
    assert probe.saved_bytes == 0, "saved_by lets go of the result"
    with probe.saved_tensors():
        first = a * a
        with probe.saved_tensors():  # nested use counts each save once
            b = a + 1
            second = b * b
    assert probe.saved_bytes == 20 * FLOAT
    del first, second, b
    assert probe.sample("after").peak_saved_bytes == 20 * FLOAT
    assert probe.sample("again").peak_saved_bytes == 0
    probe.clear()
    assert (probe.samples, probe.peak_saved_bytes) == ([], 0)


def test_saved_by_measures_one_call_alone() -> None:
    model, x = _linear_tanh()
    probe = MemoryProbe(static=model.parameters)
    assert probe.saved_by(lambda: model(x)) == 384
    with probe.saved_tensors():
        kept = model(x)
        assert probe.saved_by(lambda: model(x)) == 384, "x counts: this call saved it too"
    assert probe.saved_bytes == 384
    del kept


def test_probed_gradients_equal_plain_ones_with_freed_outputs() -> None:
    """The executor frees sent outputs by swapping .data; tanh saved the output: unharmed."""
    results = [run_distributed(_probed_step, 2, probed, timeout=120) for probed in (False, True)]
    for plain, probed in zip(*results, strict=True):
        torch.testing.assert_close(probed["grad"], plain["grad"], rtol=0, atol=0)


def _chunks(pp: int, rank: int) -> list[Any]:
    placement = Placement.looped(pp, 1)
    return stage_chunks(tiny_layers(LAYERS, WIDTH), stages=placement.stages[rank], num_stages=pp)


def _probed_step(probed: bool, m: int = 4) -> dict[str, Any]:
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=60)))
    chunks = _chunks(comm.num_stages, comm.stage)
    probe = MemoryProbe(static=chunks[0].parameters)
    executor = get_forward_backward_func(comm, config=ScheduleConfig(hidden_size=WIDTH))
    executor.record_memory(probe if probed else None)
    executor(
        forward_step_func=tiny_forward_step(),
        data_iterator=iter(tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)),
        model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    actions, _ = executor.plan_for(m, forward_only=False)
    comm.destroy()
    layer = chunks[0].layers[0]
    assert isinstance(layer, torch.nn.Linear)
    assert layer.weight.grad is not None
    return {
        "grad": layer.weight.grad.clone(),
        "labels": [s.label for s in probe.samples],
        "actions": [str(a) for a in actions],
        "saved": [s.saved_bytes for s in probe.samples],
        "static": {s.static_bytes for s in probe.samples},
        "after": probe.saved_bytes,
        "expected_static": sum(p.numel() for p in chunks[0].parameters()) * FLOAT,
    }


def test_samples_line_up_with_the_compute_steps_and_empty_after_the_step() -> None:
    results = run_distributed(_probed_step, 2, True, timeout=120)
    activation = SEQ * BATCH * WIDTH * FLOAT
    # Per microbatch: the stage's input and each of its 4 tanh outputs; the last stage also
    # the (output - target) its squared loss saves.
    per_microbatch = [5 * activation, 6 * activation]
    for rank, result in enumerate(results):
        assert result["labels"] == result["actions"]
        assert result["after"] == 0
        assert result["static"] == {result["expected_static"]}
        held = per_microbatch[rank]
        # 1F1B at pp 2: rank 0 holds two microbatches at its peak, rank 1 one.
        assert result["saved"][0] == held
        assert max(result["saved"]) == (2 - rank) * held
        assert result["saved"][-1] == 0


def _broken(data: Iterator[Any], model: Any) -> Any:
    raise RuntimeError("broken forward")


@pytest.mark.reliability
def test_a_failed_step_leaves_no_hooks_behind() -> None:
    (stage,) = _chunks(1, 0)
    probe = MemoryProbe()
    executor = get_forward_backward_func(None, config=ScheduleConfig(hidden_size=WIDTH))
    executor.record_memory(probe)
    with pytest.raises(RuntimeError, match="broken forward"):
        executor(
            forward_step_func=_broken, data_iterator=iter([]), model=[stage],
            num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip
    a = torch.randn(4, requires_grad=True)
    kept = a * a
    assert probe.saved_bytes == 0, "outside the call nothing is counted"
    del kept
    executor.record_memory(None)
    data = tiny_microbatches(1, seq=SEQ, batch=BATCH, width=WIDTH)
    executor(
        forward_step_func=tiny_forward_step(), data_iterator=iter(data), model=[stage],
        num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    assert probe.samples == [], "a removed probe samples nothing"


def _profiled_step(path: str, predicted: list[list[int]] | None) -> str:
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=60)))
    chunks = _chunks(comm.num_stages, comm.stage)
    executor = get_forward_backward_func(comm, config=ScheduleConfig(hidden_size=WIDTH))
    executor.record_timeline()
    executor.record_memory(MemoryProbe(static=chunks[0].parameters))
    executor(
        forward_step_func=tiny_forward_step(),
        data_iterator=iter(tiny_microbatches(4, seq=SEQ, batch=BATCH, width=WIDTH)),
        model=chunks, num_microbatches=4, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    try:
        write_schedule_trace(path, executor, num_microbatches=4, predicted=predicted)
    except ValueError as error:
        return str(error)
    finally:
        comm.destroy()
    return json.dumps([s.live_bytes for s in executor.memory_samples])


def test_the_trace_draws_measured_and_predicted_memory_per_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "trace.json")
    predicted = [[MB * (rank + 1)] * 8 for rank in range(2)]
    totals = [json.loads(t) for t in run_distributed(_profiled_step, 2, path, predicted)]
    events = json.loads(Path(path).read_text())["traceEvents"]
    for rank in range(2):
        ends = sorted(
            e["ts"] + e["dur"] for e in events
            if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == rank and e["name"][0] in "FB"
        )  # fmt: skip
        counters = [e for e in events if e["ph"] == "C" and e["id"] == rank]
        assert {e["name"] for e in counters} == {"memory (MB)"}
        assert [e["ts"] for e in counters] == pytest.approx(ends)
        assert [e["args"]["measured"] * MB for e in counters] == pytest.approx(totals[rank])
        assert {e["args"]["predicted"] for e in counters} == {rank + 1.0}


@pytest.mark.reliability
def test_a_prediction_for_other_steps_is_refused(tmp_path: Path) -> None:
    messages = run_distributed(_profiled_step, 2, str(tmp_path / "t.json"), [[0] * 8, [0] * 7])
    assert messages[0] == (
        "rank 1 ran 8 compute steps, but 7 predicted memory values are given (one after each "
        "compute step, in order)"
    )
    assert not (tmp_path / "t.json").exists()


@requires_gpus(1)
def test_on_cuda_each_sample_also_carries_the_allocators_count() -> None:
    model, x = _linear_tanh()
    model, x = model.cuda(), x.cuda()
    probe = MemoryProbe(static=model.parameters)
    with probe.saved_tensors():
        out = model(x)
    sample = probe.sample("F0")
    assert sample.saved_bytes == 384
    assert sample.allocated_bytes is not None
    assert sample.allocated_bytes >= sample.total_bytes  # blocks are rounded up
    del out
    assert probe.saved_bytes == 0


@requires_gpus(1)
def test_on_cuda_the_live_bytes_are_the_allocators_with_its_peak_reset_per_sample() -> None:
    model, x = _linear_tanh()
    model, x = model.cuda(), x.cuda()
    probe = MemoryProbe(static=model.parameters)
    assert probe.device == "cuda"
    probe.clear()
    with probe.counting():
        big = torch.empty(1 << 20, device="cuda")  # 4 MiB, freed before the sample
        del big
        out = model(x)
        first = probe.sample("F0")
        second = probe.sample("again")
    assert first.live_bytes == torch.cuda.memory_allocated()
    assert first.peak_live_bytes is not None
    assert first.peak_live_bytes >= first.live_bytes + (1 << 22)  # the freed 4 MiB counted
    # The peak restarts at each sample: nothing was made in between.
    assert second.peak_live_bytes == second.live_bytes == first.live_bytes
    # The reserved peak outlives the resets: the freed 4 MiB were reserved once.
    assert probe.peak_reserved_bytes is not None
    assert probe.peak_reserved_bytes >= first.peak_live_bytes
    del out
