"""The executor: runs any valid plan on real model chunks with pp-comm, Megatron-style.

`get_forward_backward_func` returns a callable with Megatron-LM's keyword arguments
(``forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
decoder_seq_length, forward_only, collect_non_loss_data``) and Megatron's meaning:
``set_input_tensor`` on each chunk, ``forward_step_func(data_iterator, model)`` returning
``(output, loss_func)``, the loss divided by the number of microbatches, loss scaling through
an injected ``grad_scale_func``, DDP gradient sync off for all but the last microbatch of each
chunk, outputs deallocated once sent (with the custom backward that allows it), and the list
of loss dicts returned on the last stage.

It runs a plan the way `validate` checks it: sends are posted as soon as their tensor exists
and completed in the background; a receive is posted and waited for right before the step that
needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.autograd import Variable

from pp_comm import NullTimers, P2PCommunicator, P2PHandle, Timers
from pp_schedules.actions import Action
from pp_schedules.generators import plan
from pp_schedules.validation import PlanReport, validate

__all__ = [
    "ForwardStepFunc",
    "PipelineExecutor",
    "RunStats",
    "ScheduleConfig",
    "custom_backward",
    "deallocate_output_tensor",
    "get_forward_backward_func",
]

ForwardStepFunc = Callable[..., tuple[Any, Callable[..., Any]]]
"""``forward_step_func(data_iterator, model_chunk) -> (output, loss_func)``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """What the executor needs besides the communicator (Megatron's ModelParallelConfig parts)."""

    hidden_size: int | None = None
    """Width of the activations between stages: they travel as (seq_length, micro_batch_size,
    hidden_size). None when the communicator exchanges shapes (variable_seq_lengths)."""

    schedule: str | None = None
    """A schedule name for `pp_schedules.plan`; by default no_pipelining for one stage,
    interleaved_1f1b with virtual stages, 1f1b otherwise."""

    microbatch_group_size_per_vp_stage: int | None = None
    """Interleaving group size (the pipeline size by default)."""

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
    virtual stages a list of one per chunk; left for the last microbatch of each chunk."""

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


def deallocate_output_tensor(output: torch.Tensor | Sequence[torch.Tensor] | None) -> None:
    """Replace an output's storage with one element, keeping its autograd node (Megatron's trick).

    Only the next stage needs the values; this stage's backward needs the graph, which
    `custom_backward` runs without checking the output's shape.
    """
    for tensor in _as_list(output):
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


def _wrapped_attr(module: torch.nn.Module, name: str) -> Any:
    """An attribute of a module or of what it wraps (DDP, Float16Module: ``.module``)."""
    current: Any = module
    while not hasattr(current, name) and hasattr(current, "module"):
        current = current.module
    return getattr(current, name)


class PipelineExecutor:
    """Runs a schedule's plan on this rank's model chunks; see `get_forward_backward_func`."""

    def __init__(
        self,
        communicator: P2PCommunicator | None,
        *,
        vp_size: int | None = None,
        config: ScheduleConfig | None = None,
    ) -> None:
        """Bind to a pipeline (None: a single stage) and a config."""
        self.communicator = communicator
        self.config = config or ScheduleConfig()
        self.pp_size = communicator.num_stages if communicator is not None else 1
        self.rank = communicator.stage if communicator is not None else 0
        self.vp_size = vp_size or 1
        self.schedule = self.config.schedule or (
            "no_pipelining"
            if self.pp_size == 1
            else "interleaved_1f1b"
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
        self.stats = RunStats()
        self._plans: dict[tuple[int, bool], PlanReport] = {}

    def plan_for(
        self, num_microbatches: int, forward_only: bool
    ) -> tuple[list[Action], PlanReport]:
        """This rank's actions and the validated plan (cached per microbatch count)."""
        key = (num_microbatches, forward_only)
        if key not in self._plans:
            actions = plan(
                self.schedule,
                pp_size=self.pp_size,
                num_microbatches=num_microbatches,
                vp_size=self.vp_size,
                microbatch_group_size_per_vp_stage=self.config.microbatch_group_size_per_vp_stage,
                forward_only=forward_only,
            )
            self._plans[key] = validate(
                actions,
                num_microbatches=num_microbatches,
                vp_size=self.vp_size,
                forward_only=forward_only,
            )
        report = self._plans[key]
        return [
            step.compute for step in report.steps[self.rank] if step.compute is not None
        ], report

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

        Returns:
            On the last stage, what each microbatch's ``loss_func`` reported (its loss dict, or
            with `collect_non_loss_data` and `forward_only` its non-loss data); elsewhere [].

        Raises:
            ValueError: The model chunks or data iterators do not match the virtual size, a
                single no_sync_func or shared iterator comes with virtual stages, or
                `collect_non_loss_data` comes without `forward_only`.
        """
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
        if collect_non_loss_data and not forward_only:
            raise ValueError(
                "collect_non_loss_data needs forward_only=True: there is no loss to backward"
            )
        actions, _ = self.plan_for(num_microbatches, forward_only)
        run = _Run(
            self,
            chunks,
            iterators,
            actions,
            num_microbatches=num_microbatches,
            seq_and_batch=(seq_length, micro_batch_size),
            decoder_seq_length=decoder_seq_length,
            forward_only=forward_only,
        )
        try:
            with run.sync_control():
                for action in actions:
                    if action.kind == "F":
                        run.forward(action, forward_step_func, collect_non_loss_data)
                    else:
                        run.backward(action)
            run.finish()
        except BaseException as error:
            # Sends of this step may still be pending; a later step would receive them.
            if self.communicator is not None:
                self.communicator.invalidate(f"a pipeline step failed: {type(error).__name__}")
            raise
        self.stats = run.stats
        return run.store


class _Run:
    """One call's state on one rank."""

    def __init__(
        self,
        executor: PipelineExecutor,
        chunks: list[torch.nn.Module],
        iterators: Sequence[Any],
        actions: Sequence[Action],
        *,
        num_microbatches: int,
        seq_and_batch: tuple[int, int],
        decoder_seq_length: int | None,
        forward_only: bool,
    ) -> None:
        self.x = executor
        self.chunks = chunks
        self.iterators = iterators
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        hidden = executor.config.hidden_size
        seq, batch = seq_and_batch
        self.shape: tuple[int, ...] | None = None if hidden is None else (seq, batch, hidden)
        self.decoder_shape: tuple[int, ...] | None = (
            None if hidden is None else (decoder_seq_length or seq, batch, hidden)
        )
        self.split = executor.config.pipeline_model_parallel_split_rank
        self.inputs: dict[tuple[int, int], list[torch.Tensor] | None] = {}
        self.outputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.pending: list[P2PHandle] = []
        self.store: list[Any] = []
        self.stats = RunStats()
        # Each chunk's last backward re-enables its gradient sync.
        self.last_backward = {a.chunk: a.microbatch for a in actions if a.kind == "B"}
        self.sync_stacks: dict[int, contextlib.ExitStack] = {}

    # -------------------------------------------------------------------- stage geometry
    def _virtual(self, chunk: int) -> int:
        return chunk * self.x.pp_size + self.x.rank

    def _first(self, chunk: int) -> bool:
        return self._virtual(chunk) == 0

    def _last(self, chunk: int) -> bool:
        return self._virtual(chunk) == self.x.pp_size * self.x.vp_size - 1

    def _decoder(self, stage: int) -> bool:
        """Whether `stage` runs the decoder of an encoder-decoder model."""
        return self.split is not None and stage >= self.split

    def _shapes_sent_by(self, stage: int) -> list[tuple[int, ...] | None]:
        """What `stage` sends on (Megatron's get_tensor_shapes); decoders add encoder output."""
        if self._decoder(stage):
            return [self.decoder_shape, self.shape]
        return [self.shape]

    # -------------------------------------------------------------------- communication
    def _receive(self, from_prev: bool, microbatch: int) -> list[torch.Tensor]:
        comm = self.x.communicator
        assert comm is not None
        stage = self.x.rank
        received_prev, received_next, _ = comm.communicate(
            recv_prev=from_prev,
            recv_next=not from_prev,
            tensor_shapes=self._shapes_sent_by(stage - 1 if from_prev else stage),
            operation="recv_forward" if from_prev else "recv_backward",
            microbatch=microbatch,
            requires_grad=from_prev and not self.forward_only,
        )
        received = received_prev if from_prev else received_next
        return _as_list(received)

    def _send(
        self, to_next: bool, tensors: list[torch.Tensor], microbatch: int, free: list[torch.Tensor]
    ) -> None:
        comm = self.x.communicator
        assert comm is not None
        # The transfer reads through detached aliases, which keep the storage alive until the
        # send completes; the stage's own tensors can let go of it at once (Megatron frees
        # outputs right after sending; only their autograd nodes are needed for backward).
        payload = [t.detach() for t in tensors]
        _, _, handle = comm.communicate(
            tensor_send_next=payload if to_next else None,
            tensor_send_prev=None if to_next else payload,
            async_op=True,
            operation="send_forward" if to_next else "send_backward",
            microbatch=microbatch,
        )
        deallocate_output_tensor(free)
        self.pending.append(handle)
        self._retire_sends(block=False)

    def _retire_sends(self, block: bool) -> None:
        """Drop sends that completed (all of them when `block`), releasing their buffers."""
        still: list[P2PHandle] = []
        for handle in self.pending:
            if block or handle.is_completed():
                handle.wait()
            else:
                still.append(handle)
        self.pending = still

    # -------------------------------------------------------------------- compute
    def forward(
        self, action: Action, forward_step_func: ForwardStepFunc, collect_non_loss_data: bool
    ) -> None:
        chunk, microbatch = action.chunk, action.microbatch
        inputs = None if self._first(chunk) else self._receive(True, microbatch)
        # Megatron hands set_input_tensor a list: [None] on the first stage.
        _wrapped_attr(self.chunks[chunk], "set_input_tensor")(
            inputs if inputs is not None else [None]
        )
        timer = self.x.timers("forward-compute")
        timer.start()
        with torch.no_grad() if self.forward_only else contextlib.nullcontext():
            output, loss_func = forward_step_func(self.iterators[chunk], self.chunks[chunk])
            outputs = _as_list(output)
            if self._last(chunk):
                outputs = [self._loss(output, loss_func, collect_non_loss_data)]
        timer.stop()
        self.stats.steps += 1
        own = list(outputs)
        if self._decoder(self.x.rank) and not self._last(chunk):
            assert inputs is not None
            outputs = [outputs[0], inputs[-1]]  # pass the encoder's output along
        if not self._last(chunk):
            freed = own if self.x.config.deallocate_pipeline_outputs else []
            self._send(True, outputs, microbatch, free=freed)
        if not self.forward_only:
            self.inputs[(microbatch, chunk)] = inputs
            self.outputs[(microbatch, chunk)] = outputs
            self._measure()

    def _loss(
        self, output: Any, loss_func: Callable[..., Any], collect_non_loss_data: bool
    ) -> torch.Tensor:
        if collect_non_loss_data:
            self.store.append(loss_func(output, non_loss_data=True))
            return torch.zeros(())
        result = loss_func(output)
        if len(result) == 3:  # Megatron's (loss, num_tokens, loss_reduced): a per-token mean
            loss, num_tokens, reduced = result
            loss = loss / num_tokens
        else:
            loss, reduced = result
        self.store.append(reduced)
        return loss / self.num_microbatches  # type: ignore[no-any-return]

    def backward(self, action: Action) -> None:
        chunk, microbatch = action.chunk, action.microbatch
        grads = None if self._last(chunk) else self._receive(False, microbatch)
        inputs = self.inputs.pop((microbatch, chunk))
        outputs = self.outputs.pop((microbatch, chunk))
        if microbatch == self.last_backward.get(chunk):
            self._enable_sync(chunk)
        timer = self.x.timers("backward-compute")
        timer.start()
        for tensor in inputs or []:
            tensor.retain_grad()
        if grads is None:
            loss = outputs[0]
            if self.x.config.grad_scale_func is not None:
                loss = self.x.config.grad_scale_func(loss)
            custom_backward(loss, None)
        else:
            passthrough = self._decoder(self.x.rank) and len(grads) > 1
            own = outputs[:1] if passthrough else outputs
            pairs = [(o, g) for o, g in zip(own, grads, strict=False) if o.requires_grad]
            if pairs:
                custom_backward([o for o, _ in pairs], [g for _, g in pairs])
        timer.stop()
        self.stats.steps += 1
        if not self._first(chunk):
            input_grads = [
                t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs or []
            ]
            if grads is not None and self._decoder(self.x.rank) and len(grads) > 1:
                # The encoder's output was passed along: its gradient comes back too.
                input_grads[-1] = input_grads[-1] + grads[1]
            self._send(False, input_grads, microbatch, free=[])
        self._measure()

    def _measure(self) -> None:
        stored = [
            t
            for tensors in (*self.outputs.values(), *(v for v in self.inputs.values() if v))
            for t in tensors
        ]
        in_flight = [t for handle in self.pending for t in handle.tensors()]
        stats = self.stats
        stats.peak_activations = max(stats.peak_activations, len(self.outputs))
        stats.peak_activation_bytes = max(stats.peak_activation_bytes, _storage_bytes(stored))
        stats.peak_in_flight_bytes = max(stats.peak_in_flight_bytes, _storage_bytes(in_flight))

    # -------------------------------------------------------------------- data-parallel sync
    @contextlib.contextmanager
    def sync_control(self) -> Iterator[None]:
        func = self.x.config.no_sync_func
        if func is None or self.forward_only:
            yield
            return
        funcs: list[Callable[[], AbstractContextManager[Any]]] = (
            list(func) if isinstance(func, (list, tuple)) else [func] * len(self.chunks)  # type: ignore[list-item]
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
        self._retire_sends(block=True)
        assert not self.outputs, "every forward got its backward"


def get_forward_backward_func(
    communicator: P2PCommunicator | None = None,
    *,
    vp_size: int | None = None,
    config: ScheduleConfig | None = None,
) -> PipelineExecutor:
    """The function that runs one step's forward and backward passes, as Megatron's.

    Args:
        communicator: This rank's pipeline communicator; None for a single stage.
        vp_size: Model chunks per rank; above 1 selects interleaved 1F1B.
        config: Hidden size, schedule override, loss scaling, no_sync, timers.

    Returns:
        A callable taking Megatron's keyword arguments (see `PipelineExecutor.__call__`);
        its ``stats`` describe the last call.
    """
    return PipelineExecutor(communicator, vp_size=vp_size, config=config)
