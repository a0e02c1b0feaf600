"""The wrapped optimizer's step: mixed precision, overflow skips over the group, exact state dicts."""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import re
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from pp_optim import (
    ConstantGradScaler,
    DistributedDataParallel,
    DynamicGradScaler,
    Float16Module,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    NonFiniteGradError,
    OptimizerConfig,
    fp32_to_float16,
    get_megatron_optimizer,
)
from pp_state import ParallelConfig, ParallelState
from pp_testing import run_distributed


def _mlp(dtype: torch.dtype, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(
        dtype
    )


def _scaler() -> DynamicGradScaler:
    return DynamicGradScaler(2.0**12, 1.0, 2.0, 0.5, growth_interval=1000, hysteresis=1)


def _fp16_optimizer(
    model: torch.nn.Module,
    *,
    clip_grad: float = 0.0,
    zeros: bool = False,
    dtype: torch.dtype = torch.float16,
) -> Float16OptimizerWithFloat16Params:
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return Float16OptimizerWithFloat16Params(
        inner,
        OptimizerConfig(clip_grad=clip_grad, log_num_zeros_in_grad=zeros),
        _scaler() if dtype == torch.float16 else None,
        grad_stats_group=None,
    )


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_main_params_follow_an_fp32_optimizer_given_the_same_grads(dtype: torch.dtype) -> None:
    model = _mlp(dtype)
    optimizer = _fp16_optimizer(model, clip_grad=1.0, dtype=dtype)
    reference = copy.deepcopy(model).float()  # the main copies start from the half weights
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(4):
        optimizer.zero_grad()
        loss = model(_batch(step).to(dtype)).float().square().mean()
        optimizer.scale_loss(loss).backward()
        # The reference gets exactly the unscaled half gradients the wrapper works from.
        scale = optimizer.get_loss_scale().item()
        for ref, param in zip(reference.parameters(), model.parameters(), strict=True):
            assert param.grad is not None
            ref.grad = param.grad.float() / scale
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
        reference_optimizer.step()
        ok, norm, zeros = optimizer.step()
        assert ok
        assert zeros is None
        assert norm == pytest.approx(expected_norm, rel=1e-5)
        for main, ref, param in zip(
            optimizer.main_params(), reference.parameters(), model.parameters(), strict=True
        ):
            torch.testing.assert_close(main, ref, rtol=1e-5, atol=1e-6)
            assert param.dtype == dtype
            assert torch.equal(param, main.to(dtype))  # copied back


def test_overflow_skips_the_step_and_backs_off() -> None:
    model = _mlp(torch.float16)
    optimizer = _fp16_optimizer(model, zeros=True)
    optimizer.scale_loss(model(_batch(0).half()).float().sum()).backward()
    assert optimizer.step()[0]
    before_params = [p.detach().clone() for p in model.parameters()]
    before_main = [p.detach().clone() for p in optimizer.main_params()]
    before_state = copy.deepcopy(optimizer.optimizer.state_dict())
    scale = optimizer.get_loss_scale().item()
    optimizer.zero_grad()
    optimizer.scale_loss(model(_batch(1).half()).float().sum()).backward()
    first = next(iter(model.parameters()))
    assert first.grad is not None
    first.grad[0, 0] = math.inf
    assert optimizer.step() == (False, None, None)
    assert optimizer.get_loss_scale().item() == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before_params, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before_main, optimizer.main_params(), strict=True))
    after_state = optimizer.optimizer.state_dict()
    for key, values in before_state["state"].items():
        for name, value in values.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(after_state["state"][key][name])
            )


def test_nan_also_skips() -> None:
    model = _mlp(torch.float16)
    optimizer = _fp16_optimizer(model)
    optimizer.scale_loss(model(_batch(0).half()).float().sum()).backward()
    last = list(model.parameters())[-1]
    assert last.grad is not None
    last.grad[0] = math.nan
    assert optimizer.step()[0] is False


