"""What memory_bench.py runs: pp-train's real training step, and the same chunks under torch's.

`Training` is one configuration built from pp-train's pieces exactly as a run builds them
(`setup_model_and_optimizer`: GPT chunks, DDP, the optimizer; `build_forward_backward_func`:
pp-schedules' executor; `train_step`: zero grads, forward-backward, gradient reduction,
optimizer step). `PipelinePair` is one rank's chunks of the GPT driven by this package's
executor and by torch.distributed.pipelining's `PipelineStage` and schedule, for a side by side
count of the bytes saved for backward. `Column` and its helpers lay out the tables.

Imported by memory_bench.py as ``import _memory_runs as runs`` (a script's own folder is first
on ``sys.path``).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from pp_comm import CommConfig, P2PCommunicator
from pp_optim import (
    DDPConfig,
    LRScheduleConfig,
    MegatronOptimizer,
    OptimizerConfig,
    OptimizerParamScheduler,
)
from pp_schedules import MemoryProbe, PipelineExecutor, ScheduleConfig, get_forward_backward_func
from pp_schedules.planning import resolve_on_demand
from pp_state import ParallelConfig, ParallelState, Placement
from pp_tensor import MODEL_PARALLEL_RNG, RNGStatesTracker
from pp_train import (
    PretrainConfig,
    build_forward_backward_func,
    microbatches,
    setup_model_and_optimizer,
    train_step,
    training_state_tensors,
)
from pp_train.app import CorpusDataset, GPTChunk, GPTConfig, chunk_layers, gpt_forward_step

SEED = 7
OPTIMIZER = OptimizerConfig(lr=1e-3)
"""Adam in fp32, Megatron's defaults otherwise: what the byte model is given too."""
PRETRAIN = PretrainConfig(optimizer=OPTIMIZER, ddp=DDPConfig())
"""The settings `pp_train.memory_plan.memory_model` reads (precision, optimizer, grad dtype)."""
TORCH_SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
}


@functools.cache
def parallel_state(pp: int, vp: int, tp: int = 1) -> ParallelState:
    """The groups of `pp` stages of `tp` ranks, `vp` chunks each (data parallel: the rest).

    Every rank asks for the same sizes in the same order (group creation is collective).
    """
    return ParallelState.create(
        ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        )
    )


