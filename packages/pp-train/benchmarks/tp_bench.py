"""Tensor parallelism: pp-tensor's layers under pp-schedules against torch's DTensor and pipelining.

Four ranks over gloo; both sides train the same GPT-like transformer (pre-LayerNorm blocks:
causal self-attention with a fused qkv projection, then a GELU MLP; fp32; no embedding: random
input activations and a mean-squared-error loss) from the same full weights on the same
microbatches, in the same processes:

- ``ours``: blocks of pp-tensor's `ColumnParallelLinear` (qkv, fc1) and `RowParallelLinear`
  (proj, fc2, ``input_is_parallel``) over the tensor-parallel group of a pp-state
  `ParallelState`, activations (sequence, batch, hidden) as Megatron keeps them, each rank's
  attention over its heads / tp, run by pp-schedules' 1F1B executor over pp-comm.
- ``torch``: the same blocks of plain ``nn.Linear`` in torch's own (batch, sequence, hidden)
  order, parallelized by DTensor's ``parallelize_module`` (qkv and fc1 ``ColwiseParallel``,
  proj and fc2 ``RowwiseParallel``) on the ``tp`` dimension of an ``init_device_mesh("cpu",
  (2, 2))``, the local head count set to heads / tp, staged by torch.distributed.pipelining
  (``PipelineStage`` + ``Schedule1F1B``) over the mesh's ``pp`` dimension.
- ``+sp``: each with sequence parallelism. Ours: the layers' ``sequence_parallel`` (the
  sequence is split outside the linear layers: all-gathered before qkv and fc1,
  reduce-scattered after proj and fc2), the LayerNorm and row-parallel-bias gradients summed
  over tp after backward (pp-train's `finalize_model_grads`, as Megatron's). Torch's:
  ``SequenceParallel`` on the LayerNorms, ``input_layouts=Shard(1)`` / ``output_layouts=
  Shard(1)`` on the linear styles (DTensor sums those gradients itself, as Partial
  placements, when the optimizer reads them). The first stage splits the input along the
  sequence, the last stage all-gathers its output before the loss.

Layouts (rows), each measured in the same run:

- ``tp2 x pp2``: two pipeline stages of two tensor-parallel ranks each, half the layers per
  stage, 1F1B over the microbatches.
- ``tp2 x dp2``: tp 2 alone: the four ranks as two tensor-parallel pairs, each training the
  whole model on the same batch with no data-parallel gradient sync (two independent
  replicas, so the pairs only share the machine); ours runs pp-schedules' no-pipelining
  schedule, torch's a plain loop of forward and backward per microbatch.

A step is zero grads, the forward and backward of every microbatch (gradients averaged over
them), for ours pp-train's `finalize_model_grads` (the sequence-parallel gradient sum), and an
SGD step (``foreach``, as torch's default; learning rate 1.0, large enough that a wrong
gradient shows in the next loss). Every step trains on the same microbatches. Before timing,
each contender's first two steps give their losses (the second after the first's gradients
and update): ours and torch's must agree within 1e-5 relative (printed), so both do the same
work. Then rounds alternate A B C D / D C B A over ours, torch, ours+sp, torch+sp; each
block's time is the slowest rank's; the table shows medians. Goals (issue 27):

1. step time ours / torch <= 1.00 (the same sequence-parallel setting on both sides);
2. parameter bytes per rank at tp 2 / tp 1 = 0.50 +- 2% (distinct local storages of the
   stage's parameters; DTensors count their local shards; tp 1 is the same stage unsplit;
   the largest rank's). LayerNorm weights and row-parallel biases stay whole on every tp
   rank, so the ratio is a little over one half.

Prints the load average at the start and at the end; ``--json`` prints JSON lines instead of
the table, ``--quick`` two rounds of one step (check that it runs).

    torchrun --standalone --nproc-per-node 4 packages/pp-train/benchmarks/tp_bench.py
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's own convention
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import ScheduleConfig, get_forward_backward_func
from pp_state import ParallelConfig, ParallelState
from pp_tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    divide,
    gather_from_sequence_parallel_region,
    mark_sequence_parallel,
    scatter_to_sequence_parallel_region,
    shard_of,
    tp_rank,
    tp_size,
)
from pp_train import finalize_model_grads

TP = 2
TIME_GOAL = 1.0
"""ours / torch step time must be at most this."""
BYTES_GOAL, BYTES_TOLERANCE = 0.5, 0.02
"""Parameter bytes at tp 2 over tp 1: one half, within 2%."""
LOSS_TOLERANCE = 1e-5
"""Relative difference allowed between ours' and torch's first loss."""
LAYOUTS = {"tp2xpp2": 2, "tp2xdp2": 1}
"""Each row's layout on the four ranks: its pipeline size."""
KINDS = ("ours", "torch", "ours+sp", "torch+sp")

