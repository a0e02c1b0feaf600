"""Autograd helpers of the executor: Megatron's output deallocation and torch-DDP's order.

`deallocate_output_tensor` frees a sent output's storage and `custom_backward` runs the
backward that such an output would fail in torch's own (its shape no longer matches); both
keep Megatron's signatures. `check_torch_ddp_order` refuses a plan that torch's
``DistributedDataParallel`` cannot reduce, before anything runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from pp_schedules.planning import Action

__all__ = [
    "check_torch_ddp_order",
    "custom_backward",
    "deallocate_output_tensor",
    "is_torch_ddp",
    "tensor_list",
]


def tensor_list(value: Any) -> list[torch.Tensor]:
    """`value` as a list of tensors: none for None, one for a tensor, the non-None ones else."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in value if v is not None]


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
    for tensor in tensor_list(out):
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


def is_torch_ddp(module: torch.nn.Module) -> bool:
    """Whether `module` is torch's own ``DistributedDataParallel`` (it decides at forward)."""
    return isinstance(module, DistributedDataParallel)


def check_torch_ddp_order(chunks: Sequence[torch.nn.Module], actions: Sequence[Action]) -> None:
    """Refuse a plan that torch's DDP cannot reduce: it decides at forward time.

    A chunk wrapped in ``torch.nn.parallel.DistributedDataParallel`` reduces its gradients in
    the backward that follows its latest forward, so each of its forwards must be followed by
    that microbatch's backward (B, or I and W) before the next forward or any other backward.

    Raises:
        ValueError: Naming the chunk, the microbatches and what to use instead.
    """
    for chunk, module in enumerate(chunks):
        if not is_torch_ddp(module):
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
