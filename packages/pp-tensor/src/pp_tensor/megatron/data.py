"""megatron.core.tensor_parallel.data: `broadcast_data` with Megatron's signature."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from pp_tensor import data as _pp
from pp_tensor.data import MAX_DATA_DIM as _MAX_DATA_DIM
from pp_tensor.megatron._groups import get_tensor_model_parallel_group_if_none

__all__ = ["_MAX_DATA_DIM", "broadcast_data", "get_tensor_model_parallel_group_if_none"]


def broadcast_data(
    keys: Sequence[str],
    data: Mapping[str, torch.Tensor] | None,
    datatype: torch.dtype,
    tp_group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank 0's ``data[key]`` for each key, on every rank of the group."""
    group = get_tensor_model_parallel_group_if_none(tp_group)
    return _pp.broadcast_data(keys, data, datatype, tp_group=group)
