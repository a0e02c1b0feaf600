"""The same checks on CUDA tensors and NCCL groups; skipped without GPUs."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pp_optim import (
    DDPConfig,
    DistributedDataParallel,
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    OptimizerConfig,
    clip_grad_norm,
)
from pp_testing import requires_gpus, run_distributed


def _model(device: torch.device) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(
        device
    )


@requires_gpus(1)
def test_fp16_step_and_overflow_skip_on_cuda() -> None:
    device = torch.device("cuda", 0)
    model = _model(device).half()
    optimizer = Float16OptimizerWithFloat16Params(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        OptimizerConfig(clip_grad=1.0, log_num_zeros_in_grad=True),
        DynamicGradScaler(2.0**16, 1.0, 2.0, 0.5, 1000, 1),
        grad_stats_group=None,
    )
    inputs = torch.randn(8, 16, device=device, dtype=torch.float16)
    optimizer.scale_loss(model(inputs).float().square().mean()).backward()
    ok, norm, zeros = optimizer.step()
    assert ok
    assert norm is not None
    assert norm > 0
    assert zeros is not None
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    optimizer.scale_loss(model(inputs).float().square().mean()).backward()
    grad = next(iter(model.parameters())).grad
    assert grad is not None
    grad[0, 0] = math.inf
    assert optimizer.step() == (False, None, None)
    assert optimizer.get_loss_scale().item() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _nccl_data_parallel() -> tuple[list[torch.Tensor], float]:
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    model = _model(device)
    ddp = DistributedDataParallel(
        model,
        DDPConfig(bucket_size=100, overlap_grad_reduce=True),
        data_parallel_group=dist.group.WORLD,
    )
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(5)).to(device)
    ddp(inputs.chunk(2)[rank]).square().mean().backward()
    ddp.finish_grad_sync()
    norm = clip_grad_norm(model.parameters(), 1e9, group=None)
    return [p.main_grad.cpu() for p in model.parameters()], norm  # type: ignore[attr-defined]


@requires_gpus(2)
def test_nccl_bucketed_all_reduce_equals_the_whole_batch() -> None:
    reference = _model(torch.device("cpu"))
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    reference(inputs).square().mean().backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    for grads, norm in run_distributed(_nccl_data_parallel, 2, backend="nccl"):
        assert abs(norm - expected_norm) <= 1e-4 * expected_norm
        for grad, param in zip(grads, reference.parameters(), strict=True):
            assert param.grad is not None
            torch.testing.assert_close(grad, param.grad, rtol=1e-4, atol=1e-5)