@dataclasses.dataclass(frozen=True)
class Setup:
    """One configuration of the pipeline: sizes, schedule, microbatches."""

    pp: int
    schedule: str
    vp: int = 1
    placement: str = "looped"
    microbatches: int = 8
    micro_batch_size: int = 2
    tp: int = 1
    sequence_parallel: bool = False

    @property
    def label(self) -> str:
        """How the tables name it."""
        chunks = f" vp{self.vp}" if self.vp > 1 else ""
        tensor = f"tp{self.tp} x " if self.tp > 1 else ""
        sequence = " sp" if self.sequence_parallel else ""
        return f"{tensor}pp{self.pp}{chunks} {self.schedule}{sequence}"

    def layer_counts(self, num_layers: int) -> tuple[int, ...]:
        """Transformer layers of each virtual stage (an even split)."""
        stages = self.pp * self.vp
        return (num_layers // stages,) * stages


@dataclasses.dataclass(frozen=True)
class Column:
    """A table column: its title, its width (negative: left-aligned) and its cell."""

    title: str
    width: int
    cell: Callable[[dict[str, Any]], str]


def header(columns: tuple[Column, ...]) -> str:
    """The titles, aligned as the cells."""
    return " ".join(f"{c.title:<{-c.width}}" if c.width < 0 else f"{c.title:>{c.width}}"
                    for c in columns).rstrip()  # fmt: skip


def row(columns: tuple[Column, ...], record: dict[str, Any]) -> str:
    """One record's cells."""
    cells = [(c.cell(record), c.width) for c in columns]
    return " ".join(f"{v:<{-w}}" if w < 0 else f"{v:>{w}}" for v, w in cells).rstrip()


def text(key: str) -> Callable[[dict[str, Any]], str]:
    """A cell showing ``record[key]`` as it is."""
    return lambda record: str(record[key])


def fixed(key: str, digits: int) -> Callable[[dict[str, Any]], str]:
    """A cell showing ``record[key]`` to `digits` decimals."""
    return lambda record: f"{record[key]:.{digits}f}"


def megabytes(key: str, digits: int = 3) -> Callable[[dict[str, Any]], str]:
    """A cell showing the bytes ``record[key]`` in MB (2**20 bytes)."""
    return lambda record: f"{record[key] / 2**20:.{digits}f}"


def verdict(record: dict[str, Any]) -> str:
    """Whether the row meets its goal."""
    return "yes" if record["passed"] else "NO"


def _corpus() -> torch.Tensor:
    return torch.randint(0, 256, (1 << 15,), generator=torch.Generator().manual_seed(0))


class Training:
    """One configuration trained through pp-train's `train_step`, as a run trains it.

    Args:
        setup: Sizes, schedule and microbatches.
        gpt: The model's shape (dropout and recomputation included).
    """

    def __init__(self, setup: Setup, gpt: GPTConfig) -> None:
        self.setup, self.gpt = setup, gpt
        self.state = parallel_state(setup.pp, setup.vp, setup.tp)
        self.placement = Placement.named(setup.placement, setup.pp, setup.vp)
        self.model, self.optimizer, self.scheduler = self._build()
        resolved = resolve_on_demand(
            setup.schedule, pp_size=setup.pp, vp_size=setup.vp, placement=self.placement
        )
        self.executor: PipelineExecutor = build_forward_backward_func(
            self.state, self.model, self.optimizer, hidden_size=gpt.hidden_size, resolved=resolved,
            sequence_parallel=setup.sequence_parallel,
        )  # fmt: skip
        dp = self.state.group_size("dp")
        self.streams = [
            microbatches(CorpusDataset(_corpus(), gpt.seq_length, seed=3), consumed_samples=0,
                         micro_batch_size=setup.micro_batch_size,
                         data_parallel_rank=self.state.group_rank("dp"), data_parallel_size=dp)
            for _ in range(setup.vp)
        ]  # fmt: skip

    def _build(self) -> tuple[list[torch.nn.Module], MegatronOptimizer, OptimizerParamScheduler]:
        gpt, setup, rank = self.gpt, self.setup, self.state.pipeline_model_parallel_rank

        tracker = RNGStatesTracker("cpu")  # dropout draws under it, as in the command's runs
        tracker.add(MODEL_PARALLEL_RNG, SEED + 1)

        def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
            layers = chunk_layers(gpt.num_layers, setup.pp, setup.vp, rank, vp_stage,
                                  placement=self.placement)  # fmt: skip
            return GPTChunk(gpt, layers=layers, pre_process=pre_process,
                            post_process=post_process, seed=SEED, rng_tracker=tracker,
                            tp_group=self.state.group("tp") if setup.tp > 1 else None,
                            sequence_parallel=setup.sequence_parallel)  # fmt: skip

        model, optimizer, scheduler, _ = setup_model_and_optimizer(
            provider, self.state, optimizer_config=OPTIMIZER,
            lr_schedule=LRScheduleConfig(max_lr=1e-3, lr_decay_steps=100,
                                         lr_decay_style="constant"),
            ddp_config=PRETRAIN.ddp, placement=self.placement,
        )  # fmt: skip
        return model, optimizer, scheduler

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the model (ranks over pipeline ranks)."""
        return self.state.group_size("dp")

    def step(self) -> None:
        """One training iteration: forward-backward, gradient reduction, optimizer step."""
        setup = self.setup
        train_step(
            gpt_forward_step, self.streams if setup.vp > 1 else self.streams[0], self.model,
            self.optimizer, self.scheduler, forward_backward_func=self.executor,
            state=self.state, num_microbatches=setup.microbatches,
            micro_batch_size=setup.micro_batch_size, seq_length=self.gpt.seq_length,
            placement=self.placement,
        )  # fmt: skip

    def probed_steps(self, steps: int, warm: int = 0) -> MemoryProbe:
        """`steps` iterations measured, after `warm` ones counted but not kept.

        A probe on the executor counts every storage each whole iteration allocates (its
        optimizer step too), with a sample after each compute step and one at the end. The
        probe's static bytes are the training state (`training_state_tensors`: parameters,
        gradient buffers, optimizer state). Counting from the first warm step on sees what a
        step keeps for the next (pp-comm's frames).
        """
        probe = MemoryProbe(functools.partial(training_state_tensors, self.model, self.optimizer))
        self.executor.record_memory(probe)
        try:
            for number in range(warm + steps):
                if number == warm:
                    probe.clear()
                with probe.counting():
                    self.step()
                    probe.sample("step end")
        finally:
            self.executor.record_memory(None)
        return probe

    def timed_step(self, counting: bool) -> Callable[[], None]:
        """One iteration, with the probe counting every storage (`counting`) or without."""
        probe = MemoryProbe(functools.partial(training_state_tensors, self.model, self.optimizer))

        def step() -> None:
            if not counting:
                self.step()
                return
            self.executor.record_memory(probe)
            try:
                with probe.counting():
                    self.step()
                    probe.sample("step end")
            finally:
                self.executor.record_memory(None)
                probe.clear()

        return step


def timed(step: Callable[[], None]) -> float:
    """Seconds for one step, every rank starting and ending together."""
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def alternate(first: Callable[[], None], second: Callable[[], None], rounds: int) -> list[float]:
    """Median seconds of each over `rounds` rounds in the order A B, B A, A B, ..."""
    times: list[list[float]] = [[], []]
    pairs = [(0, first), (1, second)]
    for index in range(rounds):
        for which, step in pairs if index % 2 == 0 else reversed(pairs):
            times[which].append(timed(step))
    return [statistics.median(t) for t in times]


# ---------------------------------------------------------------------------- against torch
def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``[batch, seq, vocab]`` logits: both executors' loss."""
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    )


