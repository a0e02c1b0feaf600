"""The facade's one rule for groups: None means pp-state's default state's group."""

from __future__ import annotations

import torch.distributed as dist

from pp_state import parallel_state

__all__ = ["get_tensor_model_parallel_group_if_none"]


def get_tensor_model_parallel_group_if_none(
    tp_group: dist.ProcessGroup | None, is_expert: bool = False, check_initialized: bool = True
) -> dist.ProcessGroup | None:
    """`tp_group`, or the default state's tensor-parallel group when it is None.

    The expert-tensor-parallel group for `is_expert`, as megatron-core's helper of this name.

    Without torch.distributed, or before ``initialize_model_parallel``, a None stays None
    (no tensor parallelism), as Megatron's.

    Raises:
        ValueError: This rank is not in the group.
    """
    if not dist.is_initialized():
        return None
    if tp_group is None and not parallel_state.model_parallel_is_initialized():
        return None  # Megatron passes the group through: no tensor parallelism
    if tp_group is None:
        read = (
            parallel_state.get_expert_tensor_parallel_group
            if is_expert
            else parallel_state.get_tensor_model_parallel_group
        )
        tp_group = read(check_initialized=check_initialized)
    if tp_group is not None and dist.get_rank(tp_group) < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not in the tensor-parallel group given (its ranks: "
            f"{dist.get_process_group_ranks(tp_group)}); pass this rank's own group"
        )
    return tp_group
