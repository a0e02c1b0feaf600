"""A split backward through a checkpointed (recomputed) forward: how often it recomputes.

A plain backward recomputes the checkpointed forward once. Split into I and W it recomputes
twice: once in I and once in W, however many parameter groups the W step starts from (its
engine calls share one `torch.utils.checkpoint.GraphExecGroup`). With dropout the recomputed
masks are the original ones, so the gradients equal an unrecomputed run's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from pp_schedules.runtime._split_backward import backward_input


class _CountedMLP(torch.nn.Module):
    """Linear-GELU-dropout-Linear-dropout, counting its forwards; optionally checkpointed."""

    def __init__(self, *, recompute: bool) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.first = torch.nn.Linear(8, 16)
        self.second = torch.nn.Linear(16, 8)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))
        self.recompute = recompute
        self.forwards = 0

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        hidden = torch.nn.functional.dropout(torch.nn.functional.gelu(self.first(x)), 0.3)
        out: torch.Tensor = torch.nn.functional.dropout(self.second(hidden), 0.3)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.recompute:
            return self._body(x)
        out: torch.Tensor = checkpoint(self._body, x, use_reentrant=False, preserve_rng_state=True)
        return out


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)


def _plain_backward(model: _CountedMLP) -> tuple[int, list[torch.Tensor]]:
    """Recomputations in one backward; the input's and the parameters' gradients."""
    x, grad = _inputs()
    x.requires_grad_()
    torch.manual_seed(2)
    out = model(x)
    before = model.forwards
    out.backward(grad)
    assert x.grad is not None
    return model.forwards - before, [
        x.grad,
        *(p.grad for p in model.parameters() if p.grad is not None),
    ]


def _split_backward(model: _CountedMLP) -> tuple[int, int, list[torch.Tensor]]:
    """Recomputations in I and in W; the input's and the parameters' gradients."""
    x, grad = _inputs()
    x.requires_grad_()
    torch.manual_seed(2)
    out = model(x)
    before = model.forwards
    (input_grad,), weights = backward_input([out], [grad], [x], list(model.parameters()))
    after_input = model.forwards
    assert len(weights.groups) > 1, "the W step starts from several parameter groups"
    weights.run()
    assert input_grad is not None
    grads = [input_grad, *(p.grad for p in model.parameters() if p.grad is not None)]
    return after_input - before, model.forwards - after_input, grads


def test_a_plain_backward_recomputes_once_and_a_split_one_once_in_i_and_once_in_w() -> None:
    recomputed, _ = _plain_backward(_CountedMLP(recompute=True))
    assert recomputed == 1
    in_i, in_w, _ = _split_backward(_CountedMLP(recompute=True))
    assert (in_i, in_w) == (1, 1)
    plain_i, plain_w, _ = _split_backward(_CountedMLP(recompute=False))
    assert (plain_i, plain_w) == (0, 0)


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
def test_recomputed_gradients_with_dropout_equal_the_plain_run_bitwise(split: bool) -> None:
    def grads(recompute: bool) -> list[torch.Tensor]:
        model = _CountedMLP(recompute=recompute)
        return _split_backward(model)[2] if split else _plain_backward(model)[1]

    plain, recomputed = grads(False), grads(True)
    assert len(plain) == len(recomputed) == 5
    for want, got in zip(plain, recomputed, strict=True):
        assert torch.equal(want, got)
