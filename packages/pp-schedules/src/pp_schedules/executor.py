"""The executor: runs any valid plan on real model chunks with pp-comm, Megatron-style.

`get_forward_backward_func` returns a callable with Megatron-LM's keyword arguments
(``forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
decoder_seq_length, forward_only, collect_non_loss_data``) and Megatron's meaning:
``set_input_tensor`` on each chunk, ``forward_step_func(data_iterator, model)`` returning
``(output, loss_func)``, the loss divided by the number of microbatches, loss scaling through
an injected ``grad_scale_func``, DDP gradient sync off for all but the last microbatch of each
chunk, outputs deallocated once sent (with the custom backward that allows it), and the list
of loss dicts returned on the last stage.

It runs exactly the plan `validate` approved: for each rank it walks the lowered steps in
order, each compute step one forward or backward and each exchange one pp-comm call posting its
sends and receives together. It waits for an exchange's receives at once and lets its sends
complete in the background; a send is waited for (and its buffers freed) as soon as the plan
shows that the peer has received it, or at the end of the call. Which stage each chunk holds,
and so where tensors go, comes from the plan's placement; between two chunks of one rank (the
turn of a V) a tensor is handed over in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from pp_comm import NullTimers, P2PCommunicator, P2PHandle, P2PMessage, Timers
from pp_schedules.actions import Action
from pp_schedules.generators import plan
from pp_schedules.lowering import Exchange, Message, Step
from pp_schedules.plans import Plan, as_plan
from pp_schedules.split_backward import WeightGradients, backward_input
from pp_schedules.timeline import MeasuredSpan, TimelineRecorder
from pp_schedules.validation import PlanReport, sends_delivered, validate
from pp_state.placement import Placement

__all__ = [
    "ForwardStepFunc",
    "PipelineExecutor",
    "PlanLike",
    "RunStats",
    "ScheduleConfig",
    "custom_backward",
    "deallocate_output_tensor",
    "get_forward_backward_func",
]

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
    """A schedule name for `pp_schedules.plan`; by default no_pipelining for one stage,
    interleaved_1f1b with virtual stages, 1f1b otherwise."""

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
    virtual stages a list of one per chunk; left for the last microbatch of each chunk. None
    with chunks wrapped in torch's ``DistributedDataParallel``: their own ``no_sync``, as
    Megatron takes it. torch's DDP decides at each forward whether the backward reduces, so
    for such a chunk the context is left before the forward of its last microbatch (a plan
    that runs another microbatch's backward in between is refused); other contexts (pp-optim's
    and Megatron's DDP, which decide at backward) are left before the last backward."""

    timers: Timers | None = None
    """Timer hooks for "forward-compute" and "backward-compute"."""


@dataclasses.dataclass
class RunStats:
    """What the last call measured on this rank.

    Attributes:
        peak_activations: Most forwards held at once awaiting their backward.
        peak_activation_bytes: Most bytes held at once by the stage's stored outputs and
            inputs (distinct storages). Tensors that autograd saved for backward are not
            seen here: a deallocated output whose storage the last op also saved (tanh does,
            linear does not) still occupies memory.
        peak_in_flight_bytes: Most bytes held at once by sends not yet completed. gloo
            reports a send complete only once waited for, so there these are kept until the
            end of the step; NCCL reports completions as they happen.
        steps: Compute steps run.
    """

    peak_activations: int = 0
    peak_activation_bytes: int = 0
    peak_in_flight_bytes: int = 0
    steps: int = 0


def deallocate_output_tensor(
    out: torch.Tensor | Sequence[torch.Tensor] | None, deallocate_pipeline_outputs: bool = False
) -> None:
    """Replace an output's storage with one element, keeping its autograd node (Megatron's trick).

    Only the next stage needs the values; this stage's backward needs the graph, which
    `custom_backward` runs without checking the output's shape. Megatron's signature: nothing
    happens unless `deallocate_pipeline_outputs` is True.
    """
    if not deallocate_pipeline_outputs:
        return
    for tensor in _as_list(out):
        if tensor._base is not None:  # a view shares storage it does not own
            continue
        tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)


