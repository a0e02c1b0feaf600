"""Each mapping's forward and backward against the tensors it must give, on 2 and 4 gloo ranks.

Every rank can build every rank's input and gradient (`_of`), so each checks its own result
against the expected one computed locally.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch
import torch.distributed as dist

from pp_tensor import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from pp_testing import run_distributed

Mapping = Callable[[torch.Tensor], torch.Tensor]
SHAPE = (8, 2, 12)  # [sequence, batch, hidden]: divisible by 2 and 4 where it is split


def _of(rank: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """A tensor that depends on (rank, salt), the same wherever it is built."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + rank))


def _run(
    mapping: Mapping, x: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_(True)
    output = mapping(leaf)
    output.backward(grad)
    assert leaf.grad is not None
    return output.detach(), leaf.grad


def _sum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(tensors)).sum(dim=0)


def _chunk(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    return tensor.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]


def _last_dim_region_mappings() -> None:
    group, rank, size = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    every = range(size)
    local = (*SHAPE[:-1], SHAPE[-1] // size)

    output, grad = _run(
        lambda t: copy_to_tensor_model_parallel_region(t, tp_group=group),
        _of(rank, SHAPE, 1),
        _of(rank, SHAPE, 2),
    )
    torch.testing.assert_close(output, _of(rank, SHAPE, 1))
    torch.testing.assert_close(grad, sum(_of(r, SHAPE, 2) for r in every))

    output, grad = _run(
        lambda t: reduce_from_tensor_model_parallel_region(t, tp_group=group),
        _of(rank, SHAPE, 3),
        _of(rank, SHAPE, 4),
    )
    torch.testing.assert_close(output, sum(_of(r, SHAPE, 3) for r in every))
    torch.testing.assert_close(grad, _of(rank, SHAPE, 4))

    output, grad = _run(
        lambda t: scatter_to_tensor_model_parallel_region(t, tp_group=group),
        _of(0, SHAPE, 5),
        _of(rank, local, 6),
    )
    torch.testing.assert_close(output, _chunk(_of(0, SHAPE, 5), -1))
    torch.testing.assert_close(grad, torch.cat([_of(r, local, 6) for r in every], dim=-1))

    output, grad = _run(
        lambda t: gather_from_tensor_model_parallel_region(t, tp_group=group),
        _of(rank, local, 7),
        _of(rank, SHAPE, 8),
    )
    torch.testing.assert_close(output, torch.cat([_of(r, local, 7) for r in every], dim=-1))
    torch.testing.assert_close(grad, _chunk(_of(rank, SHAPE, 8), -1))


def _sequence_mappings() -> None:
    group, rank, size = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    every = range(size)
    local = (SHAPE[0] // size, *SHAPE[1:])

    output, grad = _run(
        lambda t: scatter_to_sequence_parallel_region(t, tp_group=group),
        _of(0, SHAPE, 1),
        _of(rank, local, 2),
    )
    torch.testing.assert_close(output, _chunk(_of(0, SHAPE, 1), 0))
    torch.testing.assert_close(grad, torch.cat([_of(r, local, 2) for r in every]))

    for reduce_grad in (True, False):
        output, grad = _run(
            lambda t: gather_from_sequence_parallel_region(
                t,
                tp_group=group,
                tensor_parallel_output_grad=reduce_grad,  # noqa: B023 - called at once
            ),
            _of(rank, local, 3),
            _of(rank, SHAPE, 4),
        )
        torch.testing.assert_close(output, torch.cat([_of(r, local, 3) for r in every]))
        full_grad = _sum(_of(r, SHAPE, 4) for r in every) if reduce_grad else _of(rank, SHAPE, 4)
        torch.testing.assert_close(grad, _chunk(full_grad, 0))

    output, grad = _run(
        lambda t: reduce_scatter_to_sequence_parallel_region(t, tp_group=group),
        _of(rank, SHAPE, 5),
        _of(rank, local, 6),
    )
    torch.testing.assert_close(output, _chunk(_sum(_of(r, SHAPE, 5) for r in every), 0))
    torch.testing.assert_close(grad, torch.cat([_of(r, local, 6) for r in every]))


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_region_mappings(world_size: int) -> None:
    run_distributed(_last_dim_region_mappings, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_mappings(world_size: int) -> None:
    run_distributed(_sequence_mappings, world_size)


def test_no_group_is_the_identity() -> None:
    x = torch.ones(3, 4)
    for mapping in (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
        scatter_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    ):
        assert mapping(x, tp_group=None) is x


def _indivisible_dims_are_refused() -> None:
    group = dist.group.WORLD
    x = torch.zeros(3, 2, 5)
    for mapping in (
        scatter_to_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    ):
        with pytest.raises(
            ValueError,
            match=r"first dimension \(the sequence\) 3 is not divisible by tensor-parallel size 2",
        ):
            mapping(x, tp_group=group)
    with pytest.raises(
        ValueError, match="last dimension 5 is not divisible by tensor-parallel size 2"
    ):
        scatter_to_tensor_model_parallel_region(x, tp_group=group)


@pytest.mark.reliability
def test_indivisible_dims_are_refused() -> None:
    run_distributed(_indivisible_dims_are_refused, 2)