Weights = dict[str, torch.Tensor]
Batch = dict[str, torch.Tensor]
Step = Callable[[], list[float]]
"""One training step; returns the microbatch losses where this rank computes them."""


class Where(NamedTuple):
    """This rank's place in a layout: ours' parallel state, torch's mesh over the same ranks."""

    state: ParallelState
    mesh: DeviceMesh
    """Torch's 2-D mesh: (pp or dp, tp)."""

    @property
    def tp_group(self) -> dist.ProcessGroup:
        """Ours' tensor-parallel group."""
        return self.state.group("tp")

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.state.pipeline_model_parallel_rank

    @property
    def stages(self) -> int:
        """The pipeline size."""
        return self.state.pipeline_model_parallel_size

    @property
    def first(self) -> bool:
        """Whether this rank holds the first layers."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Whether this rank holds the last layers (and computes the loss)."""
        return self.stage == self.stages - 1


# ----------------------------------------------------------------------------------- model
def full_weights(hidden: int, layers: int) -> list[Weights]:
    """Every layer's unsplit weights, seeded; the qkv rows in per-head [q k v] order."""
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "ln1.weight": (hidden,), "ln1.bias": (hidden,),
        "qkv.weight": (3 * hidden, hidden), "qkv.bias": (3 * hidden,),
        "proj.weight": (hidden, hidden), "proj.bias": (hidden,),
        "ln2.weight": (hidden,), "ln2.bias": (hidden,),
        "fc1.weight": (4 * hidden, hidden), "fc1.bias": (4 * hidden,),
        "fc2.weight": (hidden, 4 * hidden), "fc2.bias": (hidden,),
    }  # fmt: skip

    def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        one = 1.0 if name.startswith("ln") and name.endswith("weight") else 0.0
        return one + 0.02 * torch.randn(shape, generator=generator)

    return [{name: tensor(name, shape) for name, shape in shapes.items()} for _ in range(layers)]


