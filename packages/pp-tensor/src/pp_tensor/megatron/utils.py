"""megatron.core.tensor_parallel.utils: Megatron's signatures over `pp_tensor.utils`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pp_tensor import utils as _pp
from pp_tensor.megatron._groups import get_tensor_model_parallel_group_if_none
from pp_tensor.utils import VocabUtility, split_tensor_along_last_dim

__all__ = [
    "VocabUtility",
    "divide",
    "gather_split_1d_tensor",
    "get_tensor_model_parallel_group_if_none",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
]


def divide(numerator: int, denominator: int) -> int:
    """``numerator / denominator``, which must be whole (Megatron's two-argument helper).

    Raises:
        ValueError: A remainder, naming both numbers.
    """
    return _pp.divide(numerator, denominator, "numerator", by="denominator")


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This tensor-parallel rank's equal part of `tensor` flattened (a copy with `new_buffer`)."""
    group = get_tensor_model_parallel_group_if_none(tp_group)
    return _pp.split_tensor_into_1d_equal_chunks(tensor, new_buffer, tp_group=group)


def gather_split_1d_tensor(
    tensor: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The ranks' 1-D parts in rank order, as one new tensor."""
    group = get_tensor_model_parallel_group_if_none(tp_group)
    return _pp.gather_split_1d_tensor(tensor, tp_group=group)
