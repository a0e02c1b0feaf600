"""A Hugging Face Llama pipelined by PipelineModel against torch.distributed.pipelining.

Step time of the same LlamaForCausalLM (random weights from one seed, hidden 256, 4 decoder
layers, seq 128, micro-batch 2, 8 microbatches) split at pp 2 into the same chunks, 1F1B over
gloo in the same processes: ours is `PipelineModel` (contracts inferred from a sample) run by
pp-schedules' executor; torch's is a `PipelineStage` per chunk run by `Schedule1F1B`. Each stage
computes the rotary cos/sin from the microbatch in both. Steps (forward and backward of every
microbatch, no optimizer) alternate A B B A after one warm-up step each; the table shows
medians and the ratio ours/torch (goal <= 1.00) with the load average it ran at.

Needs the transformers library (``nox -s bench`` installs it):

    torchrun --standalone --nproc-per-node 2 packages/pp-schedules/benchmarks/any_model_vs_torch.py
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Iterator
from typing import Any

import _pipeline_bench as bench
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from pp_comm import P2PCommunicator
from pp_schedules import (
    Boundary,
    PipelineChunk,
    PipelineModel,
    get_forward_backward_func,
    resolve_schedule,
    split_module_names,
)
from pp_state import ParallelConfig, ParallelState, Placement

SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
SEQ, MICRO_BATCH = 128, 2


def _llama() -> tuple[Any, Any]:
    """The whole model from one seed, and a rotary embedding for the stages."""
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(**SIZES)
    torch.manual_seed(0)
    return llama.LlamaForCausalLM(config), llama.LlamaRotaryEmbedding(config)


def _keywords(rotary: Any, ids_or_hidden: torch.Tensor) -> dict[str, Any]:
    """Position ids and rotary cos/sin for a batch-first microbatch."""
    positions = torch.arange(ids_or_hidden.shape[1]).unsqueeze(0)
    return {"position_ids": positions, "position_embeddings": rotary(torch.ones(1), positions)}


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _data(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`m` microbatches of token ids and labels, (micro-batch, seq)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(SIZES["vocab_size"], (m, MICRO_BATCH, SEQ + 1), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def ours(state: ParallelState, comm: P2PCommunicator, data: list[Any]) -> bench.Step:
    """One step of PipelineModel's chunks under pp-schedules' 1F1B."""
    model, rotary = _llama()
    resolved = resolve_schedule("1f1b", pp_size=2, microbatch_counts=[len(data)])
    layers = [f"model.layers.{i}" for i in range(SIZES["num_hidden_layers"])]
    names = split_module_names(layers, 2, first=["model.embed_tokens"],
                               last=["model.norm", "lm_head"])  # fmt: skip
    pipe = PipelineModel.from_model(model, names, placement=resolved, state=state)
    pipe.infer_contracts(data[0][0], **_keywords(rotary, data[0][0]))
    forward_backward = get_forward_backward_func(comm, resolved=resolved)

    def forward_step(it: Iterator[Any], chunk: torch.nn.Module) -> tuple[Any, Any]:
        ids, labels = next(it)
        output = chunk(ids, **_keywords(rotary, ids))
        return output, lambda logits: (_loss(logits, labels), {})

    def step() -> None:
        for chunk in pipe.chunks:
            chunk.zero_grad(set_to_none=True)
        forward_backward(forward_step_func=forward_step, data_iterator=iter(data),
                         model=pipe.chunks, num_microbatches=len(data))  # fmt: skip

    return step


class _TorchStage(torch.nn.Module):
    """The same chunk for torch's PipelineStage: one positional input, cos/sin computed here."""

    def __init__(self, chunk: PipelineChunk, rotary: Any) -> None:
        super().__init__()
        self.chunk, self.rotary = chunk, rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keywords = _keywords(self.rotary, x)
        if not self.chunk.is_first:
            self.chunk.set_input_tensor([x])
        output: torch.Tensor = self.chunk(x, **keywords)
        self.chunk.set_input_tensor(None)
        return output


def theirs(state: ParallelState, data: list[Any]) -> bench.Step:
    """One step of the same chunks under torch.distributed.pipelining's Schedule1F1B."""
    model, rotary = _llama()
    rank = state.pipeline_model_parallel_rank
    layers = [f"model.layers.{i}" for i in range(SIZES["num_hidden_layers"])]
    names = split_module_names(layers, 2, first=["model.embed_tokens"],
                               last=["model.norm", "lm_head"])[rank]  # fmt: skip
    chunk = PipelineChunk([(n, model.get_submodule(n)) for n in names], stage=rank,
                          placement=Placement.looped(2))  # fmt: skip
    if rank == 1:  # the received hidden states, as the executor would set them
        chunk.input_boundary = Boundary.tensor((MICRO_BATCH, SEQ, SIZES["hidden_size"]))
    stage = PipelineStage(_TorchStage(chunk, rotary), rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=len(data), loss_fn=_loss)
    inputs = torch.cat([ids for ids, _ in data])
    targets = torch.cat([labels for _, labels in data])

    def step() -> None:
        chunk.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets)

    return step


def main() -> None:
    """Time both, alternating A B B A, and print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=8)
    args, comm = bench.start(parser)
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2))
    data = _data(args.microbatches)
    steps = [ours(state, comm, data), theirs(state, data)]
    ours_s, theirs_s = bench.alternate(steps, args.steps + 1, warm_up=1)
    record = {"model": "llama", "schedule": "1f1b", "pp": 2, "m": args.microbatches,
              "ours_ms": ours_s * 1e3, "torch_ms": theirs_s * 1e3, "ratio": ours_s / theirs_s,
              "load": bench.load_average()}  # fmt: skip
    if dist.get_rank() == 0:
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(f"load average {record['load']}")
            print("| model | schedule | pp | m | ours ms | torch ms | ours/torch (goal <= 1.00) |")
            print("|---|---|---|---|---|---|---|")
            print(f"| Hugging Face Llama (hidden 256, 4 layers, seq 128) | 1f1b | 2 | "
                  f"{args.microbatches} | {ours_s * 1e3:.1f} | {theirs_s * 1e3:.1f} | "
                  f"{ours_s / theirs_s:.3f} |", flush=True)  # fmt: skip
    state.destroy()
    bench.finish(comm)


if __name__ == "__main__":
    main()