def custom_backward(
    output: torch.Tensor | Sequence[torch.Tensor],
    grad_output: torch.Tensor | Sequence[torch.Tensor] | None,
) -> None:
    """Backward from `output` without the shape check that a deallocated output would fail.

    Several outputs (with one gradient each) go through one backward pass.
    """
    outputs = [output] if isinstance(output, torch.Tensor) else list(output)
    if grad_output is None:
        assert len(outputs) == 1, "a gradient-free backward starts from one scalar loss"
        assert outputs[0].numel() == 1, "a gradient-free backward starts from a scalar loss"
        grads = [torch.ones_like(outputs[0], memory_format=torch.preserve_format)]
    else:
        grads = [grad_output] if isinstance(grad_output, torch.Tensor) else list(grad_output)
    Variable._execution_engine.run_backward(
        tensors=tuple(outputs),
        grad_tensors=tuple(grads),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _as_list(value: Any) -> list[torch.Tensor]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in value if v is not None]


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _is_torch_ddp(module: torch.nn.Module) -> bool:
    return isinstance(module, DistributedDataParallel)


def _check_torch_ddp_order(chunks: Sequence[torch.nn.Module], actions: Sequence[Action]) -> None:
    """Refuse a plan that torch's DDP cannot reduce: it decides at forward time.

    A chunk wrapped in ``torch.nn.parallel.DistributedDataParallel`` reduces its gradients in
    the backward that follows its latest forward, so each of its forwards must be followed by
    that microbatch's backward (B, or I and W) before the next forward or any other backward.

    Raises:
        ValueError: Naming the chunk, the microbatches and what to use instead.
    """
    for chunk, module in enumerate(chunks):
        if not _is_torch_ddp(module):
            continue
        open_microbatch: int | None = None
        for action in (a for a in actions if a.chunk == chunk):
            if action.kind == "F" and open_microbatch is None:
                open_microbatch = action.microbatch
            elif action.kind != "F" and action.microbatch == open_microbatch:
                open_microbatch = None if action.kind in ("B", "W") else open_microbatch
            else:
                raise ValueError(
                    f"model chunk {chunk} is wrapped in torch.nn.parallel."
                    "DistributedDataParallel, which decides at each forward whether the next "
                    f"backward reduces gradients, but this rank's plan runs {action} while "
                    f"microbatch {open_microbatch} is between its forward and its backward; "
                    "wrap the chunk in pp_optim.DistributedDataParallel (it reduces at "
                    "backward, as Megatron's DDP) or run one microbatch at a time (no "
                    "pipelining)"
                )


def _wrapped_attr(module: torch.nn.Module, name: str) -> Any:
    """An attribute of a module or of what it wraps (DDP, Float16Module: ``.module``)."""
    current: Any = module
    while not hasattr(current, name) and hasattr(current, "module"):
        current = current.module
    return getattr(current, name)


