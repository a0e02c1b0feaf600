"""One microbatch through a chunk, counted byte by byte: the figures of a `StageMemory`.

`measure_stage` runs a chunk's forward and backward (plain, then split into ``I`` and ``W``)
as the executor runs them, under an `AllocationCounter`, and returns what the byte model
(`pp_schedules.planning`) needs to predict a schedule's memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pp_schedules.planning import StageMemory
from pp_schedules.runtime._allocation_counter import AllocationCounter
from pp_schedules.runtime._autograd import custom_backward, deallocate_output_tensor
from pp_schedules.runtime._split_backward import backward_input

__all__ = ["measure_stage"]


def measure_stage(
    forward: Callable[[torch.Tensor | None], torch.Tensor],
    given: torch.Tensor | None,
    params: Iterable[torch.Tensor],
    *,
    loss: bool = False,
) -> StageMemory:
    """Every byte one microbatch through a chunk (or part of one) holds, step by step.

    Counted by an `AllocationCounter` over a forward and a plain backward, then a forward
    and a split backward (``I``, then ``W``, as the zero-bubble schedules run it), as
    `pp_schedules.StageMemory` defines the figures. The chunk runs as the executor runs it:
    its input a fresh tensor (a receive's), its output's storage freed once sent, and the
    parameters' gradients added into existing tensors (as into pp-optim's gradient buffers,
    so only the transient gradient counts; existing ``.grad`` tensors are restored after).

    Args:
        forward: Runs the chunk's forward on its input (None for a first stage, which reads
            its own data) and returns its output, or with `loss` its scalar loss.
        given: An input as the previous stage would send it (its values do not matter; a
            copy that requires grad is used); None for a first stage.
        params: The chunk's parameters.
        loss: `forward` ends in the loss (the last stage): backward starts from it and
            nothing is sent.

    Returns:
        The figures; `parameters` is the number of elements of `params`.
    """
    trainable = [p for p in params if p.requires_grad]
    kept_grads = [p.grad for p in trainable]
    for param in trainable:
        param.grad = torch.zeros_like(param)
    try:
        plain = _counted_steps(forward, given, trainable, loss=loss, split=False)
        split = _counted_steps(forward, given, trainable, loss=loss, split=True)
    finally:
        for param, grad in zip(trainable, kept_grads, strict=True):
            param.grad = grad
    return dataclasses.replace(
        plain,
        input_transient_bytes=split.input_transient_bytes,
        deferred_bytes=split.deferred_bytes,
        weight_transient_bytes=split.weight_transient_bytes,
        weight_kept_bytes=split.weight_kept_bytes,
        keeps_output_grad=split.keeps_output_grad,
    )


def _counted_steps(
    forward: Callable[[torch.Tensor | None], torch.Tensor],
    given: torch.Tensor | None,
    params: list[torch.Tensor],
    *,
    loss: bool,
    split: bool,
) -> StageMemory:
    """One forward and backward (split into I and W with `split`), counted."""
    base = None if given is None else given.detach().clone().requires_grad_()
    counter = AllocationCounter()
    with counter.counting():
        received = None if base is None else base.clone()  # what a receive allocates
        received_bytes = 0 if received is None else received.untyped_storage().nbytes()
        output = forward(received)
        forward_peak = counter.take_peak() - received_bytes
        before = counter.live_bytes
        del received
        holds_input = base is not None and counter.live_bytes == before
        held_input = received_bytes if holds_input else 0
        output_bytes = 0 if loss else output.untyped_storage().nbytes()
        kept = counter.live_bytes - held_input
        grad = None if loss else torch.randn_like(output)  # what the next stage sends back
        if grad is not None:  # sent: the executor frees the output's storage
            deallocate_output_tensor(output, deallocate_pipeline_outputs=True)
        sent = 0 if grad is None else grad.nbytes + output.untyped_storage().nbytes()
        activation = counter.live_bytes - held_input - sent
        start = counter.live_bytes
        counter.take_peak()
        figures: dict[str, Any] = {}
        if split:
            figures = _split_steps(counter, (output, grad), base, params, start)
        else:
            custom_backward(output, grad)
            figures["backward_transient_bytes"] = max(counter.take_peak() - start, 0)
            made = base.grad if base is not None else None
            figures["input_grad_bytes"] = 0 if made is None else made.untyped_storage().nbytes()
    return StageMemory(
        parameters=sum(p.numel() for p in params),
        activation_bytes=max(activation, 0),
        output_bytes=output_bytes,
        forward_transient_bytes=max(forward_peak - kept, 0),
        holds_input=holds_input or base is None,
        **figures,
    )


def _split_steps(
    counter: AllocationCounter,
    root: tuple[torch.Tensor, torch.Tensor | None],
    base: torch.Tensor | None,
    params: list[torch.Tensor],
    start: int,
) -> dict[str, Any]:
    """Count an ``I`` and then a ``W`` (pp-schedules' split backward) from `start`.

    `root` is the output and the gradient it gets (None for a loss).
    """
    output, grad = root
    inputs = [] if base is None else [base]
    grads = None if grad is None else [grad]
    input_grads, weights = backward_input([output], grads, inputs, params)
    input_peak = counter.take_peak() - start
    made = sum(g.untyped_storage().nbytes() for g in input_grads if g is not None)
    deferred = counter.live_bytes - start - made
    captured = {t.untyped_storage().data_ptr() for ts in weights.captured.values()
                for t in ts if t is not None}  # fmt: skip
    keeps = grad is not None and grad.untyped_storage().data_ptr() in captured
    del input_grads
    weight_start = counter.live_bytes
    counter.take_peak()
    kept: list[int] = []
    weights.run(before_exit=lambda: kept.append(counter.live_bytes - weight_start))
    return {
        "input_grad_bytes": made,
        "input_transient_bytes": max(input_peak, 0),
        "deferred_bytes": max(deferred, 0),
        "weight_transient_bytes": max(counter.take_peak() - weight_start, 0),
        "weight_kept_bytes": max(kept[0] if kept else 0, 0),
        "keeps_output_grad": keeps,
    }
