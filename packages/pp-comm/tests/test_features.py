"""Scatter-gather over tensor parallel, timer hooks, and building from a ParallelState."""

from __future__ import annotations

import datetime
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator
from pp_state import ParallelConfig, ParallelState
from pp_testing import run_distributed

TIMEOUT = datetime.timedelta(seconds=30)


class _RecordingTimer:
    def __init__(self, log: Counter[str], name: str) -> None:
        self.log, self.name = log, name

    def start(self) -> None:
        self.log[f"{self.name}:start"] += 1

    def stop(self) -> None:
        self.log[f"{self.name}:stop"] += 1


class RecordingTimers:
    def __init__(self) -> None:
        self.log: Counter[str] = Counter()

    def __call__(self, name: str) -> _RecordingTimer:
        return _RecordingTimer(self.log, name)


def _scatter_gather(batched: bool) -> dict[str, object]:
    # 4 ranks: tp 2 x pp 2; stage 0 is ranks 0 and 1 (tp ranks 0 and 1), stage 1 ranks 2 and 3.
    state = ParallelState.create(
        ParallelConfig(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, timeout=TIMEOUT
        )
    )
    config = CommConfig(
        batch_p2p_comm=batched, scatter_gather_tensors_in_pipeline=True, timeout=TIMEOUT
    )
    comm = P2PCommunicator.from_parallel_state(state, config=config)
    seen: dict[str, object] = {}
    if comm.is_first_stage:
        # Tensor-parallel ranks normally hold the same activations; here they differ on
        # purpose, so the receiver's result shows which share came from which sender.
        tp_rank = state.tensor_model_parallel_rank
        activations = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 1000 * tp_rank
        odd = torch.arange(5, dtype=torch.float32) + 1000 * tp_rank  # tp 2 does not divide 5
        comm.send_forward([activations, odd])
    else:
        received = comm.recv_forward([(2, 3, 4), (5,)])
        assert isinstance(received, list)
        seen["first"] = received[0].detach().reshape(-1).tolist()
        seen["odd"] = received[1].detach().tolist()
        seen["requires_grad"] = received[0].requires_grad
    comm.destroy()
    state.destroy()
    return seen


@pytest.mark.parametrize("batched", [True, False])
def test_scatter_gather_sends_one_tp_share_and_rebuilds_the_whole(batched: bool) -> None:
    results = run_distributed(_scatter_gather, 4, batched, timeout=120)
    # Each sender sent only its own half (tp rank 0 the first 12 elements, tp rank 1 the
    # last 12, offset by 1000); both receivers rebuilt the same whole from the two halves.
    whole = list(range(12)) + [1000.0 + i for i in range(12, 24)]
    for rank in (2, 3):
        assert results[rank]["first"] == whole
        assert results[rank]["requires_grad"] is True
    # The 5-element tensor is not divisible by tp 2: it travels whole, from the same tp rank.
    assert results[2]["odd"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert results[3]["odd"] == [1000.0, 1001.0, 1002.0, 1003.0, 1004.0]


def _timers() -> dict[str, int]:
    timers = RecordingTimers()
    comm = P2PCommunicator(dist.group.WORLD, config=CommConfig(timeout=TIMEOUT), timers=timers)
    if comm.is_first_stage:
        comm.send_forward(torch.ones(2))
        comm.recv_backward((2,))
    else:
        comm.recv_forward((2,))
        comm.send_backward(torch.ones(2))
        comm.send_forward(torch.ones(2))  # a no-op on the last stage: no timer
    comm.destroy()
    return dict(timers.log)


def test_timer_hooks_wrap_each_transfer_with_megatron_names() -> None:
    first, last = run_distributed(_timers, 2)
    assert first == {
        "forward-send:start": 1,
        "forward-send:stop": 1,
        "backward-recv:start": 1,
        "backward-recv:stop": 1,
    }
    assert last == {
        "forward-recv:start": 1,
        "forward-recv:stop": 1,
        "backward-send:start": 1,
        "backward-send:stop": 1,
    }


def _from_state() -> tuple[int, int, int, int]:
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=4, timeout=TIMEOUT))
    comm = P2PCommunicator.from_parallel_state(state, config=CommConfig(timeout=TIMEOUT))
    received = comm.send_forward_recv_forward(torch.full((1,), float(state.rank)), True, (1,))
    assert isinstance(received, torch.Tensor)
    facts = (comm.stage, comm.prev_rank, comm.next_rank, int(received.item()))
    comm.destroy()
    state.destroy()
    return facts


def test_from_parallel_state_uses_its_pipeline_groups() -> None:
    # 8 ranks, pp 4: pipelines [0, 2, 4, 6] and [1, 3, 5, 7].
    for rank, (stage, prev, nxt, received) in enumerate(
        run_distributed(_from_state, 8, timeout=120)
    ):
        assert stage == rank // 2
        assert prev == (rank - 2) % 8
        assert nxt == (rank + 2) % 8
        assert received == prev


def _scatter_with_variable_shapes() -> list[float] | None:
    # tp 3 x pp 2: the 81-element shape header is divisible by 3 but must travel whole.
    state = ParallelState.create(
        ParallelConfig(
            tensor_model_parallel_size=3, pipeline_model_parallel_size=2, timeout=TIMEOUT
        )
    )
    config = CommConfig(
        scatter_gather_tensors_in_pipeline=True, variable_seq_lengths=True, timeout=TIMEOUT
    )
    comm = P2PCommunicator.from_parallel_state(state, config=config)
    result: list[float] | None = None
    if comm.is_first_stage:
        comm.send_forward(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    else:
        received = comm.recv_forward(None)
        assert isinstance(received, torch.Tensor)
        assert received.shape == (3, 4)
        result = received.detach().reshape(-1).tolist()
    comm.destroy()
    state.destroy()
    return result


def test_scatter_gather_with_variable_shapes_keeps_the_header_whole() -> None:
    results = run_distributed(_scatter_with_variable_shapes, 6, timeout=120)
    for rank in (3, 4, 5):
        assert results[rank] == [float(i) for i in range(12)]
