"""What the executor takes besides the communicator: the schedule config and its types.

`ScheduleConfig` holds Megatron's ModelParallelConfig parts the executor reads (hidden size,
schedule, loss scaling, no_sync, timers); `ForwardStepFunc` and `PlanLike` name what a call
and a given plan may be.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from pp_comm import Timers
from pp_schedules.actions import Action
from pp_schedules.plans import Plan
from pp_state.placement import Placement

__all__ = ["ForwardStepFunc", "PlanLike", "ScheduleConfig"]

ForwardStepFunc = Callable[..., tuple[Any, Callable[..., Any]]]
"""``forward_step_func(data_iterator, model_chunk) -> (output, loss_func)``."""

PlanLike = Plan | str | Sequence[Sequence[Action]]
"""A plan, its text form (see `pp_schedules.parse_schedule`), or compute action lists."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """What the executor needs besides the communicator (Megatron's ModelParallelConfig parts)."""

    hidden_size: int | None = None
    """Width of the activations between stages: they travel as (seq_length, micro_batch_size,
    hidden_size). None when the communicator exchanges shapes (variable_seq_lengths)."""

    schedule: str | None = None
    """A schedule name for `pp_schedules.plan` (or "auto"); by default the registry's
    `default_schedule`: no_pipelining for one stage, interleaved_1f1b with virtual stages on
    the looped placement (gpipe on another), 1f1b otherwise. Not needed with a resolved
    schedule (if set, it must be its name)."""

    plan: PlanLike | None = None
    """A plan to run instead of a named schedule: a `Plan`, its text, or compute action lists.
    It is validated before anything is sent; a forward-only call runs its forward steps."""

    placement: str | Placement | None = None
    """Which virtual stage each chunk holds for a named schedule: "looped" (Megatron's, the
    default) or "v"; a given plan carries its own."""

    microbatch_group_size_per_vp_stage: int | None = None
    """Interleaving group size (the pipeline size by default)."""

    prefetch_receives: int | None = None
    """Post each receive this many exchanges before the one its step needs (see
    `pp_schedules.lower`); the plan validated and run is the moved one. By default 1 on gloo
    with fixed shapes, where a receive posted only when needed costs a round trip; 0 on NCCL,
    where transfers complete in posting order and an early receive would hold up later
    sends, and with shape headers, which are waited for when a receive is posted. A plan
    that writes its exchanges runs as written."""

    pipeline_model_parallel_split_rank: int | None = None
    """Encoder-decoder models: the first decoder stage. From it on, stages receive and send two
    tensors, their activations and the encoder's output, which each decoder stage passes
    along (its gradient is added back), as Megatron does. Not with interleaving."""

    deallocate_pipeline_outputs: bool = True
    """Free an output's storage once it has been sent; only its autograd node is kept."""

    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Applied to the loss before backward (the optimizer's ``scale_loss``)."""

    no_sync_func: (
        Callable[[], AbstractContextManager[Any]]
        | Sequence[Callable[[], AbstractContextManager[Any]]]
        | None
    ) = None
    """Context that turns off data-parallel gradient sync (DDP's ``no_sync``): one, or with
    virtual stages a list of one per chunk; left for the last microbatch of each chunk. None:
    the chunks' own ``no_sync`` when every chunk has one (torch's, pp-optim's or Megatron's
    ``DistributedDataParallel``), as Megatron's training loop sets it. torch's DDP decides at
    each forward whether the backward reduces, so for such a chunk the context is left before
    the forward of its last microbatch (a plan that runs another microbatch's backward in
    between is refused); other contexts (pp-optim's and Megatron's DDP, which decide at
    backward) are left before the last backward."""

    timers: Timers | None = None
    """Timer hooks for "forward-compute" and "backward-compute"."""