def test_zero_count() -> None:
    model = _mlp(torch.float16)
    optimizer = _fp16_optimizer(model, zeros=True)
    optimizer.scale_loss(model(_batch(0).half()).float().sum()).backward()
    first = next(iter(model.parameters()))
    assert first.grad is not None
    first.grad[:2] = 0
    expected = sum(int((p.grad == 0).sum()) for p in model.parameters() if p.grad is not None)
    assert optimizer.step()[2] == expected


def _save_load(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _train(
    model: torch.nn.Module, optimizer: Float16OptimizerWithFloat16Params, steps: range
) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = model(_batch(step).half()).float().square().mean()
        optimizer.scale_loss(loss).backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_state_dict_reloads_exactly_through_a_safe_load() -> None:
    unbroken = _mlp(torch.float16)
    unbroken_optimizer = _fp16_optimizer(unbroken, clip_grad=1.0)
    expected = _train(unbroken, unbroken_optimizer, range(6))

    first = _mlp(torch.float16)
    first_optimizer = _fp16_optimizer(first, clip_grad=1.0)
    _train(first, first_optimizer, range(3))
    saved_model = _save_load(first.state_dict())
    saved = _save_load(first_optimizer.state_dict())
    assert set(saved) == {"optimizer", "grad_scaler", "fp32_from_fp16_params"}

    resumed = _mlp(torch.float16, seed=99)  # other weights: everything must come from the files
    resumed.load_state_dict(saved_model)
    resumed_optimizer = _fp16_optimizer(resumed, clip_grad=1.0)
    resumed_optimizer.load_state_dict(saved)
    for main, old in zip(
        resumed_optimizer.main_params(), first_optimizer.main_params(), strict=True
    ):
        assert torch.equal(main, old)  # the fp32 copies, not the rounded fp16 weights
    assert _train(resumed, resumed_optimizer, range(3, 6)) == expected[3:]
    assert all(
        torch.equal(a, b) for a, b in zip(resumed.parameters(), unbroken.parameters(), strict=True)
    )


def test_refused_state_changes_nothing() -> None:
    model = _mlp(torch.float16)
    optimizer = _fp16_optimizer(model)
    _train(model, optimizer, range(2))
    other = _fp16_optimizer(
        torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4)).half()
    )
    before = [p.detach().clone() for p in optimizer.main_params()]
    before_scale = optimizer.get_loss_scale().clone()
    with pytest.raises(ValueError, match=r"shapes .*\(4, 8\).* this optimizer has .*\(3, 8\)"):
        optimizer.load_state_dict(other.state_dict())
    fp32 = FP32Optimizer(
        torch.optim.SGD(_mlp(torch.float32).parameters(), lr=0.1),
        OptimizerConfig(),
        grad_stats_group=None,
    )
    with pytest.raises(ValueError, match="saved with no loss scaler"):
        optimizer.load_state_dict(
            {
                **fp32.state_dict(),
                "fp32_from_fp16_params": optimizer.state_dict()["fp32_from_fp16_params"],
            }
        )
    assert all(torch.equal(a, b) for a, b in zip(before, optimizer.main_params(), strict=True))
    assert torch.equal(before_scale, optimizer.get_loss_scale())


def test_construction_errors() -> None:
    with pytest.raises(ValueError, match="fp16 parameters need a grad scaler"):
        Float16OptimizerWithFloat16Params(
            torch.optim.SGD(_mlp(torch.float16).parameters(), lr=0.1),
            OptimizerConfig(),
            None,
            grad_stats_group=None,
        )
    with pytest.raises(TypeError, match=r"parameter 0 of group 0 is torch.float64"):
        Float16OptimizerWithFloat16Params(
            torch.optim.SGD(_mlp(torch.float64).parameters(), lr=0.1),
            OptimizerConfig(),
            _scaler(),
            grad_stats_group=None,
        )
    with pytest.raises(TypeError, match=r"FP32Optimizer parameter 0 is torch\.float16"):
        FP32Optimizer(
            torch.optim.SGD(_mlp(torch.float16).parameters(), lr=0.1),
            OptimizerConfig(),
            grad_stats_group=None,
        )
    with pytest.raises(ValueError, match=r"clip_grad must be >= 0.*got -1"):
        OptimizerConfig(clip_grad=-1.0)


