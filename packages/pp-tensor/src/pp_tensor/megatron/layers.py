"""megatron.core.tensor_parallel.layers: Megatron's constructors over pp-tensor's layers.

Each layer is pp-tensor's (a subclass adding nothing to its computation): the constructor
reads Megatron's `ModelParallelConfig` and keywords and resolves a group left as None from the
default state (the expert-tensor-parallel group for ``is_expert``). What differs from
Megatron, and why:

- Weights are always built whole on the CPU from `init_method` and sliced (Megatron's
  ``use_cpu_initialization`` path), so a model has the same weights at every tensor-parallel
  size; ``use_cpu_initialization=False`` only places them on the current GPU.
- ``output_dtype`` other than the input's needs Transformer Engine's GEMM: refused.
- ``gradient_accumulation_fusion`` needs no extension: the weight gradient is added into
  ``main_grad`` by a matrix product in that buffer's dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pp_state.params import param_is_not_tensor_parallel_duplicate
from pp_state.process_groups_config import ProcessGroupCollection
from pp_tensor import layers as _pp
from pp_tensor import linear as _linear
from pp_tensor.linear import (
    LinearWithFrozenWeight,
    LinearWithGradAccumulationAndAsyncCommunication,
    check_linear_options,
)
from pp_tensor.megatron._groups import get_tensor_model_parallel_group_if_none
from pp_tensor.megatron.model_parallel_config import ModelParallelConfig
from pp_tensor.utils import (
    TENSOR_PARALLEL_ATTRIBUTE_DEFAULTS as _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS,
)
from pp_tensor.utils import (
    VocabUtility,
    copy_tensor_model_parallel_attributes,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    tp_size,
)

__all__ = [
    "_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS",
    "ColumnParallelLinear",
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabUtility",
    "copy_tensor_model_parallel_attributes",
    "get_tensor_model_parallel_group_if_none",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]

Group = dist.ProcessGroup | None


def linear_with_grad_accumulation_and_async_allreduce(  # noqa: PLR0917 - Megatron's signature
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: int | None = 0,
    tp_group: Group = None,
    gtp_remat_size: int = 1,
    output_dtype: torch.dtype | None = None,
    *,
    async_grad_allreduce: bool | None = None,
) -> torch.Tensor:
    """`pp_tensor.linear.linear_with_grad_accumulation_and_async_allreduce`.

    ``async_grad_allreduce`` is megatron-core 0.16.1's former name of `allreduce_dgrad`
    (keyword-only here: 0.20 put `tp_group` in its place); given, it wins, as it did there.
    """
    check_linear_options(gtp_remat_size, output_dtype, input.dtype)
    if async_grad_allreduce is not None:
        allreduce_dgrad = async_grad_allreduce
    return _linear.linear_with_grad_accumulation_and_async_allreduce(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        tp_group=get_tensor_model_parallel_group_if_none(tp_group),
    )


def linear_with_frozen_weight(  # noqa: PLR0917 - Megatron's signature
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: Group,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: None = None,
    gtp_remat_size: int = 1,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`pp_tensor.linear.linear_with_frozen_weight`."""
    check_linear_options(gtp_remat_size, output_dtype, input.dtype)
    return _linear.linear_with_frozen_weight(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        tp_group=get_tensor_model_parallel_group_if_none(tp_group),
    )