class PipelineExecutor:
    """Runs a validated plan on this rank's model chunks; see `get_forward_backward_func`."""

    def __init__(
        self,
        communicator: P2PCommunicator | None,
        *,
        vp_size: int | None = None,
        config: ScheduleConfig | None = None,
        plan: PlanLike | None = None,
    ) -> None:
        """Bind to a pipeline (None: a single stage), a config and optionally a plan.

        Raises:
            ValueError: A plan or placement that does not fit the pipeline, or a split rank
                with virtual stages.
        """
        self.communicator = communicator
        self.config = config or ScheduleConfig()
        self.pp_size = communicator.num_stages if communicator is not None else 1
        self.rank = communicator.stage if communicator is not None else 0
        given = plan if plan is not None else self.config.plan
        self.user_plan = None if given is None else as_plan(given)
        if self.user_plan is not None and vp_size is None:
            vp_size = self.user_plan.vp_size
        self.vp_size = vp_size or 1
        self.placement = self._placement()
        self.schedule = self.config.schedule or (
            "no_pipelining"
            if self.pp_size == 1 and self.vp_size == 1
            else "interleaved_1f1b"
            if self.vp_size > 1 and self.placement.name == "looped"
            else "gpipe"
            if self.vp_size > 1
            else "1f1b"
        )
        self.timers: Timers = self.config.timers or NullTimers()
        split = self.config.pipeline_model_parallel_split_rank
        if split is not None and (self.vp_size > 1 or not 1 <= split < self.pp_size):
            raise ValueError(
                f"pipeline_model_parallel_split_rank {split} needs a pipeline it splits (1 .. "
                f"{self.pp_size - 1}) and no virtual stages (vp_size {self.vp_size})"
            )
        # gloo completes each transfer on its own; NCCL in posting order, a batch as one work.
        self.independent = communicator is None or communicator.device.type != "cuda"
        self.prefetch = self._prefetch()
        self.stats = RunStats()
        self.timeline: list[MeasuredSpan] = []
        self._recording = False
        self._plans: dict[tuple[int, bool], _Prepared] = {}

    def _placement(self) -> Placement:
        if self.user_plan is not None:
            placement = self.user_plan.placement
            if (placement.pp_size, placement.vp_size) != (self.pp_size, self.vp_size):
                raise ValueError(
                    f"the plan is for {placement.pp_size} ranks x {placement.vp_size} chunks, "
                    f"but the pipeline has {self.pp_size} ranks and vp_size {self.vp_size}"
                )
            if self.config.placement is not None and str(self.config.placement) != str(placement):
                raise ValueError(
                    f"the plan runs on placement {placement}, but the config asks for "
                    f"{self.config.placement}"
                )
            return placement
        chosen = self.config.placement
        if isinstance(chosen, Placement):
            return chosen
        default = "v" if self.config.schedule == "zbv" else "looped"
        return Placement.named(chosen or default, self.pp_size, self.vp_size)

    def _prefetch(self) -> int:
        chosen = self.config.prefetch_receives
        # With shape headers pp-comm waits for a receive's header while posting it.
        headers = self.communicator is not None and self.communicator.config.exchanges_shapes
        if chosen is None:
            return 1 if self.independent and not headers else 0
        if chosen < 0 or (chosen and headers):
            raise ValueError(
                f"prefetch_receives must be 0 (receives where needed) or more, got {chosen}"
                if chosen < 0
                else f"prefetch_receives={chosen} needs fixed shapes: with shape headers "
                "(variable_seq_lengths or debug) a receive waits for its header when posted, "
                "so posting it early would wait for a send not made yet; use 0"
            )
        return chosen

    def record_timeline(self, enabled: bool = True) -> None:
        """Record every compute step and exchange of the following calls in `timeline`."""
        self._recording = enabled

    def plan_for(
        self, num_microbatches: int, forward_only: bool
    ) -> tuple[list[Action], PlanReport]:
        """This rank's compute actions and the validated plan (cached per microbatch count).

        Raises:
            ValueError: The schedule refuses the configuration, or a given plan is for
                another number of microbatches.
            PlanError: The plan is invalid (the message draws the grid).
        """
        prepared = self._prepared(num_microbatches, forward_only)
        report = prepared.report
        return [s.compute for s in report.steps[self.rank] if s.compute is not None], report

    def _prepared(self, num_microbatches: int, forward_only: bool) -> _Prepared:
        key = (num_microbatches, forward_only)
        if key not in self._plans:
            report = validate(
                self._plan(num_microbatches, forward_only),
                num_microbatches=num_microbatches,
                forward_only=forward_only,
                prefetch=self.prefetch,
            )
            self._check_runs(report)
            self._plans[key] = _Prepared(report, sends_delivered(report.steps)[self.rank])
        return self._plans[key]

    def _check_runs(self, report: PlanReport) -> None:
        """Refuse what this pipeline cannot run of a valid plan, before anything is sent.

        Raises:
            ValueError: Split backwards with an encoder-decoder split, or (on NCCL, which
                matches transfers in order only) a link carrying activations and gradients
                the same way, as the V placement does beyond two ranks.
        """
        split = any(s.compute.kind in ("I", "W") for r in report.steps for s in r if s.compute)
        if split and self.config.pipeline_model_parallel_split_rank is not None:
            raise ValueError(
                "split backwards (I/W, zero-bubble schedules) do not run with "
                "pipeline_model_parallel_split_rank; use '1f1b' for encoder-decoder models"
            )
        streams: dict[tuple[int, int], set[str]] = {}
        for rank, steps in enumerate(report.steps):
            for step in steps:
                for message in step.exchange.messages if step.exchange else ():
                    if message.is_send:
                        streams.setdefault((rank, message.peer), set()).add(message.channel)
        if not self.independent and self.pp_size > 2 and any(len(c) > 1 for c in streams.values()):
            raise ValueError(
                f"placement {self.placement} sends activations and gradients the same way "
                "between two ranks, which NCCL (matching transfers in order only) cannot keep "
                "apart beyond two ranks yet; use the looped placement, or gloo"
            )

    def _prepared_for(
        self, chunks: list[torch.nn.Module], num_microbatches: int, forward_only: bool
    ) -> _Prepared:
        """The validated plan of a call, checked against the chunks' DDP wrappers."""
        prepared = self._prepared(num_microbatches, forward_only)
        if not forward_only:
            steps = prepared.report.steps[self.rank]
            _check_torch_ddp_order(chunks, [s.compute for s in steps if s.compute])
        return prepared

    def _plan(self, num_microbatches: int, forward_only: bool) -> Plan:
        if self.user_plan is None:
            return plan(
                self.schedule,
                pp_size=self.pp_size,
                num_microbatches=num_microbatches,
                vp_size=self.vp_size,
                microbatch_group_size_per_vp_stage=self.config.microbatch_group_size_per_vp_stage,
                forward_only=forward_only,
                placement=self.placement,
            )
        chosen = self.user_plan.without_backward() if forward_only else self.user_plan
        if chosen.num_microbatches != num_microbatches:
            raise ValueError(
                f"the plan covers {chosen.num_microbatches} microbatches, but this step runs "
                f"{num_microbatches}; give a plan for {num_microbatches} or change "
                "num_microbatches"
            )
        return chosen

    def _check_call(
        self, model: Any, data_iterator: Any, collect: bool, fwd: bool
    ) -> tuple[list[torch.nn.Module], Sequence[Any]]:
        """The call's chunks and per-chunk iterators, after checking they fit the executor."""
        chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
        iterators = (
            data_iterator
            if isinstance(data_iterator, (list, tuple))
            else [data_iterator] * len(chunks)
        )
        if len(chunks) != self.vp_size or len(iterators) != self.vp_size:
            raise ValueError(
                f"{self.vp_size} model chunks per rank expected (vp_size), got {len(chunks)} "
                f"chunks and {len(iterators)} data iterators"
            )
        if self.vp_size > 1 and len({id(i) for i in iterators if i is not None}) < sum(
            i is not None for i in iterators
        ):
            # Each chunk pulls its own microbatches; one shared iterator would skip data.
            raise ValueError(
                "with virtual stages, give each model chunk its own data iterator "
                "(a list of distinct iterators, as Megatron's interleaved schedule takes)"
            )
        no_sync = self.config.no_sync_func
        if self.vp_size > 1 and no_sync is not None and not isinstance(no_sync, (list, tuple)):
            raise ValueError(
                f"with {self.vp_size} model chunks, no_sync_func must be a list with one context "
                "factory per chunk (each chunk re-enables gradient sync for its last microbatch)"
            )
        if collect and not fwd:
            raise ValueError(
                "collect_non_loss_data needs forward_only=True: there is no loss to backward"
            )
        return chunks, iterators

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
        """Run forward (and backward) of `num_microbatches` microbatches over the pipeline.

        Walks this rank's steps of the validated plan in order: each compute step is one
        forward or backward, each exchange one pp-comm call; nothing else communicates.

        Returns:
            On the rank holding the last stage, what each microbatch's ``loss_func`` reported
            (its loss dict, or with `collect_non_loss_data` and `forward_only` its non-loss
            data); elsewhere [].

        Raises:
            ValueError: The model chunks or data iterators do not match the virtual size, a
                single no_sync_func or shared iterator comes with virtual stages,
                `collect_non_loss_data` comes without `forward_only`, or the plan does not
                fit the call.
            PlanError: The plan is invalid; nothing was sent.
        """
        chunks, iterators = self._check_call(
            model, data_iterator, collect_non_loss_data, forward_only
        )
        prepared = self._prepared_for(chunks, num_microbatches, forward_only)
        run = _Run(
            self,
            _Call(
                chunks=chunks,
                iterators=iterators,
                forward_step_func=forward_step_func,
                num_microbatches=num_microbatches,
                seq_and_batch=(seq_length, micro_batch_size),
                decoder_seq_length=decoder_seq_length,
                forward_only=forward_only,
                collect_non_loss_data=collect_non_loss_data,
            ),
            prepared,
        )
        try:
            run.walk()
        except BaseException as error:
            # Sends of this step may still be pending; a later step would receive them.
            if self.communicator is not None:
                self.communicator.invalidate(f"a pipeline step failed: {type(error).__name__}")
            raise
        self.stats = run.stats
        self.timeline = run.recorder.spans if run.recorder is not None else []
        return run.store


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A validated plan and, for this rank, where its sends are known to have arrived."""

    report: PlanReport
    delivered: dict[int, list[int]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Call:
    """The arguments of one call."""

    chunks: list[torch.nn.Module]
    iterators: Sequence[Any]
    forward_step_func: ForwardStepFunc
    num_microbatches: int
    seq_and_batch: tuple[int, int]
    decoder_seq_length: int | None
    forward_only: bool
    collect_non_loss_data: bool


_Key = tuple[int, int]  # (microbatch, chunk)


class _Run:
    """One call's state on one rank: it walks the rank's lowered steps."""

    def __init__(self, executor: PipelineExecutor, call: _Call, prepared: _Prepared) -> None:
        self.x = executor
        self.call = call
        self.steps = prepared.report.steps[executor.rank]
        self.delivered = prepared.delivered
        self.placement = executor.placement
        hidden = executor.config.hidden_size
        seq, batch = call.seq_and_batch
        self.shape: tuple[int, ...] | None = None if hidden is None else (seq, batch, hidden)
        self.decoder_shape: tuple[int, ...] | None = (
            None if hidden is None else (call.decoder_seq_length or seq, batch, hidden)
        )
        self.split = executor.config.pipeline_model_parallel_split_rank
        self.inputs: dict[_Key, list[torch.Tensor] | None] = {}
        self.outputs: dict[_Key, list[torch.Tensor]] = {}
        # Tensors between a step and the exchange that moves them, by (channel, mb, chunk).
        self.arrived: dict[tuple[str, int, int], tuple[P2PHandle, int, list[torch.Tensor]]] = {}
        self.to_send: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        # Hand-overs between chunks of this rank (the turn of a V).
        self.local: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        # Exchanges with sends in flight: their handle and what they send.
        self.pending: dict[int, tuple[P2PHandle, list[torch.Tensor]]] = {}
        self.store: list[Any] = []
        self.stats = RunStats()
        self.recorder = TimelineRecorder(executor.rank) if executor._recording else None
        actions = [s.compute for s in self.steps if s.compute is not None]
        # Each chunk's last backward (or weight-gradient step) re-enables its gradient sync.
        self.last_backward = {a.chunk: a.microbatch for a in actions if a.kind in ("B", "W")}
        # Split backwards: what each W needs once its I has run.
        self.deferred: dict[_Key, WeightGradients] = {}
        self.trainable: dict[int, list[torch.Tensor]] = {}
        self.sync_stacks: dict[int, contextlib.ExitStack] = {}
        # torch's DDP chunks leave no_sync before the forward of their last microbatch.
        self.sync_at_forward = {
            chunk: microbatch
            for chunk, microbatch in self.last_backward.items()
            if _is_torch_ddp(call.chunks[chunk])
        }

    def walk(self) -> None:
        """Run every step of this rank in order, then complete the sends still in flight."""
        with self.sync_control():
            for index, step in enumerate(self.steps):
                if step.compute is None:
                    assert step.exchange is not None
                    self.exchange(index, step.exchange)
                elif step.compute.kind == "F":
                    self.forward(step.compute)
                elif step.compute.kind == "B":
                    self.backward(step.compute)
                elif step.compute.kind == "I":
                    self.backward_input(step.compute)
                else:
                    self.backward_weight(step.compute)
                for done in self.delivered.get(index, ()):
                    self._complete_sends(done)
        self.finish()

    def _complete_sends(self, index: int) -> None:
        """Wait for the sends of exchange `index` (its receives are waited for by their users).

        On NCCL a batch's sends complete with its receives; while one of those is unused,
        waiting would wait for it earlier than the plan says, so the batch completes when
        that receive is used or at the end of the call.
        """
        handle, _ = self.pending.get(index, (None, None))
        if handle is None or (
            not self.x.independent and any(h is handle for h, _, _ in self.arrived.values())
        ):
            return
        del self.pending[index]
        handle.wait_send()

    # -------------------------------------------------------------------- stage geometry
    def _first(self, chunk: int) -> bool:
        return self.placement.is_first(self.x.rank, chunk)

    def _last(self, chunk: int) -> bool:
        return self.placement.is_last(self.x.rank, chunk)

    def _local_neighbour(self, chunk: int, step: int) -> int | None:
        """The chunk of this rank `step` stages away, if that stage is on this rank."""
        neighbour = self.placement.neighbour(self.x.rank, chunk, step)
        return neighbour[1] if neighbour is not None and neighbour[0] == self.x.rank else None

    def _decoder(self, stage: int) -> bool:
        """Whether pipeline rank `stage` runs the decoder of an encoder-decoder model."""
        return self.split is not None and stage >= self.split

    def _shapes_sent_by(self, stage: int) -> tuple[tuple[int, ...] | None, ...]:
        """What `stage` sends on (Megatron's get_tensor_shapes); decoders add encoder output."""
        if self._decoder(stage):
            return (self.decoder_shape, self.shape)
        return (self.shape,)

    # -------------------------------------------------------------------- communication
    def _message(self, message: Message) -> P2PMessage:
        action = message.action
        key = (message.channel, action.microbatch, action.chunk)
        if message.is_send:
            # The transfer reads through detached aliases, which keep the storage alive until
            # the send completes; the stage's own tensors can let go of it at once.
            tensors = [t.detach() for t in self.to_send.pop(key)]
            return P2PMessage(
                slot=message.slot,
                tensors=tensors,
                microbatch=action.microbatch,
                channel=message.channel,
            )
        activations = message.channel == "forward"
        sender = message.peer if activations else self.x.rank
        return P2PMessage(
            slot=message.slot,
            shapes=self._shapes_sent_by(sender),
            requires_grad=activations and not self.call.forward_only,
            microbatch=action.microbatch,
            channel=message.channel,
        )

    def exchange(self, index: int, exchange: Exchange) -> None:
        """Post the exchange as one pp-comm call; its receives are waited for by their users."""
        comm = self.x.communicator
        assert comm is not None, "a plan with transfers needs a communicator"
        start = self.recorder.now() if self.recorder is not None else 0.0
        messages = [self._message(m) for m in exchange.messages]
        received, handle = comm.exchange(messages, operation=exchange.operation, async_op=True)
        sent = [t for m in messages for t in m.tensors]
        for number, (message, tensors) in enumerate(zip(exchange.messages, received, strict=True)):
            action = message.action
            if tensors is not None:
                key = (message.channel, action.microbatch, action.chunk)
                self.arrived[key] = (handle, number, tensors)
            elif message.channel == "forward" and self.x.config.deallocate_pipeline_outputs:
                deallocate_output_tensor(
                    self._own_outputs((action.microbatch, action.chunk)),
                    deallocate_pipeline_outputs=True,
                )
        if sent:
            self.pending[index] = (handle, sent)
            self._measure_in_flight()
        if self.recorder is not None:
            first = exchange.messages[0].action
            self.recorder.add(
                str(Step(exchange=exchange)), "exchange", first.microbatch, first.chunk,
                start, self.recorder.now(),
            )  # fmt: skip

    def _own_outputs(self, key: _Key) -> list[torch.Tensor]:
        """The outputs this stage computed (not the encoder output it passes along)."""
        outputs = self.outputs.get(key, [])
        if self._decoder(self.x.rank) and len(outputs) > 1:
            return outputs[:1]
        return outputs

    # -------------------------------------------------------------------- compute
    def _inputs(self, action: Action) -> list[torch.Tensor] | None:
        if self._first(action.chunk):
            return None
        producer = self._local_neighbour(action.chunk, -1)
        if producer is not None:
            return self.local.pop(("forward", action.microbatch, action.chunk))
        return self._wait_for(("forward", action.microbatch, action.chunk))

    def _wait_for(self, key: tuple[str, int, int]) -> list[torch.Tensor]:
        """A received tensor list, once its transfer has completed."""
        handle, number, tensors = self.arrived.pop(key)
        if self.recorder is None:
            handle.wait_recv([number])
            return tensors
        start = self.recorder.now()
        handle.wait_recv([number])
        self.recorder.add(f"wait {key[0]} {key[1]}.{key[2]}", "wait", key[1], key[2], start,
                          self.recorder.now())  # fmt: skip
        return tensors

    def forward(self, action: Action) -> None:
        chunk, microbatch = action.chunk, action.microbatch
        call = self.call
        if microbatch == self.sync_at_forward.get(chunk):
            self._enable_sync(chunk)
        inputs = self._inputs(action)
        # Megatron hands set_input_tensor a list: [None] on the first stage.
        _wrapped_attr(call.chunks[chunk], "set_input_tensor")(
            inputs if inputs is not None else [None]
        )
        timer = self.x.timers("forward-compute")
        start = self.recorder.now() if self.recorder is not None else 0.0
        timer.start()
        with torch.no_grad() if call.forward_only else contextlib.nullcontext():
            output, loss_func = call.forward_step_func(call.iterators[chunk], call.chunks[chunk])
            outputs = _as_list(output)
            if self._last(chunk):
                outputs = [self._loss(output, loss_func)]
        timer.stop()
        self._record(action, start)
        self.stats.steps += 1
        if self._decoder(self.x.rank) and not self._last(chunk):
            assert inputs is not None
            outputs = [outputs[0], inputs[-1]]  # pass the encoder's output along
        self._hand_on(action, outputs, +1)
        if not call.forward_only:
            self.inputs[(microbatch, chunk)] = inputs
            self.outputs[(microbatch, chunk)] = outputs
            self._measure_activations()

    def _hand_on(self, action: Action, tensors: list[torch.Tensor], step: int) -> None:
        """Keep a step's result for the exchange that sends it, or for the next local chunk."""
        channel = "forward" if step > 0 else "backward"
        edge = self._first(action.chunk) if step < 0 else self._last(action.chunk)
        if edge:
            return
        consumer = self._local_neighbour(action.chunk, step)
        if consumer is None:
            self.to_send[(channel, action.microbatch, action.chunk)] = tensors
            return
        # A new leaf per tensor, as a receive would give: the consumer's backward stops there.
        handed = [
            t.detach().requires_grad_(step > 0 and not self.call.forward_only)
            if t.is_floating_point()
            else t.detach()
            for t in tensors
        ]
        self.local[(channel, action.microbatch, consumer)] = handed

    def _record(self, action: Action, start: float) -> None:
        if self.recorder is not None:
            self.recorder.add(
                str(action), action.kind, action.microbatch, action.chunk, start,
                self.recorder.now(),
            )  # fmt: skip

    def _loss(self, output: Any, loss_func: Callable[..., Any]) -> torch.Tensor:
        if self.call.collect_non_loss_data:
            self.store.append(loss_func(output, non_loss_data=True))
            return torch.zeros(())
        result = loss_func(output)
        if len(result) == 3:  # Megatron's (loss, num_tokens, loss_reduced): a per-token mean
            loss, num_tokens, reduced = result
            loss = loss / num_tokens
        else:
            loss, reduced = result
        self.store.append(reduced)
        return loss / self.call.num_microbatches  # type: ignore[no-any-return]

    def _output_grads(self, action: Action) -> list[torch.Tensor] | None:
        if self._last(action.chunk):
            return None
        if self._local_neighbour(action.chunk, +1) is not None:
            return self.local.pop(("backward", action.microbatch, action.chunk))
        return self._wait_for(("backward", action.microbatch, action.chunk))

    def backward(self, action: Action) -> None:
        chunk, microbatch = action.chunk, action.microbatch
        grads = self._output_grads(action)
        inputs = self.inputs.pop((microbatch, chunk))
        outputs = self.outputs.pop((microbatch, chunk))
        if microbatch == self.last_backward.get(chunk):
            self._enable_sync(chunk)
        timer = self.x.timers("backward-compute")
        start = self.recorder.now() if self.recorder is not None else 0.0
        timer.start()
        for tensor in inputs or []:
            if tensor.requires_grad:
                tensor.retain_grad()
        self._run_backward(outputs, grads)
        timer.stop()
        self._record(action, start)
        self.stats.steps += 1
        if not self._first(chunk):
            input_grads = [
                t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs or []
            ]
            if grads is not None and self._decoder(self.x.rank) and len(grads) > 1:
                # The encoder's output was passed along: its gradient comes back too.
                input_grads[-1] = input_grads[-1] + grads[1]
            self._hand_on(action, input_grads, -1)

    def backward_input(self, action: Action) -> None:
        """The input half of a split backward: the gradient the previous stage waits for.

        The stage's outputs and inputs stay stored (and counted) until the W step.
        """
        key = (action.microbatch, action.chunk)
        grads = self._output_grads(action)
        inputs = self.inputs[key] or []
        outputs = self.outputs[key]
        if grads is None and self.x.config.grad_scale_func is not None:
            outputs = [self.x.config.grad_scale_func(outputs[0])]
        timer = self.x.timers("backward-compute")
        start = self.recorder.now() if self.recorder is not None else 0.0
        timer.start()
        input_grads, self.deferred[key] = backward_input(
            outputs, grads, inputs, self._trainable(action.chunk)
        )
        timer.stop()
        self._record(action, start)
        self.stats.steps += 1
        if not self._first(action.chunk):
            sent = [
                g if g is not None else torch.zeros_like(t)
                for g, t in zip(input_grads, inputs, strict=True)
            ]
            self._hand_on(action, sent, -1)

    def _trainable(self, chunk: int) -> list[torch.Tensor]:
        """The chunk's parameters that take gradients (listed once per call)."""
        if chunk not in self.trainable:
            module = self.call.chunks[chunk]
            self.trainable[chunk] = [p for p in module.parameters() if p.requires_grad]
        return self.trainable[chunk]

    def backward_weight(self, action: Action) -> None:
        """The weight half: accumulate the parameters' gradients (through their hooks)."""
        key = (action.microbatch, action.chunk)
        del self.inputs[key], self.outputs[key]
        if action.microbatch == self.last_backward.get(action.chunk):
            self._enable_sync(action.chunk)
        timer = self.x.timers("backward-compute")
        start = self.recorder.now() if self.recorder is not None else 0.0
        timer.start()
        self.deferred.pop(key).run()
        timer.stop()
        self._record(action, start)
        self.stats.steps += 1

    def _run_backward(self, outputs: list[torch.Tensor], grads: list[torch.Tensor] | None) -> None:
        if grads is None:
            loss = outputs[0]
            if self.x.config.grad_scale_func is not None:
                loss = self.x.config.grad_scale_func(loss)
            custom_backward(loss, None)
            return
        passthrough = self._decoder(self.x.rank) and len(grads) > 1
        own = outputs[:1] if passthrough else outputs
        pairs = [(o, g) for o, g in zip(own, grads, strict=False) if o.requires_grad]
        if pairs:
            custom_backward([o for o, _ in pairs], [g for _, g in pairs])

    def _measure_activations(self) -> None:
        """Activations only grow with a forward (its inputs and outputs are then stored)."""
        stored = [
            t
            for tensors in (*self.outputs.values(), *(v for v in self.inputs.values() if v))
            for t in tensors
        ]
        stats = self.stats
        stats.peak_activations = max(stats.peak_activations, len(self.outputs))
        stats.peak_activation_bytes = max(stats.peak_activation_bytes, _storage_bytes(stored))

    def _measure_in_flight(self) -> None:
        """Sends in flight only grow with an exchange."""
        in_flight = [t for _, sent in self.pending.values() for t in sent]
        stats = self.stats
        stats.peak_in_flight_bytes = max(stats.peak_in_flight_bytes, _storage_bytes(in_flight))

    # -------------------------------------------------------------------- data-parallel sync
    @contextlib.contextmanager
    def sync_control(self) -> Iterator[None]:
        func = self.x.config.no_sync_func
        if func is None and all(_is_torch_ddp(chunk) for chunk in self.call.chunks):
            func = [cast("DistributedDataParallel", c).no_sync for c in self.call.chunks]
        if func is None or self.call.forward_only:
            yield
            return
        funcs: list[Callable[[], AbstractContextManager[Any]]] = (
            list(func) if isinstance(func, (list, tuple)) else [func] * len(self.call.chunks)  # type: ignore[list-item]
        )
        for chunk, make in enumerate(funcs):
            stack = contextlib.ExitStack()
            stack.enter_context(make())
            self.sync_stacks[chunk] = stack
        try:
            yield
        finally:
            for stack in self.sync_stacks.values():
                stack.close()

    def _enable_sync(self, chunk: int) -> None:
        """Leave no_sync before the last backward of `chunk`, so its gradients get reduced."""
        stack = self.sync_stacks.pop(chunk, None)
        if stack is not None:
            stack.close()

    def finish(self) -> None:
        for handle, _ in self.pending.values():
            handle.wait_send()
        self.pending.clear()
        assert not self.outputs, "every forward got its backward"
        assert not self.arrived, "every received tensor was used"
        assert not self.to_send, "every result that leaves the rank was sent"


def get_forward_backward_func(
    communicator: P2PCommunicator | None = None,
    *,
    vp_size: int | None = None,
    config: ScheduleConfig | None = None,
    plan: PlanLike | None = None,
) -> PipelineExecutor:
    """The function that runs one step's forward and backward passes, as Megatron's.

    Args:
        communicator: This rank's pipeline communicator; None for a single stage.
        vp_size: Model chunks per rank; above 1 selects interleaved 1F1B (the plan's, when a
            plan is given).
        config: Hidden size, schedule override, loss scaling, no_sync, timers.
        plan: A plan to run (a `Plan`, its text, or compute action lists) instead of the
            config's schedule; validated before anything is sent.

    Returns:
        A callable taking Megatron's keyword arguments (see `PipelineExecutor.__call__`);
        its ``stats`` describe the last call.
    """
    return PipelineExecutor(communicator, vp_size=vp_size, config=config, plan=plan)