def test_fp32_optimizer_reads_main_grad_and_can_skip_with_a_scaler() -> None:
    model = _mlp(torch.float32)
    optimizer = FP32Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        OptimizerConfig(clip_grad=0.0),
        ConstantGradScaler(1.0),
        grad_stats_group=None,
    )
    for param in model.parameters():
        param.main_grad = torch.ones_like(param)  # type: ignore[attr-defined]
    before = [p.detach().clone() for p in model.parameters()]
    assert optimizer.step() == (True, None, None)
    for old, param in zip(before, model.parameters(), strict=True):
        torch.testing.assert_close(param, old - 0.5)
    next(iter(model.parameters())).main_grad[0] = math.nan  # type: ignore[attr-defined]
    assert optimizer.step()[0] is False


# --- two model-parallel ranks: an overflow on one rank skips the step on both ----------------


def _overflow_on_rank_one() -> tuple[bool, float, list[torch.Tensor], float | None]:
    rank = dist.get_rank()
    model = _mlp(torch.float16)
    optimizer = Float16OptimizerWithFloat16Params(
        torch.optim.SGD(model.parameters(), lr=0.1),
        OptimizerConfig(clip_grad=1.0),
        _scaler(),
        grad_stats_group=dist.group.WORLD,
        tensor_parallel_rank=rank,
    )
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.scale_loss(model(_batch(rank).half()).float().sum()).backward()
    if rank == 1:
        grad = next(iter(model.parameters())).grad
        assert grad is not None
        grad[0, 0] = math.inf
    ok, _, _ = optimizer.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert unchanged
    optimizer.zero_grad()
    optimizer.scale_loss(model(_batch(rank).half()).float().sum()).backward()
    second = optimizer.step()
    return (
        ok,
        optimizer.get_loss_scale().item(),
        [p.detach().clone() for p in model.parameters()],
        second[1],
    )


def test_overflow_on_one_rank_skips_everywhere() -> None:
    results = run_distributed(_overflow_on_rank_one, 2)
    for ok, scale, _params, norm in results:
        assert ok is False
        assert scale == 2.0**11
        assert norm is not None
        assert norm > 0
    assert results[0][3] == results[1][3]  # one norm for the whole model


def test_factory_builds_megatron_groups_scalers_and_wrappers() -> None:
    model = _mlp(torch.float16)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(fp16=True, initial_loss_scale=1024.0), [model], grad_stats_group=None
    )
    assert isinstance(optimizer, Float16OptimizerWithFloat16Params)
    assert isinstance(optimizer.grad_scaler, DynamicGradScaler)
    assert optimizer.get_loss_scale().item() == 1024.0
    assert isinstance(optimizer.optimizer, torch.optim.AdamW)
    decayed, not_decayed = optimizer.param_groups
    assert [tuple(p.shape) for p in decayed["params"]] == [(8, 6), (3, 8)]
    assert [tuple(p.shape) for p in not_decayed["params"]] == [(8,), (3,)]
    assert (decayed["wd_mult"], not_decayed["wd_mult"]) == (1.0, 0.0)
    assert all(
        p.dtype == torch.float32 for group in optimizer.param_groups for p in group["params"]
    )

    bf16 = get_megatron_optimizer(
        OptimizerConfig(bf16=True), [_mlp(torch.bfloat16)], grad_stats_group=None
    )
    assert bf16.grad_scaler is None
    fp32 = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", loss_scale=8.0),
        [_mlp(torch.float32)],
        grad_stats_group=None,
    )
    assert isinstance(fp32, FP32Optimizer)
    assert isinstance(fp32.grad_scaler, ConstantGradScaler)
    assert isinstance(fp32.optimizer, torch.optim.SGD)
    with pytest.raises(ValueError, match="set at most one of fp16 and bf16"):
        OptimizerConfig(fp16=True, bf16=True)
    with pytest.raises(ValueError, match=r"adam_beta2 must be in \[0, 1\), got 1\.5"):
        OptimizerConfig(adam_beta2=1.5)
    with pytest.raises(ValueError, match="no trainable parameters"):
        get_megatron_optimizer(OptimizerConfig(), [torch.nn.ReLU()], grad_stats_group=None)


