"""One training step: the schedule's forward-backward function, gradient finalisation, the update.

`build_forward_backward_func` wires pp-schedules' executor to the model and optimizer;
`train_step` zeroes the grads, runs it, `finalize_model_grads` and steps the optimizer and
scheduler, as Megatron's ``train_step``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pp_comm import CommConfig, NullTimers, P2PCommunicator, Timers
from pp_optim import (
    MegatronOptimizer,
    NonFiniteGradError,
    OptimizerParamScheduler,
    all_reduce_grads,
)
from pp_schedules import (
    PipelineExecutor,
    ResolvedSchedule,
    ScheduleConfig,
    get_forward_backward_func,
)
from pp_schedules.runtime import on_demand_for
from pp_state import ParallelState, Placement
from pp_state.collectives import collective, collective_device
from pp_train.checkpoint.agreement import gather_ints
from pp_train.embeddings import split_position_embedding, sum_tied_gradients
from pp_train.memory import empty_unused_memory
from pp_train.models import checked_placement
from pp_train.timers import Timers as LevelledTimers
from pp_train.wrappers import unwrap_model

__all__ = [
    "ForwardBackwardFunc",
    "ForwardStepFunc",
    "NonFiniteError",
    "StepResult",
    "average_losses",
    "build_forward_backward_func",
    "finalize_model_grads",
    "schedule_placement",
    "train_step",
]

ForwardStepFunc = Callable[[Any, torch.nn.Module], tuple[Any, Callable[..., Any]]]
"""Megatron's ``forward_step(data_iterator, model) -> (output, loss_func)``."""

StepResult = tuple[dict[str, float], int, float | None, int | None]
"""What `train_step` returns: ``(loss_dict, skipped_iter, grad_norm, num_zeros_in_grad)``."""


class ForwardBackwardFunc(Protocol):
    """What `pp_schedules.get_forward_backward_func` returns (Megatron's interface).

    A function with a ``placement`` attribute (pp-schedules' executor) says which virtual
    stage each chunk holds; any other is taken to run Megatron's looped placement.
    """

    def __call__(
        self,
        *,
        forward_step_func: ForwardStepFunc,
        data_iterator: Any,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
    ) -> list[Any]:
        """Runs one step's forward (and backward) passes; loss dicts on the last stage."""


def build_forward_backward_func(
    state: ParallelState,
    model: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    *,
    hidden_size: int,
    device: torch.device | None = None,
    timers: Timers | None = None,
    comm_config: CommConfig | None = None,
    resolved: ResolvedSchedule | None = None,
    sequence_parallel: bool = False,
    fb_overlap: str | None = None,
    calculate_per_token_loss: bool = False,
) -> PipelineExecutor:
    """The schedule for `state`'s pipeline, wired to the optimizer's loss scale and DDP's no_sync.

    Activations travel in the model's dtype (fp16/bf16 chunks send half tensors), shaped
    ``[seq, micro batch, hidden]`` (``seq / tp`` under sequence parallelism, as Megatron's
    ``get_tensor_shapes``); the result is pp-schedules' executor.

    Args:
        state: The parallel state; its pipeline group carries the transfers.
        model: This rank's chunks (from `get_model`).
        optimizer: Its ``scale_loss`` scales each loss before backward.
        hidden_size: Width of the activations between stages.
        device: Where received tensors go.
        timers: Megatron-style timers for the compute and communication phases.
        comm_config: pp-comm settings; by default the model's dtype on the wire.
        resolved: The schedule resolved once (`pp_schedules.resolve_schedule`, or the run's
            `pp_train.RunPlan.resolved`): a name, ``auto``'s pick or a plan, with its
            placement and every validated plan; the executor plans nothing itself. None:
            Megatron's choice for the sizes (1F1B, interleaved 1F1B with several chunks),
            resolved for each microbatch count when first run.
        sequence_parallel: The chunks' activations between stages are split along the
            sequence over `state`'s tensor-parallel group (``--sequence-parallel``).
        fb_overlap: How F&B steps run (``--fb-overlap``; `pp_schedules.ScheduleConfig`).
        calculate_per_token_loss: Losses are token sums with their counts (per-token loss);
            `train_step` hands the executor's ``total_num_tokens`` to `finalize_model_grads`.

    Raises:
        ValueError: A resolved schedule that does not fit the pipeline or the chunks.
    """
    communicator = _pipeline_communicator(
        state, model, device=device, timers=timers, comm_config=comm_config
    )
    resolved = _schedule_for(communicator, resolved, chunks=len(model))
    pipelined = state.pipeline_model_parallel_size > 1
    config = ScheduleConfig(
        hidden_size=hidden_size,
        pipeline_model_parallel_split_rank=state.pipeline_model_parallel_split_rank
        if pipelined else None,
        grad_scale_func=optimizer.scale_loss, no_sync_func=_no_sync_func(model), timers=timers,
        fb_overlap=fb_overlap, calculate_per_token_loss=calculate_per_token_loss,
        context_parallel_size=state.context_parallel_size,
    )  # fmt: skip
    tp = state.tensor_model_parallel_size if sequence_parallel else 1
    splits = {"context-parallel": state.context_parallel_size, "tensor-parallel": tp}
    if math.prod(splits.values()) > 1:
        return _SequenceSplitExecutor(splits, communicator, resolved, config=config)
    return get_forward_backward_func(communicator, resolved, config=config)


