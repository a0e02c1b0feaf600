"""The tensor-parallel linear product with its communication inside the autograd function.

`linear_with_grad_accumulation_and_async_allreduce` is Megatron's: the forward all-gathers the
sequence under sequence parallelism; the backward starts the all-reduce (or, under sequence
parallelism, the reduce-scatter) of the input gradient before it computes the weight gradient,
so the two overlap (an asynchronous collective: NCCL's stream, gloo's worker thread), and can
add the weight gradient straight into the parameter's ``main_grad`` (pp-optim's contiguous grad
buffer) instead of returning it (``gradient_accumulation_fusion``). `linear_with_frozen_weight`
is the same product for a weight that gets no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's own convention

from pp_state.collectives import collective
from pp_tensor.mappings import gather_from_sequence_parallel_region
from pp_tensor.utils import (
    PendingCollective,
    start_all_gather_first,
    start_reduce_scatter_first,
    tp_size,
)

__all__ = [
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "check_linear_options",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
]

Group = dist.ProcessGroup | None


def _check_flags(allreduce_dgrad: bool, sequence_parallel: bool) -> None:
    if allreduce_dgrad and sequence_parallel:
        raise ValueError(
            "allreduce_dgrad=True and sequence_parallel=True exclude each other: under "
            "sequence parallelism the input gradient is reduce-scattered, not all-reduced"
        )


def check_linear_options(
    gtp_remat_size: int, output_dtype: torch.dtype | None, input_dtype: torch.dtype
) -> None:
    """Refuses megatron-core 0.20's linear options pp has no feature for.

    Raises:
        ValueError: `gtp_remat_size` other than 1, or `output_dtype` other than None or
            `input_dtype` (a mixed-dtype GEMM is Transformer Engine's).
    """
    if gtp_remat_size != 1:
        raise ValueError(
            f"gtp_remat_size={gtp_remat_size}: pp has no generalized tensor parallelism; use 1"
        )
    if output_dtype is not None and output_dtype != input_dtype:
        raise ValueError(
            f"output_dtype={output_dtype} differs from the input's {input_dtype}: that needs "
            "Transformer Engine's GEMM, which pp does not use; leave output_dtype None"
        )


def _start_input_grad_reduction(
    grad_input: torch.Tensor, group: dist.ProcessGroup, sequence_parallel: bool
) -> PendingCollective:
    """Starts the input gradient's all-reduce (sequence parallelism: reduce-scatter).

    `grad_input` is the backward's own tensor: the sum may go into it.
    """
    if sequence_parallel:
        operation = "sequence-parallel reduce-scatter (linear input gradient)"
        return start_reduce_scatter_first(grad_input, group, operation, reuse_input=True)
    return PendingCollective(
        "tensor-parallel all-reduce (linear input gradient)",
        group,
        lambda: dist.all_reduce(grad_input, group=group, async_op=True),
        lambda: grad_input,
    )


_GATHER_INPUT = "sequence-parallel all-gather (linear input)"


def _weight_grad(
    weight: torch.Tensor,
    grad_output: torch.Tensor,
    total_input: torch.Tensor,
    fusion: bool,
    main_grad: torch.Tensor | None,
) -> torch.Tensor | None:
    grad_2d = grad_output.reshape(-1, grad_output.size(-1))
    input_2d = total_input.reshape(-1, total_input.size(-1))
    if not fusion or main_grad is None:
        return grad_2d.t().matmul(input_2d)
    # Accumulated in the buffer's dtype (fp32 for a bf16 model), as Megatron's fused kernel.
    main_grad.addmm_(grad_2d.t().to(main_grad.dtype), input_2d.to(main_grad.dtype))
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # A grad buffer that watches gradients (overlap_grad_reduce) still sees one arrive; the
    # flag tells it the value is already in main_grad.
    weight.grad_added_to_main_grad = True
    return torch.zeros(main_grad.shape, dtype=total_input.dtype, device=total_input.device)


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``input @ weight.T + bias`` with the communication of tensor and sequence parallelism.

    Forward arguments (Megatron's order): input, weight, bias, gradient_accumulation_fusion,
    allreduce_dgrad, sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group.
    """

    @staticmethod
    def forward(  # noqa: PLR0917 - Megatron's signature
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        grad_output_buffer: list[torch.Tensor] | None,
        wgrad_deferral_limit: int | None,
        tp_group: Group,
        gtp_remat_size: int = 1,
        output_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The product; the input's sequence gathered first under sequence parallelism.

        `gtp_remat_size` and `output_dtype` (megatron-core 0.20's) must stay 1 and None or the
        input's dtype: pp has no generalized tensor parallelism and no mixed-dtype GEMM.
        """
        check_linear_options(gtp_remat_size, output_dtype, input.dtype)
        ctx.save_for_backward(input, weight)
        ctx.main_grad = getattr(weight, "main_grad", None) if gradient_accumulation_fusion else None
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad and tp_size(tp_group) > 1
        ctx.sequence_parallel = sequence_parallel and tp_size(tp_group) > 1
        ctx.grad_output_buffer = grad_output_buffer
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.tp_group = tp_group
        total_input = input
        if ctx.sequence_parallel:
            assert tp_group is not None  # sequence parallelism needs a group of 2 or more
            total_input = start_all_gather_first(input, tp_group, _GATHER_INPUT).wait()
        return F.linear(total_input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        """Input gradient reduced while the weight gradient is computed."""
        input, weight = ctx.saved_tensors
        group = ctx.tp_group
        buffer = ctx.grad_output_buffer
        wgrad_compute = True
        if buffer is not None and (
            not ctx.wgrad_deferral_limit or len(buffer) < ctx.wgrad_deferral_limit
        ):
            buffer.append(grad_output)  # the caller computes this weight gradient later
            wgrad_compute = False
        gathering = None
        if ctx.sequence_parallel and wgrad_compute:
            gathering = start_all_gather_first(input, group, _GATHER_INPUT)
        grad_input = grad_output.matmul(weight)
        total_input = input if gathering is None else gathering.wait()
        reducing = None
        if ctx.allreduce_dgrad or ctx.sequence_parallel:
            reducing = _start_input_grad_reduction(grad_input, group, ctx.sequence_parallel)
        grad_weight = None
        if wgrad_compute:  # overlaps the input gradient's reduction
            grad_weight = _weight_grad(
                weight, grad_output, total_input, ctx.gradient_accumulation_fusion, ctx.main_grad
            )
        grad_bias = (
            grad_output.reshape(-1, grad_output.size(-1)).sum(dim=0) if ctx.use_bias else None
        )
        if reducing is not None:
            grad_input = reducing.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(  # noqa: PLR0917 - Megatron's signature
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: int | None = 0,
    *,
    tp_group: Group,
) -> torch.Tensor:
    """The linear product of a tensor-parallel layer, its communication overlapped.

    Args:
        input: ``[..., in]``; under sequence parallelism this rank's part of the sequence
            (the first dimension), all-gathered before the product.
        weight: ``[out, in]``.
        bias: ``[out]`` or None.
        gradient_accumulation_fusion: Add the weight gradient into ``weight.main_grad``
            (pp-optim's grad buffer) instead of returning it; a weight without ``main_grad``
            gets its gradient the usual way.
        allreduce_dgrad: All-reduce the input gradient over `tp_group` (a column-parallel
            layer's input), overlapped with the weight gradient.
        sequence_parallel: Gather the input's sequence; reduce-scatter its gradient.
        grad_output_buffer: Collect the output gradients here instead of computing the weight
            gradient (Megatron's deferred embedding weight gradient).
        wgrad_deferral_limit: How many to collect before computing again (0: all).
        tp_group: The tensor-parallel group (None: no communication).

    Raises:
        ValueError: Both `allreduce_dgrad` and `sequence_parallel`.
    """
    _check_flags(allreduce_dgrad, sequence_parallel)
    out: torch.Tensor = LinearWithGradAccumulationAndAsyncCommunication.apply(  # type: ignore[no-untyped-call]
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        tp_group,
    )
    return out


class LinearWithFrozenWeight(torch.autograd.Function):
    """``input @ weight.T + bias`` that computes no weight gradient.

    The input gradient is all-reduced over the group when asked (Megatron's order: input,
    weight, bias,
    allreduce_dgrad, tp_group).
    """

    @staticmethod
    def forward(  # noqa: PLR0917 - Megatron's signature
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        allreduce_dgrad: bool,
        tp_group: Group,
        output_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The product, keeping only the weight (`output_dtype`: None or the input's)."""
        check_linear_options(1, output_dtype, input.dtype)
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad = allreduce_dgrad and tp_size(tp_group) > 1
        ctx.tp_group = tp_group
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        """The input gradient alone."""
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            with collective(
                "tensor-parallel all-reduce (frozen linear input gradient)", group=ctx.tp_group
            ):
                dist.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None, None


def linear_with_frozen_weight(  # noqa: PLR0917 - Megatron's signature
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: int | None = None,
    *,
    tp_group: Group,
) -> torch.Tensor:
    """The product of `linear_with_grad_accumulation_and_async_allreduce`, weight frozen.

    For a weight that gets no gradient: the forward keeps only the weight, the backward
    computes only the input gradient (the bias, if any, gets none either).

    `gradient_accumulation_fusion` is accepted for the same signature and unused;
    `grad_output_buffer` and `wgrad_deferral_limit` must stay None.

    Raises:
        ValueError: Both `allreduce_dgrad` and `sequence_parallel`, or a buffer or limit given.
    """
    del gradient_accumulation_fusion  # no weight gradient to accumulate
    _check_flags(allreduce_dgrad, sequence_parallel)
    if grad_output_buffer is not None or wgrad_deferral_limit is not None:
        raise ValueError(
            "linear_with_frozen_weight computes no weight gradient: grad_output_buffer and "
            "wgrad_deferral_limit must be None"
        )
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tp_group=tp_group)
    out: torch.Tensor = LinearWithFrozenWeight.apply(  # type: ignore[no-untyped-call]
        input, weight, bias, allreduce_dgrad, tp_group
    )
    return out
