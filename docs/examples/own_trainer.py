"""A pipeline-parallel training loop of your own, from pp-state, pp-comm and pp-schedules only.

Run it under torchrun, on CPU (gloo):

    torchrun --standalone --nproc-per-node 4 docs/examples/own_trainer.py \
        --pipeline-model-parallel-size 2 [--virtual-stages 2] [--iters 5] [--check]

The model is a tiny language model (an embedding, residual Linear layers, an output layer),
built from one seed on every rank; each rank keeps only its model chunks. pp-schedules runs
the pipeline schedule, a plain torch.optim optimizer updates the chunks, and gradients are
averaged over data-parallel ranks by hand. With --check, rank 0 also trains the whole model
in one process and the last rank compares the losses of every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the usual spelling

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import ScheduleConfig, get_forward_backward_func
from pp_schedules.planning import plan
from pp_schedules.runtime import resolve_for
from pp_state import ParallelConfig, ParallelState, Placement

__all__ = [
    "ModelChunk",
    "TrainerConfig",
    "average_gradients",
    "build_chunks",
    "check_against_one_process",
    "forward_step",
    "global_batches",
    "main",
    "reference_losses",
    "train",
]

VOCAB = 32
"""Token ids are 0 .. VOCAB - 1."""

STRIDE = 3
"""Each sequence counts up by STRIDE modulo VOCAB, so the next token is learnable."""

TOLERANCE = 1e-5
"""Largest relative loss difference --check accepts between the pipelined and whole model."""

Microbatch = tuple[torch.Tensor, torch.Tensor]
"""Token ids and labels, both (micro_batch_size, seq_length) as a data loader yields them."""

LossFunc = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The job: parallel sizes, model and batch sizes, and the run."""

    world_size: int
    """Number of ranks (torchrun's WORLD_SIZE)."""

    pipeline_model_parallel_size: int = 1
    """Pipeline stages; the rest of the world is data parallelism."""

    virtual_stages: int | None = None
    """Model chunks per rank (interleaved 1F1B); None or 1 for one chunk."""

    num_layers: int = 8
    """Residual Linear layers, split evenly over the pp x vp virtual stages."""

    hidden_size: int = 16
    """Width of the activations that travel between stages."""

    seq_length: int = 4
    """Tokens per sequence."""

    micro_batch_size: int = 2
    """Sequences per microbatch."""

    num_microbatches: int | None = None
    """Microbatches per step on each data-parallel rank; None for twice the pipeline size."""

    microbatch_group_size: int | None = None
    """Interleaved schedule only: microbatches per group (the pipeline size by default)."""

    iters: int = 5
    """Optimizer steps."""

    lr: float = 0.05
    """Learning rate of SGD with momentum."""

    seed: int = 1234
    """Seed of the initial weights; the data uses seed + 1."""

    check: bool = False
    """Also train the whole model in one process and compare the losses."""

    timeout_seconds: float = 60.0
    """Longest wait for any collective or transfer."""

    def __post_init__(self) -> None:
        """Refuse sizes that do not fit the world, the layers or the schedule.

        Raises:
            ValueError: A size is out of range, the pipeline does not divide the world, the
                layers do not split evenly, or the schedule cannot run that many microbatches.
        """
        self._check_positive()
        pp, world = self.pipeline_model_parallel_size, self.world_size
        if world % pp:
            raise ValueError(
                f"pipeline_model_parallel_size {pp} does not divide the world size {world}; "
                f"choose one of {_divisors(world)}"
            )
        if self.vp_size > 1 and pp < 2:
            raise ValueError(
                f"virtual_stages {self.vp_size} needs pipeline_model_parallel_size of 2 or more, "
                f"got {pp}; leave virtual_stages out for a single stage"
            )
        stages = pp * self.vp_size
        if self.num_layers % stages:
            raise ValueError(
                f"{self.num_layers} layers do not split evenly over pp x vp = {pp} x "
                f"{self.vp_size} = {stages} virtual stages; choose num_layers among the "
                f"multiples of {stages}, or pp x vp among {_divisors(self.num_layers)}"
            )
        try:
            plan(
                self.schedule,
                pp_size=pp,
                num_microbatches=self.microbatches,
                vp_size=self.vp_size,
                microbatch_group_size_per_vp_stage=self.microbatch_group_size,
            )
        except ValueError as error:
            raise ValueError(
                f"{self.schedule} cannot run {self.microbatches} microbatches: {error}"
            ) from error

    def _check_positive(self) -> None:
        sizes = {
            "world_size": self.world_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "virtual_stages": self.vp_size,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "seq_length": self.seq_length,
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.microbatches,
            "iters": self.iters,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be 1 or more, got {value}")
        if not self.lr > 0 or not self.timeout_seconds > 0:
            raise ValueError(
                f"lr and timeout_seconds must be positive, got {self.lr} and {self.timeout_seconds}"
            )

    @property
    def vp_size(self) -> int:
        """Model chunks per rank (1 without interleaving)."""
        return 1 if self.virtual_stages is None else self.virtual_stages

    @property
    def data_parallel_size(self) -> int:
        """Ranks that hold the same stage and see different data."""
        return self.world_size // self.pipeline_model_parallel_size

    @property
    def microbatches(self) -> int:
        """Microbatches per step on each data-parallel rank."""
        if self.num_microbatches is None:
            return 2 * self.pipeline_model_parallel_size
        return self.num_microbatches

    @property
    def schedule(self) -> str:
        """The schedule the executor picks for these sizes."""
        if self.pipeline_model_parallel_size == 1:
            return "no_pipelining"
        return "interleaved_1f1b" if self.vp_size > 1 else "1f1b"


class ModelChunk(torch.nn.Module):
    """Consecutive layers of the model: one virtual pipeline stage, or all of them.

    The first chunk of the model embeds token ids; the others take their input from the
    previous stage through `set_input_tensor`. The last chunk ends in the output layer.
    """

    def __init__(
        self,
        layers: Sequence[torch.nn.Linear],
        *,
        embedding: torch.nn.Embedding | None,
        head: torch.nn.Linear | None,
    ) -> None:
        """Holds `layers`, with the embedding on the first chunk and the head on the last."""
        super().__init__()
        self.embedding = embedding
        self.layers = torch.nn.ModuleList(layers)
        self.head = head
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None]) -> None:
        """The executor's hook: activations from the previous stage ([None] on the first)."""
        self.input_tensor = input_tensor[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Activations (seq, batch, hidden), or logits (seq, batch, vocab) on the last chunk.

        Args:
            tokens: Token ids (batch, seq); read by the first chunk only.

        Returns:
            What the next stage receives, or the logits on the last chunk.
        """
        x: torch.Tensor
        if self.embedding is not None:
            # Stages exchange (seq, batch, hidden), Megatron's layout; sends need contiguity.
            x = self.embedding(tokens).transpose(0, 1).contiguous()
        else:
            assert self.input_tensor is not None, "the executor sets the input before forward"
            x = self.input_tensor
        for layer in self.layers:
            # A residual add ends each layer: no autograd node keeps its output, so the
            # executor may free a sent output's storage.
            x = x + torch.tanh(layer(x))
        if self.head is None:
            return x
        logits: torch.Tensor = self.head(x)
        return logits


def _all_modules(
    config: TrainerConfig,
) -> tuple[torch.nn.Embedding, list[torch.nn.Linear], torch.nn.Linear]:
    """The whole model's modules, the same on every rank for one seed."""
    torch.manual_seed(config.seed)
    hidden = config.hidden_size
    embedding = torch.nn.Embedding(VOCAB, hidden)
    layers = [torch.nn.Linear(hidden, hidden) for _ in range(config.num_layers)]
    head = torch.nn.Linear(hidden, VOCAB)
    return embedding, layers, head


def build_chunks(config: TrainerConfig, pipeline_rank: int) -> list[ModelChunk]:
    """This rank's model chunks, on Megatron's looped placement (the schedule's default).

    Args:
        config: The job.
        pipeline_rank: This rank's pipeline stage.

    Returns:
        One chunk per virtual stage this rank runs, in chunk order. The modules of other
        stages are built too (so every rank draws the same weights) and then dropped.
    """
    embedding, layers, head = _all_modules(config)
    placement = Placement.looped(config.pipeline_model_parallel_size, config.vp_size)
    chunks = []
    for chunk in range(config.vp_size):
        held = placement.layers(pipeline_rank, chunk, config.num_layers)
        chunks.append(
            ModelChunk(
                layers[held.start : held.stop],
                embedding=embedding if placement.is_first(pipeline_rank, chunk) else None,
                head=head if placement.is_last(pipeline_rank, chunk) else None,
            )
        )
    return chunks


def whole_model(config: TrainerConfig) -> ModelChunk:
    """The model unpipelined: one chunk holding every layer, from the same seed."""
    embedding, layers, head = _all_modules(config)
    return ModelChunk(layers, embedding=embedding, head=head)


def make_optimizer(params: Sequence[torch.nn.Parameter], config: TrainerConfig) -> torch.optim.SGD:
    """Any torch.optim optimizer that updates each parameter on its own works per chunk."""
    return torch.optim.SGD(params, lr=config.lr, momentum=0.9)


def global_batches(config: TrainerConfig) -> list[torch.Tensor]:
    """Each step's token sequences, (dp x microbatches, micro_batch_size, seq_length + 1).

    Every rank draws the same batches; data-parallel rank d trains on microbatches
    d * microbatches ... (d + 1) * microbatches - 1 of each step.
    """
    generator = torch.Generator().manual_seed(config.seed + 1)
    count = config.data_parallel_size * config.microbatches
    positions = torch.arange(config.seq_length + 1)
    batches = []
    for _ in range(config.iters):
        starts = torch.randint(VOCAB, (count, config.micro_batch_size, 1), generator=generator)
        batches.append((starts + STRIDE * positions) % VOCAB)
    return batches


def split_microbatches(sequences: torch.Tensor) -> list[Microbatch]:
    """Token ids and next-token labels of each microbatch."""
    return [(seq[:, :-1], seq[:, 1:]) for seq in sequences]


def lm_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of logits (seq, batch, vocab) against labels (batch, seq)."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.t().reshape(-1))


def _loss_func(
    labels: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = lm_loss(labels, output)
    return loss, {"lm loss": loss.detach()}


def forward_step(
    data_iterator: Iterator[Microbatch], model: torch.nn.Module
) -> tuple[torch.Tensor, LossFunc]:
    """The executor's callback: run one microbatch through one chunk.

    Args:
        data_iterator: This chunk's iterator; every chunk draws each microbatch once.
        model: The chunk.

    Returns:
        The chunk's output and the function the executor applies to it on the last stage.
    """
    tokens, labels = next(data_iterator)
    return model(tokens), functools.partial(_loss_func, labels)


def average_gradients(params: Sequence[torch.nn.Parameter], state: ParallelState) -> None:
    """Average every gradient over the data-parallel group with one all-reduce.

    Args:
        params: This rank's parameters; the same list, in the same order, on every
            data-parallel rank (they hold the same chunks).
        state: The job's process groups.
    """
    size = state.group_size("dp")
    if size == 1:
        return
    grads = []
    for param in params:
        if param.grad is None:  # unused this step: every rank must still send its share
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=state.group("dp"))
    flat /= size
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def _step_loss(loss_dicts: list[dict[str, torch.Tensor]], state: ParallelState) -> float:
    """The mean loss of the global batch; on the last stage, whose dp group is all last stages."""
    loss = torch.stack([d["lm loss"] for d in loss_dicts]).mean()
    dist.all_reduce(loss, group=state.group("dp"))
    return float(loss) / state.group_size("dp")


def train(config: TrainerConfig) -> list[float]:
    """Train the pipelined model; every rank calls it once torch.distributed is initialised.

    Args:
        config: The job.

    Returns:
        Each step's mean loss over the global batch on the pipeline's last stage; [] elsewhere.
    """
    timeout = datetime.timedelta(seconds=config.timeout_seconds)
    state = ParallelState.create(
        ParallelConfig(
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=config.virtual_stages
            if config.vp_size > 1
            else None,
            timeout=timeout,
        )
    )
    comm = (
        P2PCommunicator.from_parallel_state(state, config=CommConfig(timeout=timeout))
        if config.pipeline_model_parallel_size > 1
        else None
    )
    chunks = build_chunks(config, state.pipeline_model_parallel_rank)
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = make_optimizer(params, config)
    resolved = resolve_for(
        comm,
        vp_size=config.vp_size,
        microbatch_counts=[config.microbatches],
        microbatch_group_size_per_vp_stage=config.microbatch_group_size,
    )
    forward_backward = get_forward_backward_func(
        comm, resolved, config=ScheduleConfig(hidden_size=config.hidden_size)
    )
    m, dp_rank = config.microbatches, state.data_parallel_rank
    losses = []
    for step, sequences in enumerate(global_batches(config), start=1):
        mine = split_microbatches(sequences[dp_rank * m : (dp_rank + 1) * m])
        optimizer.zero_grad()
        loss_dicts = forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(mine) for _ in chunks],  # one per chunk: each draws all m
            model=chunks,
            num_microbatches=m,
            seq_length=config.seq_length,
            micro_batch_size=config.micro_batch_size,
        )
        average_gradients(params, state)
        optimizer.step()
        if state.is_pipeline_last_stage():
            losses.append(_step_loss(loss_dicts, state))
            if state.rank == config.world_size - 1:
                print(f"step {step} | loss {losses[-1]:.6f}", flush=True)
    if comm is not None:
        comm.destroy()
    state.destroy()
    return losses


