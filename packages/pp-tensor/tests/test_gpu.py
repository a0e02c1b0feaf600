"""The layer equalities on CUDA tensors and NCCL groups, and the tracker on CUDA; skipped without GPUs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

from pp_tensor import (
    ColumnParallelLinear,
    InitMethod,
    RNGStatesTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from pp_testing import requires_gpus, run_distributed

SEQ, BATCH, HIDDEN, FFN, VOCAB = 8, 2, 16, 32, 32


def _full(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # Small values keep the logits moderate: fp32 sums in another order then agree to 1e-5.
    return 0.3 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _reference(ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The unsplit model on the CPU: embedding, MLP, logits on the tied embedding, loss."""
    weights = [
        _full(shape, seed).requires_grad_(True)
        for seed, shape in enumerate([(VOCAB, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)])
    ]
    hidden = F.embedding(ids, weights[0]).transpose(0, 1)
    hidden = hidden + F.linear(F.gelu(F.linear(hidden, weights[1])), weights[2])
    logits = F.linear(hidden, weights[0])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids.t().reshape(-1), reduction="none").sum()
    loss.backward()
    return loss.detach(), [_grad(w) for w in weights]


def _init(seed: int) -> InitMethod:
    def fill(weight: torch.Tensor) -> None:
        weight.copy_(_full(tuple(weight.shape), seed))

    return fill


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad.cpu()


def _tensor_parallel(
    ids: torch.Tensor, sequence_parallel: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    group, sp = dist.group.WORLD, sequence_parallel
    # The body also runs on gloo (CPU tensors), where it was written and checked.
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    embedding = VocabParallelEmbedding(
        VOCAB,
        HIDDEN,
        tp_group=group,
        init_method=_init(0),
        reduce_scatter_embeddings=sp,
        device=device,
    )
    column = ColumnParallelLinear(
        HIDDEN,
        FFN,
        tp_group=group,
        init_method=_init(1),
        bias=False,
        sequence_parallel=sp,
        device=device,
    )
    row = RowParallelLinear(
        FFN,
        HIDDEN,
        tp_group=group,
        init_method=_init(2),
        bias=False,
        input_is_parallel=True,
        sequence_parallel=sp,
        device=device,
    )
    output_layer = ColumnParallelLinear(
        HIDDEN,
        VOCAB,
        tp_group=group,
        init_method=_init(0),
        bias=False,
        skip_weight_param_allocation=True,
        sequence_parallel=sp,
        device=device,
    )
    hidden = embedding(ids.to(device))
    if not sequence_parallel:
        hidden = hidden.transpose(0, 1)
    hidden = hidden + row(F.gelu(column(hidden)[0]))[0]
    logits = output_layer(hidden, embedding.weight)[0]
    loss = vocab_parallel_cross_entropy(logits, ids.t().to(device), tp_group=group).sum()
    loss.backward()  # every rank's loss is the whole loss: the logits cover every token
    assert column.weight is not None
    return loss.detach().cpu(), [_grad(p) for p in (embedding.weight, column.weight, row.weight)]


def _nccl_equals_unsplit() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(9))
    expected_loss, expected_grads = _reference(ids)
    for sequence_parallel in (False, True):
        loss, grads = _tensor_parallel(ids, sequence_parallel)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
        for grad, expected, dim in zip(grads, expected_grads, (0, 0, 1), strict=True):
            torch.testing.assert_close(
                grad, expected.chunk(size, dim=dim)[rank], rtol=1e-5, atol=1e-5
            )


@requires_gpus(2)
def test_layers_on_nccl_equal_the_unsplit_model() -> None:
    run_distributed(_nccl_equals_unsplit, 2, backend="nccl")


@requires_gpus(1)
def test_tracker_forks_the_cuda_generator() -> None:
    tracker = RNGStatesTracker("cuda")
    tracker.add("dropout", 7)
    torch.cuda.manual_seed(1)
    with tracker.fork("dropout"):
        forked = torch.rand(3, device="cuda")
    outside = torch.rand(3, device="cuda")
    torch.cuda.manual_seed(1)
    torch.testing.assert_close(outside, torch.rand(3, device="cuda"))
    torch.cuda.manual_seed(7)
    torch.testing.assert_close(forked, torch.rand(3, device="cuda"))
    with pytest.raises(KeyError, match="known states"), tracker.fork("other"):
        pass
