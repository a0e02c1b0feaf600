"""The distributed optimizer (ZeRO-1) against ours unsharded and torch's ZeroRedundancyOptimizer.

Run at any data-parallel size under torchrun (``python3 -m nox -s bench`` runs dp 2 and dp 4):

    torchrun --standalone --nproc-per-node 4 packages/pp-optim/benchmarks/distopt_bench.py

Every rank trains copies of one small GPT-like model (an embedding-sized first layer, then
LayerNorm / Linear / GELU / Linear blocks: a few million parameters, so the optimizer matters)
with Adam, in fp32 and in bf16, five ways in the same processes:

- ``A``: ours unsharded: `DistributedDataParallel` and `FP32Optimizer` (bf16:
  `Float16Module` and `Float16OptimizerWithFloat16Params`), grads all-reduced after backward.
- ``B``: `DistributedOptimizer`, grads reduce-scattered after backward, params all-gathered
  after the step; ``B+ov``: the same with ``overlap_grad_reduce`` and ``overlap_param_gather``.
- ``C``: torch's ``ZeroRedundancyOptimizer(optimizer_class=torch.optim.Adam)`` under torch's
  DDP (``gradient_as_bucket_view``, same bucket bytes). In bf16 its model stays fp32 and runs
  under ``torch.autocast(bfloat16)``: torch's recipe with fp32 master weights and fp32 Adam
  state, as ours keeps (Adam straight on bf16 weights would keep bf16 moments).

Ours run without clipping and without the NaN check (torch's does neither). A step is zero
grad, forward, backward, grad sync, optimizer step and param sync; blocks of steps are timed in
rounds ordered A B B+ov C, then reversed (A B B A, B C C B), each block's time the slowest
rank's; the table shows medians. Measured per rank, the largest over ranks shown:

1. optimizer-state bytes: distinct storages of ours' ``optimizer.state_tensors()`` and of
   the tensors in torch's local ``optim.state``. Goal: B / A = 1/dp within 1%.
2. step time. Goal: B+ov / C <= 1.0 (both overlap grad sync with backward); B / A and
   B+ov / A reported. gloo runs a reduce-scatter as a whole all-reduce: the line above the
   table times the collectives on the model's gradient bytes alone.
3. static bytes at the end of a step, when parameters, gradients and optimizer state all
   exist (distinct storages: parameters and parameter buffers, grad buffers or ``.grad``,
   optimizer state). Activations are left out (the same model and batch for all five; C's
   bf16 weight casts under autocast would add to C). Goal: B <= C.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from pp_optim import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    Float16Module,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    OptimizerConfig,
)

KINDS = ("A", "B", "B+ov", "C")
LR = 1e-4
STATE_TOLERANCE = 0.01
"""B / A state bytes must be within 1% of 1/dp."""
TIME_GOAL = 1.0
"""B+ov / C step time must be at most this."""

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class Contender:
    """One way to train: a step, a wait for what it left in flight, and what it holds."""

    step: Callable[[Batch], None]
    finish: Callable[[], None]
    state: Callable[[], list[torch.Tensor]]
    static: Callable[[], list[torch.Tensor]]


def gpt_like(vocab: int, hidden: int, layers: int) -> torch.nn.Sequential:
    """An embedding-sized first layer, then `layers` LayerNorm-Linear-GELU-Linear blocks."""
    torch.manual_seed(0)
    modules: list[torch.nn.Module] = [torch.nn.Linear(vocab, hidden)]
    for _ in range(layers):
        modules += [
            torch.nn.LayerNorm(hidden),
            torch.nn.Linear(hidden, 4 * hidden),
            torch.nn.GELU(),
            torch.nn.Linear(4 * hidden, hidden),
        ]
    modules.append(torch.nn.LayerNorm(hidden))
    return torch.nn.Sequential(*modules)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def ours(base: torch.nn.Module, dtype: str, kind: str, bucket: int) -> Contender:
    """A (unsharded), B or B+ov (sharded) over a copy of `base`."""
    module = copy.deepcopy(base)
    if dtype == "bf16":
        module = Float16Module(module, torch.bfloat16)
    overlap, sharded = kind == "B+ov", kind != "A"
    config = DDPConfig(
        bucket_size=bucket,
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=sharded,
        overlap_param_gather=overlap,
    )
    ddp = DistributedDataParallel(module, config, data_parallel_group=dist.group.WORLD)
    inner = torch.optim.Adam(list(ddp.parameters()), lr=LR)
    settings = OptimizerConfig(
        bf16=dtype == "bf16", clip_grad=0.0, check_for_nan_in_loss_and_grad=False
    )
    optimizer: MegatronOptimizer
    finish = _nothing
    if sharded:
        optimizer = DistributedOptimizer(inner, settings, model_chunks=[ddp], grad_stats_group=None)
        finish = optimizer.finish_param_sync
    elif dtype == "bf16":
        optimizer = Float16OptimizerWithFloat16Params(inner, settings, grad_stats_group=None)
    else:
        optimizer = FP32Optimizer(inner, settings, grad_stats_group=None)

    def step(batch: Batch) -> None:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(batch[0]).float(), batch[1])
        optimizer.scale_loss(loss).backward()
        ddp.finish_grad_sync()
        optimizer.step()

    def static() -> list[torch.Tensor]:
        buffers = [*ddp.buffers_by_dtype.values(), *ddp.param_buffers.values()]
        return [*ddp.parameters(), *buffers, *optimizer.state_tensors()]

    return Contender(step, finish, optimizer.state_tensors, static)


def torch_zero(base: torch.nn.Module, dtype: str, bucket: int) -> Contender:
    """C: torch's DDP and ZeroRedundancyOptimizer(Adam); bf16 by autocast over fp32 weights."""
    module = copy.deepcopy(base)
    ddp = TorchDDP(module, bucket_cap_mb=bucket * 4 / 2**20, gradient_as_bucket_view=True)
    optimizer = ZeroRedundancyOptimizer(
        list(module.parameters()), optimizer_class=torch.optim.Adam, lr=LR
    )

    def step(batch: Batch) -> None:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            out = ddp(batch[0])
        torch.nn.functional.mse_loss(out.float(), batch[1]).backward()
        optimizer.step()

    def state() -> list[torch.Tensor]:
        return [
            value
            for per_param in optimizer.optim.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        ]

    def static() -> list[torch.Tensor]:
        params = list(module.parameters())
        return [*params, *(p.grad for p in params if p.grad is not None), *state()]

    return Contender(step, _nothing, state, static)


