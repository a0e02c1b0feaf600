"""`DistributedOptimizer`: the same training as the non-distributed optimizer, 1/dp of the state."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_optim import (
    ConstantGradScaler,
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    DynamicGradScaler,
    Float16Module,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    GradScaler,
    MegatronOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
    get_param_groups,
)
from pp_testing import run_distributed

STEPS = 20
BATCH = 8


@dataclasses.dataclass(frozen=True)
class Run:
    """One training configuration, run once sharded and once not."""

    optimizer: str = "adamw"
    dtype: str = "fp32"
    overlap: bool = False
    bucket_size: int | None = 60
    inf_step: int | None = None


def _model(dtype: str, width: int = 12) -> torch.nn.Module:
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(5, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 2),
    )
    if dtype != "fp32":
        model = Float16Module(model, torch.float16 if dtype == "fp16" else torch.bfloat16)
    return model


def _inner(name: str, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)
    momentum = 0.9 if name == "sgd-momentum" else 0.0
    return torch.optim.SGD(groups, lr=0.05, momentum=momentum, weight_decay=0.01)


def _scaler(run: Run) -> GradScaler | None:
    if run.dtype == "fp16":
        return DynamicGradScaler(
            initial_scale=2.0**10,
            min_scale=1.0,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=4,
            hysteresis=1,
        )
    return ConstantGradScaler(1.0) if run.inf_step is not None else None


def _build(run: Run, sharded: bool) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    ddp = DistributedDataParallel(
        _model(run.dtype),
        DDPConfig(
            bucket_size=run.bucket_size,
            overlap_grad_reduce=run.overlap,
            use_distributed_optimizer=sharded,
            overlap_param_gather=run.overlap and sharded,
        ),
        data_parallel_group=dist.group.WORLD,
    )
    inner = _inner(run.optimizer, get_param_groups([ddp]))
    config = OptimizerConfig(clip_grad=0.3, bf16=run.dtype == "bf16", fp16=run.dtype == "fp16")
    scaler = _scaler(run)
    if sharded:
        optimizer: MegatronOptimizer = DistributedOptimizer(
            inner, config, scaler, model_chunks=[ddp], grad_stats_group=None
        )
    elif run.dtype == "fp32":
        optimizer = FP32Optimizer(inner, config, scaler, grad_stats_group=None)
    else:
        optimizer = Float16OptimizerWithFloat16Params(inner, config, scaler, grad_stats_group=None)
    return ddp, optimizer


def _step(ddp: DistributedDataParallel, optimizer: MegatronOptimizer, step: int, run: Run) -> float:
    rank, size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(BATCH, 5, generator=generator).chunk(size)[rank]
    targets = torch.randn(BATCH, 2, generator=generator).chunk(size)[rank]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(inputs).float(), targets)
    optimizer.scale_loss(loss).backward()
    ddp.finish_grad_sync()
    if step == run.inf_step and (rank == 0 or not isinstance(optimizer, DistributedOptimizer)):
        ddp.buckets[0].data[0] = float("inf")  # rank 0 owns element 0: only its shard holds it
    optimizer.step()
    mean = loss.detach().reshape(1)
    dist.all_reduce(mean)
    return float(mean.item()) / size


def _train(run: Run, sharded: bool) -> tuple[list[float], list[torch.Tensor], int]:
    ddp, optimizer = _build(run, sharded)
    losses = [_step(ddp, optimizer, step, run) for step in range(STEPS)]
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.finish_param_sync()
    params = [p.detach().float().clone() for p in ddp.module.parameters()]
    return losses, params, optimizer.num_skipped_steps


def _both(runs: list[Run]) -> list[tuple[Any, Any]]:
    return [(_train(run, True), _train(run, False)) for run in runs]


def _check(results: list[list[tuple[Any, Any]]], runs: list[Run]) -> None:
    for rank_results in results:
        for run, (sharded, plain) in zip(runs, rank_results, strict=True):
            if run.dtype == "fp32":
                for got, want in zip(sharded[1], plain[1], strict=True):
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=str(run))
            else:
                for got, want in zip(sharded[0], plain[0], strict=True):
                    assert abs(got - want) <= 0.01 * abs(want), (run, got, want)
            assert sharded[2] == plain[2], run
            if run.inf_step is not None:
                assert sharded[2] == 1, run


FP32_RUNS = [
    Run(optimizer="adam"),
    Run(optimizer="adamw", overlap=True),
    Run(optimizer="sgd"),
    Run(optimizer="sgd-momentum", overlap=True, bucket_size=1),
    Run(optimizer="adamw", bucket_size=None, inf_step=5),
]


@pytest.mark.parametrize("dp", [2, 4])
def test_fp32_equals_the_non_distributed_optimizer(dp: int) -> None:
    _check(run_distributed(_both, dp, FP32_RUNS, timeout=120), FP32_RUNS)


HALF_RUNS = [Run(dtype="bf16"), Run(dtype="bf16", overlap=True), Run(dtype="fp16", overlap=True)]


@pytest.mark.parametrize("dp", [2, 4])
def test_half_losses_equal_the_non_distributed_optimizer(dp: int) -> None:
    _check(run_distributed(_both, dp, HALF_RUNS, timeout=120), HALF_RUNS)


def _state_bytes(dtype: str) -> tuple[int, int]:
    def build(sharded: bool) -> int:
        ddp = DistributedDataParallel(
            _model(dtype, width=32),
            DDPConfig(use_distributed_optimizer=sharded),
            data_parallel_group=dist.group.WORLD,
        )
        config = OptimizerConfig(bf16=dtype == "bf16")
        optimizer = get_megatron_optimizer(config, [ddp])
        assert isinstance(optimizer, DistributedOptimizer) == sharded
        _step(ddp, optimizer, 0, Run(dtype=dtype))
        return sum(t.untyped_storage().nbytes() for t in optimizer.state_tensors())

    return build(True), build(False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_state_bytes_are_one_over_dp(dtype: str) -> None:
    for sharded, whole in run_distributed(_state_bytes, 4, dtype):
        assert abs(sharded - whole / 4) <= 0.01 * whole / 4, (sharded, whole)


def _round_trips() -> list[torch.Tensor]:
    run = Run(optimizer="adamw", dtype="bf16")
    ddp, optimizer = _build(run, True)
    assert isinstance(optimizer, DistributedOptimizer)
    for step in range(3):
        _step(ddp, optimizer, step, run)
    # torch's state_dict shares the live state tensors; a checkpoint is a copy.
    saved, gathered = copy.deepcopy(optimizer.state_dict()), optimizer.gather_state_to_dp_zero()
    assert (gathered is not None) == (dist.get_rank() == 0)
    expected = [_step(ddp, optimizer, step, run) for step in range(3, 6)]
    losses = []
    for from_gather in (False, True):
        fresh_ddp, fresh = _build(run, True)
        assert isinstance(fresh, DistributedOptimizer)
        # Either load restores the main shards and gathers them into the fresh model.
        if from_gather:
            fresh.load_state_from_dp_zero(gathered)
        else:
            fresh.load_state_dict(saved)
        losses.append(torch.tensor([_step(fresh_ddp, fresh, step, run) for step in range(3, 6)]))
    return [torch.tensor(expected), *losses]


def test_shard_state_and_gathered_state_load_back() -> None:
    for expected, from_shard, from_gather in run_distributed(_round_trips, 2):
        torch.testing.assert_close(from_shard, expected)
        torch.testing.assert_close(from_gather, expected)


def _refusals() -> list[str]:
    ddp, optimizer = _build(Run(), True)
    assert isinstance(optimizer, DistributedOptimizer)
    messages = []
    inner = torch.optim.RMSprop(get_param_groups([ddp]))
    try:
        DistributedOptimizer(inner, OptimizerConfig(), model_chunks=[ddp], grad_stats_group=None)
    except ValueError as error:
        messages.append(str(error))
    other = optimizer.state_dict()
    other["shard_layout"] = {**other["shard_layout"], "data_parallel_rank": 1 - dist.get_rank()}
    try:
        optimizer.load_state_dict(other)
    except ValueError as error:
        messages.append(str(error))
    return messages


@pytest.mark.reliability
def test_refusals_name_the_choices() -> None:
    for rmsprop, wrong_rank in run_distributed(_refusals, 2):
        assert "got RMSprop" in rmsprop
        assert "torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD" in rmsprop
        assert "saved by data-parallel rank" in wrong_rank


@pytest.mark.reliability
def test_config_refusals_name_the_flags() -> None:
    with pytest.raises(ValueError, match=r"--overlap-param-gather.*missing: --use-distributed"):
        DDPConfig(overlap_param_gather=True, overlap_grad_reduce=True)
    with pytest.raises(ValueError, match="missing: --use-distributed-optimizer, --overlap-grad"):
        DDPConfig(overlap_param_gather=True)
    with pytest.raises(ValueError, match="missing: --overlap-grad-reduce"):
        DDPConfig(overlap_param_gather=True, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match=r"got -3 \(--ddp-bucket-size\)"):
        DDPConfig(bucket_size=-3)


def test_buckets_are_padded_and_sharded_with_params_in_the_buffer() -> None:
    model = _model("fp32")
    params = list(model.parameters())
    ddp = DistributedDataParallel(
        model, DDPConfig(use_distributed_optimizer=True, bucket_size=60), data_parallel_group=None
    )
    buffer = ddp.param_buffers[torch.float32]
    assert all(
        p.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for p in params
    )
    assert [b.shard(0) for b in ddp.buckets] == [(0, b.data.numel()) for b in ddp.buckets]
    assert list(model.state_dict()) == list(_model("fp32").state_dict())


class _TiedHead(torch.nn.Module):
    """A body, and a head whose weight the forward hands straight to a matmul.

    As a tied output layer on the last pipeline stage: the head's own forward, and so its
    forward pre-hook, never runs.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.body(x), self.head.weight)