def _schedule_for(
    communicator: P2PCommunicator | None, resolved: ResolvedSchedule | None, *, chunks: int
) -> ResolvedSchedule:
    """`resolved`, checked against the rank's chunk count; Megatron's choice when None."""
    if resolved is None:
        return on_demand_for(communicator, vp_size=chunks)
    if resolved.vp_size != chunks:
        raise ValueError(
            f"the resolved schedule runs {resolved.vp_size} model chunk(s) per rank, but "
            f"{chunks} were given; build the model for the resolved schedule"
        )
    return resolved


class _SequenceSplitExecutor(PipelineExecutor):
    """The executor for chunks whose activations between stages are split along the sequence.

    Callers pass the sample's sequence lengths, as to any forward-backward function; each
    stage sends and receives its rank's part of them: ``1 / cp`` under context parallelism,
    and ``1 / tp`` of that under sequence parallelism (Megatron's ``get_tensor_shapes``).
    """

    def __init__(
        self,
        splits: dict[str, int],
        communicator: P2PCommunicator | None,
        resolved: ResolvedSchedule,
        *,
        config: ScheduleConfig,
    ) -> None:
        super().__init__(communicator, resolved, config=config)
        self.splits = splits
        self.sequence_split = math.prod(splits.values())

    def __call__(
        self, *, seq_length: int | None = None, decoder_seq_length: int | None = None, **kwargs: Any
    ) -> list[Any]:
        """`PipelineExecutor.__call__`, with the lengths of the parts that travel.

        Raises:
            ValueError: A sequence length does not divide by the sizes it is split over.
        """
        decoder = None if decoder_seq_length is None else self._part(decoder_seq_length)
        length = None if seq_length is None else self._part(seq_length)
        return super().__call__(seq_length=length, decoder_seq_length=decoder, **kwargs)

    def _part(self, length: int) -> int:
        if length % self.sequence_split:
            sizes = " x ".join(
                f"{kind} size {size}" for kind, size in self.splits.items() if size > 1
            )
            raise ValueError(
                f"sequence length {length} is not divisible by {sizes} = "
                f"{self.sequence_split}, which the activations between stages are split over"
            )
        return length // self.sequence_split


def _pipeline_communicator(
    state: ParallelState,
    model: Sequence[torch.nn.Module],
    *,
    device: torch.device | None,
    timers: Timers | None,
    comm_config: CommConfig | None,
) -> P2PCommunicator | None:
    """The transfers between stages (None for one stage).

    By default in the model's dtype, timing out with the parallel state's collectives.
    """
    dtype = next(unwrap_model(model[0]).parameters()).dtype
    if state.pipeline_model_parallel_size <= 1:
        return None
    # Transfers wait as long as the run's collectives (--distributed-timeout-minutes).
    timeout = getattr(getattr(state, "config", None), "timeout", None)
    config = comm_config or (
        CommConfig(pipeline_dtype=dtype, timeout=timeout)
        if timeout is not None
        else CommConfig(pipeline_dtype=dtype)
    )
    return P2PCommunicator.from_parallel_state(state, config=config, device=device, timers=timers)


