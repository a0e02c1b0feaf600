"""A pipelined step equals the same model run unpipelined on one process: loss and every gradient."""

from __future__ import annotations

import datetime

import pytest
import torch

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import ScheduleConfig, get_forward_backward_func
from pp_testing import (
    reference_run,
    run_distributed,
    stage_chunks,
    tiny_forward_step,
    tiny_layers,
    tiny_microbatches,
)

WIDTH, SEQ, BATCH, LAYERS, MICROBATCHES = 8, 3, 2, 8, 8


def _pipelined(
    schedule: str | None, vp_size: int, batched: bool
) -> tuple[list[float], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    config = CommConfig(batch_p2p_comm=batched, timeout=datetime.timedelta(seconds=60))
    comm = P2PCommunicator(None, config=config)
    pp, rank = comm.num_stages, comm.stage
    layers = tiny_layers(LAYERS, WIDTH)
    chunks = stage_chunks(layers, pp_size=pp, vp_size=vp_size, rank=rank)
    data = tiny_microbatches(MICROBATCHES, seq=SEQ, batch=BATCH, width=WIDTH)
    forward_backward = get_forward_backward_func(
        comm, vp_size=vp_size, config=ScheduleConfig(hidden_size=WIDTH, schedule=schedule)
    )
    losses = forward_backward(
        forward_step_func=tiny_forward_step(),
        data_iterator=[iter(data) for _ in range(vp_size)],
        model=chunks,
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=BATCH,
    )
    per = LAYERS // (pp * vp_size)
    grads = {}
    for chunk, stage in enumerate(chunks):
        for index, layer in enumerate(stage.layers):
            assert isinstance(layer, torch.nn.Linear)
            assert layer.weight.grad is not None
            assert layer.bias.grad is not None
            grads[(chunk * pp + rank) * per + index] = (layer.weight.grad, layer.bias.grad)
    comm.destroy()
    return [float(loss["lm loss"]) for loss in losses], grads


CASES = [
    pytest.param("gpipe", 2, 1, True, id="gpipe-pp2"),
    pytest.param("gpipe", 4, 1, False, id="gpipe-pp4-unbatched"),
    pytest.param("1f1b", 2, 1, True, id="1f1b-pp2"),
    pytest.param("1f1b", 4, 1, True, id="1f1b-pp4"),
    pytest.param(None, 2, 2, True, id="interleaved-pp2-vp2"),
    pytest.param(None, 4, 2, False, id="interleaved-pp4-vp2-unbatched"),
]


@pytest.mark.parametrize(("schedule", "pp", "vp", "batched"), CASES)
def test_pipelined_step_equals_the_unpipelined_model(
    schedule: str | None, pp: int, vp: int, batched: bool
) -> None:
    expected_losses, expected_grads = reference_run(
        tiny_layers(LAYERS, WIDTH),
        tiny_microbatches(MICROBATCHES, seq=SEQ, batch=BATCH, width=WIDTH),
    )
    results = run_distributed(_pipelined, pp, schedule, vp, batched, timeout=180)
    # Only the last stage computes losses; the others return none.
    assert all(losses == [] for losses, _ in results[:-1])
    assert results[-1][0] == pytest.approx(expected_losses, rel=1e-6, abs=1e-7)
    grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for _, rank_grads in results:
        grads.update(rank_grads)
    assert sorted(grads) == list(range(LAYERS))
    for index, (weight, bias) in enumerate(expected_grads):
        torch.testing.assert_close(grads[index][0], weight, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grads[index][1], bias, rtol=1e-5, atol=1e-7)