def _nothing() -> None:
    """Nothing left in flight."""


def contenders(base: torch.nn.Module, dtype: str, bucket: int) -> dict[str, Contender]:
    """A, B, B+ov and C over copies of `base` (equal starting weights)."""
    built = {kind: ours(base, dtype, kind, bucket) for kind in KINDS[:-1]}
    built["C"] = torch_zero(base, dtype, bucket)
    return built


def slowest(seconds: float) -> float:
    """The largest of every rank's `seconds`."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def timed_block(contender: Contender, batches: list[Batch], iterations: int) -> float:
    """Seconds per step over `iterations` consecutive steps, the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    for index in range(iterations):
        contender.step(batches[index % len(batches)])
    contender.finish()
    return slowest((time.perf_counter() - start) / iterations)


def step_times(
    built: dict[str, Contender], batches: list[Batch], rounds: int, iterations: int
) -> dict[str, float]:
    """Median seconds per step of each, rounds alternating A B B+ov C / C B+ov B A."""
    for contender in built.values():  # warm-up: the first step makes Adam's state
        timed_block(contender, batches, 1)
    times: dict[str, list[float]] = {kind: [] for kind in built}
    for round_ in range(rounds):
        order = list(built) if round_ % 2 == 0 else list(reversed(built))
        for kind in order:
            times[kind].append(timed_block(built[kind], batches, iterations))
    return {kind: statistics.median(values) for kind, values in times.items()}