def _no_sync_func(model: Sequence[torch.nn.Module]) -> Any:
    """The chunks' ``no_sync`` (one, or a list for several); None unless every chunk has one."""
    no_sync = [getattr(chunk, "no_sync", None) for chunk in model]
    if not all(func is not None for func in no_sync):
        return None
    return no_sync if len(no_sync) > 1 else no_sync[0]


def schedule_placement(forward_backward_func: Any, state: ParallelState) -> Placement:
    """The placement a forward-backward function runs: the executor's, else Megatron's looped.

    For callers that do not know it: `pretrain` hands the resolved schedule's placement to
    `train`, `train_step` and `evaluate` instead (their ``placement`` keyword), and a user
    with a Megatron-style function of their own passes the placement it runs there.

    Args:
        forward_backward_func: pp-schedules' executor (it has ``placement``) or any function
            with Megatron's interface (taken to run the looped placement).
        state: The parallel state (pipeline and virtual sizes).
    """
    placement = getattr(forward_backward_func, "placement", None)
    if isinstance(placement, Placement):
        return placement
    return checked_placement(state, None)


def finalize_model_grads(
    model: Sequence[torch.nn.Module],
    state: ParallelState,
    *,
    placement: Placement | None = None,
    num_tokens: torch.Tensor | None = None,
) -> None:
    """After backward: data-parallel reduction, replicated weights over tp, tied embeddings.

    Megatron's order. Every chunk's grad buffer is reduced over data parallelism
    (reduce-scattered with the distributed optimizer: each rank's shard, where the tied
    copies' shards line up); under sequence parallelism the gradients of weights every
    tensor-parallel rank holds whole but sees only its part of the sequence through (marked
    ``sequence_parallel``: layer norms, row-parallel biases) are summed over the
    tensor-parallel group; the word embedding's copies on the first and last stage are
    summed (over the embedding group, or in place when one rank holds both, see
    `tied_embedding_sync`); with a split rank the position embedding over its group
    (Megatron's encoder-decoder models). With per-token loss (`num_tokens` given) the token
    count is broadcast from the rank holding the last stage over the pipeline, summed over
    data x context parallelism, and every gradient is divided by it (at least 1).

    Args:
        model: This rank's chunks.
        state: The parallel state.
        placement: Which stage each chunk holds (the schedule's); looped when None.
        num_tokens: Per-token loss only, on every rank: the step's token count on the rank
            holding the last stage (the executor's ``total_num_tokens``), any scalar tensor
            elsewhere (it is overwritten by the broadcast); None for the mean losses.
    """
    for chunk in model:
        finish = getattr(chunk, "finish_grad_sync", None)
        if callable(finish):
            finish()
    _allreduce_non_tensor_model_parallel_grads(model, state)
    sum_tied_gradients(model, state, checked_placement(state, placement))
    position = split_position_embedding(model, state)
    if position is not None:
        all_reduce_grads([position], group=state.group("position_embedding"))
    if num_tokens is not None:
        count = _global_token_count(num_tokens, state, checked_placement(state, placement))
        _scale_gradients(model, 1.0 / max(count, 1.0))


def _global_token_count(
    num_tokens: torch.Tensor, state: ParallelState, placement: Placement
) -> float:
    """The last stage's token count, summed over data x context parallel ranks (every rank)."""
    count = num_tokens.detach().to(torch.float64).reshape(()).clone()  # the caller's stays
    if state.pipeline_model_parallel_size > 1:
        group = state.group("pp")
        count = count.to(collective_device(group))
        last = dist.get_global_rank(group, placement.holder(placement.num_stages - 1)[0])
        with collective("token count broadcast over the pipeline", group=group):
            dist.broadcast(count, src=last, group=group)
    if state.group_size("dp_cp") > 1:
        group = state.group("dp_cp")
        count = count.to(collective_device(group))
        with collective("token count all-reduce over data parallel", group=group):
            dist.all_reduce(count, group=group)
    return float(count)


def _scale_gradients(model: Sequence[torch.nn.Module], factor: float) -> None:
    """Multiplies every gradient of the chunks: the grad buffers, else each ``grad``."""
    for chunk in model:
        scale = getattr(chunk, "scale_gradients", None)
        if callable(scale):
            scale(factor)
            continue
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grad.mul_(factor)


