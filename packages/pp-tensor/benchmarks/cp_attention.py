"""Context-parallel attention: the ring ("p2p") against all-gather, forward and backward.

Run on two ranks under torchrun (``python3 -m nox -s bench`` does it):

    torchrun --standalone --nproc-per-node 2 packages/pp-tensor/benchmarks/cp_attention.py

At cp = world size, each global sequence length is split the load-balanced way and
`context_parallel_attention` runs forward and backward with both ``comm_type`` values, timed in
alternating rounds (A B B A) in the same run. Each time is the largest over the ranks; the
table gives the median over rounds of each, the ratio ring / all-gather, and, for scale, one
process's ``scaled_dot_product_attention`` over the whole sequence (rank 0 alone, forward and
backward). Both ways must give the same output and gradients; the script checks that before
timing. ``--quick``: sequences 256 and 512, 2 rounds. ``--json``: one JSON line per sequence.

torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``) is tried first on
the same inputs; where it does not run (torch 2.13 on CPU: no sharding strategy for the CPU
flash-attention operator), the script prints the error it raised instead of its time.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pp_tensor import context_parallel_attention, split_for_context_parallel

BATCH, HEADS, HEAD_DIM = 1, 4, 64
WARMUP = 2
FULL = ((1024, 6), (2048, 6), (4096, 6), (8192, 3))
"""(global sequence length, rounds of A B B A)."""
QUICK = ((256, 2), (512, 2))


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def whole_inputs(seq: int) -> Inputs:
    """Queries, keys and values over the whole sequence, the same on every rank."""
    generator = torch.Generator().manual_seed(seq)
    shape = (BATCH, HEADS, seq, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=generator) for _ in range(3))
    return q, k, v


def local_inputs(whole: Inputs) -> Inputs:
    """This rank's part of each, as leaves that take gradients."""
    size, rank = dist.get_world_size(), dist.get_rank()
    q, k, v = (
        split_for_context_parallel(x, size, rank, seq_dim=2).clone().requires_grad_() for x in whole
    )
    return q, k, v


def forward_backward(inputs: Inputs, comm_type: str) -> tuple[torch.Tensor, ...]:
    """One step of context-parallel attention: the output and the input gradients."""
    for x in inputs:
        x.grad = None
    out = context_parallel_attention(*inputs, group=dist.group.WORLD, comm_type=comm_type)
    out.sum().backward()
    grads = tuple(x.grad for x in inputs)
    assert all(g is not None for g in grads)
    return (out.detach(), *(g for g in grads if g is not None))


def largest_difference(inputs: Inputs) -> float:
    """Max abs difference, over ranks and over output and gradients, ring against all-gather."""
    ring = forward_backward(inputs, "p2p")
    gathered = forward_backward(inputs, "all_gather")
    local = max(float((a - b).abs().max()) for a, b in zip(ring, gathered, strict=True))
    worst = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def slowest_rank_seconds(call: Callable[[], object]) -> float:
    """Seconds for one call, all ranks starting together; the largest over the ranks."""
    dist.barrier()
    start = time.perf_counter()
    call()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def sdpa_seconds(whole: Inputs, rounds: int) -> float:
    """Median seconds of one process's causal attention over the whole sequence (rank 0)."""
    q, k, v = (x.clone().requires_grad_() for x in whole)

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_context_parallel(whole: Inputs) -> str:
    """Whether torch's ``context_parallel`` runs causal sdpa here: "runs", or its error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = (t.clone() for t in whole)
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    except (NotImplementedError, RuntimeError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return "runs (not timed by this script)"


def compare(seq: int, rounds: int) -> dict[str, object]:
    """Both ways at one sequence length, checked equal, then timed A B B A."""
    whole = whole_inputs(seq)
    inputs = local_inputs(whole)
    difference = largest_difference(inputs)
    if dist.get_rank() == 0:
        print(f"seq {seq}: max abs diff ring vs all-gather {difference:.2e}", flush=True)
    if difference > 1e-4:
        raise RuntimeError(f"ring and all-gather differ by {difference} at sequence {seq}")
    times: dict[str, list[float]] = {"p2p": [], "all_gather": []}
    for comm_type in (*times, *times) * WARMUP:
        forward_backward(inputs, comm_type)
    for _ in range(rounds):
        for comm_type in ("p2p", "all_gather", "all_gather", "p2p"):
            step = functools.partial(forward_backward, inputs, comm_type)
            times[comm_type].append(slowest_rank_seconds(step))
    ring, gathered = statistics.median(times["p2p"]), statistics.median(times["all_gather"])
    # Rank 0 alone: the other rank waits at the barrier that follows.
    sdpa = sdpa_seconds(whole, 2 * rounds) if dist.get_rank() == 0 else 0.0
    dist.barrier()
    return {
        "benchmark": "cp_attention",
        "seq": seq,
        "ring_ms": round(ring * 1e3, 3),
        "all_gather_ms": round(gathered * 1e3, 3),
        "ratio": round(ring / gathered, 3),
        "sdpa_ms": round(sdpa * 1e3, 3),
    }


def table(records: list[dict[str, object]]) -> str:
    """The records as an aligned table."""
    header = ("sequence", "ring ms", "all-gather ms", "ring/all-gather", "sdpa whole seq ms")
    rows = [
        (
            str(r["seq"]), f"{r['ring_ms']:.2f}", f"{r['all_gather_ms']:.2f}",
            f"{r['ratio']:.2f}", f"{r['sdpa_ms']:.2f}",
        )
        for r in records
    ]  # fmt: skip
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [header, *rows]
    )


def main() -> None:
    """Time both ways at each sequence length; rank 0 prints the table or JSON lines."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="sequences 256, 512; 2 rounds")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    torch_status = torch_context_parallel(whole_inputs(256))
    records = [compare(seq, rounds) for seq, rounds in (QUICK if args.quick else FULL)]
    load_end = os.getloadavg()[0]
    if dist.get_rank() == 0:
        for record in records:
            record.update(load_start=load_start, load_end=load_end, torch=torch_status)
        if args.json:
            for record in records:
                print(json.dumps(record), flush=True)
        else:
            print(f"context-parallel attention, cp {dist.get_world_size()}, forward+backward, "
                  f"batch {BATCH}, {HEADS} heads, head dim {HEAD_DIM}, fp32, gloo")  # fmt: skip
            print(table(records))
            print(f"load average (1 min): {load_start:.2f} at start, {load_end:.2f} at end")
            print(f"torch's context_parallel here: {torch_status}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
