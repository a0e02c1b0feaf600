"""The parameters' norm over the whole model (Megatron's ``--log-params-norm``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pp_optim import param_is_not_shared, param_is_not_tensor_parallel_duplicate
from pp_state import ParallelState
from pp_state.collectives import collective
from pp_train.wrappers import finish_param_sync

__all__ = ["calc_params_l2_norm"]


def calc_params_l2_norm(model: Sequence[torch.nn.Module], state: ParallelState) -> float:
    """The L2 norm of every parameter of the model, each weight counted once.

    Each rank sums the squares of its chunks' parameters, leaving out tied copies (marked
    ``shared``, e.g. the output layer's copy of the word embedding) and tensor-parallel
    duplicates held on tensor-parallel rank 0 only; the sums meet over the model-parallel
    group (tensor x pipeline). Squares are summed in float64. Every rank of
    the model-parallel group must call this. With the distributed optimizer's
    ``--overlap-param-gather`` the parameters' all-gathers still in flight are waited for
    first (`finish_param_sync`).

    Args:
        model: This rank's model chunks (wrapped or not).
        state: The parallel state (its model-parallel group and tensor-parallel rank).

    Returns:
        The norm, the same on every rank of a model-parallel group.
    """
    finish_param_sync(model)
    tp_rank = state.tensor_model_parallel_rank
    kept: dict[int, torch.Tensor] = {}  # by id: a weight two chunks share counts once
    for chunk in model:
        for param in chunk.parameters():
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(
                param, tp_rank
            ):
                kept.setdefault(id(param), param)
    # Summed where the parameters live; one copy to the host at the end.
    squares = [p.detach().double().pow(2).sum() for p in kept.values()]
    square = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if state.group_size("mp") > 1:
        group = state.group("mp")
        if dist.get_backend(group) == "nccl":
            square = square.cuda()
        with collective("parameter norm all-reduce", group=group):
            dist.all_reduce(square, group=group)
    return float(square.sqrt())
