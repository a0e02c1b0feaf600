"""DDPConfig(calculate_per_token_loss=True): the reduction sums, with or without the sharding.

Each data-parallel rank holds a different number of samples (tokens), as with packed
documents. Its loss is the sum over them; the reduction sums the gradients and the trainer
divides by the tokens of the whole batch, which gives the gradient of the batch's mean over
tokens, as one process computes it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_optim import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    FP32Optimizer,
    MegatronOptimizer,
    OptimizerConfig,
    get_param_groups,
)
from pp_testing import run_distributed

COUNTS = (3, 5)
"""Samples on data-parallel rank 0 and 1."""
LR = 0.1


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def _samples(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    inputs, targets = (
        torch.randn(sum(COUNTS), 5, generator=generator),
        torch.randn(sum(COUNTS), 2, generator=generator),
    )
    start = sum(COUNTS[:rank])
    return inputs[start : start + COUNTS[rank]], targets[start : start + COUNTS[rank]]


def _optimizer(ddp: DistributedDataParallel, sharded: bool) -> MegatronOptimizer:
    inner = torch.optim.SGD(get_param_groups([ddp]), lr=LR)
    config = OptimizerConfig(clip_grad=0.0)
    if sharded:
        return DistributedOptimizer(inner, config, model_chunks=[ddp], grad_stats_group=None)
    return FP32Optimizer(inner, config, grad_stats_group=None)


def _step(per_token: bool, sharded: bool, scatter: bool) -> dict[str, Any]:
    """One step: this rank's reduced gradients (its shard when sharded), then the weights."""
    config = DDPConfig(
        bucket_size=30, use_distributed_optimizer=sharded, calculate_per_token_loss=per_token
    )
    ddp = DistributedDataParallel(_model(), config, data_parallel_group=dist.group.WORLD)
    if scatter:
        # Reduce-scatter as on NCCL (on gloo the buckets are all-reduced whole, see _reduce).
        ddp._gloo = False
    optimizer = _optimizer(ddp, sharded)
    inputs, targets = _samples(dist.get_rank())
    loss = ((ddp(inputs) - targets) ** 2).sum()  # summed over this rank's samples
    (loss if per_token else loss / len(inputs)).backward()
    ddp.finish_grad_sync()
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    buckets = []
    for bucket in ddp.buckets:  # the part this rank owns: its shard, or the whole bucket
        start, end = bucket.shard(dist.get_rank()) if sharded else (0, bucket.data.numel())
        members = [index[id(p)] for p in bucket.params]
        buckets.append((members, bucket.data.numel(), start, bucket.data[start:end].clone()))
    if per_token:  # the trainer's part: the tokens of the whole batch
        count = torch.tensor(float(len(inputs)))
        dist.all_reduce(count)
        ddp.scale_gradients(1.0 / float(count))
    optimizer.step()
    if sharded:
        ddp.finish_param_sync()
    return {"buckets": buckets, "params": [p.detach().clone() for p in ddp.module.parameters()]}


def _both(sharded: bool, scatter: bool) -> dict[str, dict[str, Any]]:
    return {
        "per_token": _step(True, sharded, scatter),
        "average": _step(False, sharded, scatter),
    }


def _reference(per_token: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """On one process over the whole batch: the reduced gradients, and the weights after SGD.

    Per token: the gradient of the sum over every sample (what the reduction sums to), then
    the step on it over the samples; averaged: of each rank's mean, averaged over the ranks.
    """
    model = _model()
    losses = []
    for rank in range(len(COUNTS)):
        inputs, targets = _samples(rank)
        total = ((model(inputs) - targets) ** 2).sum()
        losses.append(total if per_token else total / len(inputs) / len(COUNTS))
    torch.stack(losses).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    scale = 1.0 / sum(COUNTS) if per_token else 1.0
    with torch.no_grad():
        params = [p - LR * scale * g for p, g in zip(model.parameters(), grads, strict=True)]
    return grads, params


def _expected_part(
    grads: list[torch.Tensor], members: list[int], size: int, start: int, end: int
) -> torch.Tensor:
    """The reference gradients laid out as a bucket (padded), and the rank's part of it."""
    flat = torch.cat([grads[i].reshape(-1) for i in members])
    return torch.nn.functional.pad(flat, (0, size - flat.numel()))[start:end]


@pytest.mark.parametrize(
    ("sharded", "scatter"),
    [(False, False), (True, False), (True, True)],
    ids=["all-reduce", "distributed-optimizer", "distributed-optimizer-reduce-scatter"],
)
def test_per_token_mode_sums_over_data_parallel_and_the_average_mode_averages(
    sharded: bool, scatter: bool
) -> None:
    results = run_distributed(_both, 2, sharded, scatter)
    for mode in ("per_token", "average"):
        grads, params = _reference(mode == "per_token")
        for result in results:
            for members, size, start, part in result[mode]["buckets"]:
                expected = _expected_part(grads, members, size, start, start + part.numel())
                torch.testing.assert_close(part, expected, rtol=1e-6, atol=1e-7)
            for got, want in zip(result[mode]["params"], params, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # The two modes reduce to different gradients, so the checks above could fail.
    summed, averaged = _reference(True)[0][0], _reference(False)[0][0]
    assert not torch.allclose(summed, averaged, rtol=1e-2)


def test_average_gradients_off_and_per_token_loss_both_sum() -> None:
    for config in (DDPConfig(average_gradients=False), DDPConfig(calculate_per_token_loss=True)):
        ddp = DistributedDataParallel(_model(), config, data_parallel_group=None)
        assert not ddp.averages
    assert DistributedDataParallel(_model(), data_parallel_group=None).averages
