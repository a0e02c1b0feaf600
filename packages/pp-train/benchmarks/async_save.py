"""Step time while an asynchronous torch_dist save writes, beside a blocking save's stall.

Run on two ranks under torchrun (``python3 -m nox -s bench_checkpoint`` does it):

    torchrun --standalone --nproc-per-node 2 packages/pp-train/benchmarks/async_save.py

A small GPT trains with pipeline size 2. Rounds alternate A B B A: A saves with a blocking
``save_checkpoint(ckpt_format="torch_dist")``, B with an `AsyncCheckpointSaver`. Rank 0 prints
one table: the median normal step, the steps taken while the async save was in flight (their
mean and its ratio to the normal step), the async call's own cost (staging the tensors), and
the blocking save's stall (and its ratio to a step).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from pp_optim import LRScheduleConfig, OptimizerConfig
from pp_state import ParallelConfig, ParallelState
from pp_train import (
    build_forward_backward_func,
    microbatches,
    save_checkpoint,
    setup_model_and_optimizer,
    train_step,
)
from pp_train.app import CorpusDataset, GPTChunk, GPTConfig, chunk_layers, gpt_forward_step
from pp_train.checkpoint import AsyncCheckpointSaver

MICRO, MICROBATCHES = 2, 4


def build(gpt: GPTConfig) -> dict[str, Any]:
    """State, model, optimizer, scheduler, schedule and data of a pp-2 run."""
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2))

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        rank = state.pipeline_model_parallel_rank
        layers = chunk_layers(gpt.num_layers, 2, 1, rank, vp_stage)
        return GPTChunk(
            gpt, layers=layers, pre_process=pre_process, post_process=post_process, seed=1
        )

    model, optimizer, scheduler, _ = setup_model_and_optimizer(
        provider,
        state,
        optimizer_config=OptimizerConfig(lr=1e-4),
        lr_schedule=LRScheduleConfig(
            max_lr=1e-4,
            min_lr=1e-5,
            lr_warmup_steps=0,
            lr_decay_steps=10**6,
            lr_decay_style="constant",
        ),
    )
    tokens = (torch.arange(200_000) % (gpt.vocab_size - 1)).to(torch.int64)
    data = microbatches(
        CorpusDataset(tokens, gpt.seq_length, seed=0),
        consumed_samples=0,
        micro_batch_size=MICRO,
        data_parallel_rank=0,
        data_parallel_size=1,
    )
    schedule = build_forward_backward_func(state, model, optimizer, hidden_size=gpt.hidden_size)
    return {
        "state": state,
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "data": data,
        "schedule": schedule,
        "seq": gpt.seq_length,
    }


def step(run: dict[str, Any]) -> float:
    """Seconds of one training step."""
    started = time.perf_counter()
    train_step(
        gpt_forward_step,
        run["data"],
        run["model"],
        run["optimizer"],
        run["scheduler"],
        forward_backward_func=run["schedule"],
        state=run["state"],
        num_microbatches=MICROBATCHES,
        micro_batch_size=MICRO,
        seq_length=run["seq"],
    )
    return time.perf_counter() - started


def save(
    run: dict[str, Any], root: str, iteration: int, saver: AsyncCheckpointSaver | None
) -> float:
    """Seconds the save call holds training up."""
    dist.barrier()
    started = time.perf_counter()
    save_checkpoint(
        root,
        iteration,
        state=run["state"],
        model=run["model"],
        optimizer=run["optimizer"],
        scheduler=run["scheduler"],
        args={},
        consumed_train_samples=0,
        ckpt_format="torch_dist",
        async_saver=saver,
    )
    return time.perf_counter() - started


def round_(
    run: dict[str, Any], root: str, iteration: int, mode: str, normal: int
) -> dict[str, Any]:
    """Normal steps, a save, then steps until the async save is published."""
    steps = [step(run) for _ in range(normal)]
    saver = AsyncCheckpointSaver() if mode == "B" else None
    call = save(run, root, iteration, saver)
    during: list[float] = []
    while saver is not None:
        during.append(step(run))
        saver.poll(run["state"])
        flags = torch.tensor([float(saver.in_flight)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank steps until all are done
        if not flags.item() or len(during) >= 50:
            saver.wait(run["state"])
            break
    return {"mode": mode, "normal": statistics.median(steps), "call": call, "during": during}


def main() -> None:
    """Alternates blocking (A) and async (B) rounds and prints the table on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA groups")
    options = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    gpt = GPTConfig(
        num_layers=options.num_layers,
        hidden_size=options.hidden_size,
        num_attention_heads=4,
        seq_length=64,
    )
    run = build(gpt)
    root = [tempfile.mkdtemp(prefix="async-save-")] if dist.get_rank() == 0 else [""]
    dist.broadcast_object_list(root, src=0)
    for _ in range(3):
        step(run)  # warm-up
    results = [
        round_(run, root[0], index + 1, mode, normal=6)
        for index, mode in enumerate("ABBA" * options.rounds)
    ]
    if dist.get_rank() == 0:
        print_table(results, gpt)
    dist.destroy_process_group()


def print_table(results: list[dict[str, Any]], gpt: GPTConfig) -> None:
    """One row per round and the medians of both kinds."""
    print(f"async torch_dist save, pp 2, GPT {gpt.num_layers} layers x {gpt.hidden_size}")
    print(
        f"{'round':>5} {'mode':>8} {'step ms':>8} {'save call ms':>12} {'steps in flight':>15} "
        f"{'their ms':>8} {'ratio':>6}"
    )
    ratios, stalls = [], []
    for index, row in enumerate(results):
        during = statistics.mean(row["during"]) if row["during"] else float("nan")
        ratio = during / row["normal"] if row["during"] else float("nan")
        if row["mode"] == "B":
            ratios.append(ratio)
        else:
            stalls.append(row["call"] / row["normal"])
        mode = "async" if row["mode"] == "B" else "blocking"
        print(
            f"{index:>5} {mode:>8} {row['normal'] * 1e3:>8.1f} {row['call'] * 1e3:>12.1f} "
            f"{len(row['during']):>15} {during * 1e3:>8.1f} {ratio:>6.2f}"
        )
    print(
        f"median step-time ratio during an async save: {statistics.median(ratios):.2f}x "
        f"(target <= 1.10); blocking save stall: {statistics.median(stalls):.1f} steps"
    )


if __name__ == "__main__":
    main()