def reference_losses(config: TrainerConfig) -> list[float]:
    """Each step's mean loss when the whole model trains in one process on the same batches.

    Args:
        config: The job; its parallel sizes only decide how many microbatches a step holds.

    Returns:
        One loss per step, the mean over all data-parallel ranks' microbatches.
    """
    model = whole_model(config)
    optimizer = make_optimizer(list(model.parameters()), config)
    losses = []
    for sequences in global_batches(config):
        microbatches = split_microbatches(sequences)
        optimizer.zero_grad()
        total = 0.0
        for tokens, labels in microbatches:
            loss = lm_loss(labels, model(tokens))
            (loss / len(microbatches)).backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total / len(microbatches))
    return losses


def check_against_one_process(config: TrainerConfig, losses: list[float]) -> bool:
    """Rank 0 trains the whole model, the last rank compares, and every rank gets the verdict.

    Args:
        config: The job.
        losses: The pipelined run's losses on the last rank (anything elsewhere).

    Returns:
        Whether every step's loss is within `TOLERANCE` (relative) of the single process's.
    """
    # A group of its own, destroyed before exit: once torch.optim has imported torch._dynamo
    # (torch 2.13), the default group outlives destroy_process_group, and a gloo worker that
    # frees a collective's tensor during interpreter shutdown aborts the process.
    group = dist.new_group(timeout=datetime.timedelta(seconds=config.timeout_seconds))
    reference = torch.zeros(config.iters, dtype=torch.float64)
    if dist.get_rank() == 0:
        reference = torch.tensor(reference_losses(config), dtype=torch.float64)
    dist.broadcast(reference, src=0, group=group)
    last = config.world_size - 1
    failed = torch.zeros(1)
    if dist.get_rank() == last:
        pipelined = torch.tensor(losses, dtype=torch.float64)
        worst = float(((pipelined - reference).abs() / reference.abs()).max())
        if worst <= TOLERANCE:
            print(f"matches the single-process run: max relative difference {worst:.3g}")
        else:
            print(
                f"differs from the single-process run: max relative difference {worst:.3g} "
                f"(tolerance {TOLERANCE:g})"
            )
            failed.fill_(1)
    dist.broadcast(failed, src=last, group=group)
    dist.destroy_process_group(group)
    return not failed.item()


def build_parser() -> argparse.ArgumentParser:
    """Megatron's flag names where Megatron has one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--virtual-stages", type=int, default=None, help="model chunks per rank")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--num-microbatches", type=int, default=None, help="default 2 x pp")
    parser.add_argument("--microbatch-group-size", type=int, default=None)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--check", action="store_true", help="compare with one process")
    parser.add_argument("--timeout-seconds", type=float, default=60.0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, train, optionally check; 0 on success.

    Args:
        argv: The flags; the command line's by default.

    Returns:
        The exit status: 1 when --check finds a difference above the tolerance.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    # An entry point may read torchrun's environment; the library layers never do.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = TrainerConfig(world_size=world_size, **vars(args))
    except ValueError as error:
        parser.error(str(error))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=config.timeout_seconds))
    try:
        if dist.get_rank() == world_size - 1:
            print(
                f"pp {config.pipeline_model_parallel_size} x dp {config.data_parallel_size}, "
                f"{config.vp_size} chunk(s) per rank, {config.schedule}, "
                f"{config.microbatches} microbatches of {config.micro_batch_size} x "
                f"{config.seq_length} tokens per rank and step",
                flush=True,
            )
        losses = train(config)
        ok = check_against_one_process(config, losses) if config.check else True
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
