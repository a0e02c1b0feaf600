"""Contiguous grad buffers: layout, accumulation, and data-parallel all-reduce against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pp_optim import DDPConfig, DistributedDataParallel, Float16Module, GradSyncError
from pp_state import ParallelConfig, ParallelState, set_collective_hook
from pp_testing import run_distributed

GLOBAL_BATCH = 8


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7),
        torch.nn.Tanh(),
        torch.nn.Linear(7, 7),
        torch.nn.Tanh(),
        torch.nn.Linear(7, 2),
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return torch.randn(GLOBAL_BATCH, 5, generator=generator), torch.randn(
        GLOBAL_BATCH, 2, generator=generator
    )


def _reference_grads() -> list[torch.Tensor]:
    model = _model()
    inputs, targets = _data()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_layout_is_reverse_order_views_of_one_buffer() -> None:
    model = _model()
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=40), data_parallel_group=None)
    params = list(model.parameters())
    buffer = ddp.buffers_by_dtype[torch.float32]
    assert buffer.numel() == sum(p.numel() for p in params)
    offsets = [p.main_grad.data_ptr() - buffer.data_ptr() for p in params]  # type: ignore[attr-defined]
    assert offsets == sorted(offsets, reverse=True)  # last parameter first
    assert offsets[-1] == 0
    # Buckets close at the first parameter that reaches 40 elements; together they tile the buffer.
    assert sum(b.data.numel() for b in ddp.buckets) == buffer.numel()
    assert all(b.data.numel() >= 40 for b in ddp.buckets[:-1])
    shapes = [[tuple(p.shape) for p in bucket.params] for bucket in ddp.buckets]
    assert shapes == [[(2,), (2, 7), (7,), (7, 7)], [(7,), (7, 5)]]  # 72 elements, then 42


def test_default_is_one_bucket_and_overlap_uses_megatrons_size() -> None:
    assert len(DistributedDataParallel(_model(), data_parallel_group=None).buckets) == 1
    overlapped = DistributedDataParallel(
        _model(), DDPConfig(overlap_grad_reduce=True), data_parallel_group=None
    )
    assert len(overlapped.buckets) == 1  # 40M elements hold this model
    unbucketed = DistributedDataParallel(
        _model(), DDPConfig(bucket_size=1), data_parallel_group=None, disable_bucketing=True
    )
    assert len(unbucketed.buckets) == 1


def test_backward_accumulates_into_main_grad_over_microbatches() -> None:
    model = _model()
    ddp = DistributedDataParallel(model, data_parallel_group=None)
    inputs, targets = _data()
    for micro_inputs, micro_targets in zip(inputs.chunk(2), targets.chunk(2), strict=True):
        (torch.nn.functional.mse_loss(ddp(micro_inputs), micro_targets) / 2).backward()
    for param, expected in zip(model.parameters(), _reference_grads(), strict=True):
        assert param.grad is None
        torch.testing.assert_close(param.main_grad, expected)  # type: ignore[attr-defined]
    ddp.zero_grad_buffer()
    assert all(not p.main_grad.any() for p in model.parameters())  # type: ignore[attr-defined]


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="bucket_size must be a positive int or None, got 0"):
        DDPConfig(bucket_size=0)


def _data_parallel_step(config: DDPConfig, microbatches: int) -> list[torch.Tensor]:
    state = ParallelState.create(ParallelConfig())
    rank, size = state.group_rank("dp"), state.group_size("dp")
    model = _model(seed=rank)  # different on purpose: broadcast_params must make them equal
    ddp = DistributedDataParallel(model, config, data_parallel_group=state.group("dp"))
    ddp.broadcast_params()
    inputs, targets = (t.chunk(size)[rank] for t in _data())
    for _ in range(2):  # the second step checks that zero_grad_buffer resets everything
        ddp.zero_grad_buffer()
        pairs = list(zip(inputs.chunk(microbatches), targets.chunk(microbatches), strict=True))
        for index, (micro_inputs, micro_targets) in enumerate(pairs):
            loss = torch.nn.functional.mse_loss(ddp(micro_inputs), micro_targets) / microbatches
            if index < len(pairs) - 1:
                with ddp.no_sync():
                    loss.backward()
                assert not any(b.started for b in ddp.buckets)
            else:
                loss.backward()
        if config.overlap_grad_reduce:
            assert all(b.started for b in ddp.buckets)  # every bucket left during backward
        ddp.finish_grad_sync()
    return [p.main_grad.clone() for p in model.parameters()]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("config", "microbatches"),
    [
        (DDPConfig(), 1),
        (DDPConfig(bucket_size=30), 2),
        (DDPConfig(bucket_size=30, overlap_grad_reduce=True), 2),
        (DDPConfig(bucket_size=1, overlap_grad_reduce=True), 1),
    ],
    ids=["one-bucket", "buckets", "buckets-overlap", "bucket-per-param-overlap"],
)
def test_data_parallel_average_equals_the_whole_batch(config: DDPConfig, microbatches: int) -> None:
    expected = _reference_grads()
    for grads in run_distributed(_data_parallel_step, 2, config, microbatches):
        for grad, reference in zip(grads, expected, strict=True):
            torch.testing.assert_close(grad, reference)


def test_sum_instead_of_average() -> None:
    expected = _reference_grads()
    for grads in run_distributed(_data_parallel_step, 2, DDPConfig(average_gradients=False), 1):
        for grad, reference in zip(grads, expected, strict=True):
            torch.testing.assert_close(grad, 2 * reference)


def _unused_layer_and_late_grad() -> tuple[list[torch.Tensor], str]:
    rank = dist.get_rank()
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 3), "unused": torch.nn.Linear(3, 3)})
    ddp = DistributedDataParallel(
        model,
        DDPConfig(bucket_size=1, overlap_grad_reduce=True),
        data_parallel_group=dist.group.WORLD,
    )
    ddp.broadcast_params()
    model["used"](torch.full((1, 3), float(rank))).sum().backward()
    ddp.finish_grad_sync()  # the unused layer's buckets are reduced here, on every rank
    grads = [p.main_grad.clone() for p in model.parameters()]  # type: ignore[attr-defined]
    try:  # a second backward without zero_grad_buffer: the bucket has already left
        model["used"](torch.ones(1, 3)).sum().backward()
        message = ""
    except RuntimeError as error:
        message = str(error)
    return grads, message


def test_unused_parameters_and_a_late_gradient() -> None:
    for grads, message in run_distributed(_unused_layer_and_late_grad, 2):
        torch.testing.assert_close(grads[0], torch.full((3, 3), 0.5))  # mean of rank 0 and 1 inputs
        torch.testing.assert_close(grads[1], torch.ones(3))
        assert not grads[2].any()
        assert not grads[3].any()
        assert "after the bucket's all-reduce started" in message
        assert "zero_grad_buffer" in message


def _half_grads(grad_reduce_in_fp32: bool) -> list[tuple[torch.dtype, torch.Tensor]]:
    state = ParallelState.create(ParallelConfig())
    model = Float16Module(_model(), torch.bfloat16)
    ddp = DistributedDataParallel(
        model,
        DDPConfig(grad_reduce_in_fp32=grad_reduce_in_fp32),
        data_parallel_group=state.group("dp"),
    )
    inputs, targets = (t.chunk(2)[state.group_rank("dp")] for t in _data())
    torch.nn.functional.mse_loss(ddp(inputs), targets).backward()
    ddp.finish_grad_sync()
    return [(p.main_grad.dtype, p.main_grad.float()) for p in model.parameters()]  # type: ignore[attr-defined]


@pytest.mark.parametrize("grad_reduce_in_fp32", [True, False])
def test_half_parameters_reduce_in_the_chosen_dtype(grad_reduce_in_fp32: bool) -> None:
    expected = _reference_grads()
    for grads in run_distributed(_half_grads, 2, grad_reduce_in_fp32):
        for (dtype, grad), reference in zip(grads, expected, strict=True):
            assert dtype == (torch.float32 if grad_reduce_in_fp32 else torch.bfloat16)
            torch.testing.assert_close(grad, reference, rtol=0.05, atol=0.02)  # bf16 model


class _Heard:
    """A collective hook that keeps what it hears: (operation, group, failed)."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, tuple[int, ...]]] = []

    def begin(self, operation: str, group_ranks: tuple[int, ...], iteration: int | None) -> object:
        self.heard.append((operation, group_ranks))
        return None

    def end(self, token: object, failed: bool = False) -> None:
        pass


