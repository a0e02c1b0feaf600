"""A backward split in two gives autograd's gradients, through the parameters' hooks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pp_schedules.runtime._split_backward import backward_input


class _Fused(torch.autograd.Function):
    """Input and weight gradients in one backward, as fused kernels do."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * w, (grad * x).sum(0)


def _model(kind: str) -> tuple[list[torch.nn.Parameter], Callable[[torch.Tensor], torch.Tensor]]:
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    embedding, position = torch.nn.Embedding(10, 4), torch.nn.Parameter(torch.randn(4))
    params = [*first.parameters(), *second.parameters(), *embedding.parameters(), position]

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(first(x + position))
        out: torch.Tensor = second(h)
        if kind == "side input":  # a parameter that never meets the input's path before the add
            out = out + embedding(torch.tensor([1, 2, 3]))
        if kind == "tied":  # one weight used twice
            out = out + first(second.weight[:3])
        return out

    return params, forward


@pytest.mark.parametrize("kind", ["chain", "side input", "tied"])
def test_input_then_weight_gradients_equal_one_backward(kind: str) -> None:
    params, forward = _model(kind)
    x = torch.randn(3, 4, requires_grad=True)
    grad = torch.randn(3, 4)
    expected = torch.autograd.grad(forward(x), [x, *params], grad, allow_unused=True)
    accumulated: list[int] = []
    for param in params:
        param.register_post_accumulate_grad_hook(lambda p: accumulated.append(id(p)))  # type: ignore[no-untyped-call]
    (input_grad,), weights = backward_input([forward(x)], [grad], [x], params)
    torch.testing.assert_close(input_grad, expected[0])
    assert all(p.grad is None for p in params), "the input step leaves parameters alone"
    grads_after: list[torch.Tensor | None] = []
    assert weights.groups, "every branch starts where the input's path is"
    assert not weights.rest
    weights.run()
    grads_after += [p.grad for p in params]
    wanted: list[torch.Tensor | None] = list(expected[1:])  # None where a parameter is unused
    for got, want in zip(grads_after, wanted, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want)
    # Autograd accumulated each used parameter once, through its hooks.
    assert sorted(accumulated) == sorted(
        id(p) for p, w in zip(params, wanted, strict=True) if w is not None
    )


def test_a_stage_without_input_gradients_runs_its_whole_backward_later() -> None:
    layer = torch.nn.Linear(4, 1)
    loss = layer(torch.randn(3, 4)).sum()
    grads, weights = backward_input([loss], None, [torch.randn(3, 4)], list(layer.parameters()))
    assert grads == [None]
    before = [layer.weight.grad, layer.bias.grad]
    weights.run()
    assert before == [None, None]
    assert all(p.grad is not None for p in layer.parameters())


def test_a_custom_function_that_fuses_both_gradients_is_refused() -> None:
    weight = torch.nn.Parameter(torch.randn(4))
    x = torch.randn(3, 4, requires_grad=True)
    output = _Fused.apply(x, weight)  # type: ignore[no-untyped-call]
    with pytest.raises(ValueError, match=r"cannot split this model.s backward.*_FusedBackward"):
        backward_input([output], [torch.ones(3, 4)], [x], [weight])
