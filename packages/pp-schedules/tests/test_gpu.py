"""Schedules on CUDA tensors over NCCL, validated under NCCL's rules; skipped without GPUs."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import ScheduleConfig, get_forward_backward_func
from pp_schedules.runtime import resolve_for
from pp_testing import (
    cuda_device_count,
    reference_run,
    run_distributed,
    stage_chunks,
    tiny_forward_step,
    tiny_layers,
    tiny_microbatches,
)

WIDTH, SEQ, BATCH, LAYERS = 8, 3, 2, 8


def _gpus(count: int) -> list[pytest.MarkDecorator]:
    """The gpu marker, and a skip unless `count` CUDA devices (one per NCCL rank) are there."""
    found = cuda_device_count()
    reason = f"needs {count} CUDA devices, found {found}"
    return [pytest.mark.gpu, pytest.mark.skipif(found < count, reason=reason)]


def _on_nccl(pp: int, vp: int, name: str, headers: bool) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    config = CommConfig(variable_seq_lengths=headers, timeout=datetime.timedelta(seconds=60))
    comm = P2PCommunicator(None, config=config, device=device)
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
    chunks = [chunk.to(device) for chunk in chunks]
    data = [
        {key: value.to(device) for key, value in microbatch.items()}
        for microbatch in tiny_microbatches(m, seq=SEQ, batch=BATCH, width=WIDTH)
    ]
    store = forward_backward(
        forward_step_func=tiny_forward_step(), data_iterator=[iter(data) for _ in chunks],
        model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    torch.cuda.synchronize()
    comm.destroy()
    return {
        "transport": (comm.transport, forward_backward.transport),
        "losses": [float(d["lm loss"]) for d in store],
    }


@pytest.mark.parametrize(
    ("pp", "vp", "name", "headers"),
    [
        pytest.param(2, 2, "zbv", False, marks=_gpus(2)),
        pytest.param(2, 2, "interleaved_1f1b", True, marks=_gpus(2)),
        pytest.param(4, 2, "zbv", True, marks=_gpus(4)),
        pytest.param(4, 2, "interleaved_1f1b", False, marks=_gpus(4)),
        pytest.param(4, 1, "zb_h1", True, marks=_gpus(4)),
    ],
)
def test_schedules_run_on_nccl_as_validated_under_its_rules(
    pp: int, vp: int, name: str, headers: bool
) -> None:
    """ZB-V, interleaving and headers: NCCL's pairing rules, on one group per stream."""
    results = run_distributed(_on_nccl, pp, pp, vp, name, headers, backend="nccl", timeout=300)
    expected, _ = reference_run(
        tiny_layers(LAYERS, WIDTH), tiny_microbatches(2 * pp, seq=SEQ, batch=BATCH, width=WIDTH)
    )
    for result in results:
        assert result["transport"] == ("nccl", "nccl")
    last = results[0] if name == "zbv" else results[-1]  # where the loss is computed
    assert last["losses"] == pytest.approx(expected, rel=1e-5)