def test_float16_module_casts_at_the_pipeline_ends() -> None:
    first = Float16Module(
        torch.nn.Linear(3, 3), torch.bfloat16, pre_process=True, post_process=False
    )
    middle = Float16Module(
        torch.nn.Linear(3, 3), torch.bfloat16, pre_process=False, post_process=False
    )
    last = Float16Module(
        torch.nn.Linear(3, 3), torch.bfloat16, pre_process=False, post_process=True
    )
    hidden = first(torch.randn(2, 3))
    assert hidden.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in first.parameters())
    assert middle(hidden).dtype == torch.bfloat16
    assert last(hidden).dtype == torch.float32
    embedding = Float16Module(torch.nn.Embedding(10, 3), torch.float16, post_process=True)
    ids = torch.tensor([[1, 2]])
    assert embedding(ids).dtype == torch.float32  # integer ids pass through untouched
    assert (
        fp32_to_float16({"x": [torch.ones(1)], "n": 3}, torch.float16)["x"][0].dtype
        == torch.float16
    )
    with pytest.raises(ValueError, match=r"torch\.float16 or torch\.bfloat16, got torch\.float32"):
        Float16Module(torch.nn.Linear(1, 1), torch.float32)


# --- tp 2 x dp 2 from a ParallelState: the wrapper, the buffer and the factory together -------


def _built_from_parallel_state() -> tuple[bool, float | None, list[torch.Tensor]]:
    state = ParallelState.create(ParallelConfig(tensor_model_parallel_size=2))
    model = _mlp(torch.float32)  # every parameter whole on both tp ranks: duplicates
    ddp = DistributedDataParallel.from_parallel_state(model, state)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0, weight_decay=0.0),
        [model],
        parallel_state=state,
    )
    ddp.zero_grad_buffer()
    inputs = torch.cat([_batch(0), _batch(1)]).chunk(2)[state.group_rank("dp")]
    model(inputs).square().mean().backward()
    ddp.finish_grad_sync()
    ok, norm, _ = optimizer.step()
    return ok, norm, [p.detach().clone() for p in model.parameters()]


def test_optimizer_and_buffer_built_from_a_parallel_state() -> None:
    reference = _mlp(torch.float32)
    reference(torch.cat([_batch(0), _batch(1)])).square().mean().backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for ok, norm, params in run_distributed(_built_from_parallel_state, 4):
        assert ok
        assert norm == pytest.approx(expected_norm, rel=1e-5)  # duplicates counted once
        for param, expected in zip(params, reference.parameters(), strict=True):
            torch.testing.assert_close(param, expected)
    state = cast("ParallelState", object())  # refused before it is used
    with pytest.raises(ValueError, match="not both"):
        get_megatron_optimizer(
            OptimizerConfig(), [_mlp(torch.float32)], parallel_state=state, tensor_parallel_rank=1
        )


