"""Zero-bubble schedules with pp-optim: loss scaling, contiguous grad buffers and no_sync."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pp_comm import CommConfig, P2PCommunicator
from pp_optim import DistributedDataParallel, DynamicGradScaler
from pp_schedules import ScheduleConfig, get_forward_backward_func
from pp_schedules.runtime import resolve_for
from pp_state import Placement
from pp_testing import (
    reference_run,
    run_distributed,
    stage_chunks,
    tiny_layers,
    tiny_microbatches,
)

WIDTH, SEQ, BATCH, LAYERS, MICROBATCHES, SCALE = 8, 3, 2, 8, 4, 1024.0


def _forward_step(
    data: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[..., Any]]:
    stage = model.module if isinstance(model, DistributedDataParallel) else model
    microbatch = next(data)
    x = microbatch["x"] if stage.input_tensor is None else stage.input_tensor
    output = model(x)

    def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = ((out - microbatch["y"]) ** 2).mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func  # type: ignore[return-value]


def _scaled_step(schedule: str, vp: int) -> dict[str, Any]:
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=60)))
    placement = Placement.named("looped" if schedule == "zb_h1" else "v", comm.num_stages, vp)
    stages = placement.stages[comm.stage]
    chunks = [
        DistributedDataParallel(chunk, data_parallel_group=None)
        for chunk in stage_chunks(
            tiny_layers(LAYERS, WIDTH), stages=stages, num_stages=placement.num_stages
        )
    ]
    scaler = DynamicGradScaler(SCALE, 1.0, 2.0, 0.5, 1000, 2)
    sync_states: list[bool] = []

    def note_sync(chunk: DistributedDataParallel) -> Callable[[], Any]:
        @contextlib.contextmanager
        def no_sync() -> Iterator[None]:
            with chunk.no_sync():
                yield
            sync_states.append(True)

        return no_sync

    forward_backward = get_forward_backward_func(
        comm,
        resolve_for(comm, schedule, vp_size=vp, microbatch_counts=[MICROBATCHES]),
        config=ScheduleConfig(
            hidden_size=WIDTH,
            grad_scale_func=lambda loss: loss * scaler.scale.to(loss.dtype),
            no_sync_func=[note_sync(c) for c in chunks],
        ),
    )
    data = tiny_microbatches(MICROBATCHES, seq=SEQ, batch=BATCH, width=WIDTH)
    losses = forward_backward(
        forward_step_func=_forward_step,
        data_iterator=[iter(data) for _ in range(vp)],
        model=chunks,
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=BATCH,
    )
    grads = {}
    for chunk, wrapped in enumerate(chunks):
        layers = wrapped.module.layers
        for index, layer in zip(placement.layers(comm.stage, chunk, LAYERS), layers, strict=True):
            assert layer.weight.grad is None, "the buffer's hook takes every gradient"
            grads[index] = (layer.weight.main_grad.clone(), layer.bias.main_grad.clone())
    comm.destroy()
    return {"losses": [float(d["lm loss"]) for d in losses], "grads": grads, "syncs": sync_states}


@pytest.mark.parametrize(("schedule", "vp"), [("zb_h1", 1), ("zbv", 2), ("dualpipev", 2)])
def test_zero_bubble_fills_grad_buffers_with_scaled_gradients(schedule: str, vp: int) -> None:
    results = run_distributed(_scaled_step, 2, schedule, vp, timeout=120)
    expected_losses, expected_grads = reference_run(
        tiny_layers(LAYERS, WIDTH),
        tiny_microbatches(MICROBATCHES, seq=SEQ, batch=BATCH, width=WIDTH),
    )
    last = 1 if schedule == "zb_h1" else 0  # the V's last stage is on rank 0
    assert results[last]["losses"] == pytest.approx(expected_losses, rel=1e-6)
    grads = {**results[0]["grads"], **results[1]["grads"]}
    assert sorted(grads) == list(range(LAYERS))
    for index, (weight, bias) in enumerate(expected_grads):
        # The weight-gradient steps accumulate through the buffers' hooks, scaled.
        torch.testing.assert_close(grads[index][0], weight * SCALE, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(grads[index][1], bias * SCALE, rtol=1e-5, atol=1e-4)
    # Every chunk left no_sync once (before its last weight-gradient step).
    assert [len(r["syncs"]) for r in results] == [vp, vp]
