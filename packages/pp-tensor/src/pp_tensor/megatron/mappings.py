"""megatron.core.tensor_parallel.mappings: Megatron's signatures over `pp_tensor.mappings`.

A group left as None is the default state's tensor-parallel group, read through this
module's `get_tensor_model_parallel_group_if_none` (patchable, as Megatron's). The autograd
classes are pp-tensor's, under Megatron's names. ``use_global_buffer`` is accepted and has no
effect: pp keeps no global memory buffer (the results are the same).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pp_tensor import mappings as _pp
from pp_tensor.mappings import (
    AllGatherFromTensorParallelRegion,
    AllToAll,
    CopyToModelParallelRegion,
    GatherFromModelParallelRegion,
    GatherFromSequenceParallelRegion,
    ReduceFromModelParallelRegion,
    ReduceScatterToSequenceParallelRegion,
    ReduceScatterToTensorParallelRegion,
    ScatterToModelParallelRegion,
    ScatterToSequenceParallelRegion,
)
from pp_tensor.megatron._groups import get_tensor_model_parallel_group_if_none

__all__ = [
    "_AllGatherFromTensorParallelRegion",
    "_AllToAll",
    "_CopyToModelParallelRegion",
    "_GatherFromModelParallelRegion",
    "_GatherFromSequenceParallelRegion",
    "_ReduceFromModelParallelRegion",
    "_ReduceScatterToSequenceParallelRegion",
    "_ReduceScatterToTensorParallelRegion",
    "_ScatterToModelParallelRegion",
    "_ScatterToSequenceParallelRegion",
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_to_all",
    "all_to_all_hp2sp",
    "all_to_all_sp2hp",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_tensor_model_parallel_group_if_none",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]

Group = dist.ProcessGroup | None

# Megatron's (underscored) names of the autograd functions.
_CopyToModelParallelRegion = CopyToModelParallelRegion
_ReduceFromModelParallelRegion = ReduceFromModelParallelRegion
_ScatterToModelParallelRegion = ScatterToModelParallelRegion
_GatherFromModelParallelRegion = GatherFromModelParallelRegion
_ScatterToSequenceParallelRegion = ScatterToSequenceParallelRegion
_GatherFromSequenceParallelRegion = GatherFromSequenceParallelRegion
_ReduceScatterToSequenceParallelRegion = ReduceScatterToSequenceParallelRegion
_AllGatherFromTensorParallelRegion = AllGatherFromTensorParallelRegion
_ReduceScatterToTensorParallelRegion = ReduceScatterToTensorParallelRegion
_AllToAll = AllToAll


def _group(group: Group) -> Group:
    return get_tensor_model_parallel_group_if_none(group)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Identity forward, all-reduced gradient."""
    return _pp.copy_to_tensor_model_parallel_region(input_, tp_group=_group(group))


def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: Group = None
) -> torch.Tensor:
    """All-reduce forward, identity gradient."""
    return _pp.reduce_from_tensor_model_parallel_region(input_, tp_group=_group(group))


def scatter_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: Group = None
) -> torch.Tensor:
    """This rank's part of the last dimension; all-gathered gradient."""
    return _pp.scatter_to_tensor_model_parallel_region(input_, tp_group=_group(group))


def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: Group = None
) -> torch.Tensor:
    """All-gather of the last dimension; the gradient keeps this rank's part."""
    return _pp.gather_from_tensor_model_parallel_region(input_, tp_group=_group(group))


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """This rank's part of the first dimension; all-gathered gradient."""
    return _pp.scatter_to_sequence_parallel_region(input_, tp_group=_group(group))


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group: Group = None,
    output_split_sizes: Sequence[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """All-gather of the first dimension; reduce-scattered (or split) gradient."""
    del use_global_buffer  # no global buffer in pp: same result
    return _pp.gather_from_sequence_parallel_region(
        input_,
        tp_group=_group(group),
        tensor_parallel_output_grad=tensor_parallel_output_grad,
        output_split_sizes=output_split_sizes,
    )


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    group: Group = None,
    input_split_sizes: Sequence[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Reduce-scatter of the first dimension; all-gathered gradient."""
    del use_global_buffer  # no global buffer in pp: same result
    return _pp.reduce_scatter_to_sequence_parallel_region(
        input_, tp_group=_group(group), input_split_sizes=input_split_sizes
    )


def all_gather_last_dim_from_tensor_parallel_region(
    input_: torch.Tensor, group: Group = None
) -> torch.Tensor:
    """All-gather of the last dimension; reduce-scattered gradient."""
    return _pp.all_gather_last_dim_from_tensor_parallel_region(input_, tp_group=_group(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(
    input_: torch.Tensor, group: Group = None
) -> torch.Tensor:
    """Reduce-scatter of the last dimension; all-gathered gradient."""
    return _pp.reduce_scatter_last_dim_to_tensor_parallel_region(input_, tp_group=_group(group))


def all_to_all(
    group: Group,
    input_: torch.Tensor,
    output_split_sizes_: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    use_nccl_stream: bool = False,
) -> torch.Tensor:
    """All-to-all of the first dimension over `group` (required, as in Megatron).

    ``use_nccl_stream`` (megatron-core 0.20's side stream) changes nothing here.

    Raises:
        ValueError: `group` is None.
    """
    del use_nccl_stream  # one stream: the same result
    if group is None:
        raise ValueError("all_to_all needs a group (Megatron's all_to_all reads no default)")
    return _pp.all_to_all(group, input_, output_split_sizes_, input_split_sizes)


def all_to_all_sp2hp(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """``[tokens / tp, hidden]`` to ``[tokens, hidden / tp]``."""
    return _pp.all_to_all_sp2hp(input_, tp_group=_group(group))


def all_to_all_hp2sp(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """``[tokens, hidden / tp]`` to ``[tokens / tp, hidden]``."""
    return _pp.all_to_all_hp2sp(input_, tp_group=_group(group))