def test_check_state_dict_refuses_optimizer_state_of_other_shapes() -> None:
    model = _mlp(torch.float16)
    optimizer = _fp16_optimizer(model)
    _train(model, optimizer, range(1))
    state = optimizer.state_dict()
    optimizer.check_state_dict(state)  # its own state fits
    exp_avg = state["optimizer"]["state"][0]["exp_avg"]
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(exp_avg.shape[0] + 1, exp_avg.shape[1])
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 has shape \(9, 6\)"):
        optimizer.check_state_dict(state)
    with pytest.raises(ValueError, match="not a dict"):
        optimizer.check_state_dict([state])


# --- grad_norm_skip_threshold: a step with too large a gradient norm is skipped --------------


def test_grad_norm_skip_threshold_default_and_refusals() -> None:
    assert OptimizerConfig().grad_norm_skip_threshold == math.inf
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match=rf"grad_norm_skip_threshold must be > 0.*got {bad}"):
            OptimizerConfig(grad_norm_skip_threshold=bad)


def _snapshot(optimizer: Any, model: torch.nn.Module) -> list[torch.Tensor]:
    """Model parameters, main parameters and every optimizer state tensor, copied."""
    state = [
        torch.as_tensor(value).clone()
        for entries in optimizer.optimizer.state.values()
        for value in entries.values()
    ]
    params = [p.detach().clone() for p in [*model.parameters(), *optimizer.main_params()]]
    return params + state


@pytest.mark.parametrize("clip_grad", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_step_above_the_threshold_changes_nothing_and_is_counted(
    dtype: torch.dtype, clip_grad: float
) -> None:
    model = _mlp(dtype)
    config = OptimizerConfig(
        lr=1e-2,
        clip_grad=clip_grad,
        log_num_zeros_in_grad=True,
        initial_loss_scale=256.0,
        fp16=dtype == torch.float16,
        bf16=dtype == torch.bfloat16,
    )

    def backward(seed: int) -> None:
        optimizer.zero_grad()
        optimizer.scale_loss(model(_batch(seed).to(dtype)).float().square().sum()).backward()

    # The same gradients once without a threshold, to learn their norm.
    optimizer = get_megatron_optimizer(config, [model], grad_stats_group=None)
    backward(0)
    ok, norm, _ = optimizer.step()  # Adam now has state to protect
    assert ok
    # No threshold yet: a norm to clip, or without a scaler to check it is finite.
    assert (norm is None) == (clip_grad == 0.0 and dtype == torch.float16)
    backward(1)
    grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
    expected /= optimizer.get_loss_scale().item()

    config = dataclasses.replace(config, grad_norm_skip_threshold=expected * 0.9)
    optimizer.config = config
    before = _snapshot(optimizer, model)
    ok, norm, zeros = optimizer.step()
    assert (ok, zeros) == (False, 0)
    assert norm == pytest.approx(expected, rel=1e-3)
    after = _snapshot(optimizer, model)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert (optimizer.num_skipped_steps, optimizer.num_grad_norm_skips) == (1, 1)

    # Below the threshold: a normal step.
    optimizer.config = dataclasses.replace(config, grad_norm_skip_threshold=expected * 1.1)
    backward(1)
    ok, norm, _ = optimizer.step()
    assert ok
    assert norm == pytest.approx(expected, rel=1e-3)
    assert not all(
        torch.equal(a, b) for a, b in zip(before, _snapshot(optimizer, model), strict=True)
    )
    assert optimizer.num_skipped_steps == 1


def test_an_overflow_is_counted_as_a_skip_but_not_for_the_norm() -> None:
    model = _mlp(torch.float16)
    config = OptimizerConfig(fp16=True, initial_loss_scale=256.0, grad_norm_skip_threshold=1e9)
    optimizer = get_megatron_optimizer(config, [model], grad_stats_group=None)
    optimizer.scale_loss(model(_batch(0).half()).float().sum()).backward()
    first = next(iter(model.parameters()))
    assert first.grad is not None
    first.grad[0, 0] = math.inf
    assert optimizer.step() == (False, None, None)
    assert (optimizer.num_skipped_steps, optimizer.num_grad_norm_skips) == (1, 0)


def _norm_of_the_whole_model(threshold: float) -> tuple[bool, float | None, float]:
    # Two pipeline stages of one model: each holds its own parameter (tensor-parallel rank 0),
    # local norm 2, whole-model norm sqrt(8).
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = FP32Optimizer(
        torch.optim.SGD([param], lr=1.0),
        OptimizerConfig(clip_grad=0.0, grad_norm_skip_threshold=threshold),
        grad_stats_group=dist.group.WORLD,
    )
    param.grad = torch.ones(4)
    ok, norm, _ = optimizer.step()
    return ok, norm, float(param.abs().sum())


def test_the_norm_compared_is_the_whole_model_norm_over_the_group() -> None:
    for ok, norm, moved in run_distributed(_norm_of_the_whole_model, 2, 2.5):
        assert (ok, moved) == (False, 0.0)  # 2 alone would pass; sqrt(8) does not
        assert norm == pytest.approx(math.sqrt(8))
    for ok, norm, moved in run_distributed(_norm_of_the_whole_model, 2, 3.0):
        assert (ok, moved) == (True, 4.0)
        assert norm == pytest.approx(math.sqrt(8))


# --- non-finite gradients without a scaler: refused, never applied ----------------------------


def _nan_on_rank_one(check: bool, dtype: torch.dtype) -> tuple[str, bool]:
    """fp32 or bf16 without a scaler; rank 1's gradients hold NaN. Returns (error, unchanged)."""
    rank = dist.get_rank()
    model = _mlp(dtype)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="sgd", lr=0.1, clip_grad=0.0, bf16=dtype == torch.bfloat16,
            check_for_nan_in_loss_and_grad=check,
        ),
        [model], grad_stats_group=dist.group.WORLD,  # two pipeline stages: no duplicates
    )  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    model(_batch(rank).to(dtype)).float().sum().backward()
    if rank == 1:
        grad = next(iter(model.parameters())).grad
        assert grad is not None
        grad[0, 0] = math.nan
    error = ""
    if check:
        with pytest.raises(NonFiniteGradError) as refused:
            optimizer.step()
        assert math.isnan(refused.value.grad_norm)
        assert refused.value.ranks == [1]
        error = str(refused.value)
    else:
        optimizer.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return error, unchanged


