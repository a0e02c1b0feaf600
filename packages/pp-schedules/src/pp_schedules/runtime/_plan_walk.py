"""One call's walk over a rank's lowered steps: the executor's per-call state.

`PlanWalk` runs this rank's steps of a validated plan in order. Each step goes through
`STEP_HANDLERS`, a table keyed by the step's kind (a compute kind, or `EXCHANGE`), as torch's
pipelining runtime dispatches its actions: a new action kind is one more entry. Each compute
step is one forward, backward, input-gradient or weight-gradient pass; each exchange is one
pp-comm call posting its sends and receives together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, cast

import torch

from pp_comm import P2PHandle, P2PMessage
from pp_schedules.planning import COMPUTE, Action, Exchange, Message, Step
from pp_schedules.runtime._autograd import (
    custom_backward,
    deallocate_output_tensor,
    is_torch_ddp,
    tensor_list,
)
from pp_schedules.runtime._memory_probe import storage_bytes
from pp_schedules.runtime._overlap import communicating, run_fb_step
from pp_schedules.runtime._split_backward import WeightGradients, backward_input
from pp_schedules.runtime._stages import Boundary
from pp_schedules.runtime._timeline import TimelineRecorder
from pp_schedules.runtime._walk_inputs import (
    CallArguments,
    PreparedPlan,
    RunStats,
    WalkHost,
    chunk_contract,
    with_grads,
    wrapped_attr,
)

__all__ = [
    "EXCHANGE",
    "STEP_HANDLERS",
    "Handler",
    "Key",
    "PlanWalk",
    "handler_key",
]

EXCHANGE = "exchange"
"""The handler key of an exchange step (its sends and receives, as one pp-comm call)."""


Key = tuple[int, int]  # (microbatch, chunk)


class PlanWalk:
    """One call's state on one rank: it walks the rank's lowered steps."""

    def __init__(self, executor: WalkHost, call: CallArguments, prepared: PreparedPlan) -> None:
        self.x = executor
        self.call = call
        self.plan = prepared.report.steps
        self.steps = self.plan[executor.rank]
        self.delivered = prepared.delivered
        self.placement = prepared.placement
        hidden = executor.config.hidden_size
        seq, batch = call.seq_and_batch
        # Megatron's (seq, batch, hidden), for chunks without contracts (`Boundary`).
        self.shape: tuple[int, ...] | None = None
        self.decoder_shape: tuple[int, ...] | None = None
        if hidden is not None and seq is not None and batch is not None:
            self.shape = (seq, batch, hidden)
            self.decoder_shape = (call.decoder_seq_length or seq, batch, hidden)
        self.split = executor.config.pipeline_model_parallel_split_rank
        self.inputs: dict[Key, list[torch.Tensor] | None] = {}
        self.outputs: dict[Key, list[torch.Tensor]] = {}
        # Tensors between a step and the exchange that moves them, by (channel, mb, chunk).
        self.arrived: dict[tuple[str, int, int], tuple[P2PHandle, int, list[torch.Tensor]]] = {}
        self.to_send: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        # Hand-overs between chunks of this rank (the turn of a V).
        self.local: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        # Exchanges with sends in flight: their handle and what they send.
        self.pending: dict[int, tuple[P2PHandle, list[torch.Tensor]]] = {}
        # Exchanges whose sends are delivered by the plan but whose batch (NCCL: sends and
        # receives complete together) still has a receive in `arrived`.
        self.overdue: set[int] = set()
        self.store: list[Any] = []
        self.num_tokens: torch.Tensor | None = None
        """With per-token loss, the tokens the call's microbatches counted (last stage); None
        until the first is counted (nothing is allocated without per-token loss)."""
        self.fb_mode = prepared.fb_mode
        """How F&B steps run ("sequential", "chunk" or "threads"; see `run_fb_step`)."""
        # A chunk's own overlap function backwards through torch's autograd, which needs
        # the outputs whole: they are not deallocated once sent.
        self.deallocate = executor.config.deallocate_pipeline_outputs and self.fb_mode != "chunk"
        self.stats = RunStats()
        self.recorder = TimelineRecorder(executor.rank) if executor.recording else None
        actions = [s.compute for s in self.steps if s.compute is not None]
        # Each chunk's last backward (or weight-gradient step) re-enables its gradient sync.
        self.last_backward = {a.chunk: a.microbatch for a in actions if a.kind in ("B", "W")}
        # Split backwards: what each W needs once its I has run.
        self.deferred: dict[Key, WeightGradients] = {}
        self.trainable: dict[int, list[torch.Tensor]] = {}
        self.sync_stacks: dict[int, contextlib.ExitStack] = {}
        # torch's DDP chunks leave no_sync before the forward of their last microbatch.
        self.sync_at_forward = {
            chunk: microbatch
            for chunk, microbatch in self.last_backward.items()
            if is_torch_ddp(call.chunks[chunk])
        }

    def walk(self) -> None:
        """Run every step of this rank in order, then complete the sends still in flight.

        With a memory probe, each compute step is followed by one sample labelled with its
        action (``F0.1``): the samples line up with the rank's compute steps in plan order.
        """
        probe = self.x.memory_probe
        recorder = self.x.recorder
        recorder.start_call(self.x.rank, self.plan)
        with self.sync_control():
            for index, step in enumerate(self.steps):
                if step.overlap:
                    continue  # run with the forward before it, as one F&B step
                recorder.begin(index, step)
                if self._fb_step(index):
                    self._run_fb_step(index)
                else:
                    kind = EXCHANGE if step.compute is None else step.compute.kind
                    STEP_HANDLERS[kind](self, index, step)
                recorder.end()
                for done in (index, index + 1) if self._fb_step(index) else (index,):
                    computed = self.steps[done].compute
                    if probe is not None and computed is not None:
                        probe.sample(str(computed))
                    for delivered in self.delivered.get(done, ()):
                        self._complete_sends(delivered)
        self.finish()

    def _fb_step(self, index: int) -> bool:
        """Whether step `index` is the forward of an F&B step (the next one its backward)."""
        following = index + 1
        return following < len(self.steps) and self.steps[following].overlap

    def _run_fb_step(self, index: int) -> None:
        forward, backward = self.steps[index].compute, self.steps[index + 1].compute
        assert forward is not None
        assert backward is not None
        run_fb_step(self, self.fb_mode, forward, backward)

    def _complete_sends(self, index: int) -> None:
        """Wait for the sends of exchange `index` (its receives are waited for by their users).

        On NCCL a batch's sends complete with its receives; while one of those is unused,
        waiting would wait for it earlier than the plan says, so the batch completes when
        that receive is used or at the end of the call.
        """
        handle, _ = self.pending.get(index, (None, None))
        if handle is None:
            return
        if not self.x.independent and any(h is handle for h, _, _ in self.arrived.values()):
            self.overdue.add(index)  # completed by `_wait_for` once that receive is used
            return
        self.overdue.discard(index)
        del self.pending[index]
        self.x.recorder.wait(("send", index))
        with communicating():
            handle.wait_send()
        self.x.recorder.waited()

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
        chunk = self.call.chunks[action.chunk]
        contract = chunk_contract(chunk, "input_boundary" if activations else "output_boundary")
        if contract is not None:  # the chunk's own: what it receives, or its outputs' gradients
            specs = contract.specs if activations else contract.grad_specs
            return P2PMessage(
                slot=message.slot,
                shapes=[None if self.x.exchanges_shapes else s.shape for s in specs],
                dtypes=[s.dtype for s in specs],
                requires_grad=activations and not self.call.forward_only,
                microbatch=action.microbatch,
                channel=message.channel,
            )
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
            elif message.channel == "forward" and self.deallocate:
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

    def _own_outputs(self, key: Key) -> list[torch.Tensor]:
        """The sent outputs whose storage may go: those this stage computed.

        Not the encoder output a decoder passes along, nor a tensor without an autograd node
        (an input passed on, an integer tensor); of several outputs under a contract, none
        (one may be saved for this stage's backward as the input of another).
        """
        outputs = self.outputs.get(key, [])
        if self._decoder(self.x.rank) and len(outputs) > 1:
            outputs = outputs[:1]
        elif len(outputs) > 1 and chunk_contract(self.call.chunks[key[1]], "output_boundary"):
            return []
        return [t for t in outputs if t.grad_fn is not None]

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
        self.x.recorder.wait(("recv", key))
        start = self.recorder.now() if self.recorder is not None else 0.0
        with communicating():  # the other half of an F&B step computes meanwhile
            handle.wait_recv([number])
        self.x.recorder.waited()
        for index in sorted(self.overdue):  # sends held back by this receive (NCCL)
            self._complete_sends(index)
        if self.recorder is not None:
            self.recorder.add(f"wait {key[0]} {key[1]}.{key[2]}", "wait", key[1], key[2], start,
                              self.recorder.now())  # fmt: skip
        return tensors

    def forward(self, action: Action) -> None:
        """Run a forward step and keep (or hand on) its output."""
        inputs = self.begin_forward(action)
        call, chunk = self.call, action.chunk
        timer = self.x.timers("forward-compute")
        start = self.recorder.now() if self.recorder is not None else 0.0
        timer.start()
        with torch.no_grad() if call.forward_only else contextlib.nullcontext():
            output, loss_func = call.forward_step_func(call.iterators[chunk], call.chunks[chunk])
            outputs = self.forward_outputs(action, output, loss_func)
        timer.stop()
        self.end_forward(action, inputs, outputs, start)

    def begin_forward(self, action: Action) -> list[torch.Tensor] | None:
        """A forward's inputs, received or handed over, set on its chunk."""
        chunk, call = action.chunk, self.call
        if action.microbatch == self.sync_at_forward.get(chunk):
            self._enable_sync(chunk)
        inputs = self._inputs(action)
        # Megatron hands set_input_tensor a list: [None] on the first stage.
        set_input = wrapped_attr(call.chunks[chunk], "set_input_tensor")
        set_input(inputs if inputs is not None else [None])
        return inputs

    def forward_outputs(
        self, action: Action, output: Any, loss_func: Callable[..., Any]
    ) -> list[torch.Tensor]:
        """What a forward's output stands for: the loss on the last stage, else its tensors."""
        chunk = self.call.chunks[action.chunk]
        if self._last(action.chunk):
            return [self._loss(output, loss_func)]
        if (contract := chunk_contract(chunk, "output_boundary")) is not None:
            outputs: list[torch.Tensor] = wrapped_attr(chunk, "flatten_output")(output)
            self._check_shapes(contract, outputs, action)
            return outputs
        return tensor_list(output)

    def end_forward(
        self,
        action: Action,
        inputs: list[torch.Tensor] | None,
        outputs: list[torch.Tensor],
        start: float,
    ) -> None:
        """Keep a forward's inputs and outputs for its backward and hand its outputs on."""
        chunk, microbatch, call = action.chunk, action.microbatch, self.call
        set_input = wrapped_attr(call.chunks[chunk], "set_input_tensor")
        if inputs is not None:
            # The chunk would keep the input (and, after backward, its gradient) until its
            # next forward, beyond the step; the executor holds it as long as it is needed.
            set_input([None])
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

    def _check_shapes(
        self, contract: Boundary, outputs: list[torch.Tensor], action: Action
    ) -> None:
        """Outputs of the contract's shapes, unless shapes travel with the data.

        Raises:
            ValueError: Naming both shapes and how to send varying ones.
        """
        found = [tuple(t.shape) for t in outputs]
        if not self.x.exchanges_shapes and found != contract.shapes:
            raise ValueError(
                f"virtual stage {self.placement.stages[self.x.rank][action.chunk]} returned "
                f"shapes {found} for microbatch {action.microbatch}, but its contract says "
                f"{contract.shapes}; for shapes that vary, send them with the data "
                "(CommConfig(variable_seq_lengths=True), resolve_schedule(..., "
                "exchanges_shapes=True))"
            )

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
        """The loss to backward, normalised as Megatron's ``forward_step_calc_loss`` does.

        ``(loss, num_tokens, reported)``: divided by the token count and the microbatch
        count, or with per-token loss left a sum and its count added to the call's total;
        ``(loss, reported)``: times the context-parallel size, over the microbatch count.

        Raises:
            ValueError: A result of another length, or of two under per-token loss.
        """
        if self.call.collect_non_loss_data:
            self.store.append(loss_func(output, non_loss_data=True))
            return torch.zeros(())
        config, microbatches = self.x.config, self.call.num_microbatches
        result = loss_func(output)
        length = len(result) if isinstance(result, (tuple, list)) else None
        if length == 3:  # Megatron's (loss, num_tokens, loss_reduced)
            loss, num_tokens, reduced = result
            if config.calculate_per_token_loss:
                self._count_tokens(num_tokens)
            else:
                loss = loss / _at_least_one(num_tokens) / microbatches
        elif length == 2 and not config.calculate_per_token_loss:
            loss, reduced = result
            loss = loss * config.context_parallel_size / microbatches
        else:
            raise _loss_result_error(result, length, config.calculate_per_token_loss)
        self.store.append(reduced)
        return loss  # type: ignore[no-any-return]

    def _count_tokens(self, num_tokens: Any) -> None:
        """Add a microbatch's token count to the call's total, on the count's device."""
        count = torch.as_tensor(num_tokens).detach().to(torch.float64).sum()
        self.num_tokens = count if self.num_tokens is None else self.num_tokens + count

    def _output_grads(self, action: Action) -> list[torch.Tensor] | None:
        if self._last(action.chunk):
            return None
        if self._local_neighbour(action.chunk, +1) is not None:
            return self.local.pop(("backward", action.microbatch, action.chunk))
        return self._wait_for(("backward", action.microbatch, action.chunk))

    def backward(self, action: Action) -> None:
        """Run a whole backward step and hand on its input gradients."""
        grads, inputs, outputs = self.begin_backward(action)
        timer = self.x.timers("backward-compute")
        start = self.recorder.now() if self.recorder is not None else 0.0
        timer.start()
        self._run_backward(outputs, grads)
        timer.stop()
        self.end_backward(action, inputs, grads, start)

    def begin_backward(
        self, action: Action
    ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None, list[torch.Tensor]]:
        """A backward's output gradients (None on the last stage), inputs and outputs."""
        chunk, microbatch = action.chunk, action.microbatch
        grads = self._output_grads(action)
        inputs = self.inputs.pop((microbatch, chunk))
        outputs = self.outputs.pop((microbatch, chunk))
        if microbatch == self.last_backward.get(chunk):
            self._enable_sync(chunk)
        for tensor in inputs or []:
            if tensor.requires_grad:
                tensor.retain_grad()
        return grads, inputs, outputs

    def end_backward(
        self,
        action: Action,
        inputs: list[torch.Tensor] | None,
        grads: list[torch.Tensor] | None,
        start: float,
    ) -> None:
        """Hand a backward's input gradients on (to the previous stage)."""
        chunk = action.chunk
        self._record(action, start)
        self.stats.steps += 1
        if not self._first(chunk):
            input_grads = [
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t in with_grads(inputs or [])
            ]
            for tensor in inputs or []:
                # The received input may outlive this step (its exchange's handle keeps it
                # until that exchange's sends complete); its gradient need not.
                tensor.grad = None
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
            outputs if grads is None else with_grads(outputs),
            grads,
            with_grads(inputs),
            self._trainable(action.chunk),
        )
        timer.stop()
        self._record(action, start)
        self.stats.steps += 1
        if not self._first(action.chunk):
            sent = [
                g if g is not None else torch.zeros_like(t)
                for g, t in zip(input_grads, with_grads(inputs), strict=True)
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
        loss, pairs = self.backward_roots(outputs, grads)
        if loss is not None:
            custom_backward(loss, None)
        elif pairs:
            custom_backward([o for o, _ in pairs], [g for _, g in pairs])

    def backward_roots(
        self, outputs: list[torch.Tensor], grads: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor | None, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Where a backward starts: the scaled loss on the last stage, else (output, grad)s."""
        if grads is None:
            loss = outputs[0]
            if self.x.config.grad_scale_func is not None:
                loss = self.x.config.grad_scale_func(loss)
            return loss, []
        passthrough = self._decoder(self.x.rank) and len(grads) > 1
        own = outputs[:1] if passthrough else with_grads(outputs)
        return None, [(o, g) for o, g in zip(own, grads, strict=False) if o.requires_grad]

    def _measure_activations(self) -> None:
        """Activations only grow with a forward (its inputs and outputs are then stored)."""
        stored = [
            t
            for tensors in (*self.outputs.values(), *(v for v in self.inputs.values() if v))
            for t in tensors
        ]
        stats = self.stats
        stats.peak_activations = max(stats.peak_activations, len(self.outputs))
        stats.peak_activation_bytes = max(stats.peak_activation_bytes, storage_bytes(stored))

    def _measure_in_flight(self) -> None:
        """Sends in flight only grow with an exchange."""
        in_flight = [t for _, sent in self.pending.values() for t in sent]
        stats = self.stats
        stats.peak_in_flight_bytes = max(stats.peak_in_flight_bytes, storage_bytes(in_flight))

    # -------------------------------------------------------------------- data-parallel sync
    @contextlib.contextmanager
    def sync_control(self) -> Iterator[None]:
        """Hold every chunk in no_sync for the call (each leaves at its last backward).

        Without a ``no_sync_func``, chunks that all have a ``no_sync`` (torch's, pp-optim's
        or Megatron's DDP) use their own.
        """
        func = self.x.config.no_sync_func
        owns = [getattr(chunk, "no_sync", None) for chunk in self.call.chunks]
        if func is None and all(callable(own) for own in owns):
            func = cast("list[Callable[[], AbstractContextManager[Any]]]", owns)
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
        """Complete the sends still in flight and check that nothing was left over."""
        for index, (handle, _) in self.pending.items():
            self.x.recorder.wait(("send", index))
            handle.wait_send()
        self.x.recorder.waited()
        self.pending.clear()
        self.overdue.clear()
        assert not self.outputs, "every forward got its backward"
        assert not self.arrived, "every received tensor was used"
        assert not self.to_send, "every result that leaves the rank was sent"


def _at_least_one(count: Any) -> Any:
    """A token count of at least 1 (a microbatch whose tokens are all masked divides by 1)."""
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def _loss_result_error(result: Any, length: int | None, per_token: bool) -> ValueError:
    """What a ``loss_func`` returned that the executor cannot take, and what it takes."""
    got = f"{length} values" if length is not None else type(result).__name__
    if per_token and length == 2:
        return ValueError(
            "calculate_per_token_loss needs loss_func to return 3 values, (loss_sum, "
            "num_tokens, reported): the loss summed over the microbatch's tokens and their "
            "count; it returned 2, (loss, reported). Return the sum and the count, or set "
            "calculate_per_token_loss=False"
        )
    return ValueError(
        f"loss_func returned {got}; it returns (loss, reported) or (loss, num_tokens, "
        "reported), as Megatron's loss functions do"
    )


Handler = Callable[[PlanWalk, int, Step], None]
"""Runs one step (with its index in the rank's steps) of a walk."""


def _compute(run: Callable[[PlanWalk, Action], None]) -> Handler:
    """The handler of a compute kind: `run` on the step's action."""

    def handle(walk: PlanWalk, index: int, step: Step) -> None:
        assert step.compute is not None
        run(walk, step.compute)

    return handle


def _exchange(walk: PlanWalk, index: int, step: Step) -> None:
    assert step.exchange is not None
    walk.exchange(index, step.exchange)


STEP_HANDLERS: Mapping[str, Handler] = {
    "F": _compute(PlanWalk.forward),
    "B": _compute(PlanWalk.backward),
    "I": _compute(PlanWalk.backward_input),
    "W": _compute(PlanWalk.backward_weight),
    EXCHANGE: _exchange,
}
"""What runs each lowered step, by `handler_key` of its kind."""


def handler_key(kind: str) -> str:
    """The `STEP_HANDLERS` key of an action kind: compute kinds their own, transfers `EXCHANGE`.

    Lowering gathers transfers (SEND_F, RECV_F, SEND_B, RECV_B) into exchanges.
    """
    return kind if kind in COMPUTE else EXCHANGE
