"""What the executor takes besides the communicator and the schedule: its config and types.

`ScheduleConfig` holds the parts of Megatron's ModelParallelConfig the executor reads (hidden
size, encoder-decoder split, loss scaling, no_sync, timers); which schedule runs is the
resolved schedule's alone. `ForwardStepFunc` names what a call takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from pp_comm import Timers

__all__ = ["ForwardStepFunc", "ScheduleConfig"]

ForwardStepFunc = Callable[..., tuple[Any, Callable[..., Any]]]
"""``forward_step_func(data_iterator, model_chunk) -> (output, loss_func)``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """What the executor needs besides the communicator and the resolved schedule.

    The schedule, its placement, interleaving group and receive prefetch are the resolved
    schedule's (`pp_schedules.resolve_schedule`); these are the rest of Megatron's
    ModelParallelConfig fields the executor reads.
    """

    hidden_size: int | None = None
    """Width of the activations between stages: they travel as (seq_length, micro_batch_size,
    hidden_size). None when the communicator exchanges shapes (variable_seq_lengths)."""

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

    fb_overlap: str | None = None
    """How an F&B step (DualPipeV's forward of one microbatch beside another's backward)
    runs: "sequential" (the forward, then the backward), "chunk" (the forward's chunk class's
    ``overlapped_forward_backward``, DeepSeek's contract) or "threads" (pp's own overlap: the
    halves take turns computing, each letting the other run while it waits on communication,
    see `pp_schedules.runtime.communicating`). None: the chunk's function when it defines
    one, else sequential. "chunk" and "threads" with a schedule without F&B steps are
    refused before any step."""

    timers: Timers | None = None
    """Timer hooks for "forward-compute" and "backward-compute"."""
