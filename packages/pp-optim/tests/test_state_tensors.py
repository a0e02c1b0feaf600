"""`MegatronOptimizer.state_tensors`: the optimizer's own storage, byte for byte."""

from __future__ import annotations

import torch

from pp_optim import (
    DDPConfig,
    DistributedDataParallel,
    MegatronOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)

# Linear(6, 8) and Linear(8, 3): weights and biases.
PARAMETERS = 6 * 8 + 8 + 8 * 3 + 3


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(
        dtype
    )


def _bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert len(storages) == len(tensors), "each tensor a storage of its own"
    return sum(storages.values())


def _step(model: torch.nn.Module, optimizer: MegatronOptimizer) -> None:
    dtype = next(model.parameters()).dtype
    model(torch.randn(5, 6).to(dtype)).float().pow(2).mean().backward()
    optimizer.step()


def test_fp32_adam_holds_two_moments() -> None:
    model = _model(torch.float32)
    optimizer = get_megatron_optimizer(OptimizerConfig(), [model])
    assert optimizer.state_tensors() == [], "state is made by the first step"
    _step(model, optimizer)
    assert _bytes(optimizer.state_tensors()) == PARAMETERS * (4 + 4)


def test_sgd_holds_its_momentum_and_nothing_without_one() -> None:
    model = _model(torch.float32)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd"), [model])
    _step(model, optimizer)
    assert _bytes(optimizer.state_tensors()) == PARAMETERS * 4
    plain = _model(torch.float32)
    without = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", sgd_momentum=0.0), [plain])
    _step(plain, without)
    assert without.state_tensors() == []


def test_bf16_adds_fp32_main_copies_and_their_gradients() -> None:
    model = _model(torch.bfloat16)
    optimizer = get_megatron_optimizer(OptimizerConfig(bf16=True), [model])
    # Before a step: the fp32 main copies only.
    assert _bytes(optimizer.state_tensors()) == PARAMETERS * 4
    _step(model, optimizer)
    # Adam's moments (8), the main copies (4) and their fp32 gradients (4).
    assert _bytes(optimizer.state_tensors()) == PARAMETERS * (8 + 4 + 4)
    optimizer.zero_grad()
    assert _bytes(optimizer.state_tensors()) == PARAMETERS * (8 + 4)


def test_a_main_gradient_that_is_the_fp32_grad_buffer_is_left_out() -> None:
    model = _model(torch.bfloat16)
    ddp = DistributedDataParallel(
        model, DDPConfig(grad_reduce_in_fp32=True), data_parallel_group=None
    )
    optimizer = get_megatron_optimizer(OptimizerConfig(bf16=True), [ddp])
    _step(ddp, optimizer)
    assert _bytes(optimizer.state_tensors()) == PARAMETERS * (8 + 4)
