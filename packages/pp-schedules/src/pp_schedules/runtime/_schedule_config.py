"""What the executor takes besides the communicator and the schedule: its config and types.

`ScheduleConfig` holds the parts of Megatron's ModelParallelConfig the executor reads (hidden
size, encoder-decoder split, loss scaling and normalisation, no_sync, the gradient finalisation
hook, timers); which schedule runs is the resolved schedule's alone. `ForwardStepFunc` names
what a call takes, `FinalizeModelGradsFunc` what the finalisation hook is called with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from pp_comm import Timers

__all__ = ["FinalizeModelGradsFunc", "ForwardStepFunc", "ScheduleConfig"]

ForwardStepFunc = Callable[..., tuple[Any, Callable[..., Any]]]
"""``forward_step_func(data_iterator, model_chunk) -> (output, loss_func)``."""

FinalizeModelGradsFunc = Callable[[list[torch.nn.Module], "torch.Tensor | None"], Any]
"""``finalize_model_grads_func(model_chunks, num_tokens)``: the chunks of the call, and with
per-token loss the call's token count (the total on the rank holding the last stage, a zero
elsewhere), else None."""


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

    calculate_per_token_loss: bool = False
    """Megatron's per-token loss: a ``loss_func`` returns ``(loss_sum, num_tokens, reported)``
    and the loss is backwarded as it is (a sum over the microbatch's tokens), not divided by
    its token count and the microbatch count; the call adds up the counts
    (`PipelineExecutor.total_num_tokens`) and hands them to `finalize_model_grads_func`,
    which divides the gradients by the count over the whole batch once they are summed over
    data parallelism. The loss then no longer depends on how the batch is cut into
    microbatches. A ``loss_func`` returning two values is refused."""

    context_parallel_size: int = 1
    """Ranks each sequence is split over (Megatron's context parallelism). A ``loss_func``
    returning ``(loss, reported)`` has its loss multiplied by it (then divided by the
    microbatch count): the data-parallel reduction averages over data x context parallel
    ranks, and this undoes the context-parallel share of that average."""

    finalize_model_grads_func: FinalizeModelGradsFunc | None = None
    """Called at the end of every call with a backward (not forward-only), as Megatron's
    ``config.finalize_model_grads_func``: with the call's model chunks and, under
    `calculate_per_token_loss`, the token count as a float64 tensor (the call's total on the
    rank holding the last stage, 0 elsewhere: broadcast it from there over the pipeline,
    all-reduce it over data x context parallelism and scale the gradients by ``1 / max(count,
    1)``); without it, None."""

    def __post_init__(self) -> None:
        """Checks the per-token loss switch, the context-parallel size and the hook.

        Raises:
            TypeError: `calculate_per_token_loss` is not a bool, or
                `finalize_model_grads_func` is not callable.
            ValueError: `context_parallel_size` is not a whole number of 1 or more.
        """
        if not isinstance(self.calculate_per_token_loss, bool):
            raise TypeError(
                "calculate_per_token_loss must be True or False, got "
                f"{self.calculate_per_token_loss!r}"
            )
        size = self.context_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"context_parallel_size must be a whole number of 1 or more (the ranks each "
                f"sequence is split over; 1 without context parallelism), got {size!r}"
            )
        if self.finalize_model_grads_func is not None and not callable(
            self.finalize_model_grads_func
        ):
            raise TypeError(
                "finalize_model_grads_func must be callable as (model_chunks, num_tokens) or "
                f"None, got {type(self.finalize_model_grads_func).__name__}"
            )
