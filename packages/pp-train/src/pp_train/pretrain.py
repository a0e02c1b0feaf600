"""`pretrain`: a whole training run from three providers and a configuration, as Megatron's.

Megatron's contracts: ``model_provider(pre_process, post_process, vp_stage)`` builds one
model chunk (it may also take ``state``, ``placement``, ``layers`` and ``layer_counts``
keywords to learn the parallel state, which stage each chunk holds, the global transformer
layers of the chunk it builds (a range, maybe empty) and the layers of every stage),
``train_valid_test_datasets_provider(num_samples)`` builds the three datasets for
``(train, valid, test)`` sample counts (None for one it has not), and
``forward_step_func(data_iterator, model)`` returns ``(output, loss_func)``. Everything the
configuration can get wrong is refused before any process group starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import os
import random
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pp_optim import LRScheduleConfig, MegatronOptimizer, OptimizerParamScheduler
from pp_schedules import Choice, Costs, schedule_spec
from pp_state import ParallelConfig, ParallelState
from pp_tensor import model_parallel_manual_seed
from pp_train.arguments import PretrainConfig
from pp_train.checkpoint import (
    TRACKER_FILENAME,
    CheckpointError,
    LoadedCheckpoint,
    detect_format,
    save_checkpoint,
)
from pp_train.checkpoint.tracker import iteration_directory
from pp_train.data import SampleDataset, microbatches
from pp_train.layer_split import rebalanced
from pp_train.memory import host_bytes
from pp_train.memory_plan import ModelFigures, memory_limit, plan_memory, predict_memory
from pp_train.reporting import Timers, TrainingLogger
from pp_train.training import (
    EncoderDecoderModelProvider,
    ExitReason,
    ForwardStepFunc,
    ModelProvider,
    ModelType,
    TrainingConfig,
    TrainingProgress,
    build_forward_backward_func,
    evaluate,
    setup_model_and_optimizer,
    train,
)
from pp_train.world import RunLayout, check_world, microbatch_calculator

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

DatasetsProvider = Callable[
    [tuple[int, int, int]],
    tuple[SampleDataset | None, SampleDataset | None, SampleDataset | None],
]
"""``train_valid_test_datasets_provider((train, valid, test) samples) -> (train, valid, test)``."""

ScheduleMeasure = Callable[[Choice, tuple[int, int, int]], Choice]
"""Chooses again with measured costs: ``(guess, (pp, microbatches, vp)) -> choice``."""

LayoutMeasure = Callable[[], tuple[Costs, float, float]]
"""Measures, the same on every rank: one transformer layer's step costs, and the embedding's
and the loss's time in transformer layers (for balancing an uneven split)."""

MemoryMeasure = Callable[[], ModelFigures]
"""Measures each part of the model alone on one microbatch (`pp_train.memory_plan`)."""


