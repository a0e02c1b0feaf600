"""pp-tensor: Megatron-LM's tensor-parallel layers, mappings, cross entropy and RNG tracker.

- `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding` (`pp_tensor.layers`):
  each keeps its slice of the full weight an `InitMethod` fills, so the same seed gives the
  same full weights at any tensor-parallel size.
- The mappings (`pp_tensor.mappings`): copy to / reduce from / scatter to / gather from the
  tensor-parallel region, and the sequence-parallel scatter, gather and reduce-scatter.
- `vocab_parallel_cross_entropy` (`pp_tensor.cross_entropy`): the loss over vocab-split logits.
- `linear_with_grad_accumulation_and_async_allreduce` (`pp_tensor.linear`): the layers'
  product, its input-gradient reduction overlapped with the weight gradient, optionally
  accumulated into pp-optim's ``main_grad``.
- The last-dimension and all-to-all mappings, `broadcast_data` (`pp_tensor.data`) and the
  1-D split and gather of `pp_tensor.utils`.
- `RNGStatesTracker` and `model_parallel_manual_seed` (`pp_tensor.random`): dropout that
  differs over tensor-parallel ranks where Megatron's does (data-, tensor- and
  expert-parallel states); `checkpoint` and `CheckpointWithoutOutput`
  (`pp_tensor.recompute`): recomputation that replays them.
- `context_parallel_attention` (`pp_tensor.context_parallel`): causal attention over a
  sequence split across a context-parallel group (a ring of passes, or an all-gather), with
  Megatron's load-balanced split (`split_for_context_parallel`, its inverse
  `join_context_parallel_parts`, `context_parallel_positions`) and document masks;
  `transformers_attention` / `register_transformers_attention`
  (`pp_tensor.transformers_attention`): the same as a Hugging Face transformers attention
  function (transformers imported only when registering).
- `pp_tensor.megatron`: Megatron's ``megatron.core.tensor_parallel``, names and signatures,
  over all of the above (groups left as None are read from pp-state's default state).
- `pp_tensor.utils`: sizes, vocabulary ranges and padding, shards, and the parameter
  attributes (`tensor_model_parallel`, `partition_dim`, `partition_stride`,
  `sequence_parallel`, `expert_tp`, `is_qkv`, `qkv_split_shapes`) that pp-optim's norms read.

Process groups come in as arguments (``tp_group``; None means no tensor parallelism);
nothing reads global state except `model_parallel_cuda_manual_seed` without a rank and the
`pp_tensor.megatron` facade, which say so.
"""

from importlib.metadata import version as _version

from pp_tensor.context_parallel import (
    CP_COMM_TYPES,
    context_parallel_attention,
    context_parallel_positions,
    join_context_parallel_parts,
    split_for_context_parallel,
)
from pp_tensor.cross_entropy import vocab_parallel_cross_entropy
from pp_tensor.data import broadcast_data
from pp_tensor.layers import (
    ColumnParallelLinear,
    InitMethod,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pp_tensor.linear import (
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from pp_tensor.mappings import (
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
from pp_tensor.random import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    CudaRNGStatesTracker,
    RNGStatesTracker,
    add_model_parallel_states,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
    model_parallel_seeds,
)
from pp_tensor.recompute import CheckpointWithoutOutput, CheckpointWithoutOutputManager, checkpoint
from pp_tensor.transformers_attention import (
    TRANSFORMERS_ATTENTION_NAME,
    register_transformers_attention,
    transformers_attention,
)
from pp_tensor.utils import (
    VocabUtility,
    copy_tensor_model_parallel_attributes,
    divide,
    gather_split_1d_tensor,
    join_shards,
    mark_sequence_parallel,
    pad_vocab_size,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    shard_of,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
    strided_shard_of,
    tp_rank,
    tp_size,
)

__version__ = _version("pp-tensor")

__all__ = [
    "CP_COMM_TYPES",
    "DATA_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    "MODEL_PARALLEL_RNG",
    "TRANSFORMERS_ATTENTION_NAME",
    "CheckpointWithoutOutput",
    "CheckpointWithoutOutputManager",
    "ColumnParallelLinear",
    "CudaRNGStatesTracker",
    "InitMethod",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabUtility",
    "__version__",
    "add_model_parallel_states",
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_to_all",
    "all_to_all_hp2sp",
    "all_to_all_sp2hp",
    "broadcast_data",
    "checkpoint",
    "context_parallel_attention",
    "context_parallel_positions",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "divide",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_split_1d_tensor",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_rng_tracker",
    "join_context_parallel_parts",
    "join_shards",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "mark_sequence_parallel",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "model_parallel_seeds",
    "pad_vocab_size",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "register_transformers_attention",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "shard_of",
    "split_for_context_parallel",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
    "strided_shard_of",
    "tp_rank",
    "tp_size",
    "transformers_attention",
    "vocab_parallel_cross_entropy",
]
