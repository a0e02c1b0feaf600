"""The parameters' norm over the whole model (Megatron's ``--log-params-norm``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pp_optim import param_is_not_shared, param_is_not_tensor_parallel_duplicate
from pp_state import ParallelState
from pp_state.collectives import collective

__all__ = ["calc_params_l2_norm"]


def calc_params_l2_norm(model: Sequence[torch.nn.Module], state: ParallelState) -> float:
    """The L2 norm of every parameter of the model, each weight counted once.

    Each rank sums the squares of its chunks' parameters, leaving out tied copies (marked
    ``shared``, e.g. the output layer's copy of the word embedding) and tensor-parallel
    duplicates held on tensor-parallel rank 0 only; the sums meet over the model-parallel
    group (tensor x pipeline). Half-precision parameters are summed in fp32. Every rank of
    the model-parallel group must call this.

    Args:
        model: This rank's model chunks (wrapped or not).
        state: The parallel state (its model-parallel group and tensor-parallel rank).

    Returns:
        The norm, the same on every rank of a model-parallel group.
    """
    tp_rank = state.tensor_model_parallel_rank
    square = torch.zeros((), dtype=torch.float64)
    seen: set[int] = set()
    for chunk in model:
        for param in chunk.parameters():
            if id(param) in seen:  # a weight two chunks share (counted once)
                continue
            seen.add(id(param))
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(
                param, tp_rank
            ):
                square += param.detach().double().pow(2).sum().cpu()
    if state.group_size("mp") > 1:
        group = state.group("mp")
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        reduced = square.to(device)
        with collective("parameter norm all-reduce", group=group):
            dist.all_reduce(reduced, group=group)
        square = reduced.cpu()
    return float(square.sqrt())
