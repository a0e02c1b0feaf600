"""The byte model against what a run allocates, and the counter against torch.profiler.

Every chunk's figures come from `measure_stage` (each chunk alone, one microbatch); the
simulator follows them over the plan; the executor's probe counts every storage the real step
allocates. torch.profiler's allocator events are the second, independent instrument for the
counter itself.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import MemoryProbe, ScheduleConfig, get_forward_backward_func
from pp_schedules.planning import MemoryModel, StageMemory, TransferBuffers, chain, simulate
from pp_schedules.runtime import AllocationCounter, measure_stage, resolve_for
from pp_state import Placement
from pp_testing import run_distributed

SEQ, BATCH, WIDTH = 16, 4, 64  # an activation is 16 KB: pp-comm copies it into a frame
BLOCKS = 8
MICROBATCHES = 8


class Block(torch.nn.Module):
    """A pre-norm MLP block with a residual: what a transformer layer's MLP half does."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.fc1 = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = torch.nn.Linear(4 * WIDTH, WIDTH)
        with torch.no_grad():
            for linear in (self.fc1, self.fc2):
                linear.weight.normal_(0.0, 0.05, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return x + hidden


class Chunk(torch.nn.Module):
    """Blocks of one virtual stage; the first stage embeds its data, the last adds the loss."""

    def __init__(self, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(i) for i in blocks)
        self.first, self.last = first, last
        self.head = torch.nn.Linear(WIDTH, WIDTH) if last else None
        self.input: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        self.input = tensors[0]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["x"] * 1.0 if self.first else self.input
        assert x is not None
        for block in self.blocks:
            x = block(x)
        if self.head is None:
            return x
        loss: torch.Tensor = ((self.head(x) - batch["y"]) ** 2).mean()
        return loss


def _batches(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        {name: torch.randn(SEQ, BATCH, WIDTH, generator=generator) for name in ("x", "y")}
        for _ in range(count)
    ]


def _chunks(placement: Placement, rank: int) -> list[Chunk]:
    per = BLOCKS // placement.num_stages
    last = placement.num_stages - 1
    chunks = []
    for stage in placement.stages[rank]:
        blocks = range(stage * per, (stage + 1) * per)
        chunks.append(Chunk(blocks, first=stage == 0, last=stage == last))
    return chunks


def _forward_step(
    data: Iterator[dict[str, torch.Tensor]], model: Chunk
) -> tuple[torch.Tensor, Callable[..., Any]]:
    output = model(next(data))
    return output, lambda out: (out, {"loss": out.detach()})


def _stage_memory(chunk: Chunk, batch: dict[str, torch.Tensor]) -> StageMemory:
    def forward(received: torch.Tensor | None) -> torch.Tensor:
        chunk.set_input_tensor([received])
        output: torch.Tensor = chunk(batch)
        chunk.set_input_tensor([None])
        return output / MICROBATCHES if chunk.last else output  # as the executor divides it

    given = None if chunk.first else torch.zeros(SEQ, BATCH, WIDTH)
    return measure_stage(forward, given, chunk.parameters(), loss=chunk.last)


def _model(placement: Placement, frames: TransferBuffers) -> MemoryModel:
    """Every virtual stage measured alone, in pipeline order (each rank builds them alike)."""
    batch = _batches(1)[0]
    stages = []
    for stage in range(placement.num_stages):
        per = BLOCKS // placement.num_stages
        chunk = Chunk(range(stage * per, (stage + 1) * per), first=stage == 0,
                      last=stage == placement.num_stages - 1)  # fmt: skip
        stages.append(_stage_memory(chunk, batch))
    # Parameters and their .grad, no optimizer: 8 bytes per parameter.
    return MemoryModel(stages=tuple(stages), optimizer="sgd", sgd_momentum=False,
                       transfers=frames)  # fmt: skip


def _run(schedule: str, vp: int, placement_name: str, variant: str = "") -> dict[str, Any]:
    config = CommConfig(timeout=datetime.timedelta(seconds=60))
    comm = P2PCommunicator(None, config=config)
    placement = Placement.named(placement_name, comm.num_stages, vp)
    chunks = _chunks(placement, comm.stage)
    params = [p for chunk in chunks for p in chunk.parameters()]
    probe = MemoryProbe(lambda: [*params, *(p.grad for p in params if p.grad is not None)])
    resolved = resolve_for(
        comm, schedule, vp_size=vp, placement=placement, microbatch_counts=[MICROBATCHES]
    )
    executor = get_forward_backward_func(comm, resolved, config=ScheduleConfig(hidden_size=WIDTH))
    if variant == "batched":  # a batch's sends complete with its receives, as on NCCL
        executor.independent = False
    batches = _batches(MICROBATCHES)
    for step in range(3):  # the third step finds what the first two left (grads, frames)
        if variant != "late" or step == 2:  # late: the frames were made before it counts
            executor.record_memory(probe)
        probe.clear()
        executor(
            forward_step_func=_forward_step,
            data_iterator=[iter(batches) for _ in chunks] if vp > 1 else iter(batches),
            model=chunks, num_microbatches=MICROBATCHES, seq_length=SEQ,
            micro_batch_size=BATCH,
        )  # fmt: skip
    frames = TransferBuffers(**dataclasses.asdict(comm.frames))
    comm.destroy()
    _, report = executor.plan_for(MICROBATCHES, forward_only=False)
    simulation = simulate(report, memory=_model(placement, frames))
    assert simulation.memory is not None
    track = simulation.memory[comm.stage]
    return {
        "labels": [s.label for s in probe.samples],
        "actions": [str(span.action) for span in simulation.spans[comm.stage]],
        "live": [s.live_bytes for s in probe.samples],
        "peaks": [s.peak_live_bytes for s in probe.samples],
        "after": list(track.after),
        "during": list(track.during),
        "peak": track.peak,
    }


@pytest.mark.parametrize(
    ("schedule", "vp", "placement", "variant"),
    [("1f1b", 1, "looped", ""), ("interleaved_1f1b", 2, "looped", ""),
     ("zb_h1", 1, "looped", ""), ("zbv", 2, "v", ""), ("dualpipev", 2, "v", ""),
     ("interleaved_1f1b", 2, "looped", "batched"),
     ("1f1b", 1, "looped", "late")],
    ids=["1f1b", "interleaved", "zb_h1", "zbv", "dualpipev",
         "interleaved-sends-complete-with-receives", "1f1b-probe-attached-late"],
)  # fmt: skip
def test_the_predicted_bytes_are_what_the_step_allocates(
    schedule: str, vp: int, placement: str, variant: str
) -> None:
    """Measured against predicted, step by step.

    "batched" completes a batch's sends with its receives, as NCCL does (the plan's
    delivered sends of a batch whose receive is not used yet complete when it is used, and
    the model holds them until then). "late" attaches the probe at the third step only: the
    frames pp-comm keeps for reuse were made before it counts, and are held all the same.
    "dualpipev" runs its F&B steps one half after the other (``fb_overlap="sequential"``, the
    default for chunks without an overlap function); the probe samples both halves once the
    step is done, and the byte model says what it sees there.
    """
    results = run_distributed(_run, 2, schedule, vp, placement, variant, timeout=240)
    for rank, result in enumerate(results):
        assert result["labels"] == result["actions"]
        measured = max(result["peaks"])
        assert result["peak"] == pytest.approx(measured, rel=0.02), rank
        for step, (live, after) in enumerate(zip(result["live"], result["after"], strict=True)):
            # Step by step, to within one small tensor (a loss, a batch's copy).
            assert abs(live - after) <= 0.02 * measured, (rank, result["labels"][step])
        for step, (peak, during) in enumerate(zip(result["peaks"], result["during"], strict=True)):
            assert abs(peak - during) <= 0.02 * measured, (rank, result["labels"][step])


def test_a_chunk_measured_whole_is_the_chain_of_its_parts() -> None:
    torch.manual_seed(0)
    batch = _batches(1)[0]
    for first, last in ((False, False), (True, False), (False, True)):
        whole = _stage_memory(Chunk(range(3), first=first, last=last), batch)
        parts = []
        for i in range(3):
            part = Chunk(range(i, i + 1), first=first and i == 0, last=last and i == 2)
            parts.append(_stage_memory(part, batch))
        chained = chain(parts)
        tolerance = SEQ * BATCH * WIDTH * 4  # one activation: where a part's gradient dies
        for field in dataclasses.fields(StageMemory):
            mine, theirs = getattr(chained, field.name), getattr(whole, field.name)
            if isinstance(mine, bool):
                continue
            assert abs(mine - theirs) <= tolerance, (first, last, field.name, mine, theirs)


# ------------------------------------------------------------------------ the counter itself
def _profiled_peak(trace: Path) -> tuple[int, int]:
    """The most bytes allocated at once since profiling began, and what was left at its end.

    From torch.profiler's allocator events (``profile_memory=True``), in time order.
    """
    events = json.loads(trace.read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    held = peak = 0
    for event in memory:
        held += event["args"]["Bytes"]
        peak = max(peak, held)
    return peak, held


def _counted_and_profiled(step: Callable[[], None]) -> tuple[tuple[int, int], tuple[int, int]]:
    counter = AllocationCounter()
    with counter.counting():
        step()
    counted = (counter.take_peak(), counter.live_bytes)
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            step()
        profiler.export_chrome_trace(str(trace))
        profiled = _profiled_peak(trace)
    return counted, profiled


def test_the_counter_sees_what_torch_profilers_allocator_events_see() -> None:
    torch.manual_seed(0)
    chunk = Chunk(range(2), first=False, last=False)
    for param in chunk.parameters():
        param.grad = torch.zeros_like(param)
    x = torch.randn(SEQ, BATCH, WIDTH, requires_grad=True)
    x.grad = torch.zeros_like(x)

    def step() -> None:
        chunk.set_input_tensor([x])
        out = chunk({})
        out.backward(torch.ones_like(out))

    step()  # warm: every gradient exists
    counted, profiled = _counted_and_profiled(step)
    assert counted == profiled
    assert counted[0] > 4 * SEQ * BATCH * WIDTH * 4  # a block's hidden layer at least


@pytest.mark.parametrize("case", ["out into an empty tensor", "resize_ growing a storage"])
def test_the_counter_sees_operators_that_reallocate_their_inputs(case: str) -> None:
    a, b = torch.randn(1000), torch.randn(1000)
    held: list[torch.Tensor] = []

    def step() -> None:
        held.clear()
        if case == "out into an empty tensor":
            out = torch.empty(0)
            torch.add(a, b, out=out)  # resized to 4,000 bytes inside the operator
        else:
            out = torch.zeros(10)
            out.resize_(2000)  # reallocated at 8,000 bytes
        held.append(out)

    counted, profiled = _counted_and_profiled(step)
    assert counted == profiled
    assert counted[1] == held[0].untyped_storage().nbytes()


def test_frees_are_counted_from_any_thread_and_never_wait_for_the_counters_lock() -> None:
    counter = AllocationCounter()
    with counter.counting():
        kept = torch.randn(250) * 2  # 1,000 bytes, counted
    assert counter.live_bytes == 1000
    freed = threading.Event()

    def free() -> None:  # garbage collection can run a finalizer while the lock is held
        kept_here.pop()
        freed.set()

    kept_here = [kept]
    del kept
    with counter._lock:
        worker = threading.Thread(target=free)
        worker.start()
        worker.join(timeout=30)
        assert freed.is_set(), "a free waited for the counter's lock"
    assert counter.live_bytes == 0
    assert counter.take_peak() == 2000  # randn and its product, alive at once


def test_an_excluded_storage_leaves_the_count_and_its_address_is_counted_again() -> None:
    counter = AllocationCounter()
    with counter.counting():
        static = torch.randn(100) + 1
        other = torch.randn(50) + 1
    counter.exclude([static.untyped_storage().data_ptr()])
    assert counter.live_bytes == 200
    key = static.untyped_storage().data_ptr()
    del static
    assert counter.live_bytes == 200
    assert key not in counter._excluded
    del other
    assert counter.live_bytes == 0


def _profiled_step() -> tuple[int, int]:
    """One executor step on 2 ranks under the probe and torch.profiler at once."""
    config = CommConfig(timeout=datetime.timedelta(seconds=60))
    comm = P2PCommunicator(None, config=config)
    placement = Placement.looped(comm.num_stages, 1)
    chunks = _chunks(placement, comm.stage)
    params = [p for chunk in chunks for p in chunk.parameters()]
    probe = MemoryProbe(lambda: [*params, *(p.grad for p in params if p.grad is not None)])
    executor = get_forward_backward_func(comm, config=ScheduleConfig(hidden_size=WIDTH))
    batches = _batches(MICROBATCHES)

    def step() -> None:
        executor(
            forward_step_func=_forward_step, data_iterator=iter(batches), model=chunks,
            num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip

    step()
    executor.record_memory(probe)
    step()  # the probe counts what stays from now on (frames kept for reuse, say)
    start = probe.sample("start")
    assert start.live_bytes is not None
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            step()
        profiler.export_chrome_trace(str(trace))
        profiled, _ = _profiled_peak(trace)
    comm.destroy()
    counted = max(s.peak_live_bytes or 0 for s in probe.samples[1:]) - start.live_bytes
    return counted, profiled


def test_a_pipeline_steps_peak_is_the_same_by_the_probe_and_by_the_profiler() -> None:
    for counted, profiled in run_distributed(_profiled_step, 2, timeout=240):
        assert counted == profiled
