"""Which parameters count once over tensor parallelism: `param_is_not_tensor_parallel_duplicate`.

A parameter split over the tensor-parallel ranks (marked ``tensor_model_parallel = True``)
holds a different slice on each of them; one every rank holds whole (a bias, a LayerNorm
weight) is the same on all of them. A statistic over the whole model (a gradient or parameter
norm, a zero count) counts the whole one on the group's rank 0 only.

Megatron-core 0.20's function takes the tensor-parallel group and the expert tensor-parallel
group (for parameters marked ``allreduce = False``, which live in the expert topology), and
falls back to ``parallel_state`` when none is given. This one does the same over pp-state's
default state, and also takes this rank's position in the group as an int: the explicit form
for code that holds the rank rather than the group.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from pp_state import parallel_state
from pp_state.default import NotInitializedError

__all__ = ["SupportsRank", "param_is_not_tensor_parallel_duplicate"]


@runtime_checkable
class SupportsRank(Protocol):
    """A group as Megatron reads it: anything whose ``rank()`` is this rank's position in it.

    A torch.distributed ``ProcessGroup`` is one; so is an entry of a process-group collection
    or a stand-in written for a test.
    """

    def rank(self) -> int:
        """This rank's position in the group, 0 or more."""
        ...


def _position(group: SupportsRank | int, name: str) -> int:
    """This rank's position in `group`, given as the group or as the position itself."""
    if isinstance(group, int) and not isinstance(group, bool):  # a bool is no position
        if group < 0:  # also torch's marker for "not a member" (GroupMember.NON_GROUP_MEMBER)
            raise ValueError(
                f"{name} as an int is this rank's position in the group and must be 0 or "
                f"more, got {group}"
            )
        return group
    if isinstance(group, SupportsRank):  # a ProcessGroup, or anything with rank()
        return _returned_position(group.rank(), name)
    raise TypeError(
        f"{name} must be a torch.distributed ProcessGroup, any object with a rank() method, "
        f"this rank's position in it (an int 0 or more) or None, got {group!r} "
        f"({type(group).__name__})"
    )


def _returned_position(position: object, name: str) -> int:
    """What `name`'s ``rank()`` returned, if it is a position (an int 0 or more)."""
    if not isinstance(position, int) or isinstance(position, bool):
        raise TypeError(
            f"{name}.rank() returned {position!r} ({type(position).__name__}); this rank's "
            "position in the group must be an int 0 or more"
        )
    if position < 0:
        raise ValueError(
            f"{name}.rank() returned {position}: this rank's position in the group must be 0 "
            "or more (is this rank a member of the group?)"
        )
    return position


def _default_tensor_parallel_rank() -> int:
    try:
        return parallel_state.get_tensor_model_parallel_rank()
    except NotInitializedError as error:
        raise NotInitializedError(
            "param_is_not_tensor_parallel_duplicate was given no tensor-parallel group and "
            "model parallel is not initialized: pass tp_group= (the group, or this rank's "
            "tensor-parallel rank as an int) or call pp_state.initialize_model_parallel(...) first"
        ) from error


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor,
    tp_group: dist.ProcessGroup | SupportsRank | int | None = None,
    expert_tp_group: dist.ProcessGroup | SupportsRank | int | None = None,
) -> bool:
    """Whether `param` counts on this rank when a statistic sums over tensor parallelism.

    Args:
        param: The parameter. ``tensor_model_parallel = True`` marks one split over the
            tensor-parallel ranks; ``allreduce = False`` one of the expert topology.
        tp_group: The tensor-parallel group (a ProcessGroup, or any object with a
            ``rank()`` method, as Megatron takes), or this rank's position in it (an int,
            pp's explicit form), or None for the default state's tensor-parallel rank.
        expert_tp_group: The expert tensor-parallel group (or this rank's position in it),
            used instead of `tp_group` for a parameter marked ``allreduce = False``; None uses
            `tp_group` for every parameter.

    Returns:
        True for a split parameter; otherwise whether this rank is rank 0 of the group that
        applies.

    Raises:
        TypeError: A group that has no ``rank()`` and is neither an int nor None, or whose
            ``rank()`` is no int.
        ValueError: A negative position (given, or returned by ``rank()``).
        NotInitializedError: No group applies and no default state is set (nor a
            tensor-parallel rank override); it is also an AssertionError, as Megatron's.
    """
    # Positions first, so a bad argument is refused whatever the parameter.
    tp_rank = None if tp_group is None else _position(tp_group, "tp_group")
    expert_rank = None if expert_tp_group is None else _position(expert_tp_group, "expert_tp_group")
    if getattr(param, "tensor_model_parallel", False):
        return True
    rank = (
        expert_rank
        if expert_rank is not None and not getattr(param, "allreduce", True)
        else tp_rank
    )
    if rank is None:
        rank = _default_tensor_parallel_rank()
    return rank == 0