def _allreduce_non_tensor_model_parallel_grads(
    model: Sequence[torch.nn.Module], state: ParallelState
) -> None:
    """Sums the ``sequence_parallel`` weights' gradients over tp, in one collective per dtype.

    Each tensor-parallel rank computed them from its part of the sequence only.
    """
    if state.tensor_model_parallel_size == 1:
        return
    params = [
        param
        for chunk in model
        for param in chunk.parameters()
        if param.requires_grad and getattr(param, "sequence_parallel", False)
    ]
    if params:
        all_reduce_grads(params, group=state.group("tp"))


def average_losses(losses: list[dict[str, Any]], state: ParallelState) -> dict[str, float]:
    """Each reported loss over the microbatches and data-parallel ranks (last stage's ranks).

    As Megatron's ``train_step``: a value of two elements is ``[loss_sum, token_count]``: both
    are summed over the microbatches and the data x context parallel ranks, and the loss is
    the sum over the count (the batch's mean over its tokens); a value of one element is
    averaged over the microbatches, then over the ranks.

    Args:
        losses: One dict of loss tensors per microbatch (the forward-backward function's).
        state: The parallel state; a collective over its data (x context) parallel group.

    Raises:
        ValueError: A value of another size.
    """
    if not losses:
        return {}
    parts = {key: _reduced_locally(key, [x[key] for x in losses]) for key in losses[0]}
    stacked = torch.cat(list(parts.values())).cpu()
    size = state.group_size("dp_cp")
    if size > 1:
        stacked = stacked.to(collective_device(state.group("dp_cp")))
        with collective("loss averaging over data parallel", group=state.group("dp_cp")):
            dist.all_reduce(stacked, group=state.group("dp_cp"))
        stacked = stacked.cpu()
    averaged, offset = {}, 0
    for key, part in parts.items():
        if part.numel() == 2:  # summed, and its tokens counted, over every rank
            averaged[key] = float(stacked[offset] / stacked[offset + 1].clamp(min=1))
        else:
            averaged[key] = float(stacked[offset]) / size
        offset += part.numel()
    return averaged


def _reduced_locally(key: str, values: list[Any]) -> torch.Tensor:
    """One key's values over the microbatches: ``[sum, count]`` summed, a loss averaged."""
    flat = [torch.as_tensor(v, dtype=torch.float32).detach().reshape(-1).cpu() for v in values]
    sizes = {v.numel() for v in flat}
    if sizes == {2}:
        return torch.stack(flat).sum(dim=0)
    if sizes == {1}:
        return torch.stack(flat).mean().reshape(1)
    raise ValueError(
        f"loss {key!r} was reported with {sorted(sizes)} elements; report one (the loss) or "
        "two ([loss_sum, token_count], Megatron's per-token form) in every microbatch"
    )


def train_step(
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    model: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    *,
    forward_backward_func: ForwardBackwardFunc,
    state: ParallelState,
    num_microbatches: int,
    micro_batch_size: int,
    seq_length: int,
    decoder_seq_length: int | None = None,
    timers: Timers | None = None,
    barrier_with_l1_time: bool = True,
    iteration: int | None = None,
    placement: Placement | None = None,
    empty_unused_memory_level: int = 0,
) -> StepResult:
    """One iteration, as Megatron's ``train_step``.

    Zeroes the grads, runs the forward-backward function, `finalize_model_grads`, steps the
    optimizer and, unless it skipped, the scheduler by ``microbatches * mbs * dp`` samples.
    Phases "forward-backward", "grads-all-reduce", "optimizer" are timed at level 1 (after a
    barrier and a device sync with `barrier_with_l1_time`); pp-train's `Timers` also go to
    the optimizer's step, which times its own phases at level 1 ("optimizer-inner-step", ...).
    `placement`: which stage each chunk holds (None: `schedule_placement` asks).
    `empty_unused_memory_level`: 1 empties the CUDA cache after the forward-backward passes,
    2 also after the optimizer step (Megatron's flag; nothing on CPU).

    Returns:
        ``(loss_dict, skipped_iter, grad_norm, num_zeros_in_grad)``: `average_losses` of the
        microbatches' losses on the rank holding the last stage (else empty).

    Raises:
        NonFiniteError: A NaN or inf gradient norm without a loss scaler; nothing applied.
    """
    timers = timers or NullTimers()
    _zero_grads(model, optimizer)
    _phase(timers, "forward-backward").start(**_barrier(timers, barrier_with_l1_time))
    losses = forward_backward_func(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=list(model),
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length, forward_only=False,
    )  # fmt: skip
    _phase(timers, "forward-backward").stop()
    empty_unused_memory(empty_unused_memory_level, 1, model)
    placement = placement or schedule_placement(forward_backward_func, state)
    _phase(timers, "grads-all-reduce").start()
    _finalize(model, state, placement, forward_backward_func)
    _phase(timers, "grads-all-reduce").stop()
    step = _optimizer_step(optimizer, timers, barrier_with_l1_time, losses, iteration)
    update_successful, grad_norm, num_zeros_in_grad = step
    if update_successful:
        scheduler.step(increment=num_microbatches * micro_batch_size * state.group_size("dp"))
    skipped_iter = 0 if update_successful else 1
    empty_unused_memory(empty_unused_memory_level, 2, model)
    holds_loss = placement.holds_last(state.pipeline_model_parallel_rank)
    loss_dict = average_losses(losses, state) if holds_loss else {}
    return loss_dict, skipped_iter, grad_norm, num_zeros_in_grad


