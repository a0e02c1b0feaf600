"""The byte model step by step: a chunk's parts chained, and what a rank holds between steps."""

from __future__ import annotations

import dataclasses

import pytest

from pp_schedules.planning import (
    MemoryModel,
    StageMemory,
    TransferBuffers,
    chain,
    format_bytes_apart,
    plan,
    simulate,
    validate,
)
from pp_schedules.planning._memory_walk import walk_rank
from pp_schedules.planning._validation import sends_delivered

A = StageMemory(
    parameters=1, activation_bytes=100, output_bytes=10, forward_transient_bytes=5,
    backward_transient_bytes=30, input_grad_bytes=10, input_transient_bytes=40,
    deferred_bytes=20, weight_transient_bytes=7, weight_kept_bytes=3,
)  # fmt: skip
B = StageMemory(
    parameters=2, activation_bytes=200, output_bytes=10, forward_transient_bytes=50,
    backward_transient_bytes=60, input_grad_bytes=10, input_transient_bytes=70,
    deferred_bytes=30, weight_transient_bytes=9, weight_kept_bytes=4,
)  # fmt: skip


def test_two_parts_chain_as_one_chunk() -> None:
    chunk = chain([A, B])
    # Forward: A's 100 + 10 stay (B holds its input); B peaks at 200 + 10 + 50 on top.
    assert chunk.activation_bytes == 100 + 10 + 200
    assert chunk.output_bytes == 10
    assert chunk.forward_peak_bytes == 110 + 260
    # Backward: B first (peak 60), then A from 60 - 200 - 10 + 10 below the start.
    assert chunk.backward_transient_bytes == 60
    # I: B keeps 30 + its input's gradient 10; A peaks 40 on top; A used that gradient.
    assert chunk.input_transient_bytes == 80
    assert chunk.deferred_bytes == 20 + 30
    assert chunk.input_grad_bytes == 10
    # W in forward order: A's part keeps 3 until W ends, B peaks 9 on top of it.
    assert chunk.weight_transient_bytes == 12
    assert chunk.weight_kept_bytes == 7
    assert chunk.parameters == 3


def test_an_output_the_next_part_does_not_hold_is_freed_after_it() -> None:
    chunk = chain([A, dataclasses.replace(B, holds_input=False)])
    assert chunk.activation_bytes == 100 + 200
    assert chunk.forward_transient_bytes == 370 - 310


def test_a_chunk_whose_input_takes_no_gradient_does_its_backward_in_w() -> None:
    embedding = dataclasses.replace(A, input_grad_bytes=0)
    chunk = chain([embedding, B])
    assert (chunk.input_transient_bytes, chunk.deferred_bytes, chunk.input_grad_bytes) == (0, 0, 0)
    assert chunk.weight_transient_bytes == chunk.backward_transient_bytes == 60
    assert chunk.first_stage


def test_saved_bytes_alone_chain_as_sums_and_the_largest_recompute() -> None:
    layer = StageMemory(parameters=5, activation_bytes=100, recompute_bytes=40)
    loss = StageMemory(parameters=2, activation_bytes=20, recompute_bytes=7)
    chunk = chain([layer, layer, loss])
    assert (chunk.parameters, chunk.activation_bytes, chunk.recompute_bytes) == (12, 220, 40)
    model = MemoryModel.from_layers([2, 2], layer=layer, loss=loss)
    assert model.stages[1] == chunk
    assert chain([]) == StageMemory(parameters=0, activation_bytes=0)


def _model(stage: StageMemory, stages: int, **options: object) -> MemoryModel:
    first = dataclasses.replace(stage, input_grad_bytes=0)
    return MemoryModel(stages=(first,) + (stage,) * (stages - 1), **options)  # type: ignore[arg-type]


def _track(name: str, model: MemoryModel, rank: int, **sizes: int) -> tuple[list[str], list[int]]:
    report = validate(plan(name, **sizes))  # type: ignore[arg-type]
    simulation = simulate(report, memory=model)
    assert simulation.memory is not None
    labels = [str(span.action) for span in simulation.spans[rank]]
    return labels, [value - simulation.memory[rank].static.total
                    for value in simulation.memory[rank].after]  # fmt: skip