@pytest.mark.reliability
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nan_gradients_are_refused_on_every_rank_before_anything_is_applied(
    dtype: torch.dtype,
) -> None:
    for error, unchanged in run_distributed(_nan_on_rank_one, 2, True, dtype):
        assert error == (
            "the gradient norm is nan (non-finite gradients on rank(s) [1]); the optimizer "
            "step was refused and nothing was applied"
        )
        assert unchanged


@pytest.mark.reliability
def test_without_the_check_nan_gradients_are_applied_as_before() -> None:
    results = run_distributed(_nan_on_rank_one, 2, False, torch.float32)
    assert all(error == "" and not unchanged for error, unchanged in results)


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"initial_loss_scale": math.inf},
            "initial_loss_scale must be a finite number > 0, got inf",
        ),
        ({"initial_loss_scale": 0.0}, "initial_loss_scale must be a finite number > 0, got 0.0"),
        ({"loss_scale": -2.0}, "loss_scale must be a finite number > 0, got -2.0"),
        ({"min_loss_scale": math.nan}, "min_loss_scale must be a finite number > 0, got nan"),
        (
            {"initial_loss_scale": 2.0, "min_loss_scale": 4.0},
            "min_loss_scale 4.0 is above initial_loss_scale 2.0",
        ),
        ({"hysteresis": 0}, "hysteresis must be an integer 1 or more, got 0"),
        ({"loss_scale_window": 0}, "loss_scale_window must be an integer 1 or more, got 0"),
    ],
)
def test_loss_scale_settings_must_be_finite_positive_and_consistent(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        OptimizerConfig(fp16=True, **settings)