def over_ranks(value: int, op: dist.ReduceOp.RedOpType) -> int:
    """Every rank's `value` reduced by `op` (MAX, MIN)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=op)
    return int(tensor.item())


def measure(
    args: argparse.Namespace, dtype: str, rounds: int, iterations: int
) -> dict[str, object]:
    """One precision's record: per kind ms, state and static bytes (the largest rank's).

    The state's smallest rank too: torch's ZeRO gives whole parameters to ranks, so its
    shards differ in size.
    """
    base = gpt_like(args.vocab, args.hidden, args.layers)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [
        (
            torch.randn(args.batch, args.vocab, generator=generator),
            torch.randn(args.batch, args.hidden, generator=generator),
        )
        for _ in range(2)
    ]
    built = contenders(base, dtype, args.bucket_elements)
    seconds = step_times(built, batches, rounds, iterations)
    record: dict[str, object] = {
        "benchmark": "distopt",
        "dtype": dtype,
        "dp": dist.get_world_size(),
        "parameters": sum(p.numel() for p in base.parameters()),
    }
    for kind, contender in built.items():
        record[f"{kind}_ms"] = round(seconds[kind] * 1e3, 2)
        state = storage_bytes(contender.state())
        record[f"{kind}_state_bytes"] = over_ranks(state, dist.ReduceOp.MAX)
        record[f"{kind}_state_bytes_smallest"] = over_ranks(state, dist.ReduceOp.MIN)
        static = storage_bytes(contender.static())
        record[f"{kind}_static_bytes"] = over_ranks(static, dist.ReduceOp.MAX)
    return record


def collective_ms(numel: int, rounds: int) -> dict[str, float]:
    """Median ms of all-reduce, reduce-scatter and all-gather of `numel` fp32 elements."""
    size = dist.get_world_size()
    whole = torch.ones(-(-numel // size) * size)
    shard = whole[: whole.numel() // size].clone()
    calls: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, whole),
        "all_gather": lambda: dist.all_gather_single(whole, shard),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds + 1):
        for name in calls if round_ % 2 == 0 else reversed(list(calls)):
            dist.barrier()
            start = time.perf_counter()
            calls[name]()
            if round_:  # the first round warms up
                times[name].append(slowest(time.perf_counter() - start))
    return {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}


def ratios(record: dict[str, object]) -> list[tuple[str, float, str, bool | None]]:
    """(what, value, goal, met or None when only reported) for one precision."""

    def value(key: str) -> float:
        return float(str(record[key]))

    dp = int(str(record["dp"]))
    state = value("B_state_bytes") / value("A_state_bytes")
    step = value("B+ov_ms") / value("C_ms")
    static = value("B_static_bytes") / value("C_static_bytes")
    return [
        ("state B/A", state, f"1/{dp} +-1%", abs(state * dp - 1) <= STATE_TOLERANCE),
        ("state C/A", value("C_state_bytes") / value("A_state_bytes"), "-", None),
        ("step B/A", value("B_ms") / value("A_ms"), "-", None),
        ("step B+ov/A", value("B+ov_ms") / value("A_ms"), "-", None),
        ("step B/C", value("B_ms") / value("C_ms"), "-", None),
        ("step B+ov/C", step, f"<= {TIME_GOAL:.2f}", step <= TIME_GOAL),
        ("static B/C", static, "<= 1.00", static <= 1.0),
    ]


def _met(met: bool | None) -> str:
    return "-" if met is None else ("yes" if met else "NO")


def tables(records: list[dict[str, object]]) -> str:
    """Per precision: each kind's ms and MB, then the ratios against their goals."""
    mb = 2**20
    header = ("dtype", "kind", "step ms", "state MB", "smallest", "static MB")
    rows = [
        (str(r["dtype"]), kind, f"{r[f'{kind}_ms']}",
         f"{float(str(r[f'{kind}_state_bytes'])) / mb:.2f}",
         f"{float(str(r[f'{kind}_state_bytes_smallest'])) / mb:.2f}",
         f"{float(str(r[f'{kind}_static_bytes'])) / mb:.2f}")
        for r in records for kind in KINDS
    ]  # fmt: skip
    goals = [
        (str(r["dtype"]), what, f"{ratio:.3f}", goal, _met(met))
        for r in records for what, ratio, goal, met in ratios(r)
    ]  # fmt: skip
    return (
        _aligned([header, *rows])
        + "\n\n"
        + _aligned([("dtype", "ratio", "value", "goal", "met"), *goals])
    )


def _aligned(lines: list[tuple[str, ...]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(*lines, strict=True)]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in lines
    )


def arguments() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=4096, help="the first layer's inputs")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-elements", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--quick", action="store_true", help="few steps: check it runs")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of tables")
    return parser.parse_args()


def report(comm: dict[str, object], records: list[dict[str, object]], as_json: bool) -> None:
    """Prints the records as JSON lines, or the load, the collectives and the tables."""
    if as_json:
        for record in [comm, *records]:
            print(json.dumps(record), flush=True)
        return
    print(
        f"distributed optimizer at dp {dist.get_world_size()}, Adam, {comm['elements']}"
        f" parameters; load average {comm['load_start']} at start, {comm['load_end']} at end"
    )
    print(
        f"gloo on {comm['elements']} fp32 elements: all-reduce {comm['all_reduce']} ms,"
        f" reduce-scatter {comm['reduce_scatter']} ms, all-gather {comm['all_gather']} ms"
    )
    print(tables(records), flush=True)


def main() -> None:
    """Measure every precision asked for; rank 0 prints the load, the collectives, the tables."""
    args = arguments()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    load_start = round(os.getloadavg()[0], 2)
    rounds, iterations = (2, 1) if args.quick else (args.rounds, args.iterations)
    elements = sum(p.numel() for p in gpt_like(args.vocab, args.hidden, args.layers).parameters())
    comm: dict[str, object] = {"benchmark": "distopt_collectives", "elements": elements}
    comm.update(collective_ms(elements, rounds))
    records = [measure(args, dtype, rounds, iterations) for dtype in args.dtypes.split(",")]
    comm.update(load_start=load_start, load_end=round(os.getloadavg()[0], 2))
    if dist.get_rank() == 0:
        report(comm, records, args.json)
    # The contenders' modules and hooks sit in reference cycles. Left to interpreter exit,
    # after the process group is gone, freeing them aborted rank 0 in about one run in three
    # ("terminate called without an active exception"); freed here, never in 16 runs.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
