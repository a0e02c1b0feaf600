"""Each tensor-parallel layer equals the unsplit torch layer with the same full weight.

On tp 2 and 4 gloo ranks: outputs equal (this rank's part of them), and every gradient of a
weight, bias and input equals the matching slice of the unsplit one (fp32). Parameters every
rank holds whole but sees only part of the sequence of (`sequence_parallel`) have their
gradients all-reduced over the group first, as a trainer does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from pp_tensor import (
    ColumnParallelLinear,
    InitMethod,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_tensor_model_parallel_region,
)
from pp_testing import run_distributed

SEQ, BATCH, HIDDEN, FFN, VOCAB = 8, 2, 8, 16, 16


def _full(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _init(seed: int) -> InitMethod:
    def fill(weight: torch.Tensor) -> None:
        weight.copy_(_full(tuple(weight.shape), seed))

    return fill


def _chunk(tensor: torch.Tensor | None, dim: int) -> torch.Tensor:
    assert tensor is not None
    return tensor.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_(True)


def _close(actual: torch.Tensor | None, expected: torch.Tensor | None) -> None:
    assert actual is not None
    assert expected is not None
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def _reduce_sequence_parallel_grads(module: torch.nn.Module) -> None:
    for param in module.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad)


def _linear(in_features: int, out_features: int, seed: int) -> torch.nn.Linear:
    linear = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.copy_(_full((out_features, in_features), seed))
        linear.bias.copy_(_full((out_features,), seed + 1))
    return linear


def _compare_and_backward(
    output: torch.Tensor,
    expected: torch.Tensor,
    split: Callable[[torch.Tensor], torch.Tensor],
    seed: int,
) -> None:
    """Checks this rank's output is `split` of the unsplit one; back-propagates a random grad."""
    grad = _full(tuple(expected.shape), seed)
    _close(output, split(expected))
    output.backward(split(grad))
    expected.backward(grad)