class TorchStage(torch.nn.Module):
    """A GPT chunk as torch's `PipelineStage` calls it: the activations as the argument."""

    def __init__(self, chunk: GPTChunk) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, given: torch.Tensor) -> torch.Tensor:
        """Tokens on the first stage, the previous stage's activations elsewhere."""
        if self.chunk.pre_process:
            return self.chunk(given)  # type: ignore[no-any-return]
        self.chunk.set_input_tensor([given])
        return self.chunk(None)  # type: ignore[no-any-return]


class PipelinePair:
    """One rank's GPT chunk under this package's executor and under torch's schedule.

    Both get the same chunk, the same microbatches (token windows drawn once) and the same
    loss (`token_loss` on the last stage's logits). Only one chunk per rank: torch's
    single-stage 1F1B and GPipe.

    Args:
        setup: Pipeline size, schedule ("1f1b" or "gpipe"), microbatches.
        gpt: The model's shape.
    """

    def __init__(self, setup: Setup, gpt: GPTConfig) -> None:
        self.setup, self.gpt = setup, gpt
        state = parallel_state(setup.pp, 1)
        rank, pp = state.pipeline_model_parallel_rank, setup.pp
        self.stage = rank
        self.chunk = GPTChunk(
            gpt, layers=chunk_layers(gpt.num_layers, pp, 1, rank, 0),
            pre_process=rank == 0, post_process=rank == pp - 1, seed=SEED,
        )  # fmt: skip
        generator = torch.Generator().manual_seed(1)
        shape = (setup.microbatches * setup.micro_batch_size, gpt.seq_length)
        self.tokens = torch.randint(0, gpt.vocab_size, shape, generator=generator)
        self.labels = torch.randint(0, gpt.vocab_size, shape, generator=generator)
        self.communicator = P2PCommunicator(
            state.group("pp"), config=CommConfig(pipeline_dtype=torch.float32)
        )
        self.ours = get_forward_backward_func(
            self.communicator, resolve_on_demand(setup.schedule, pp_size=pp),
            config=ScheduleConfig(hidden_size=gpt.hidden_size),
        )  # fmt: skip
        stage = PipelineStage(TorchStage(self.chunk), rank, pp, torch.device("cpu"),
                              group=state.group("pp"))  # fmt: skip
        self.torch_schedule = TORCH_SCHEDULES[setup.schedule](
            stage, n_microbatches=setup.microbatches, loss_fn=token_loss
        )

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        size = self.setup.micro_batch_size
        for start in range(0, self.tokens.shape[0], size):
            end = start + size
            yield {"tokens": self.tokens[start:end], "labels": self.labels[start:end]}

    def _forward_step(
        self, data: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]]:
        batch = next(data)
        output: torch.Tensor = model(batch["tokens"] if self.chunk.pre_process else None)
        return output, lambda logits: (token_loss(logits, batch["labels"]), {})

    def ours_step(self) -> None:
        """One step of this package's executor."""
        self.chunk.zero_grad(set_to_none=True)
        self.ours(
            forward_step_func=self._forward_step, data_iterator=self._batches(),
            model=[self.chunk], num_microbatches=self.setup.microbatches,
            seq_length=self.gpt.seq_length, micro_batch_size=self.setup.micro_batch_size,
        )  # fmt: skip

    def torch_step(self) -> None:
        """One step of torch's schedule."""
        self.chunk.zero_grad(set_to_none=True)
        first, last = self.chunk.pre_process, self.chunk.post_process
        if first:
            self.torch_schedule.step(self.tokens)
        elif last:
            self.torch_schedule.step(target=self.labels)
        else:
            self.torch_schedule.step()

    def peak_saved(self, step: Callable[[], None]) -> int:
        """The most bytes saved for backward at once during `step` (parameters left out)."""
        probe = MemoryProbe(static=self.chunk.parameters)
        dist.barrier()
        with probe.saved_tensors():
            step()
        dist.barrier()
        return probe.peak_saved_bytes

    def close(self) -> None:
        """Release the communicator's own groups, if any."""
        self.communicator.destroy()