def _heard_sync(config: DDPConfig) -> list[tuple[str, tuple[int, ...]]]:
    state = ParallelState.create(ParallelConfig())
    model = _model()
    ddp = DistributedDataParallel(model, config, data_parallel_group=state.group("dp"))
    inputs, targets = _data()
    hook = _Heard()
    previous = set_collective_hook(hook)
    try:
        torch.nn.functional.mse_loss(ddp(inputs), targets).backward()
        ddp.finish_grad_sync()
        if config.use_distributed_optimizer:
            ddp.start_param_sync()
            ddp.finish_param_sync()
    finally:
        set_collective_hook(previous)
    return hook.heard


@pytest.mark.parametrize(
    "config",
    [DDPConfig(bucket_size=30, overlap_grad_reduce=True),
     DDPConfig(bucket_size=30, use_distributed_optimizer=True)],
    ids=["overlapped-all-reduce", "distributed-optimizer"],
)  # fmt: skip
def test_every_buckets_sync_and_gather_is_told_to_the_collective_hook(config: DDPConfig) -> None:
    """A trainer's flight recorder hears each bucket's collective, where the rank waits."""
    heard = run_distributed(_heard_sync, 2, config)[0]
    syncs = [op for op, group in heard if group == (0, 1) and "over data parallel" in op]
    buckets = len(syncs) // (2 if config.use_distributed_optimizer else 1)
    assert buckets > 1, heard
    # On gloo the distributed optimizer's buckets are all-reduced too (see _reduce).
    assert all(op.startswith("gradient all-reduce") for op in syncs[:buckets]), syncs
    assert [f"(bucket {i}," in op for i, op in enumerate(syncs[:buckets])] == [True] * buckets
    if config.use_distributed_optimizer:
        assert all(op.startswith("parameter all-gather") for op in syncs[buckets:])


def _failed_sync(use_distributed_optimizer: bool, overlap: bool) -> str:
    """The error of a bucket whose collective fails, on gloo: its message."""
    state = ParallelState.create(ParallelConfig())
    config = DDPConfig(
        use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=overlap
    )
    ddp = DistributedDataParallel(_model(), config, data_parallel_group=state.group("dp"))

    def refused(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Connection closed by peer")

    def step() -> None:  # with overlap the bucket starts (and fails) inside backward
        inputs, targets = _data()
        torch.nn.functional.mse_loss(ddp(inputs), targets).backward()
        ddp.finish_grad_sync()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "all_reduce", refused)
        patch.setattr(dist, "reduce_scatter_single", refused)
        with pytest.raises(GradSyncError) as caught:
            step()
    state.destroy()
    return str(caught.value)


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["ddp", "distopt"])
def test_a_failed_sync_names_the_collective_that_ran(
    use_distributed_optimizer: bool, overlap: bool
) -> None:
    """gloo all-reduces every bucket, the distributed optimizer's too: the error says so."""
    for message in run_distributed(_failed_sync, 2, use_distributed_optimizer, overlap):
        assert "gradient all-reduce over data parallel (bucket 0," in message, message
        assert "reduce-scatter" not in message, message