def pretrain(
    train_valid_test_datasets_provider: DatasetsProvider,
    model_provider: ModelProvider | EncoderDecoderModelProvider | Callable[..., torch.nn.Module],
    forward_step_func: ForwardStepFunc,
    *,
    config: PretrainConfig,
    model_type: ModelType = ModelType.encoder_or_decoder,
    checkpoint_args: Mapping[str, Any] | None = None,
    measure_schedule: ScheduleMeasure | None = None,
    measure_layout: LayoutMeasure | None = None,
    measure_memory: MemoryMeasure | None = None,
    model_name: str = "model",
    layer_counts: Sequence[int] | None = None,
    layout: RunLayout | None = None,
) -> ExitReason:
    """Trains a model as `config` says, on the processes torchrun started (or this one).

    Checks `config` against the world (`check_world`, unless `layout` is given), starts the
    process group unless one runs (torchrun's environment; one process without it), measures
    what the flags need measured, builds the parallel state, seeds (`set_random_seed`), builds
    the chunks, optimizer and scheduler (restored from ``--load``), the datasets and streams,
    runs `train`, and evaluates at the end. The last stage of the last replica prints.

    Args:
        train_valid_test_datasets_provider: Builds the datasets (see the module docstring).
        model_provider: Builds one chunk (see the module docstring); with `model_type`
            ``encoder_and_decoder``, Megatron's encoder-decoder form.
        forward_step_func: One microbatch through a chunk.
        config: The run's configuration.
        model_type: One stack, or an encoder and a decoder split at a pipeline rank.
        checkpoint_args: More settings saved in checkpoints (e.g. the vocabulary size).
        measure_schedule: With ``auto``, chooses again with measured costs (once).
        measure_layout: For a split balanced by simulation whose end costs are not both
            configured: balances again with measured costs before the model is built.
        measure_memory: Measures the model's parts for the byte model (`pp_train.memory_plan`):
            the memory report's prediction, and ``--memory-limit-gb``'s choice.
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
    with _process_group(config) as device:
        # Measured before the parallel state exists: a fitted layout may change its chunks.
        measures = (measure_layout, measure_schedule, measure_memory)
        layout, measured, fitted = _measured_run(layout, config, measures)
        state = _parallel_state(config, layout)
        try:
            run = _Run(config, layout, state, device, model_name, measured, fitted)
            model = _with_context(model_provider, state, layout)
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
    world, transport = _world_size(), default_transport()
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
    tp = config.parallel.tensor_model_parallel_size
    if layout.tensor_model_parallel_size != tp:
        raise ValueError(
            f"the layout was checked for tensor-parallel size "
            f"{layout.tensor_model_parallel_size}, but this run has {tp}; pass check_world's "
            "layout for this run, or none"
        )
    return layout


def _parallel_state(config: PretrainConfig, layout: RunLayout) -> ParallelState:
    """The run's parallel state (tensor, pipeline and virtual sizes, the collectives' timeout)."""
    return ParallelState.create(
        ParallelConfig(
            tensor_model_parallel_size=config.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
            timeout=datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes),
        )
    )


def _world_size() -> int:
    """The running group's size, else torchrun's ``WORLD_SIZE`` (1 without torchrun)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _host_data_bytes(*datasets: object) -> int | None:
    """The host bytes of the datasets that say theirs (None when none does)."""
    counts = [count for count in map(host_bytes, datasets) if count is not None]
    return sum(counts) if counts else None


def default_transport() -> str:
    """The transport the run's plans are validated for: gloo or NCCL.

    The running group's backend, else NCCL when every local rank has a GPU (as
    `_process_group` decides), gloo otherwise.
    """
    if dist.is_initialized():
        return "nccl" if dist.get_backend() == "nccl" else "gloo"
    return "nccl" if _local_gpus() else "gloo"


