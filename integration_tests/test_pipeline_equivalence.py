"""A pipelined step equals the same model run unpipelined on one process: loss and every gradient."""

from __future__ import annotations

import datetime

import pytest
import torch

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import ScheduleConfig, get_forward_backward_func
from pp_schedules.runtime import resolve_for
from pp_state import Placement
from pp_testing import (
    reference_run,
    run_distributed,
    stage_chunks,
    tiny_forward_step,
    tiny_layers,
    tiny_microbatches,
)

WIDTH, SEQ, BATCH, LAYERS, MICROBATCHES = 8, 3, 2, 16, 8


def _pipelined(
    schedule: str | None, vp_size: int, batched: bool, placement_name: str = "looped"
) -> tuple[list[float], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    config = CommConfig(batch_p2p_comm=batched, timeout=datetime.timedelta(seconds=60))
    comm = P2PCommunicator(None, config=config)
    pp, rank = comm.num_stages, comm.stage
    placement = Placement.named(placement_name, pp, vp_size)
    layers = tiny_layers(LAYERS, WIDTH)
    chunks = stage_chunks(layers, stages=placement.stages[rank], num_stages=placement.num_stages)
    data = tiny_microbatches(MICROBATCHES, seq=SEQ, batch=BATCH, width=WIDTH)
    resolved = resolve_for(
        comm, schedule, vp_size=vp_size, placement=placement, microbatch_counts=[MICROBATCHES]
    )
    forward_backward = get_forward_backward_func(
        comm, resolved, config=ScheduleConfig(hidden_size=WIDTH)
    )
    losses = forward_backward(
        forward_step_func=tiny_forward_step(),
        data_iterator=[iter(data) for _ in range(vp_size)],
        model=chunks,
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=BATCH,
    )
    grads = {}
    for chunk, stage in enumerate(chunks):
        held = placement.layers(rank, chunk, LAYERS)
        for index, layer in zip(held, stage.layers, strict=True):
            assert isinstance(layer, torch.nn.Linear)
            assert layer.weight.grad is not None
            assert layer.bias.grad is not None
            grads[index] = (layer.weight.grad, layer.bias.grad)
    comm.destroy()
    return [float(loss["lm loss"]) for loss in losses], grads


# Every schedule at pp 2, 4 and 8, with one and two chunks per rank; two chunks on the
# looped placement (Megatron's interleaving, torch's looped GPipe) and on the V.
SCHEDULES = [
    ("gpipe", 1, "looped"),
    ("1f1b", 1, "looped"),
    ("interleaved_1f1b", 2, "looped"),
    ("gpipe", 2, "looped"),
    ("gpipe", 2, "v"),
]
# Zero-bubble schedules (backwards split into I and W) and DualPipeV (F&B steps) at pp 2 and 4.
ZERO_BUBBLE = [("zb_h1", 1, "looped"), ("zbv", 2, "v"), ("dualpipev", 2, "v")]
CASES = [
    pytest.param(name, pp, vp, pp != 4, where, id=f"{name}-pp{pp}-vp{vp}-{where}")
    for pp in (2, 4, 8)
    for name, vp, where in SCHEDULES + (ZERO_BUBBLE if pp < 8 else [])
]


@pytest.mark.parametrize(("schedule", "pp", "vp", "batched", "where"), CASES)
def test_pipelined_step_equals_the_unpipelined_model(
    schedule: str, pp: int, vp: int, batched: bool, where: str
) -> None:
    """pp 8 cases start 8 ranks on 2 cores: about 5-10 s each here."""
    expected_losses, expected_grads = reference_run(
        tiny_layers(LAYERS, WIDTH),
        tiny_microbatches(MICROBATCHES, seq=SEQ, batch=BATCH, width=WIDTH),
    )
    results = run_distributed(_pipelined, pp, schedule, vp, batched, where, timeout=180)
    # Only the rank holding the last stage computes losses (rank 0 on the V); the others
    # return none.
    placement = Placement.named(where, pp, vp)
    last = placement.holder(placement.num_stages - 1)[0]
    assert all(losses == [] for rank, (losses, _) in enumerate(results) if rank != last)
    assert results[last][0] == pytest.approx(expected_losses, rel=1e-6, abs=1e-7)
    grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for _, rank_grads in results:
        grads.update(rank_grads)
    assert sorted(grads) == list(range(LAYERS))
    for index, (weight, bias) in enumerate(expected_grads):
        torch.testing.assert_close(grads[index][0], weight, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grads[index][1], bias, rtol=1e-5, atol=1e-7)
