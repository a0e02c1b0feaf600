"""pp-tensor: Megatron-LM's tensor-parallel layers, mappings, cross entropy and RNG tracker.

- `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding` (`pp_tensor.layers`):
  each keeps its slice of the full weight an `InitMethod` fills, so the same seed gives the
  same full weights at any tensor-parallel size.
- The mappings (`pp_tensor.mappings`): copy to / reduce from / scatter to / gather from the
  tensor-parallel region, and the sequence-parallel scatter, gather and reduce-scatter.
- `vocab_parallel_cross_entropy` (`pp_tensor.cross_entropy`): the loss over vocab-split logits.
- `RNGStatesTracker` and `model_parallel_manual_seed` (`pp_tensor.random`): dropout that
  differs over tensor-parallel ranks where Megatron's does.
- `pp_tensor.utils`: sizes, vocabulary ranges and padding, shards, and the parameter
  attributes (`tensor_model_parallel`, `partition_dim`, `partition_stride`,
  `sequence_parallel`) that pp-optim's norms read.

Process groups come in as arguments (``tp_group``; None means no tensor parallelism);
nothing reads global state except `model_parallel_cuda_manual_seed` without a rank, which
says so.
"""

from importlib.metadata import version as _version

from pp_tensor.cross_entropy import vocab_parallel_cross_entropy
from pp_tensor.layers import (
    ColumnParallelLinear,
    InitMethod,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pp_tensor.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from pp_tensor.random import (
    MODEL_PARALLEL_RNG,
    CudaRNGStatesTracker,
    RNGStatesTracker,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
    model_parallel_seeds,
)
from pp_tensor.utils import (
    VocabUtility,
    copy_tensor_model_parallel_attributes,
    divide,
    join_shards,
    mark_sequence_parallel,
    pad_vocab_size,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    shard_of,
    split_tensor_along_last_dim,
    tp_rank,
    tp_size,
)

__version__ = _version("pp-tensor")

__all__ = [
    "MODEL_PARALLEL_RNG",
    "ColumnParallelLinear",
    "CudaRNGStatesTracker",
    "InitMethod",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabUtility",
    "__version__",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "divide",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "join_shards",
    "mark_sequence_parallel",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "model_parallel_seeds",
    "pad_vocab_size",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "shard_of",
    "split_tensor_along_last_dim",
    "tp_rank",
    "tp_size",
    "vocab_parallel_cross_entropy",
]
