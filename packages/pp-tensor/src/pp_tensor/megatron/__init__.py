"""``megatron.core.tensor_parallel``, drop-in: Megatron's names and signatures over pp-tensor.

Porting Megatron code is replacing the import prefix::

    from pp_tensor.megatron import ColumnParallelLinear, RowParallelLinear
    from pp_tensor.megatron.model_parallel_config import ModelParallelConfig

The submodules mirror Megatron's (`layers`, `mappings`, `random`, `data`, `utils`,
`cross_entropy`, and `model_parallel_config` for ``megatron.core.model_parallel_config``).
Groups left as None are read from pp-state's default state
(`pp_state.parallel_state.initialize_model_parallel`), as Megatron reads ``parallel_state``.
The facade holds no arithmetic of its own: every name adapts its arguments and calls
pp-tensor, whose API keeps groups explicit. Megatron's ``__all__`` is here but for its
inference layers and generalized tensor parallelism (``gtp``), which pp does not have.
"""

from pp_tensor.megatron.cross_entropy import vocab_parallel_cross_entropy
from pp_tensor.megatron.data import broadcast_data
from pp_tensor.megatron.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from pp_tensor.megatron.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    all_to_all,
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from pp_tensor.megatron.random import (
    CheckpointWithoutOutput,
    checkpoint,
    convert_cuda_rng_state,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    is_graph_safe_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from pp_tensor.megatron.utils import (
    gather_split_1d_tensor,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
)

__all__ = [
    "CheckpointWithoutOutput",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_to_all",
    "all_to_all_hp2sp",
    "all_to_all_sp2hp",
    "broadcast_data",
    "checkpoint",
    "convert_cuda_rng_state",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_split_1d_tensor",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "is_graph_safe_cuda_rng_tracker",
    "linear_with_grad_accumulation_and_async_allreduce",
    "model_parallel_cuda_manual_seed",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
    "vocab_parallel_cross_entropy",
]
