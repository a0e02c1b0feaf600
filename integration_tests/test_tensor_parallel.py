"""``torchrun -m pp_train`` with tensor (and sequence) parallelism, as a user starts it."""

from __future__ import annotations

import contextlib
import math
import re
import subprocess
from collections.abc import Callable

import torch

from pp_testing import run_distributed

# The `torchrun` fixture from conftest.py: (script or "-m module", ranks, *args) -> process.
Torchrun = Callable[..., subprocess.CompletedProcess[str]]

TINY = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--eval-iters", "1", "--log-interval", "1", "--lr-warmup-iters", "1", "--train-iters", "3",
]  # fmt: skip


def _losses(stdout: str) -> list[float]:
    found = re.findall(r"iteration\s+\d+/\s*\d+ \|.*? lm loss: (\S+) \|", stdout)
    return [float(loss) for loss in found]


def test_tp2_pp2_with_sequence_parallelism_under_torchrun(torchrun: Torchrun) -> None:
    done = torchrun(
        "-m pp_train", 4, *TINY, "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--sequence-parallel",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("> padded vocab (size: 256) with 0 dummy tokens (new size: 256)") == 1
    assert "tensor parallel 2 with sequence parallelism, pipeline 2, data parallel 1, 1F1B" in (
        done.stdout
    )
    losses = _losses(done.stdout)
    assert len(losses) == 3
    assert all(math.isfinite(loss) for loss in losses)
    assert "validation at the end of training | lm loss:" in done.stdout


def test_sequence_parallel_without_tensor_parallelism_is_turned_off_once(
    torchrun: Torchrun,
) -> None:
    done = torchrun("-m pp_train", 2, *TINY, "--pipeline-model-parallel-size", "2",
                    "--sequence-parallel")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    warning = (
        "pp-train: warning: --sequence-parallel is turned off: it needs "
        "--tensor-model-parallel-size 2 or more, got 1"
    )
    assert done.stdout.count(warning) == 1
    assert "pipeline 2, data parallel 1, 1F1B" in done.stdout
    assert len(_losses(done.stdout)) == 3


def _fused_in_ddp(fusion: bool) -> list[torch.Tensor]:
    """A column + row parallel MLP at tp 2 x dp 2 in pp-optim's DDP (overlapped reduction)."""
    from pp_optim import DDPConfig, DistributedDataParallel
    from pp_state import ParallelConfig, ParallelState
    from pp_tensor import ColumnParallelLinear, RowParallelLinear

    state = ParallelState.create(ParallelConfig(tensor_model_parallel_size=2))
    try:
        group = state.group("tp")
        init = torch.nn.init.normal_
        torch.manual_seed(0)
        mlp = torch.nn.ModuleList([
            ColumnParallelLinear(8, 16, tp_group=group, init_method=init, gradient_accumulation_fusion=fusion),
            RowParallelLinear(16, 8, tp_group=group, init_method=init, input_is_parallel=True, gradient_accumulation_fusion=fusion),
        ])  # fmt: skip
        ddp = DistributedDataParallel(
            mlp,
            DDPConfig(overlap_grad_reduce=True, bucket_size=40),
            data_parallel_group=state.group("dp"),
        )
        for microbatch in range(2):
            seed = 10 * state.data_parallel_rank + microbatch
            x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(seed))
            # Megatron's rule: the microbatches before the last accumulate without reducing.
            with ddp.no_sync() if microbatch == 0 else contextlib.nullcontext():
                hidden, _ = mlp[0](x)
                out, _ = mlp[1](torch.tanh(hidden))
                out.square().sum().backward()
        ddp.finish_grad_sync()
        return [p.main_grad.clone() for p in mlp.parameters()]  # type: ignore[operator]
    finally:
        state.destroy()


def _fused_and_plain() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return _fused_in_ddp(True), _fused_in_ddp(False)


def test_fused_weight_gradients_in_pp_optims_grad_buffer_equal_plain_ones() -> None:
    """gradient_accumulation_fusion adds into main_grad; the overlapped DDP neither adds the
    dummy gradient again nor waits for a bucket that never looks ready."""
    for fused, plain in run_distributed(_fused_and_plain, 4):
        for a, b in zip(fused, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