def _device(config: ModelParallelConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _expert_layout(config: ModelParallelConfig, group: Group, is_expert: bool) -> tuple[bool, bool]:
    """(explicit expert communication, the parameters live in the expert topology)."""
    expert_parallel = config.expert_model_parallel_size > 1
    explicit = is_expert and (tp_size(group) > 1 or expert_parallel)
    own_groups = is_expert and (
        expert_parallel or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
    )
    return explicit, own_groups


def _sequence_parallel(config: ModelParallelConfig, group: Group) -> bool:
    if config.sequence_parallel and tp_size(group) <= 1:
        warnings.warn(
            "sequence_parallel=True with tensor-parallel size 1: sequence parallelism is off",
            stacklevel=4,
        )
        return False
    return config.sequence_parallel


def _linear_keywords(
    config: ModelParallelConfig, tp_group: Group, is_expert: bool
) -> tuple[dict[str, Any], bool]:
    """pp-tensor's keywords a linear layer takes from Megatron's config and group.

    Also whether its parameters live in the expert topology.
    """
    group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
    explicit, own_groups = _expert_layout(config, group, is_expert)
    keywords = {
        "tp_group": group,
        "sequence_parallel": _sequence_parallel(config, group),
        "device": _device(config),
        "params_dtype": config.params_dtype,
        "perform_initialization": config.perform_initialization,
        "gradient_accumulation_fusion": config.gradient_accumulation_fusion,
        "explicit_expert_comm": explicit,
    }
    return keywords, own_groups


def _keep_megatron_fields(
    module: torch.nn.Module, config: ModelParallelConfig, is_expert: bool, own_groups: bool
) -> None:
    """Megatron's attributes of a built layer, and its parameters' ``allreduce`` marks."""
    fields = {"config": config, "is_expert": is_expert}
    fields["expert_parallel"] = config.expert_model_parallel_size > 1
    for name, value in fields.items():
        setattr(module, name, value)
    for param in (module.weight, module.bias):
        if isinstance(param, torch.nn.Parameter):
            param.allreduce = not own_groups  # type: ignore[attr-defined]


class ColumnParallelLinear(_pp.ColumnParallelLinear):
    """`pp_tensor.ColumnParallelLinear` built from Megatron's arguments.

    ``embedding_activation_buffer``, ``grad_output_buffer``, ``tp_comm_buffer_name``, ``name``
    and ``pg_collection`` are accepted and unused (their features are refused by the config).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable[[torch.Tensor], Any],
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: list[torch.Tensor] | None = None,
        grad_output_buffer: list[torch.Tensor] | None = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        tp_group: Group = None,
        name: str | None = None,
        output_dtype: torch.dtype | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        keywords, own_groups = _linear_keywords(config, tp_group, is_expert)
        super().__init__(
            input_size,
            output_size,
            init_method=init_method,
            bias=bias,
            gather_output=gather_output,
            skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=skip_weight_param_allocation,
            stride=stride,
            keep_master_weight_for_test=keep_master_weight_for_test,
            disable_grad_reduce=disable_grad_reduce,
            **keywords,
        )
        _keep_megatron_fields(self, config, is_expert, own_groups)
        self.output_dtype = output_dtype
        self.allreduce_dgrad = (
            tp_size(self.tp_group) > 1 and not self.sequence_parallel and not disable_grad_reduce
        )

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Megatron's forward: ``(output, bias or None)``."""
        check_linear_options(1, self.output_dtype, input_.dtype)
        return super().forward(input_, weight, runtime_gather_output)


class RowParallelLinear(_pp.RowParallelLinear):
    """`pp_tensor.RowParallelLinear` built from Megatron's arguments.

    ``tp_comm_buffer_name``, ``name`` and ``pg_collection`` are accepted and unused.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable[[torch.Tensor], Any],
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: Group = None,
        name: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        keywords, own_groups = _linear_keywords(config, tp_group, is_expert)
        super().__init__(
            input_size,
            output_size,
            init_method=init_method,
            bias=bias,
            input_is_parallel=input_is_parallel,
            skip_bias_add=skip_bias_add,
            stride=stride,
            keep_master_weight_for_test=keep_master_weight_for_test,
            **keywords,
        )
        _keep_megatron_fields(self, config, is_expert, own_groups)


class VocabParallelEmbedding(_pp.VocabParallelEmbedding):
    """`pp_tensor.VocabParallelEmbedding` built from Megatron's arguments.

    ``pg_collection`` is accepted and unused; ``config.deterministic_mode`` needs nothing
    (the lookup is the same either way on these devices).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Callable[[torch.Tensor], Any],
        reduce_scatter_embeddings: bool = False,
        config: ModelParallelConfig,
        tp_group: Group = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            tp_group=get_tensor_model_parallel_group_if_none(tp_group),
            init_method=init_method,
            reduce_scatter_embeddings=reduce_scatter_embeddings,
            device=_device(config),
            params_dtype=config.params_dtype,
            perform_initialization=config.perform_initialization,
        )
        self.config = config
        self.deterministic_mode = config.deterministic_mode