class _LandsWhenWaited:
    """An async all-gather whose result reaches its output only when waited for.

    A valid async collective (its output is undefined until the wait), and the widest window
    for a read that no wait covers; gloo's two worker threads open it for real, finishing a
    later bucket's gather while an earlier one is still being written.
    """

    def __init__(self, output: torch.Tensor, result: torch.Tensor) -> None:
        self.output, self.result = output, result

    def wait(self) -> bool:
        self.output.copy_(self.result)
        return True


def _late_gather(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: Any = False,
) -> Any:
    """`dist.all_gather_single`, issued at once but landing when waited for when async."""
    result = torch.empty_like(output_tensor)
    _REAL_GATHER(result, input_tensor.clone(), group=group)  # every rank issues in one order
    if not async_op:
        output_tensor.copy_(result)
        return None
    return _LandsWhenWaited(output_tensor, result)


_REAL_GATHER = dist.all_gather_single


def _forward_after_an_overlapped_gather() -> tuple[torch.Tensor, torch.Tensor]:
    ddp = DistributedDataParallel(
        _TiedHead(),
        DDPConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            bucket_size=10,
        ),
        data_parallel_group=dist.group.WORLD,
    )
    # Last parameter first: the head's weight fills bucket 0, the body bucket 1.
    assert [len(b.params) for b in ddp.buckets] == [1, 2]
    with torch.no_grad():  # as after a step: each rank has updated its own shards only
        for bucket in ddp.buckets:
            assert bucket.param_data is not None
            start, end = bucket.shard(dist.get_rank())
            bucket.param_data[start:end] += 1.0
    dist.all_gather_single = _late_gather
    try:
        ddp.start_param_sync()
        with torch.no_grad():
            output = ddp(torch.ones(2, 4))
            ddp.finish_param_sync()
            whole = ddp(torch.ones(2, 4))
    finally:
        dist.all_gather_single = _REAL_GATHER
    return output, whole


def test_a_weight_read_outside_its_module_waits_for_its_overlapped_gather() -> None:
    # The body's pre-hook waits for the gathers started before its own: the head's included.
    for output, whole in run_distributed(_forward_after_an_overlapped_gather, 2):
        assert torch.equal(output, whole)
