"""Which refusal a call meets first, and which exception types it carries, as in Megatron."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import ScheduleConfig, ScheduleConfigError, get_forward_backward_func
from pp_schedules.runtime._executor import ChunkIteratorError
from pp_state import Placement
from pp_testing import (
    run_distributed,
    stage_chunks,
    tiny_forward_step,
    tiny_layers,
    tiny_microbatches,
)

WIDTH, SEQ, BATCH, LAYERS = 8, 3, 2, 8
COUNT_RULE = "7 microbatches in groups of 4 leave 3"


def _seven_microbatches_through_one_iterator() -> list[str]:
    """pp 4, vp 2, 7 microbatches, and both chunks reading one iterator (as a list of the
    same iterator and as the bare iterator)."""
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=30)))
    placement = Placement.looped(comm.num_stages, 2)
    chunks = stage_chunks(
        tiny_layers(LAYERS, WIDTH),
        stages=placement.stages[comm.stage],
        num_stages=placement.num_stages,
    )
    shared = iter(tiny_microbatches(7, seq=SEQ, batch=BATCH, width=WIDTH))
    forward_backward = get_forward_backward_func(comm, vp_size=2, config=ScheduleConfig())
    messages = []
    try:
        for data_iterator in ([shared, shared], shared):
            # Megatron raises a RuntimeError about the count before it looks at the iterators.
            with pytest.raises(RuntimeError, match=COUNT_RULE) as refused:
                forward_backward(
                    forward_step_func=tiny_forward_step(), data_iterator=data_iterator,
                    model=chunks, num_microbatches=7, seq_length=SEQ, micro_batch_size=BATCH,
                )  # fmt: skip
            assert isinstance(refused.value, ScheduleConfigError)
            messages.append(str(refused.value))
    finally:
        comm.destroy()
    return messages


@pytest.mark.reliability
def test_the_microbatch_count_is_refused_before_a_shared_iterator() -> None:
    for messages in run_distributed(_seven_microbatches_through_one_iterator, 4, timeout=120):
        assert len(messages) == 2
        assert all(COUNT_RULE in message for message in messages)


def _call(executor: Any, data_iterator: Any, chunks: int) -> None:
    executor(
        forward_step_func=tiny_forward_step(), data_iterator=data_iterator,
        model=[torch.nn.Linear(1, 1)] * chunks, num_microbatches=2, seq_length=SEQ,
        micro_batch_size=BATCH,
    )  # fmt: skip


@pytest.mark.reliability
def test_chunk_and_iterator_refusals_are_runtime_errors_too() -> None:
    # Checked before any transfer, so an executor without a pipeline is enough.
    interleaved = get_forward_backward_func(None, vp_size=2, config=ScheduleConfig())
    shared: Iterator[Any] = iter([])
    with pytest.raises(RuntimeError, match="give each model chunk its own data iterator"):
        _call(interleaved, [shared, shared], 2)
    with pytest.raises(ValueError, match="give each model chunk its own data iterator"):
        _call(interleaved, shared, 2)
    one_chunk = get_forward_backward_func(None, config=ScheduleConfig())
    with pytest.raises(ChunkIteratorError, match=r"1 model chunks per rank expected") as refused:
        _call(one_chunk, iter([]), 2)
    assert isinstance(refused.value, RuntimeError)
    assert isinstance(refused.value, ValueError)