def attention(qkv: torch.Tensor, heads: int, *, sequence_first: bool) -> torch.Tensor:
    """Causal self-attention over a fused qkv of `heads` heads; the output in qkv's order.

    `qkv` is (sequence, batch, 3 x width) or (batch, sequence, 3 x width), each head's q, k
    and v side by side (the order whose contiguous split gives a tp rank whole heads).
    """
    if sequence_first:
        qkv = qkv.transpose(0, 1)
    batch, sequence, width = qkv.shape
    per_head = qkv.view(batch, sequence, heads, 3, width // (3 * heads))
    q, k, v = per_head.permute(3, 0, 2, 1, 4).unbind(0)  # each (batch, heads, sequence, dim)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = out.permute(2, 0, 1, 3) if sequence_first else out.transpose(1, 2)
    return out.reshape(*out.shape[:2], -1)


def layer_norm(weights: Weights, name: str) -> torch.nn.LayerNorm:
    """A LayerNorm holding `weights`' `name`.weight and `name`.bias."""
    norm = torch.nn.LayerNorm(weights[f"{name}.weight"].numel())
    with torch.no_grad():
        norm.weight.copy_(weights[f"{name}.weight"])
        norm.bias.copy_(weights[f"{name}.bias"])
    return norm


def fill_bias(layer: ColumnParallelLinear | RowParallelLinear, value: torch.Tensor) -> None:
    """Sets `layer`'s bias (its slice of the model's) to `value`."""
    assert layer.bias is not None
    with torch.no_grad():
        layer.bias.copy_(value)


def filler(full: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """An init_method that fills a layer's full (master) weight with `full`."""

    def fill(weight: torch.Tensor) -> None:
        with torch.no_grad():
            weight.copy_(full)

    return fill


class OursBlock(torch.nn.Module):
    """A transformer block of pp-tensor's layers; activations (sequence, batch, hidden)."""

    def __init__(
        self, weights: Weights, heads: int, tp_group: dist.ProcessGroup | None, sp: bool
    ) -> None:
        super().__init__()
        hidden = weights["proj.weight"].shape[0]
        common: dict[str, Any] = {"tp_group": tp_group, "sequence_parallel": sp}
        self.ln1, self.ln2 = layer_norm(weights, "ln1"), layer_norm(weights, "ln2")
        self.qkv = ColumnParallelLinear(
            hidden, 3 * hidden, init_method=filler(weights["qkv.weight"]), **common
        )
        self.proj = RowParallelLinear(
            hidden, hidden, init_method=filler(weights["proj.weight"]), input_is_parallel=True,
            **common,
        )  # fmt: skip
        self.fc1 = ColumnParallelLinear(
            hidden, 4 * hidden, init_method=filler(weights["fc1.weight"]), **common
        )
        self.fc2 = RowParallelLinear(
            4 * hidden, hidden, init_method=filler(weights["fc2.weight"]), input_is_parallel=True,
            **common,
        )  # fmt: skip
        size, rank = tp_size(tp_group), tp_rank(tp_group)
        # The layers start their biases at zero; these are the model's.
        for name, split in (("qkv", True), ("proj", False), ("fc1", True), ("fc2", False)):
            bias = weights[f"{name}.bias"]
            fill_bias(getattr(self, name), shard_of(bias, 0, rank, size) if split else bias)
        if sp:
            mark_sequence_parallel([*self.ln1.parameters(), *self.ln2.parameters()])
        self.heads = divide(heads, size, "attention heads")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention then MLP, each added to the residual stream."""
        qkv: torch.Tensor = self.qkv(self.ln1(x))[0]
        attended: torch.Tensor = self.proj(attention(qkv, self.heads, sequence_first=True))[0]
        x = x + attended
        hidden: torch.Tensor = self.fc1(self.ln2(x))[0]
        out: torch.Tensor = self.fc2(F.gelu(hidden))[0]
        return x + out


class OursStage(torch.nn.Module):
    """One pipeline stage of `OursBlock`s, taking the previous stage's activations by hook."""

    def __init__(self, blocks: list[OursBlock], where: Where, sp: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.input_tensor: torch.Tensor | None = None
        self.where, self.sp = where, sp

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        """Megatron's hook: the previous stage's activations (None on the first stage)."""
        self.input_tensor = tensors[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks; with sequence parallelism the first stage splits, the last gathers."""
        group = self.where.tp_group
        if self.input_tensor is not None:
            x = self.input_tensor
        elif self.sp:
            x = scatter_to_sequence_parallel_region(x, tp_group=group)
        for block in self.blocks:
            x = block(x)
        if self.sp and self.where.last:
            # Every tp rank computes the same loss from the whole output, so its gradient is
            # already whole: backward keeps this rank's part, no reduction.
            x = gather_from_sequence_parallel_region(
                x, tp_group=group, tensor_parallel_output_grad=False
            )
        return x


def linear(weights: Weights, name: str) -> torch.nn.Linear:
    """A plain Linear holding `weights`' `name`.weight and `name`.bias."""
    out_features, in_features = weights[f"{name}.weight"].shape
    layer = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        layer.weight.copy_(weights[f"{name}.weight"])
        layer.bias.copy_(weights[f"{name}.bias"])
    return layer


class TorchBlock(torch.nn.Module):
    """The same block of plain modules; activations (batch, sequence, hidden)."""

    def __init__(self, weights: Weights, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = layer_norm(weights, "ln1"), layer_norm(weights, "ln2")
        self.qkv, self.proj = linear(weights, "qkv"), linear(weights, "proj")
        self.fc1, self.fc2 = linear(weights, "fc1"), linear(weights, "fc2")
        self.heads = heads
        """Heads this rank computes: set to heads / tp once parallelized."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention then MLP, each added to the residual stream."""
        x = x + self.proj(attention(self.qkv(self.ln1(x)), self.heads, sequence_first=False))
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x + out


class TorchStage(torch.nn.Module):
    """One pipeline stage of `TorchBlock`s."""

    def __init__(self, blocks: list[TorchBlock], where: Where, sp: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.where, self.sp = where, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks; with sequence parallelism the first stage splits, the last gathers."""
        tp_mesh = self.where.mesh["tp"]
        if self.sp and self.where.first:
            x = x.tensor_split(TP, dim=1)[tp_mesh.get_local_rank()]
        for block in self.blocks:
            x = block(x)
        if self.sp and self.where.last:
            x = DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False).full_tensor()
        return x


def torch_plan(sp: bool) -> dict[str, ParallelStyle]:
    """Torch's tensor-parallel styles for a block, with or without sequence parallelism."""
    if not sp:
        return {
            "qkv": ColwiseParallel(), "proj": RowwiseParallel(),
            "fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
        }  # fmt: skip
    return {
        "ln1": SequenceParallel(), "qkv": ColwiseParallel(input_layouts=Shard(1)),
        "proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    }  # fmt: skip


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor's local shard)."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}
    return sum(storages.values())


# ------------------------------------------------------------------------------- contenders
class Contender(NamedTuple):
    """One way to train: its step and its parameter bytes at tp 2 and unsplit."""

    step: Step
    param_bytes: int
    param_bytes_tp1: int


def microbatches(args: argparse.Namespace) -> list[Batch]:
    """The microbatches, (batch, sequence, hidden) inputs and targets, seeded."""
    generator = torch.Generator().manual_seed(1)
    shape = (args.micro_batch, args.seq, args.hidden)
    return [
        {key: torch.randn(shape, generator=generator) for key in ("x", "y")}
        for _ in range(args.microbatches)
    ]


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error, the loss of both sides."""
    return F.mse_loss(output, target)


def ours_forward_step(
    it: Iterator[Batch], model: OursStage
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    """pp-schedules' forward step: the stage's output and its loss function."""
    batch = next(it)
    output = model(batch["x"])

    def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = mse(out, batch["y"])
        return loss, {"loss": loss.detach()}

    return output, loss_func


def ours(
    args: argparse.Namespace,
    weights: list[Weights],
    where: Where,
    comm: P2PCommunicator | None,
    sp: bool,
) -> Contender:
    """pp-tensor's blocks of this rank's layers under pp-schedules' executor."""
    chunk = OursStage([OursBlock(w, args.heads, where.tp_group, sp) for w in weights], where, sp)
    unsplit = OursStage([OursBlock(w, args.heads, None, False) for w in weights], where, False)
    data = [
        {key: value.transpose(0, 1).contiguous() for key, value in batch.items()}
        for batch in microbatches(args)
    ]
    executor = get_forward_backward_func(comm, config=ScheduleConfig(hidden_size=args.hidden))
    optimizer = torch.optim.SGD(chunk.parameters(), lr=args.lr)
    seq_length = args.seq // TP if sp else args.seq

    def step() -> list[float]:
        optimizer.zero_grad()
        losses = executor(
            forward_step_func=ours_forward_step,
            data_iterator=[iter(data)],
            model=[chunk],
            num_microbatches=len(data),
            seq_length=seq_length,
            micro_batch_size=args.micro_batch,
        )
        finalize_model_grads([chunk], where.state)
        optimizer.step()
        return [float(loss["loss"]) for loss in losses]

    return Contender(step, storage_bytes(chunk.parameters()), storage_bytes(unsplit.parameters()))


def torch_pipelined(module: TorchStage, where: Where, data: list[Batch]) -> Step:
    """Forward and backward of every microbatch by torch's PipelineStage and Schedule1F1B."""
    pp_group = where.mesh["pp"].get_group()
    stage = PipelineStage(module, where.stage, where.stages, torch.device("cpu"), group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=len(data), loss_fn=mse)
    inputs = torch.cat([batch["x"] for batch in data])
    targets = torch.cat([batch["y"] for batch in data])

    def run() -> list[float]:
        losses: list[torch.Tensor] = []
        if where.first:
            schedule.step(inputs)
        elif where.last:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        return [loss.item() for loss in losses]

    return run


def torch_looped(module: TorchStage, data: list[Batch]) -> Step:
    """Forward and backward of every microbatch in turn, gradients averaged over them."""

    def run() -> list[float]:
        losses = []
        for batch in data:
            loss = mse(module(batch["x"]), batch["y"])
            (loss / len(data)).backward()
            losses.append(loss.item())
        return losses

    return run


def theirs(args: argparse.Namespace, weights: list[Weights], where: Where, sp: bool) -> Contender:
    """Torch's DTensor tensor parallelism of the same layers, pipelined by torch."""
    blocks = [TorchBlock(w, args.heads) for w in weights]
    module = TorchStage(blocks, where, sp)
    unsplit = storage_bytes(module.parameters())
    for block in blocks:
        parallelize_module(block, where.mesh["tp"], torch_plan(sp))
        block.heads = divide(args.heads, TP, "attention heads")
    data = microbatches(args)
    run = torch_pipelined(module, where, data) if where.stages > 1 else torch_looped(module, data)
    optimizer = torch.optim.SGD(module.parameters(), lr=args.lr)

    def step() -> list[float]:
        optimizer.zero_grad()
        losses = run()
        optimizer.step()
        return losses

    return Contender(step, storage_bytes(module.parameters()), unsplit)


# -------------------------------------------------------------------------------- measuring
def largest(value: float) -> float:
    """The largest of every rank's `value`."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def first_losses(step: Step) -> tuple[float, float]:
    """The mean microbatch loss of the first two steps, as the ranks computing it see them.

    The second step's loss follows the first step's gradients and update, so it checks the
    backward too.
    """
    # Squared errors are never negative: ranks without a loss offer 0 to the maximum.
    first, second = (statistics.fmean(step() or [0.0]) for _ in range(2))
    return largest(first), largest(second)


def timing(args: argparse.Namespace) -> tuple[int, int]:
    """Rounds, and steps per timed block: two of one with ``--quick``."""
    return (2, 1) if args.quick else (args.rounds, args.iterations)


def timed_block(step: Step, iterations: int) -> float:
    """Seconds per step over `iterations` consecutive steps, the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    return largest((time.perf_counter() - start) / iterations)


def step_times(built: dict[str, Contender], rounds: int, iterations: int) -> dict[str, float]:
    """Median seconds per step of each, rounds alternating A B C D / D C B A."""
    times: dict[str, list[float]] = {kind: [] for kind in built}
    for round_ in range(rounds):
        order = list(built) if round_ % 2 == 0 else list(reversed(built))
        for kind in order:
            times[kind].append(timed_block(built[kind].step, iterations))
    return {kind: statistics.median(values) for kind, values in times.items()}


def place(layout: str) -> Where:
    """This rank's place in `layout`: ours' parallel state and torch's mesh over the same ranks.

    Raises:
        RuntimeError: The two disagree on which ranks form a tensor-parallel group.
    """
    pp = LAYOUTS[layout]
    config = ParallelConfig(
        tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=pp,
        timeout=datetime.timedelta(minutes=5),
    )
    state = ParallelState.create(config)
    names = ("pp", "tp") if pp > 1 else ("dp", "tp")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // TP, TP), mesh_dim_names=names)
    torch_tp = dist.get_process_group_ranks(mesh["tp"].get_group())
    if torch_tp != state.group_ranks("tp"):
        raise RuntimeError(f"tp groups differ: ours {state.group_ranks('tp')}, torch {torch_tp}")
    return Where(state, mesh)


def build(
    args: argparse.Namespace, where: Where, comm: P2PCommunicator | None
) -> dict[str, Contender]:
    """Ours and torch's, without and (unless told) with sequence parallelism."""
    weights = full_weights(args.hidden, args.layers)
    per_stage = divide(args.layers, where.stages, "layers", by="pipeline size")
    mine = weights[where.stage * per_stage : (where.stage + 1) * per_stage]
    built: dict[str, Contender] = {}
    for sp in (False, True) if args.sequence_parallel else (False,):
        suffix = "+sp" if sp else ""
        built["ours" + suffix] = ours(args, mine, where, comm, sp)
        built["torch" + suffix] = theirs(args, mine, where, sp)
    return built


def measure(args: argparse.Namespace, layout: str) -> list[dict[str, Any]]:
    """One layout's records: one per sequence-parallel setting."""
    where = place(layout)
    comm = None
    if where.stages > 1:
        timeout = datetime.timedelta(minutes=2)
        comm = P2PCommunicator(where.state.group("pp"), config=CommConfig(timeout=timeout))
    built = build(args, where, comm)
    losses = {kind: first_losses(contender.step) for kind, contender in built.items()}
    seconds = step_times(built, *timing(args))
    records = [
        record(layout, where, suffix=suffix, built=built, losses=losses, seconds=seconds)
        for suffix in ("", "+sp")
        if "ours" + suffix in built
    ]
    if comm is not None:
        comm.destroy()
    where.state.destroy()
    return records


def record(
    layout: str,
    where: Where,
    *,
    suffix: str,
    built: dict[str, Contender],
    losses: dict[str, tuple[float, float]],
    seconds: dict[str, float],
) -> dict[str, Any]:
    """A table row: ours against torch at one sequence-parallel setting."""
    row: dict[str, Any] = {
        "benchmark": "tp_bench", "layout": layout, "tp": TP, "pp": where.stages,
        "dp": dist.get_world_size() // (TP * where.stages), "sequence_parallel": suffix == "+sp",
    }  # fmt: skip
    for side in ("ours", "torch"):
        contender = built[side + suffix]
        tp2 = int(largest(contender.param_bytes))
        tp1 = int(largest(contender.param_bytes_tp1))
        row.update({
            f"{side}_ms": round(seconds[side + suffix] * 1e3, 2),
            f"{side}_losses": losses[side + suffix], f"{side}_param_bytes": tp2,
            f"{side}_param_bytes_tp1": tp1, f"{side}_bytes_ratio": tp2 / tp1,
        })  # fmt: skip
    ratio = row["ours_ms"] / row["torch_ms"]
    difference = max(
        abs(ours_loss - torch_loss) / abs(torch_loss)
        for ours_loss, torch_loss in zip(row["ours_losses"], row["torch_losses"], strict=True)
    )
    bytes_met = abs(row["ours_bytes_ratio"] / BYTES_GOAL - 1) <= BYTES_TOLERANCE
    row.update(
        ours_vs_torch=ratio,
        loss_rel_difference=difference,
        same_loss=difference <= LOSS_TOLERANCE,
        goal=f"ours/torch <= {TIME_GOAL:.2f}, bytes {BYTES_GOAL:.2f} +-{BYTES_TOLERANCE:.0%}",
        passed=ratio <= TIME_GOAL and bytes_met,
    )
    return row


# ------------------------------------------------------------------------------- reporting
def loss_lines(records: list[dict[str, Any]]) -> str:
    """The equal-work check: each row's first loss, ours and torch's, and their difference."""
    return "\n".join(
        f"same weights and batches, {r['layout']}{' +sp' if r['sequence_parallel'] else ''}: "
        f"first two losses ours {_pair(r['ours_losses'])}, torch {_pair(r['torch_losses'])}; "
        f"relative difference {r['loss_rel_difference']:.1e} "
        f"({'equal' if r['same_loss'] else 'NOT EQUAL'} within {LOSS_TOLERANCE:.0e})"
        for r in records
    )


def _pair(losses: Sequence[float]) -> str:
    return " ".join(f"{loss:.8f}" for loss in losses)


def table(records: list[dict[str, Any]]) -> str:
    """Step times and parameter-byte ratios against the goals, one line per row."""
    header = (
        f"{'layout':<8} {'sp':<3} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>10} "
        f"{'bytes ours':>10} {'bytes torch':>11}  {'goal':<38} met"
    )
    lines = [header]
    for r in records:
        lines.append(
            f"{r['layout']:<8} {'on' if r['sequence_parallel'] else 'off':<3} "
            f"{r['ours_ms']:>9.1f} {r['torch_ms']:>9.1f} {r['ours_vs_torch']:>10.3f} "
            f"{r['ours_bytes_ratio']:>10.4f} {r['torch_bytes_ratio']:>11.4f}  {r['goal']:<38} "
            f"{'yes' if r['passed'] else 'NO'}"
        )
    return "\n".join(lines)


def heading(run: dict[str, Any]) -> str:
    """The table's first line: sizes, rounds and the load averages at start and end."""
    return (
        f"tensor parallelism on {run['world']} ranks: hidden {run['hidden']}, {run['heads']} "
        f"heads, sequence {run['seq']}, micro batch {run['micro_batch']}, "
        f"{run['microbatches']} microbatches, {run['layers']} layers; medians of {run['rounds']} "
        f"rounds of {run['iterations']} steps; load average {run['load_start']} at start, "
        f"{run['load_end']} at end"
    )


def arguments() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4, help="in all; half per stage at pp 2")
    parser.add_argument(
        "--lr", type=float, default=1.0, help="large, so the second loss checks the gradients"
    )
    parser.add_argument("--layouts", default="tp2xpp2,tp2xdp2", help="comma-separated rows")
    parser.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure both sides with sequence parallelism",
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=1, help="steps per timed block")
    parser.add_argument("--quick", action="store_true", help="two rounds of one step")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    return parser.parse_args()


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    """Every layout asked for, side by side; rank 0 prints the table (or JSON lines)."""
    args = arguments()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    if dist.get_world_size() != 2 * TP:
        raise SystemExit(f"tp_bench runs on {2 * TP} ranks, not {dist.get_world_size()}")
    load_start = load()
    records = [record for layout in args.layouts.split(",") for record in measure(args, layout)]
    rounds, iterations = timing(args)
    run = {
        "benchmark": "tp_bench_run", "world": dist.get_world_size(), "hidden": args.hidden,
        "heads": args.heads, "seq": args.seq, "micro_batch": args.micro_batch,
        "microbatches": args.microbatches, "layers": args.layers, "rounds": rounds,
        "iterations": iterations, "load_start": load_start, "load_end": load(),
    }  # fmt: skip
    if dist.get_rank() == 0:
        lines = [json.dumps(line) for line in [run, *records]]
        if not args.json:
            lines = [heading(run), loss_lines(records), table(records)]
        print("\n".join(lines), flush=True)
    # Free the modules, schedules and meshes while the process group still exists.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