def _local_gpus() -> bool:
    """Whether every process torchrun starts on this machine gets a GPU of its own."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_world


def _print_now(text: str) -> None:
    """Prints on this rank at once (the memory lines: every rank of the first replica).

    One write with its newline: the ranks share stdout, and under ``python -u`` `print`
    writes the text and the newline apart, so two ranks' lines could run into one.
    """
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def print_once(text: str) -> None:
    """Prints `text` on the job's rank 0 only, before or after the process group starts.

    The group's rank once it runs, else torchrun's ``RANK`` (0 without torchrun).
    """
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(text, flush=True)


def _progress_line(text: str) -> None:
    """Rank 0 says what it is doing while the ranks start (before any log line)."""
    print_once(f"pp-train: {text}")


def _warn_sequence_parallel_off(config: PretrainConfig) -> None:
    """Megatron turns ``--sequence-parallel`` off at tensor-parallel size 1; said once."""
    parallel = config.parallel
    if parallel.sequence_parallel and not parallel.sequence_parallel_in_use:
        _progress_line(
            "warning: --sequence-parallel is turned off: it needs --tensor-model-parallel-size "
            f"2 or more, got {parallel.tensor_model_parallel_size}"
        )


def set_random_seed(seed: int, state: ParallelState, device: torch.device | None = None) -> None:
    """Seeds every generator of this rank as Megatron's ``_set_random_seed`` does.

    Pipeline stages draw apart (``seed + 100 x pipeline rank``; Python's, NumPy's and
    torch's default generators); pp-tensor's tracker gets the tensor-parallel seed of
    this rank (`pp_tensor.model_parallel_manual_seed`), so dropout inside tensor-parallel
    regions differs across tensor-parallel ranks and the rest matches. Models that
    initialise their weights from their own generators (the bundled GPT) and train without
    dropout are not affected.

    Args:
        seed: The run's ``--seed``.
        state: The parallel state (pipeline and tensor-parallel ranks).
        device: The run's device (the tracker's states live there).
    """
    stage_seed = seed + 100 * state.pipeline_model_parallel_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    model_parallel_manual_seed(stage_seed, tp_rank=state.tensor_model_parallel_rank, device=device)


@contextlib.contextmanager
def _process_group(config: PretrainConfig) -> Iterator[torch.device]:
    """This process's device in a running process group: the caller's, or one started here."""
    _warn_sequence_parallel_off(config)
    _progress_line(f"configuration checked; joining the process group of {_world_size()} ...")
    if dist.is_initialized():
        _progress_line(f"process group ready ({dist.get_backend()}); building the model ...")
        nccl = dist.get_backend() == "nccl"
        yield torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        return
    timeout = datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory() as scratch:
        # Without torchrun this is a one-process job: rendezvous through a file, no port.
        single: dict[str, Any] = (
            {} if "RANK" in os.environ
            else {"init_method": f"file://{scratch}/rendezvous", "rank": 0, "world_size": 1}
        )  # fmt: skip
        joining = single or restarted_store(os.environ, timeout)
        if _local_gpus():
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", timeout=timeout, **joining)
            device = torch.device("cuda", local_rank)
        else:
            # Ranks on one machine share its cores; more threads per rank only contend.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
            dist.init_process_group("gloo", timeout=timeout, **joining)
            device = torch.device("cpu")
        _progress_line(f"process group ready ({dist.get_backend()}); building the model ...")
        try:
            yield device
        finally:
            dist.destroy_process_group()


def restarted_store(environ: Mapping[str, str], timeout: datetime.timedelta) -> dict[str, Any]:
    """How a worker that torchrun restarted joins its group: the agent's store, prefixed anew.

    torchrun's agent keeps one store for all its restarts, and torch 2.13's ``env://`` joins
    it without a per-restart prefix: a restarted gloo group reads the dead workers' addresses
    and fails to connect ("Connection refused"), so ``--max-restarts`` could never resume.
    Joined under a prefix naming the restart count, each attempt has keys of its own.

    Args:
        environ: The environment torchrun set.
        timeout: The store's timeout (the process group's).

    Returns:
        ``init_process_group``'s ``store``, ``rank`` and ``world_size`` for a restarted worker
        of an agent that hosts the store; empty (``env://`` as usual) otherwise.
    """
    restart = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world_size = int(environ["WORLD_SIZE"])
    store = dist.TCPStore(
        environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), world_size, is_master=False,
        timeout=timeout,
    )  # fmt: skip
    prefixed = dist.PrefixStore(f"pp-train/restart-{restart}", store)
    return {"store": prefixed, "rank": int(environ["RANK"]), "world_size": world_size}


def _measured_run(
    layout: RunLayout,
    config: PretrainConfig,
    measures: tuple[LayoutMeasure | None, ScheduleMeasure | None, MemoryMeasure | None],
) -> tuple[RunLayout, bool, Choice | None]:
    """The layout once measured: the split rebalanced, ``auto`` chosen again, the byte model.

    Returns:
        The layout, whether ``auto`` chose with measured costs, and ``--memory-limit-gb``'s
        choice (None without one to make).
    """
    measure_layout, measure_schedule, measure_memory = measures
    layout = _measured_layout(layout, config, measure_layout)
    measured = layout.schedule_choice is not None and measure_schedule is not None
    if measure_schedule is not None and measured and config.parallel.memory_limit_gb is None:
        layout = _measured(layout, measure_schedule)
    layout, fitted = plan_memory(layout, config, measure_memory)
    return layout, measured, fitted


def _measured_layout(
    layout: RunLayout, config: PretrainConfig, measure: LayoutMeasure | None
) -> RunLayout:
    """A balanced split whose end costs are not both configured, balanced with measured ones."""
    parallel = config.parallel
    ends = (parallel.pipeline_layout_embedding_cost, parallel.pipeline_layout_loss_cost)
    if measure is None or layout.layer_split.balance is None or None not in ends:
        return layout
    split = rebalanced(layout.layer_split, parallel, measure())
    return dataclasses.replace(layout, layer_split=split)


def _measured(layout: RunLayout, measure: ScheduleMeasure) -> RunLayout:
    """``auto`` chosen once more, with measured costs; the pick resolved for every count."""
    resolved = layout.resolved
    assert resolved.choice is not None
    sizes = (resolved.pp_size, max(layout.microbatch_counts), resolved.vp_size)
    choice = measure(resolved.choice, sizes)
    return dataclasses.replace(
        layout, resolved=resolved.with_schedule(choice.chosen.name, choice=choice)
    )


def _with_context(
    provider: Callable[..., torch.nn.Module],
    state: ParallelState,
    layout: RunLayout,
) -> Callable[..., torch.nn.Module]:
    """The provider, also handed those of the run's context keywords that it takes."""
    accepted = inspect.signature(provider).parameters
    layers = layout.layer_layout
    extra = {
        name: value
        for name, value in (
            ("state", state), ("placement", layout.placement),
            ("layer_counts", layout.layer_counts), ("layer_layout", layers),
            ("recompute", layout.recompute),
        )
        if name in accepted
    }  # fmt: skip

    def build(**where: Any) -> torch.nn.Module:
        chunk: dict[str, Any] = {}
        if "layers" in accepted:
            rank = state.pipeline_model_parallel_rank
            chunk["layers"] = layers.layers(rank, where.get("vp_stage", 0))
        return provider(**where, **extra, **chunk)

    return build


def lr_schedule_config(config: PretrainConfig) -> LRScheduleConfig:
    """The learning-rate schedule in samples, as Megatron's steps it: iterations x global batch."""
    return config.lr_schedule.in_samples(
        max_lr=config.optimizer.lr,
        weight_decay=config.optimizer.weight_decay,
        global_batch_size=config.training.global_batch_size,
        train_iters=config.training.train_iters,
    )


def _load_format(config: PretrainConfig) -> dict[str, Any]:
    """The checkpoint format keywords of `setup_model_and_optimizer`."""
    checkpoint = config.checkpoint
    return {
        "ckpt_format": checkpoint.ckpt_format,
        # A conversion reads whichever format --load holds.
        "auto_detect_ckpt_format": checkpoint.auto_detect_ckpt_format
        or checkpoint.ckpt_convert_format is not None,
    }


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


def train_valid_test_num_samples(config: PretrainConfig) -> tuple[int, int, int]:
    """The samples each dataset must hold (`PretrainConfig.train_valid_test_num_samples`)."""
    return config.train_valid_test_num_samples


@dataclasses.dataclass
class _Run:
    """One `pretrain` run inside its process group: builds, trains, evaluates, reports."""

    config: PretrainConfig
    layout: RunLayout
    state: ParallelState
    device: torch.device
    model_name: str
    measured: bool
    """Whether ``auto`` chose with measured costs."""
    fitted: Choice | None = None
    """``--memory-limit-gb``'s choice (its table is printed at the start)."""

    def __post_init__(self) -> None:
        # Before any chunk is built, as Megatron's initialisation seeds.
        set_random_seed(self.config.training.seed, self.state, self.device)
        # Megatron logs from the last rank: the last stage (the losses) of the last replica.
        state = self.state
        self.is_logging_rank = (
            self.layout.placement.holds_last(state.pipeline_model_parallel_rank)
            and state.group_rank("dp_cp") == state.group_size("dp_cp") - 1
            and state.tensor_model_parallel_rank == state.tensor_model_parallel_size - 1
        )

    def say(self, text: str) -> None:
        if self.is_logging_rank:
            print(text, flush=True)

    def train(
        self,
        datasets_provider: DatasetsProvider,
        model_provider: Callable[..., torch.nn.Module],
        forward_step_func: ForwardStepFunc,
        model_type: ModelType,
        checkpoint_args: Mapping[str, Any],
    ) -> ExitReason:
        config, state, layout = self.config, self.state, self.layout
        saved_args = self._checkpoint_args(checkpoint_args)
        model, optimizer, scheduler, loaded = self._setup(model_provider, model_type, saved_args)
        if config.checkpoint.ckpt_convert_format is not None:
            return self._convert(model, optimizer, scheduler, loaded, saved_args)
        progress = self._progress(loaded)
        _progress_line("model and optimizer ready; building the datasets ...")
        train_ds, valid_ds, _ = datasets_provider(train_valid_test_num_samples(config))
        timers = Timers(config.logging.timing_log_level, config.logging.timing_log_option)
        forward_backward = build_forward_backward_func(
            state, model, optimizer, hidden_size=config.model.hidden_size, device=self.device,
            timers=timers, resolved=layout.resolved,
            sequence_parallel=config.parallel.sequence_parallel_in_use,
        )  # fmt: skip
        calculator = microbatch_calculator(config, state.group_size("dp_cp"))
        logger, writer = self._logger()
        for message in self._startup(train_ds):
            self.say(message)
        try:
            reason = train(
                forward_step_func, model, optimizer, scheduler,
                self._streams(train_ds, progress.consumed_train_samples),
                self._streams(valid_ds, progress.consumed_valid_samples),
                state=state, config=config,
                forward_backward_func=forward_backward, calculator=calculator,
                progress=progress, logger=logger, timers=timers,
                checkpoint_args=saved_args, print_fn=self.say, placement=layout.placement,
                memory_print_fn=_print_now,
                predicted_memory=predict_memory(layout, calculator.get()),
                host_data_bytes=_host_data_bytes(train_ds, valid_ds),
            )  # fmt: skip
            if reason == "train_iters" and config.training.eval_iters > 0 and valid_ds is not None:
                valid = self._streams(valid_ds, progress.consumed_valid_samples)
                count = calculator.get()
                self._final_validation(forward_step_func, model, forward_backward, valid, count)
        finally:
            if writer is not None:
                writer.close()
            if forward_backward.communicator is not None:
                forward_backward.communicator.destroy()
        return reason

    def _setup(
        self,
        model_provider: Callable[..., torch.nn.Module],
        model_type: ModelType,
        saved_args: dict[str, Any],
    ) -> Any:
        """The chunks, optimizer, scheduler and what was loaded from ``--load``."""
        config = self.config
        return setup_model_and_optimizer(
            model_provider,
            self.state,
            optimizer_config=config.optimizer,
            lr_schedule=lr_schedule_config(config),
            ddp_config=config.ddp,
            device=self.device,
            load=config.checkpoint.load,
            checkpoint_args=saved_args,
            finetune=config.checkpoint.finetune,
            no_load_optim=config.checkpoint.no_load_optim,
            no_load_rng=config.checkpoint.no_load_rng,
            **_load_format(config),
            placement=self.layout.placement,
            model_type=model_type,
        )

    def _convert(
        self,
        model: list[torch.nn.Module],
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
        loaded: LoadedCheckpoint | None,
        saved_args: dict[str, Any],
    ) -> ExitReason:
        """Saves what ``--load`` held in ``--ckpt-convert-format`` to ``--ckpt-convert-save``.

        Exactly what a save at the loaded iteration writes (model, optimizer, scheduler,
        progress, args, RNG states); nothing is trained.
        """
        checkpoint = self.config.checkpoint
        load, target = checkpoint.load, checkpoint.ckpt_convert_save
        to_format = checkpoint.ckpt_convert_format
        assert load is not None
        assert target is not None
        assert to_format is not None
        if loaded is None:  # every rank agreed on the tracker
            raise CheckpointError(
                f"--load {load} holds no checkpoint (no {TRACKER_FILENAME}): nothing to "
                f"convert; --ckpt-convert-save {target} was not written"
            )
        for note in loaded.notes:
            self.say(note)
        found = detect_format(iteration_directory(Path(load), loaded.iteration))
        save_checkpoint(
            target, loaded.iteration, state=self.state, model=model, optimizer=optimizer,
            scheduler=scheduler, args=saved_args,
            consumed_train_samples=loaded.consumed_train_samples,
            consumed_valid_samples=loaded.consumed_valid_samples, ckpt_format=to_format,
        )  # fmt: skip
        self.say(
            f"converted the {found} checkpoint of iteration {loaded.iteration} in {load} "
            f"to {to_format} in {target} ({loaded.consumed_train_samples} samples consumed)"
        )
        return "converted"

    def _checkpoint_args(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        """The flags and derived sizes saved in checkpoints (the strict ones are compared)."""
        saved: dict[str, Any] = {}
        for group in self.config.groups:
            for key, value in dataclasses.asdict(group).items():  # type: ignore[call-overload]
                saved[key] = list(value) if isinstance(value, tuple) else value
        layout = self.layout
        saved.update(
            virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
            data_parallel_size=layout.data_parallel_size,
            tensor_model_parallel_size=self.state.tensor_model_parallel_size,
            # Off at tensor-parallel size 1, whatever the flag said (Megatron's args too).
            sequence_parallel=self.config.parallel.sequence_parallel_in_use,
            lr_decay_iters=self.config.lr_decay_iters,
        )
        saved.update(extra)
        return saved

    def _progress(self, loaded: LoadedCheckpoint | None) -> TrainingProgress:
        """Where training starts: the loaded checkpoint's counters, else zero; says which."""
        load = self.config.checkpoint.load
        if loaded is None:
            if load is not None:
                self.say(f"no checkpoint in {load}: starting from scratch")
            return TrainingProgress()
        self.say(
            f"loaded checkpoint from {load} at iteration {loaded.iteration} "
            f"({loaded.consumed_train_samples} samples consumed)"
        )
        for note in loaded.notes:
            self.say(note)
        return TrainingProgress(
            iteration=loaded.iteration,
            consumed_train_samples=loaded.consumed_train_samples,
            consumed_valid_samples=loaded.consumed_valid_samples,
        )

    def _streams(self, dataset: SampleDataset | None, consumed: int) -> Any:
        """This data-parallel rank's microbatches from `consumed` on: one stream per chunk."""
        if dataset is None:
            return None
        state = self.state
        vp = state.virtual_pipeline_model_parallel_size or 1
        streams = [
            microbatches(
                dataset,
                consumed_samples=consumed,
                micro_batch_size=self.config.training.micro_batch_size,
                data_parallel_rank=state.group_rank("dp_cp"),
                data_parallel_size=state.group_size("dp_cp"),
            )
            for _ in range(vp)
        ]
        return streams if vp > 1 else streams[0]

    def _logger(self) -> tuple[TrainingLogger, Any]:
        """The training log and the TensorBoard writer it writes to (None without one)."""
        directory = self.config.logging.tensorboard_dir
        writer = None
        if directory is not None and self.is_logging_rank:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:  # pragma: no cover - depends on the environment
                raise SystemExit(
                    "--tensorboard-dir needs the tensorboard package: "
                    "pip install 'pp-train[tensorboard]'"
                ) from error
            writer = SummaryWriter(log_dir=directory, max_queue=1000)
            # Megatron's write_args_to_tensorboard: every setting once, as text.
            for key, value in self._checkpoint_args({}).items():
                writer.add_text(key, str(value))
        logger = TrainingLogger(
            train_iters=self.config.training.train_iters,
            log_interval=self.config.logging.log_interval,
            writer=writer,
            is_logging_rank=self.is_logging_rank,
        )
        return logger, writer

    def _startup(self, train_ds: SampleDataset | None) -> list[str]:
        """The line that describes the run; with ``auto``, also the schedule choice."""
        state, layout = self.state, self.layout
        pp, vp = state.pipeline_model_parallel_size, state.virtual_pipeline_model_parallel_size
        path = self.config.parallel.pipeline_schedule_file
        name = layout.schedule  # None for the plan of a file
        title = (
            schedule_spec(name).title
            if name is not None
            else f"plan {path} ({layout.placement} placement)"
        )
        epoch = getattr(train_ds, "samples_per_epoch", None)
        if epoch is None and hasattr(train_ds, "__len__"):
            epoch = len(train_ds)  # type: ignore[arg-type]  # a sized dataset
        line = (
            f"pp-train: {self.model_name} on {dist.get_world_size()} processes "
            f"({dist.get_backend()}): {self._tensor_parallel_text()}"
            f"pipeline {pp}{f' x {vp} virtual stages' if vp else ''}, "
            f"data parallel {state.group_size('dp_cp')}, {title}"
            + ("" if epoch is None else f"; {epoch} training samples per epoch")
        )
        split = layout.layer_split.summary(layout.layer_layout)
        lines = [line] if split is None else [line, split]
        if self.fitted is not None:
            limit = memory_limit(self.config, layout.resolved.transport)
            assert limit is not None
            return [*lines, f"schedule, chunks and recomputation chosen by simulation within "
                    f"{limit.flags} (warm-up costs and bytes; peaks of every byte allocated):\n"
                    + self.fitted.table()]  # fmt: skip
        choice = layout.schedule_choice
        if choice is None:
            return lines
        costs = choice.costs
        text = "-" if costs is None else (
            f"F {costs.forward:.2f}, I {costs.of('I'):.2f}, W {costs.of('W'):.2f}"
        )  # fmt: skip
        how = " with step costs measured in a warm-up" if self.measured else ""
        return [*lines, f"pipeline schedule chosen by simulation{how} (ms per chunk: {text}):\n"
                + choice.table()]  # fmt: skip

    def _tensor_parallel_text(self) -> str:
        """The startup line's tensor-parallel part (nothing at size 1)."""
        tp = self.state.tensor_model_parallel_size
        if tp == 1:
            return ""
        sequence = self.config.parallel.sequence_parallel_in_use
        return f"tensor parallel {tp}{' with sequence parallelism' if sequence else ''}, "

    def _final_validation(
        self,
        forward_step_func: ForwardStepFunc,
        model: Sequence[torch.nn.Module],
        forward_backward: Any,
        valid: Any,
        num_microbatches: int,
    ) -> None:
        """Evaluates the trained model and says each loss, as Megatron does at the end.

        Verbose, as Megatron's: rank 0 says ``Evaluating iter i/n`` every log interval.
        """
        config = self.config
        losses = evaluate(
            forward_step_func,
            valid,
            model,
            forward_backward_func=forward_backward,
            state=self.state,
            eval_iters=config.training.eval_iters,
            num_microbatches=num_microbatches,
            micro_batch_size=config.training.micro_batch_size,
            seq_length=config.model.seq_length,
            decoder_seq_length=config.model.decoder_seq_length,
            placement=self.layout.placement,
            verbose=True,
            log_interval=config.logging.log_interval,
            empty_unused_memory_level=config.training.empty_unused_memory_level,
        )
        for key, value in losses.items():
            self.say(f"validation at the end of training | {key}: {value:.6E}")
