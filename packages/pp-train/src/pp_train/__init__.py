"""pp-train: the training loop, logging, checkpoints and data, as a library.

Composed from the four lower layers: process groups (pp-state), p2p (pp-comm), schedules
(pp-schedules) and optimizer pieces (pp-optim). Use the pieces (`setup_model_and_optimizer`,
`train_step`, `evaluate`, `train`, `save_checkpoint` / `load_checkpoint`, `TrainingLogger`) in a
loop of your own. The bundled GPT, its corpus and the ``pp-train`` command are an application
of the library, in `pp_train.app` (``torchrun --nproc-per-node N -m pp_train``).
"""

from importlib.metadata import version as _version

from pp_train.arguments import (
    CheckpointArgs,
    LoggingArgs,
    LRScheduleArgs,
    ModelArgs,
    ParallelArgs,
    PretrainConfig,
    TrainingArgs,
    add_pretrain_flags,
    pretrain_config_from_args,
)
from pp_train.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    checkpoint_path,
    get_rng_state,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
    set_rng_state,
)
from pp_train.context_parallel import get_batch_on_this_cp_rank
from pp_train.data import (
    ByteTokenizer,
    DataConfig,
    IndexedDataset,
    IndexedDatasetBuilder,
    SampleDataset,
    build_tokenizer,
    build_train_valid_test_datasets,
    microbatches,
)
from pp_train.layer_split import LayerSplit
from pp_train.memory import MemoryReport, memory_report, training_state_tensors
from pp_train.norms import calc_params_l2_norm
from pp_train.num_microbatches_calculator import (
    ConstantNumMicroBatchesCalculator,
    NumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatchesCalculator,
    build_num_microbatches_calculator,
)
from pp_train.pretrain import DatasetsProvider, pretrain, train_valid_test_num_samples
from pp_train.recompute import RecomputeConfig, checkpoint_core_attention, run_layers
from pp_train.reporting import TrainingLogger, format_log_line
from pp_train.run_plan import Measurements, RunPlan, decide_run, measure_run
from pp_train.stage_layers import get_num_layers_to_build, get_transformer_layer_offset
from pp_train.timers import TIMING_LOG_OPTIONS, Timer, Timers, TimingLogOption
from pp_train.training import (
    EncoderDecoderModelProvider,
    ExitReason,
    ModelProvider,
    ModelType,
    NonFiniteError,
    TiedEmbeddingSync,
    TrainingConfig,
    TrainingProgress,
    build_forward_backward_func,
    evaluate,
    finalize_model_grads,
    finetune,
    get_model,
    schedule_placement,
    setup_model_and_optimizer,
    tied_embedding_sync,
    train,
    train_step,
)
from pp_train.world import RunLayout, check_world
from pp_train.wrappers import unwrap_model

__version__ = _version("pp-train")

__all__ = [
    "TIMING_LOG_OPTIONS",
    "ByteTokenizer",
    "CheckpointArgs",
    "CheckpointError",
    "ConstantNumMicroBatchesCalculator",
    "DataConfig",
    "DatasetsProvider",
    "EncoderDecoderModelProvider",
    "ExitReason",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "LRScheduleArgs",
    "LayerSplit",
    "LoadedCheckpoint",
    "LoggingArgs",
    "Measurements",
    "MemoryReport",
    "ModelArgs",
    "ModelProvider",
    "ModelType",
    "NonFiniteError",
    "NumMicroBatchesCalculator",
    "ParallelArgs",
    "PretrainConfig",
    "RampupBatchsizeNumMicroBatchesCalculator",
    "RecomputeConfig",
    "RunLayout",
    "RunPlan",
    "SampleDataset",
    "TiedEmbeddingSync",
    "Timer",
    "Timers",
    "TimingLogOption",
    "TrainingArgs",
    "TrainingConfig",
    "TrainingLogger",
    "TrainingProgress",
    "__version__",
    "add_pretrain_flags",
    "build_forward_backward_func",
    "build_num_microbatches_calculator",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "calc_params_l2_norm",
    "check_world",
    "checkpoint_core_attention",
    "checkpoint_path",
    "decide_run",
    "evaluate",
    "finalize_model_grads",
    "finetune",
    "format_log_line",
    "get_batch_on_this_cp_rank",
    "get_model",
    "get_num_layers_to_build",
    "get_rng_state",
    "get_transformer_layer_offset",
    "load_checkpoint",
    "measure_run",
    "memory_report",
    "microbatches",
    "pretrain",
    "pretrain_config_from_args",
    "read_tracker",
    "run_layers",
    "save_checkpoint",
    "schedule_placement",
    "set_rng_state",
    "setup_model_and_optimizer",
    "tied_embedding_sync",
    "train",
    "train_step",
    "train_valid_test_num_samples",
    "training_state_tensors",
    "unwrap_model",
]
