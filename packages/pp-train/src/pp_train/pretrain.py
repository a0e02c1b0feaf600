"""`pretrain`: a whole training run from three providers and a configuration, as Megatron's.

Megatron's contracts: ``model_provider(pre_process, post_process, vp_stage)`` builds one
model chunk (it may also take ``state``, ``placement``, ``layers`` and ``layer_counts``
keywords to learn the parallel state, which stage each chunk holds, the global transformer
layers of the chunk it builds (a range, maybe empty) and the layers of every stage),
``train_valid_test_datasets_provider(num_samples)`` builds the three datasets for
``(train, valid, test)`` sample counts (None for one it has not), and
``forward_step_func(data_iterator, model)`` returns ``(output, loss_func)``. Everything the
configuration can get wrong is refused before any process group starts.

The run in four steps, each in a module of its own: the configuration checked on the world
(`pp_train.world.check_world`), the process group joined (`pp_train.processes`), the run
decided once with what a warm-up measured (`pp_train.run_plan.decide_run`), and the run
itself (`pp_train.pretrain_run.PretrainRun`, seeding with `pp_train.seeding`).
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pp_state import ParallelConfig, ParallelState
from pp_train.arguments import PretrainConfig
from pp_train.pretrain_run import (
    DatasetsProvider,
    PretrainRun,
    lr_schedule_config,
    train_valid_test_num_samples,
    with_context,
)
from pp_train.processes import default_transport, print_once, process_group, world_size
from pp_train.run_plan import (
    ChunkMeasure,
    LayoutMeasure,
    Measures,
    MemoryMeasure,
    RunPlan,
    decide_run,
    measure_run,
)
from pp_train.seeding import set_random_seed
from pp_train.training import (
    EncoderDecoderModelProvider,
    ExitReason,
    ForwardStepFunc,
    ModelProvider,
    ModelType,
    TrainingConfig,
)
from pp_train.world import RunLayout, check_world

__all__ = [
    "DatasetsProvider",
    "default_transport",
    "lr_schedule_config",
    "pretrain",
    "print_once",
    "set_random_seed",
    "train_valid_test_num_samples",
    "training_config",
]


def pretrain(
    train_valid_test_datasets_provider: DatasetsProvider,
    model_provider: ModelProvider | EncoderDecoderModelProvider | Callable[..., torch.nn.Module],
    forward_step_func: ForwardStepFunc,
    *,
    config: PretrainConfig,
    model_type: ModelType = ModelType.encoder_or_decoder,
    checkpoint_args: Mapping[str, Any] | None = None,
    measure_schedule: ChunkMeasure | None = None,
    measure_layout: LayoutMeasure | None = None,
    measure_memory: MemoryMeasure | None = None,
    model_name: str = "model",
    layer_counts: Sequence[int] | None = None,
    layout: RunLayout | None = None,
) -> ExitReason:
    """Trains a model as `config` says, on the processes torchrun started (or this one).

    Checks `config` against the world (`check_world`, unless `layout` is given), joins or
    starts the process group, measures what the decision uses (`measure_run`), decides the
    run once (`decide_run`), builds the parallel state, then seeds, builds the chunks,
    optimizer, scheduler (``--load``) and data, trains and evaluates (`PretrainRun`).

    Args:
        train_valid_test_datasets_provider: Builds the datasets (see the module docstring).
        model_provider: Builds one chunk (see the module docstring); with `model_type`
            ``encoder_and_decoder``, Megatron's encoder-decoder form.
        forward_step_func: One microbatch through a chunk.
        config: The run's configuration.
        model_type: One stack, or an encoder and a decoder split at a pipeline rank.
        checkpoint_args: More settings saved in checkpoints (e.g. the vocabulary size).
        measure_schedule: With ``auto``: one chunk's F, I and W (`run_plan.ChunkMeasure`).
        measure_layout: A balanced split's layer and end costs (`run_plan.LayoutMeasure`).
        measure_memory: The model's parts for the byte model (`run_plan.MemoryMeasure`).
        model_name: Names the model in the first line printed.
        layer_counts: Transformer layers of each virtual stage (see `check_world`).
        layout: `check_world`'s result, when the caller has it (not checked again).

    Returns:
        Why training stopped (see `train`).

    Raises:
        ValueError: The configuration does not fit the world (or `layout`'s: nothing starts).
        CheckpointError: ``--load`` holds a checkpoint this run cannot load.
    """
    layout = _run_layout(config, layout, layer_counts)
    with process_group(config) as device:
        # Measured and decided before the parallel state exists: the decision may change the
        # chunks per rank the state is built with.
        measures = Measures(chunk=measure_schedule, layout=measure_layout, memory=measure_memory)
        run_plan = decide_run(config, layout, measure_run(config, layout, measures))
        state = _parallel_state(config, run_plan)
        try:
            run = PretrainRun(config, run_plan, state, device, model_name)
            model = with_context(model_provider, state, run_plan)
            datasets, extra = train_valid_test_datasets_provider, checkpoint_args or {}
            return run.train(datasets, model, forward_step_func, model_type, extra)
        finally:
            state.destroy()


def _run_layout(
    config: PretrainConfig, layout: RunLayout | None, layer_counts: Sequence[int] | None
) -> RunLayout:
    """`check_world`'s layout for this run: the caller's, once it is seen to fit, else made.

    Raises:
        ValueError: The configuration does not fit the world, or the caller's layout is for
            another world size, transport or pipeline size, or comes with `layer_counts`.
    """
    world, transport = world_size(), default_transport()
    if layout is None:
        return check_world(config, world, layer_counts=layer_counts, transport=transport)
    if layer_counts is not None:
        raise ValueError(
            "layer_counts and layout were both given; the layout holds its split of the "
            "layers (give the counts to check_world instead)"
        )
    pp = config.parallel.pipeline_model_parallel_size
    checked = (layout.world_size, layout.resolved.transport, layout.resolved.pp_size)
    if checked != (world, transport, pp):
        raise ValueError(
            f"the layout was checked for {layout.world_size} processes on "
            f"{layout.resolved.transport} with pipeline size {layout.resolved.pp_size}, but "
            f"this run has {world} on {transport} with pipeline size {pp}; pass check_world's "
            "layout for this run, or none"
        )
    parallel = config.parallel
    for kind, checked_size, size in (
        ("tensor", layout.tensor_model_parallel_size, parallel.tensor_model_parallel_size),
        ("context", layout.context_parallel_size, parallel.context_parallel_size),
    ):
        if checked_size != size:
            raise ValueError(
                f"the layout was checked for {kind}-parallel size {checked_size}, but this run "
                f"has {size}; pass check_world's layout for this run, or none"
            )
    return layout


def _parallel_state(config: PretrainConfig, layout: RunPlan) -> ParallelState:
    """The run's parallel state (tensor, pipeline and virtual sizes, the collectives' timeout)."""
    return ParallelState.create(
        ParallelConfig(
            tensor_model_parallel_size=config.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.parallel.pipeline_model_parallel_size,
            context_parallel_size=config.parallel.context_parallel_size,
            virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
            timeout=datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes),
        )
    )


def training_config(config: PretrainConfig) -> TrainingConfig:
    """The loop's settings from the run's flags, as a `TrainingConfig`.

    Deprecated, and removed in pp-train 0.9: `train` and `finetune` take the `PretrainConfig`
    itself and read its sections; nothing in pp-train calls this.
    """
    warnings.warn(
        "pp_train.pretrain.training_config is deprecated: pass the PretrainConfig to train",
        DeprecationWarning,
        stacklevel=2,
    )
    training, logging, checkpoint = config.training, config.logging, config.checkpoint
    return TrainingConfig(
        train_iters=training.train_iters,
        micro_batch_size=training.micro_batch_size,
        seq_length=config.model.seq_length,
        decoder_seq_length=config.model.decoder_seq_length,
        eval_interval=training.eval_interval,
        eval_iters=training.eval_iters,
        log_interval=logging.log_interval,
        save=checkpoint.save,
        save_interval=checkpoint.save_interval,
        ckpt_format=checkpoint.ckpt_format,
        async_save=checkpoint.async_save,
        exit_interval=training.exit_interval,
        exit_duration_in_mins=training.exit_duration_in_mins,
        exit_signal_handler=training.exit_signal_handler,
        adlr_autoresume_interval=training.adlr_autoresume_interval,
        profile_schedule_path=logging.profile_schedule,
        profile_schedule_iteration=logging.profile_schedule_iteration,
        log_params_norm=logging.log_params_norm,
        barrier_with_l1_time=logging.barrier_with_l1_time,
    )