def test_an_output_stays_until_its_send_completes_or_until_its_backward() -> None:
    stage = StageMemory(parameters=0, activation_bytes=0, output_bytes=10, input_grad_bytes=10)
    sizes = {"pp_size": 2, "num_microbatches": 4}
    labels, freed = _track("gpipe", _model(stage, 2), 0, **sizes)
    kept = _track("gpipe", _model(stage, 2, deallocates_outputs=False), 0, **sizes)[1]
    assert labels == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    # GPipe's first rank sends four outputs before it hears from rank 1: all four wait.
    assert freed[:4] == kept[:4] == [10, 20, 30, 40]
    # Once the first gradient is in, every send is known to have arrived: sent outputs are
    # freed; outputs kept for their backward go one by one.
    assert freed[5:] == [0, 0, 0]
    assert kept[5:] == [20, 10, 0]


def test_received_tensors_count_from_their_exchange_until_their_last_use() -> None:
    stage = StageMemory(parameters=0, activation_bytes=0, output_bytes=10, input_grad_bytes=10)
    labels, after = _track("gpipe", _model(stage, 2), 1, pp_size=2, num_microbatches=2)
    assert labels == ["F0", "F1", "B0", "B1"]
    # The last stage holds each received input (10) and its loss (10 here) until the
    # backward, which frees both and makes a gradient (10) that waits for its send.
    assert after == [20, 40, 30, 20]


def test_frames_kept_for_reuse_are_held_when_the_step_starts() -> None:
    stage = StageMemory(parameters=0, activation_bytes=0, output_bytes=10, input_grad_bytes=10)
    frames = TransferBuffers(
        receive_frame_bytes=1000, send_header_bytes=5, inline_bytes=64, spare_frames=8
    )
    report = validate(plan("1f1b", pp_size=2, num_microbatches=8))
    bare = simulate(report, memory=_model(stage, 2)).memory
    framed = simulate(report, memory=_model(stage, 2, transfers=frames)).memory
    assert bare is not None
    assert framed is not None
    for rank in (0, 1):
        kept = framed[rank].transfer_bytes
        assert kept > 0
        # Receive frames (1000) and sent ones (15: 10 bytes and a 5-byte header).
        assert kept % 1000 in range(0, 8 * 15 + 1, 15)
        assert framed[rank].peak >= bare[rank].peak + kept
    walked = walk_rank(_model(stage, 2, transfers=frames), report.placement, 1,  # type: ignore[arg-type]
                       report.steps[1], sends_delivered(report.steps)[1])  # fmt: skip
    assert walked.start == framed[1].transfer_bytes


def test_payloads_above_the_inline_size_travel_without_a_frame_of_their_size() -> None:
    frames = TransferBuffers(
        receive_frame_bytes=1000, send_header_bytes=5, inline_bytes=64, spare_frames=8
    )
    assert frames.send_frame_bytes(64) == 69
    assert frames.send_frame_bytes(65) == 0
    assert TransferBuffers().send_frame_bytes(10) == 0


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TransferBuffers(spare_frames=-1), "spare_frames must be a whole number"),
        (lambda: StageMemory(parameters=1, activation_bytes=0, holds_input=1), "True or False"),  # type: ignore[arg-type]
        (lambda: StageMemory(parameters=1, activation_bytes=0, deferred_bytes=-2), "deferred"),
    ],
)
def test_bad_figures_are_refused(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()  # type: ignore[operator]


def test_a_limit_and_a_peak_never_read_alike() -> None:
    mb = 2**20
    assert format_bytes_apart([7.647 * mb], 7.6 * mb) == ("7.60 MB", ["7.65 MB"])
    assert format_bytes_apart([7.6 * mb + 4], 7.6 * mb) == ("7.600000 MB", ["7.600004 MB"])
    assert format_bytes_apart([7.4 * mb, 5.5 * mb], 6.1 * mb) == ("6.1 MB", ["7.4 MB", "5.5 MB"])
    assert format_bytes_apart([6.1 * mb], 6.1 * mb) == ("6.1 MB", ["6.1 MB"])
    assert format_bytes_apart([100], 200) == ("200 B", ["100 B"])
    gb = 2**30  # a limit in GB from a float may fall between two bytes
    assert format_bytes_apart([8 * gb + 1], 8 * gb + 0.6) == (
        "8589934592.6 B",
        ["8589934593.0 B"],
    )


def test_a_memory_model_for_a_forward_only_plan_is_refused() -> None:
    stage = StageMemory(parameters=0, activation_bytes=10, output_bytes=10)
    forward = plan("1f1b", pp_size=2, num_microbatches=2, forward_only=True)
    report = validate(forward, forward_only=True)
    with pytest.raises(ValueError, match="this plan is forward only"):
        simulate(report, memory=_model(stage, 2))
