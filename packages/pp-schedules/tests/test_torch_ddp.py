"""Chunks wrapped in torch's DistributedDataParallel: its no_sync decides at forward time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pp_schedules import ScheduleConfig, get_forward_backward_func, resolve_schedule
from pp_testing import StageStack, reference_run, run_distributed, tiny_layers, tiny_microbatches

WIDTH, SEQ, BATCH, LAYERS, MICROBATCHES = 4, 3, 2, 2, 4
Microbatch = dict[str, torch.Tensor]


def _forward_step(
    data: Iterator[Microbatch], model: DistributedDataParallel
) -> tuple[torch.Tensor, Callable[..., Any]]:
    microbatch = next(data)
    output = model(microbatch["x"])
    return output, lambda out: (((out - microbatch["y"]) ** 2).mean(), {})


def _data(rank: int) -> list[Microbatch]:
    return tiny_microbatches(MICROBATCHES, seq=SEQ, batch=BATCH, width=WIDTH, seed=10 + rank)


def _counted_ddp(calls: list[int]) -> DistributedDataParallel:
    """torch's DDP over the tiny model; its comm hook notes the microbatch each reduction is in."""
    ddp = DistributedDataParallel(StageStack(tiny_layers(LAYERS, WIDTH)))

    def hook(_: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(len(calls))
        buffer = bucket.buffer()
        dist.all_reduce(buffer)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer / dist.get_world_size())
        return future

    # torch checks the annotations as objects; this module's are strings (postponed).
    hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    ddp.register_comm_hook(None, hook)
    return ddp


def _no_pipelining(explicit: bool) -> tuple[int, list[torch.Tensor]]:
    calls: list[int] = []
    ddp = _counted_ddp(calls)
    config = ScheduleConfig(hidden_size=WIDTH, no_sync_func=ddp.no_sync if explicit else None)
    forward_backward = get_forward_backward_func(None, config=config)
    forward_backward(
        forward_step_func=_forward_step,
        data_iterator=iter(_data(dist.get_rank())),
        model=ddp,
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=BATCH,
    )
    grads = [p.grad.clone() for p in ddp.module.parameters() if p.grad is not None]
    return len(calls), grads


@pytest.mark.parametrize("explicit", [False, True], ids=["default-no-sync", "no-sync-func"])
def test_torch_ddp_reduces_once_per_step_and_gets_the_averaged_gradients(explicit: bool) -> None:
    results = run_distributed(_no_pipelining, 2, explicit, timeout=120)
    # The reference: each rank's microbatches on one process, gradients averaged over ranks.
    per_rank = [reference_run(tiny_layers(LAYERS, WIDTH), _data(rank))[1] for rank in range(2)]
    expected = [
        (a + b) / 2
        for rank0, rank1 in zip(*per_rank, strict=True)
        for a, b in zip(rank0, rank1, strict=True)
    ]
    for reductions, grads in results:
        # One bucket, reduced once: in the last microbatch's backward only.
        assert reductions == 1
        assert len(grads) == len(expected)
        for grad, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(grad, want)


def _gpipe_on_one_stage() -> str:
    ddp = DistributedDataParallel(StageStack(tiny_layers(LAYERS, WIDTH)))
    forward_backward = get_forward_backward_func(
        None, resolve_schedule("gpipe", pp_size=1, microbatch_counts=[2]),
        config=ScheduleConfig(hidden_size=WIDTH),
    )  # fmt: skip
    with pytest.raises(ValueError, match="DistributedDataParallel") as error:
        forward_backward(
            forward_step_func=_forward_step,
            data_iterator=iter(_data(0)),
            model=ddp,
            num_microbatches=2,
            seq_length=SEQ,
            micro_batch_size=BATCH,
        )
    assert all(p.grad is None for p in ddp.parameters()), "refused before any compute"
    return str(error.value)


def test_torch_ddp_refuses_a_plan_with_two_microbatches_in_flight() -> None:
    message = run_distributed(_gpipe_on_one_stage, 1, timeout=120)[0]
    assert "model chunk 0" in message
    assert "1F0" in message or "F1" in message
    assert "pp_optim.DistributedDataParallel" in message