def _finalize(
    model: Sequence[torch.nn.Module], state: ParallelState, placement: Placement, func: Any
) -> None:
    """`finalize_model_grads`, with the executor's token total under per-token loss.

    A forward-backward function other than pp-schedules' executor runs mean losses; with
    per-token loss a rank without the last stage passes 0, which the broadcast replaces.
    """
    num_tokens = None
    if getattr(getattr(func, "config", None), "calculate_per_token_loss", False):
        total = getattr(func, "total_num_tokens", None)
        num_tokens = total if total is not None else torch.zeros((), dtype=torch.float64)
    finalize_model_grads(model, state, placement=placement, num_tokens=num_tokens)


def _zero_grads(model: Sequence[torch.nn.Module], optimizer: MegatronOptimizer) -> None:
    """Zeroes the chunks' grad buffers (pp-optim's DDP) and the optimizer's gradients."""
    for zero in (getattr(chunk, "zero_grad_buffer", None) for chunk in model):
        if callable(zero):
            zero()
    optimizer.zero_grad()


def _optimizer_step(
    optimizer: MegatronOptimizer,
    timers: Timers,
    barrier: bool,
    losses: list[Any],
    iteration: int | None,
) -> tuple[bool, float | None, int | None]:
    """The optimizer's step, timed; a non-finite norm becomes one `NonFiniteError`."""
    _phase(timers, "optimizer").start(**_barrier(timers, barrier))
    # pp-train's levelled timers also time the step's phases; a plain hook has no levels.
    levelled = timers if isinstance(timers, LevelledTimers) else None
    try:
        result = optimizer.step(levelled, barrier_with_l1_time=barrier)
    except NonFiniteGradError as error:
        raise _non_finite(error, losses, iteration) from error
    _phase(timers, "optimizer").stop()
    return result


class NonFiniteError(FloatingPointError):
    """A NaN or inf loss or gradient norm stopped training before the step was applied."""


def _non_finite(
    error: NonFiniteGradError, losses: list[Any], iteration: int | None
) -> NonFiniteError:
    """The error every rank raises, naming the ranks whose loss was not finite (a collective)."""
    bad_loss = any(
        not math.isfinite(float(torch.as_tensor(v).float().reshape(-1)[0]))
        for item in losses
        for v in (item.values() if isinstance(item, dict) else [item])
    )
    flags = gather_ints(int(bad_loss), "non-finite loss check", iteration=iteration)
    loss_ranks = [rank for rank, flag in enumerate(flags) if flag]
    where = "" if iteration is None else f"iteration {iteration}: "
    loss = f"non-finite loss on rank(s) {loss_ranks}; " if loss_ranks else ""
    return NonFiniteError(
        f"{where}{loss}{error}; training stopped, the last checkpoint is as it was "
        "(--no-check-for-nan-in-loss-and-grad turns this check off)"
    )


def _phase(timers: Timers, name: str) -> Any:
    """A once-per-iteration phase's timer: level 1 with pp-train's `Timers` (Megatron's)."""
    return timers(name, log_level=1) if isinstance(timers, LevelledTimers) else timers(name)


def _barrier(timers: Timers, barrier: bool) -> dict[str, bool]:
    """``start``'s keywords: pp-train's timers take a barrier; a plain `Timers` hook none."""
    return {"barrier": barrier} if isinstance(timers, LevelledTimers) else {}
