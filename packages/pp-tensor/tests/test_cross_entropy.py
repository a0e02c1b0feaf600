"""vocab_parallel_cross_entropy equals torch's cross_entropy on the gathered logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

from pp_tensor import vocab_parallel_cross_entropy
from pp_testing import run_distributed

SEQ, BATCH, VOCAB = 4, 3, 16


def _problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full logits, targets (every rank's range hit) and per-token loss weights."""
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(SEQ, BATCH, VOCAB, generator=generator)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
    target[0] = torch.tensor([0, VOCAB // 2, VOCAB - 1])
    return logits, target, torch.rand(SEQ, BATCH, generator=generator)


def _torch_loss_and_grad(label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits, target, weights = _problem()
    logits.requires_grad_(True)
    loss = F.cross_entropy(
        logits.view(-1, VOCAB), target.view(-1), reduction="none", label_smoothing=label_smoothing
    ).view(SEQ, BATCH)
    (loss * weights).sum().backward()
    assert logits.grad is not None
    return loss.detach(), logits.grad


def _ours(
    group: dist.ProcessGroup | None,
    rank: int,
    size: int,
    label_smoothing: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits, target, weights = _problem()
    local = logits.to(dtype).chunk(size, dim=-1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(
        local, target, tp_group=group, label_smoothing=label_smoothing
    )
    (loss * weights).sum().backward()
    assert local.grad is not None
    assert loss.dtype == torch.float32
    assert local.grad.dtype == dtype
    return loss.detach(), local.grad


def _matches_torch() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    for label_smoothing in (0.0, 0.1):
        loss, grad = _ours(dist.group.WORLD, rank, size, label_smoothing, torch.float32)
        expected_loss, expected_grad = _torch_loss_and_grad(label_smoothing)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            grad, expected_grad.chunk(size, dim=-1)[rank], rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("tp", [2, 4])
def test_matches_torch_cross_entropy(tp: int) -> None:
    run_distributed(_matches_torch, tp)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_without_a_group_and_in_bfloat16(label_smoothing: float) -> None:
    expected_loss, expected_grad = _torch_loss_and_grad(label_smoothing)
    loss, grad = _ours(None, 0, 1, label_smoothing, torch.float32)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(grad, expected_grad)
    loss, grad = _ours(None, 0, 1, label_smoothing, torch.bfloat16)  # fp32 inside
    torch.testing.assert_close(loss, expected_loss, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad.float(), expected_grad, rtol=2e-2, atol=2e-2)


@pytest.mark.reliability
def test_bad_arguments() -> None:
    logits = torch.zeros(2, 3, 8)
    with pytest.raises(
        ValueError, match=r"target shape \(2, 4\) does not match logits shape \(2, 3, 8\)"
    ):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long), tp_group=None)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\), got 1.0"):
        vocab_parallel_cross_entropy(
            logits, torch.zeros(2, 3, dtype=torch.long), tp_group=None, label_smoothing=1.0
        )
