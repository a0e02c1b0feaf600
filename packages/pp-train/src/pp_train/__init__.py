"""pp-train: the training loop, logging, checkpoints, a bundled GPT and the ``pp-train`` command.

Composed from the four lower layers: process groups (pp-state), p2p (pp-comm), schedules
(pp-schedules) and optimizer pieces (pp-optim). Use the pieces (`setup_model_and_optimizer`,
`train_step`, `evaluate`, `train`, `save_checkpoint` / `load_checkpoint`, `TrainingLogger`) in a
loop of your own, or run ``torchrun --nproc-per-node N -m pp_train`` to train the bundled GPT.
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
from pp_train.command import build_parser, gpt_forward_step, main, validate_args
from pp_train.data import (
    ByteTokenizer,
    GPTDataset,
    corpus_tokens,
    load_corpus,
    microbatches,
    split_corpus,
)
from pp_train.gpt import GPTChunk, GPTConfig, chunk_layers
from pp_train.microbatches import (
    ConstantNumMicroBatchesCalculator,
    NumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatchesCalculator,
    build_num_microbatches_calculator,
)
from pp_train.norms import calc_params_l2_norm
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
    "EncoderDecoderModelProvider",
    "ExitReason",
    "GPTChunk",
    "GPTConfig",
    "GPTDataset",
    "LoadedCheckpoint",
    "ModelProvider",
    "ModelType",
    "NumMicroBatchesCalculator",
    "RampupBatchsizeNumMicroBatchesCalculator",
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
    "build_parser",
    "calc_params_l2_norm",
    "checkpoint_path",
    "chunk_layers",
    "corpus_tokens",
    "evaluate",
    "finalize_model_grads",
    "finetune",
    "format_log_line",
    "get_model",
    "get_rng_state",
    "gpt_forward_step",
    "load_checkpoint",
    "load_corpus",
    "main",
    "memory_report",
    "microbatches",
    "read_tracker",
    "save_checkpoint",
    "schedule_placement",
    "set_rng_state",
    "setup_model_and_optimizer",
    "split_corpus",
    "tied_embedding_sync",
    "train",
    "train_step",
    "unwrap_model",
    "validate_args",
]