def _column_case(gather_output: bool, skip_bias_add: bool, sequence_parallel: bool) -> None:
    layer = ColumnParallelLinear(
        HIDDEN,
        FFN,
        tp_group=dist.group.WORLD,
        init_method=_init(1),
        gather_output=gather_output,
        skip_bias_add=skip_bias_add,
        sequence_parallel=sequence_parallel,
    )
    reference = _linear(HIDDEN, FFN, 1)
    assert layer.weight is not None
    assert layer.bias is not None
    assert tuple(layer.weight.shape) == (FFN // dist.get_world_size(), HIDDEN)
    with torch.no_grad():
        layer.bias.copy_(_chunk(reference.bias, 0))
    x = _leaf(_full((SEQ, BATCH, HIDDEN), 3))
    x_local = _leaf(_chunk(x, 0) if sequence_parallel else x)
    output, bias = layer(x_local)
    if skip_bias_add:
        assert bias is layer.bias
        # The bias returned is this rank's slice even when the output is gathered.
        gather = gather_from_tensor_model_parallel_region if gather_output else None
        output = output + (gather(bias, tp_group=dist.group.WORLD) if gather else bias)
    expected = reference(x)
    split = (lambda t: t) if gather_output else (lambda t: _chunk(t, -1))
    _compare_and_backward(output, expected, split, seed=4)
    _close(x_local.grad, _chunk(x.grad, 0) if sequence_parallel else x.grad)
    _close(layer.weight.grad, _chunk(reference.weight.grad, 0))
    _close(layer.bias.grad, _chunk(reference.bias.grad, 0))


def _column_cases() -> None:
    for gather, skip, sequence in itertools.product([False, True], repeat=3):
        if not (gather and sequence):
            _column_case(gather, skip, sequence)
    torch.manual_seed(5)  # the same default-generator draws give the same full weight
    layer = ColumnParallelLinear(
        HIDDEN, FFN, tp_group=dist.group.WORLD, init_method=torch.nn.init.normal_
    )
    torch.manual_seed(5)
    full = torch.nn.init.normal_(torch.empty(FFN, HIDDEN))
    _close(layer.weight, _chunk(full, 0))


def _row_case(input_is_parallel: bool, sequence_parallel: bool, skip_bias_add: bool) -> None:
    layer = RowParallelLinear(
        FFN,
        HIDDEN,
        tp_group=dist.group.WORLD,
        init_method=_init(1),
        input_is_parallel=input_is_parallel,
        sequence_parallel=sequence_parallel,
        skip_bias_add=skip_bias_add,
    )
    reference = _linear(FFN, HIDDEN, 1)
    assert layer.bias is not None
    assert tuple(layer.weight.shape) == (HIDDEN, FFN // dist.get_world_size())
    with torch.no_grad():
        layer.bias.copy_(reference.bias)
    x = _leaf(_full((SEQ, BATCH, FFN), 3))
    x_local = _leaf(_chunk(x, -1) if input_is_parallel else x)
    output, bias = layer(x_local)
    if skip_bias_add:
        assert bias is layer.bias
        output = output + bias
    expected = reference(x)
    split = (lambda t: _chunk(t, 0)) if sequence_parallel else (lambda t: t)
    _compare_and_backward(output, expected, split, seed=4)
    _reduce_sequence_parallel_grads(layer)
    _close(x_local.grad, _chunk(x.grad, -1) if input_is_parallel else x.grad)
    _close(layer.weight.grad, _chunk(reference.weight.grad, 1))
    _close(layer.bias.grad, reference.bias.grad)


def _row_cases() -> None:
    for parallel_input, sequence, skip in itertools.product([False, True], repeat=3):
        if parallel_input or not sequence:
            _row_case(parallel_input, sequence, skip)


def _embedding_case(reduce_scatter_embeddings: bool) -> None:
    layer = VocabParallelEmbedding(
        VOCAB,
        HIDDEN,
        tp_group=dist.group.WORLD,
        init_method=_init(1),
        reduce_scatter_embeddings=reduce_scatter_embeddings,
    )
    reference = torch.nn.Embedding(VOCAB, HIDDEN)
    with torch.no_grad():
        reference.weight.copy_(_full((VOCAB, HIDDEN), 1))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    output = layer(ids)
    expected = reference(ids)
    if reduce_scatter_embeddings:
        expected = expected.transpose(0, 1)
    split = (lambda t: _chunk(t, 0)) if reduce_scatter_embeddings else (lambda t: t)
    _compare_and_backward(output, expected, split, seed=4)
    _close(layer.weight.grad, _chunk(reference.weight.grad, 0))


def _embedding_cases() -> None:
    _embedding_case(False)
    _embedding_case(True)


def _mlp_case(sequence_parallel: bool) -> None:
    group = dist.group.WORLD
    column = ColumnParallelLinear(
        HIDDEN, FFN, tp_group=group, init_method=_init(1), sequence_parallel=sequence_parallel
    )
    row = RowParallelLinear(
        FFN,
        HIDDEN,
        tp_group=group,
        init_method=_init(3),
        input_is_parallel=True,
        sequence_parallel=sequence_parallel,
    )
    first, second = _linear(HIDDEN, FFN, 1), _linear(FFN, HIDDEN, 3)
    assert column.bias is not None
    assert row.bias is not None
    with torch.no_grad():
        column.bias.copy_(_chunk(first.bias, 0))
        row.bias.copy_(second.bias)
    x = _leaf(_full((SEQ, BATCH, HIDDEN), 5))
    x_local = _leaf(_chunk(x, 0) if sequence_parallel else x)
    output = row(torch.nn.functional.gelu(column(x_local)[0]))[0]
    expected = second(torch.nn.functional.gelu(first(x)))
    split = (lambda t: _chunk(t, 0)) if sequence_parallel else (lambda t: t)
    _compare_and_backward(output, expected, split, seed=6)
    _reduce_sequence_parallel_grads(row)
    _close(x_local.grad, split(x.grad))
    assert column.weight is not None
    _close(column.weight.grad, _chunk(first.weight.grad, 0))
    _close(column.bias.grad, _chunk(first.bias.grad, 0))
    _close(row.weight.grad, _chunk(second.weight.grad, 1))
    _close(row.bias.grad, second.bias.grad)


def _mlp_cases() -> None:
    _mlp_case(False)
    _mlp_case(True)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_linear_equals_the_unsplit_layer(tp: int) -> None:
    run_distributed(_column_cases, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_linear_equals_the_unsplit_layer(tp: int) -> None:
    run_distributed(_row_cases, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_equals_the_unsplit_layer(tp: int) -> None:
    run_distributed(_embedding_cases, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_then_row_mlp_equals_the_unsplit_mlp(tp: int) -> None:
    run_distributed(_mlp_cases, tp)


def _indivisible_sizes_are_refused() -> None:
    group = dist.group.WORLD
    ones = torch.nn.init.ones_
    with pytest.raises(
        ValueError,
        match="ColumnParallelLinear output size 6 is not divisible by tensor-parallel size 4",
    ):
        ColumnParallelLinear(4, 6, tp_group=group, init_method=ones)
    with pytest.raises(
        ValueError,
        match="RowParallelLinear input size 6 is not divisible by tensor-parallel size 4",
    ):
        RowParallelLinear(6, 4, tp_group=group, init_method=ones)
    with pytest.raises(
        ValueError,
        match="vocabulary size 257 is not divisible by tensor-parallel size 4; pad the vocabulary with --make-vocab-size-divisible-by",
    ):
        VocabParallelEmbedding(257, 4, tp_group=group, init_method=ones)


@pytest.mark.reliability
def test_indivisible_sizes_are_refused() -> None:
    run_distributed(_indivisible_sizes_are_refused, 4)
