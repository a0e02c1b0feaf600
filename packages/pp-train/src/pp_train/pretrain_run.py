"""One `pretrain` run inside its process group, as its `RunPlan` decided it.

`PretrainRun` seeds, builds the chunks, optimizer and scheduler (restored from ``--load``),
the datasets and streams, runs `train`, evaluates at the end and says what it does on the
logging rank: the last stage of the last replica, as Megatron's. It reads the run's one
decision (`pp_train.run_plan.RunPlan`) and the flags that are not part of it; it decides
nothing about the schedule, the chunks, the split or the recomputation.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pp_optim import LRScheduleConfig, MegatronOptimizer, OptimizerParamScheduler
from pp_state import ParallelState
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
from pp_train.memory import host_bytes
from pp_train.models import check_document_ids_chunk
from pp_train.processes import progress_line
from pp_train.reporting import TrainingLogger
from pp_train.run_plan import RunPlan
from pp_train.seeding import set_random_seed
from pp_train.timers import Timers
from pp_train.training import (
    ExitReason,
    ForwardStepFunc,
    ModelType,
    TrainingProgress,
    build_forward_backward_func,
    evaluate,
    setup_model_and_optimizer,
    train,
)
from pp_train.world import microbatch_calculator

__all__ = [
    "DatasetsProvider",
    "PretrainRun",
    "lr_schedule_config",
    "train_valid_test_num_samples",
    "with_context",
]


DatasetsProvider = Callable[
    [tuple[int, int, int]],
    tuple[SampleDataset | None, SampleDataset | None, SampleDataset | None],
]
"""``train_valid_test_datasets_provider((train, valid, test) samples) -> (train, valid, test)``."""


def _host_data_bytes(*datasets: object) -> int | None:
    """The host bytes of the datasets that say theirs (None when none does)."""
    counts = [count for count in map(host_bytes, datasets) if count is not None]
    return sum(counts) if counts else None


def _print_now(text: str) -> None:
    """Prints on this rank at once (the memory lines: every rank of the first replica).

    One write with its newline: the ranks share stdout, and under ``python -u`` `print`
    writes the text and the newline apart, so two ranks' lines could run into one.
    """
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def with_context(
    provider: Callable[..., torch.nn.Module],
    state: ParallelState,
    run_plan: RunPlan,
) -> Callable[..., torch.nn.Module]:
    """The provider, also handed those of the run's context keywords that it takes."""
    accepted = inspect.signature(provider).parameters
    layers = run_plan.layer_layout
    extra = {
        name: value
        for name, value in (
            ("state", state), ("placement", run_plan.placement),
            ("layer_counts", run_plan.layer_counts), ("layer_layout", layers),
            ("recompute", run_plan.recompute),
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


def train_valid_test_num_samples(config: PretrainConfig) -> tuple[int, int, int]:
    """The samples each dataset must hold (`PretrainConfig.train_valid_test_num_samples`)."""
    return config.train_valid_test_num_samples


@dataclasses.dataclass
class PretrainRun:
    """One `pretrain` run inside its process group: builds, trains, evaluates, reports."""

    config: PretrainConfig
    run_plan: RunPlan
    """The run, decided once (`pp_train.run_plan.decide_run`)."""
    state: ParallelState
    device: torch.device
    model_name: str

    def __post_init__(self) -> None:
        # Before any chunk is built, as Megatron's initialisation seeds.
        set_random_seed(self.config.training.seed, self.state, self.device)
        # Megatron logs from the last rank: the last stage (the losses) of the last replica.
        state = self.state
        self.is_logging_rank = (
            self.run_plan.placement.holds_last(state.pipeline_model_parallel_rank)
            and state.group_rank("dp_cp") == state.group_size("dp_cp") - 1
            and state.tensor_model_parallel_rank == state.tensor_model_parallel_size - 1
        )

    def say(self, text: str) -> None:
        """Prints `text` on the logging rank."""
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
        """Builds the model, optimizer and data, trains, evaluates at the end; why it stopped."""
        config, state, layout = self.config, self.state, self.run_plan
        saved_args = self._checkpoint_args(checkpoint_args)
        model, optimizer, scheduler, loaded = self._setup(model_provider, model_type, saved_args)
        if config.checkpoint.ckpt_convert_format is not None:
            return self._convert(model, optimizer, scheduler, loaded, saved_args)
        progress = self._progress(loaded)
        progress_line("model and optimizer ready; building the datasets ...")
        train_ds, valid_ds, _ = datasets_provider(train_valid_test_num_samples(config))
        timers = Timers(config.logging.timing_log_level, config.logging.timing_log_option)
        forward_backward = build_forward_backward_func(
            state, model, optimizer, hidden_size=config.model.hidden_size, device=self.device,
            timers=timers, resolved=layout.resolved,
            sequence_parallel=config.parallel.sequence_parallel_in_use,
            fb_overlap=config.parallel.fb_overlap,
            calculate_per_token_loss=config.ddp.calculate_per_token_loss,
        )  # fmt: skip
        calculator = microbatch_calculator(config, state.group_size("dp"))
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
                predicted_memory=layout.predicted(calculator.get()),
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
        built = setup_model_and_optimizer(
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
            placement=self.run_plan.placement,
            model_type=model_type,
        )
        if config.data.reset_attention_mask:  # before any step: tokens must not cross documents
            for chunk in built[0]:
                check_document_ids_chunk(chunk)
        return built

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
        layout = self.run_plan
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
                data_parallel_rank=state.group_rank("dp"),
                data_parallel_size=state.group_size("dp"),
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
        state, layout = self.state, self.run_plan
        pp, vp = state.pipeline_model_parallel_size, state.virtual_pipeline_model_parallel_size
        epoch = getattr(train_ds, "samples_per_epoch", None)
        if epoch is None and hasattr(train_ds, "__len__"):
            epoch = len(train_ds)  # type: ignore[arg-type]  # a sized dataset
        line = (
            f"pp-train: {self.model_name} on {dist.get_world_size()} processes "
            f"({dist.get_backend()}): {self._tensor_parallel_text()}"
            f"pipeline {pp}{f' x {vp} virtual stages' if vp else ''}, "
            f"data parallel {state.group_size('dp_cp')}, {layout.schedule_title}"
            + ("" if epoch is None else f"; {epoch} training samples per epoch")
        )
        split = layout.layer_split.summary(layout.layer_layout)
        lines = [line] if split is None else [line, split]
        chosen = layout.chosen_line
        return lines if chosen is None else [*lines, chosen]

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
            placement=self.run_plan.placement,
            verbose=True,
            log_interval=config.logging.log_interval,
            empty_unused_memory_level=config.training.empty_unused_memory_level,
        )
        for key, value in losses.items():
            self.say(f"validation at the end of training | {key}: {value:.6E}")
