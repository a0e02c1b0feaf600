"""pp-train: the training loop, logging, checkpoints and data, as a library.

Composed from the four lower layers: process groups (pp-state), p2p (pp-comm), schedules
(pp-schedules) and optimizer pieces (pp-optim). Use the pieces (`setup_model_and_optimizer`,
`train_step`, `evaluate`, `train`, `save_checkpoint` / `load_checkpoint`, `TrainingLogger`) in a
loop of your own. The bundled GPT, its corpus and the ``pp-train`` command are an application
of the library, in `pp_train.app` (``torchrun --nproc-per-node N -m pp_train``).
"""

from importlib.metadata import version as _version

from pp_train.checkpointing import (
    CheckpointError,
    LoadedCheckpoint,
    checkpoint_path,
    get_rng_state,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
    set_rng_state,
)
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
from pp_train.norms import calc_params_l2_norm
from pp_train.num_microbatches_calculator import (
    ConstantNumMicroBatchesCalculator,
    NumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatchesCalculator,
    build_num_microbatches_calculator,
)
from pp_train.reporting import (
    TIMING_LOG_OPTIONS,
    Timer,
    Timers,
    TimingLogOption,
    TrainingLogger,
    format_log_line,
    memory_report,
)
from pp_train.training import (
    EncoderDecoderModelProvider,
    ExitReason,
    ModelProvider,
    ModelType,
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
from pp_train.wrappers import unwrap_model

__version__ = _version("pp-train")

__all__ = [
    "TIMING_LOG_OPTIONS",
    "ByteTokenizer",
    "CheckpointError",
    "ConstantNumMicroBatchesCalculator",
    "DataConfig",
    "EncoderDecoderModelProvider",
    "ExitReason",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "LoadedCheckpoint",
    "ModelProvider",
    "ModelType",
    "NumMicroBatchesCalculator",
    "RampupBatchsizeNumMicroBatchesCalculator",
    "SampleDataset",
    "TiedEmbeddingSync",
    "Timer",
    "Timers",
    "TimingLogOption",
    "TrainingConfig",
    "TrainingLogger",
    "TrainingProgress",
    "__version__",
    "build_forward_backward_func",
    "build_num_microbatches_calculator",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "calc_params_l2_norm",
    "checkpoint_path",
    "evaluate",
    "finalize_model_grads",
    "finetune",
    "format_log_line",
    "get_model",
    "get_rng_state",
    "load_checkpoint",
    "memory_report",
    "microbatches",
    "read_tracker",
    "save_checkpoint",
    "schedule_placement",
    "set_rng_state",
    "setup_model_and_optimizer",
    "tied_embedding_sync",
    "train",
    "train_step",
    "unwrap_model",
]
