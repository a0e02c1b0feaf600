"""Bucketed grad-buffer all-reduce against one all-reduce per parameter, on the same gradients.

Run on two ranks under torchrun (``python3 -m nox -s bench`` does it):

    torchrun --standalone --nproc-per-node 2 packages/pp-optim/benchmarks/grad_allreduce.py

The model has a few hundred parameters of mixed sizes (a small transformer's shapes). Each
way of reducing its gradients over the data-parallel group is timed in alternating rounds in
the same run; rank 0 prints a table with the median time per step of each and the ratio
per-parameter / bucketed against its goal (``--json``: one JSON line per bucket setting). Goal:
ratio >= 1.0, the buffer is at least as fast as one all-reduce per parameter. Both ways must
give the same gradients; the script checks that before timing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pp_optim import DDPConfig, DistributedDataParallel


def small_transformer(layers: int, hidden: int) -> torch.nn.Module:
    """12 parameters per layer (attention and MLP weights, biases, two norms)."""
    blocks = [
        torch.nn.TransformerEncoderLayer(
            hidden, nhead=4, dim_feedforward=4 * hidden, batch_first=True
        )
        for _ in range(layers)
    ]
    return torch.nn.Sequential(*blocks)


def fill_grads(ddp: DistributedDataParallel, params: list[torch.nn.Parameter], rank: int) -> None:
    """The same gradient in both places: main_grad (buffer) and grad (per-parameter)."""
    ddp.zero_grad_buffer()
    for index, param in enumerate(params):
        value = torch.full_like(param, float(rank + 1) / (index + 1))
        param.main_grad.copy_(value)  # type: ignore[attr-defined]
        param.grad = value


def per_parameter(params: list[torch.nn.Parameter], size: int) -> None:
    """What a loop over parameters does: scale and all-reduce each gradient on its own."""
    for param in params:
        assert param.grad is not None
        param.grad.mul_(1.0 / size)
        dist.all_reduce(param.grad)


def timed(call: Callable[[], None], prepare: Callable[[], None], iterations: int) -> float:
    """Seconds per call (preparation untimed), both ranks starting together."""
    total = 0.0
    for _ in range(iterations):
        prepare()
        dist.barrier()
        start = time.perf_counter()
        call()
        total += time.perf_counter() - start
    return total / iterations


def compare(
    buckets: int, layers: int, hidden: int, rounds: int, iterations: int
) -> dict[str, object]:
    """Both reductions of one model's gradients, checked equal, then timed side by side."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model = small_transformer(layers, hidden)
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    bucket_size = None if buckets == 1 else total // buckets
    ddp = DistributedDataParallel(
        model, DDPConfig(bucket_size=bucket_size), data_parallel_group=dist.group.WORLD
    )
    fill_grads(ddp, params, rank)
    ddp.finish_grad_sync()
    per_parameter(params, size)
    for param in params:
        assert param.grad is not None
        torch.testing.assert_close(param.main_grad, param.grad)  # type: ignore[attr-defined]

    def prepare() -> None:
        fill_grads(ddp, params, rank)

    def loop() -> None:
        per_parameter(params, size)

    bucketed_times: list[float] = []
    loop_times: list[float] = []
    for round_ in range(rounds):
        pair = [(bucketed_times, ddp.finish_grad_sync), (loop_times, loop)]
        for times, call in pair if round_ % 2 == 0 else reversed(pair):
            times.append(timed(call, prepare, iterations))
    bucketed, looped = statistics.median(bucketed_times), statistics.median(loop_times)
    return {
        "benchmark": "grad_allreduce",
        "parameters": len(params),
        "elements": total,
        "buckets": len(ddp.buckets),
        "bucketed_ms": round(bucketed * 1e3, 3),
        "per_parameter_ms": round(looped * 1e3, 3),
        "ratio_per_parameter_over_bucketed": round(looped / bucketed, 2),
    }


GOAL = 1.0
"""per-parameter / bucketed must be at least this."""


def table(records: list[dict[str, object]]) -> str:
    """The records as an aligned table, each ratio against the goal."""
    header = ("buckets", "parameters", "bucketed ms", "per-parameter ms", "ratio", "goal", "pass")
    rows = [
        (
            str(r["buckets"]), str(r["parameters"]), f"{r['bucketed_ms']:.3f}",
            f"{r['per_parameter_ms']:.3f}", f"{r['ratio_per_parameter_over_bucketed']:.2f}",
            f">= {GOAL:.2f}",
            "yes" if float(str(r["ratio_per_parameter_over_bucketed"])) >= GOAL else "NO",
        )
        for r in records
    ]  # fmt: skip
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [header, *rows]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in lines
    )


def main() -> None:
    """Time both reductions for one and for several buckets; rank 0 prints the table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="few iterations: check it runs")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    rounds, iterations = (1, 1) if args.quick else (args.rounds, args.iterations)
    # Parameters are never split between buckets, so 8 asked for may come out fewer.
    records = []
    for buckets in (1, 8):
        records.append(compare(buckets, args.layers, args.hidden, rounds, iterations))
        if args.json and dist.get_rank() == 0:
            print(json.dumps(records[-1]), flush=True)
    if not args.json and dist.get_rank() == 0:
        print("gradient all-reduce per step, bucketed grad buffer vs one call per parameter")
        print(table(records), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
