"""Building an optimizer from `OptimizerConfig`: parameter groups, inner optimizer, scaler, wrapper.

`get_megatron_optimizer` picks the wrapper as Megatron does: `DistributedOptimizer` when the
model chunks are `DistributedDataParallel` with ``use_distributed_optimizer``, else
`Float16OptimizerWithFloat16Params` for fp16/bf16 and `FP32Optimizer` for fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pp_optim.distrib_optimizer import DistributedOptimizer
from pp_optim.grad_buffer import DistributedDataParallel
from pp_optim.loss_scaling import ConstantGradScaler, DynamicGradScaler, GradScaler
from pp_optim.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    OptimizerConfig,
)

if TYPE_CHECKING:
    from pp_state import ParallelState

__all__ = ["get_megatron_optimizer", "get_param_groups"]


def get_param_groups(model_chunks: list[torch.nn.Module]) -> list[dict[str, Any]]:
    """Megatron's parameter groups: no weight decay for biases and 1-D parameters (norms).

    Returns:
        Up to two torch param groups, each with a ``wd_mult`` (1.0 or 0.0) and an
        ``lr_mult`` of 1.0 that `OptimizerParamScheduler` applies, and Megatron's
        ``default_config=True`` (both follow the default schedule), which
        `get_canonical_lr_for_logging` looks for.
    """
    decayed: list[torch.nn.Parameter] = []
    not_decayed: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            no_decay = name.endswith(".bias") or param.dim() == 1
            (not_decayed if no_decay else decayed).append(param)
    groups = [
        {"params": params, "wd_mult": wd_mult, "lr_mult": 1.0, "default_config": True}
        for params, wd_mult in ((decayed, 1.0), (not_decayed, 0.0))
        if params
    ]
    if not groups:
        raise ValueError("the model chunks have no trainable parameters")
    return groups


def _inner_optimizer(
    config: OptimizerConfig, groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """The torch optimizer `config` names (Megatron's adam is AdamW), over `groups`."""
    if config.optimizer == "adam":
        return torch.optim.AdamW(
            groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
        )
    return torch.optim.SGD(
        groups, lr=config.lr, weight_decay=config.weight_decay, momentum=config.sgd_momentum
    )


def _grad_scaler(config: OptimizerConfig) -> GradScaler | None:
    """A constant scale if `loss_scale` is set, Megatron's dynamic one for fp16, else none."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: list[torch.nn.Module],
    *,
    parallel_state: ParallelState | None = None,
    grad_stats_group: dist.ProcessGroup | None = None,
    tensor_parallel_rank: int = 0,
) -> MegatronOptimizer:
    """Builds the inner optimizer, the loss scaler and the wrapper that `config` describes.

    Args:
        config: Optimizer, precision and clipping.
        model_chunks: This rank's model chunks (one per virtual pipeline stage), already in
            their training dtype.
        parallel_state: Where the model-parallel group and the tensor-parallel rank come
            from; give either this or the two arguments below.
        grad_stats_group: The model-parallel group (see `MegatronOptimizer`); None, without
            `parallel_state`: this process alone.
        tensor_parallel_rank: This rank's position in its tensor-parallel group.

    Returns:
        `DistributedOptimizer` when every chunk is a `DistributedDataParallel` with
        ``use_distributed_optimizer`` (sharded over the chunks' data-parallel group), else
        `Float16OptimizerWithFloat16Params` for fp16/bf16, else `FP32Optimizer`.

    Raises:
        ValueError: Both `parallel_state` and `grad_stats_group` or `tensor_parallel_rank`,
            or no trainable parameters.
    """
    if parallel_state is not None:
        if grad_stats_group is not None or tensor_parallel_rank:
            raise ValueError(
                "give parallel_state or grad_stats_group/tensor_parallel_rank, not both"
            )
        grad_stats_group = parallel_state.group("mp")
        tensor_parallel_rank = parallel_state.group_rank("tp")
    inner = _inner_optimizer(config, get_param_groups(model_chunks))
    scaler = _grad_scaler(config)
    if _uses_distributed_optimizer(model_chunks):
        return DistributedOptimizer(
            inner,
            config,
            scaler,
            model_chunks=model_chunks,
            grad_stats_group=grad_stats_group,
            tensor_parallel_rank=tensor_parallel_rank,
        )
    wrapper = Float16OptimizerWithFloat16Params if config.fp16 or config.bf16 else FP32Optimizer
    return wrapper(
        inner,
        config,
        scaler,
        grad_stats_group=grad_stats_group,
        tensor_parallel_rank=tensor_parallel_rank,
    )


def _uses_distributed_optimizer(model_chunks: list[torch.nn.Module]) -> bool:
    flags = {
        isinstance(chunk, DistributedDataParallel) and chunk.config.use_distributed_optimizer
        for chunk in model_chunks
    }
    if len(flags) > 1:
        raise ValueError(
            "some model chunks use the distributed optimizer and some do not; wrap every"
            " chunk with the same DDPConfig(use_distributed_optimizer=...)"
        )
    return flags == {True}
