"""A Hugging Face Llama pipelined by PipelineModel against torch.distributed.pipelining.

Step time of the same LlamaForCausalLM (random weights from one seed, hidden 256, 4 decoder
layers, seq 128, micro-batch 2, 8 microbatches) split at pp 2 into the same chunks, over gloo
in the same processes, under two schedules:

- ``1f1b``: two stages, one per rank, beside torch's `Schedule1F1B`;
- ``zbv`` and ``dualpipev``: four stages on the V placement (rank 0 holds the first and the
  last: the embedding with layer 0, and layer 3 with the norm and the output layer; rank 1
  layers 1 and 2), beside torch's `ScheduleZBVZeroBubble` and `ScheduleDualPipeV`. The chunks
  communicate nothing of their own, so both run the halves of DualPipeV's F&B steps one after
  the other (ours ``fb_overlap`` "sequential", torch's runtime without a custom function).

Ours is `PipelineModel` (contracts inferred from a sample) run by pp-schedules' executor;
torch's is a `PipelineStage` per chunk. Each stage computes the rotary cos/sin from the
microbatch in both. Steps (forward and backward of every microbatch, no optimizer) alternate
A B B A after one warm-up step each; the table shows medians and the ratio ours/torch (goal
<= 1.00) with the load average it ran at.

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
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
)

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
TORCH_SCHEDULES: dict[str, bench.TorchSchedule] = {
    "1f1b": Schedule1F1B,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


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


def _module_names(stages: int) -> list[list[str]]:
    """Each virtual stage's modules: the layers spread, the embedding and head at the ends."""
    layers = [f"model.layers.{i}" for i in range(SIZES["num_hidden_layers"])]
    return split_module_names(layers, stages, first=["model.embed_tokens"],
                              last=["model.norm", "lm_head"])  # fmt: skip


def ours(state: ParallelState, comm: P2PCommunicator, data: list[Any], schedule: str) -> bench.Step:
    """One step of PipelineModel's chunks under pp-schedules' `schedule`."""
    model, rotary = _llama()
    resolved = resolve_schedule(schedule, pp_size=2, microbatch_counts=[len(data)])
    names = _module_names(resolved.placement.num_stages)
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
        iterators = [iter(data) for _ in pipe.chunks]
        forward_backward(forward_step_func=forward_step, model=pipe.chunks,
                         data_iterator=iterators if len(iterators) > 1 else iterators[0],
                         num_microbatches=len(data))  # fmt: skip

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


def theirs(state: ParallelState, data: list[Any], schedule: str) -> bench.Step:
    """One step of the same chunks under torch.distributed.pipelining's `schedule`."""
    model, rotary = _llama()
    rank = state.pipeline_model_parallel_rank
    placement = Placement.looped(2) if schedule == "1f1b" else Placement.v_shape(2, 2)
    names = _module_names(placement.num_stages)
    chunks, stages = [], []
    for index in placement.stages[rank]:
        chunk = PipelineChunk([(n, model.get_submodule(n)) for n in names[index]],
                              stage=index, placement=placement)  # fmt: skip
        if index > 0:  # the received hidden states, as the executor would set them
            chunk.input_boundary = Boundary.tensor((MICRO_BATCH, SEQ, SIZES["hidden_size"]))
        chunks.append(chunk)
        stages.append(PipelineStage(_TorchStage(chunk, rotary), index, placement.num_stages,
                                    torch.device("cpu")))  # fmt: skip
    kind: Any = TORCH_SCHEDULES[schedule]
    given = stages[0] if schedule == "1f1b" else list(stages)
    run = kind(given, n_microbatches=len(data), loss_fn=_loss)
    inputs = torch.cat([ids for ids, _ in data])
    targets = torch.cat([labels for _, labels in data])
    first, last = placement.holds_first(rank), placement.holds_last(rank)

    def step() -> None:
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        if first:
            run.step(inputs, **({"target": targets} if last else {}))
        else:
            run.step(**({"target": targets} if last else {}))

    return step


def main() -> None:
    """Time both under each schedule, alternating A B B A, and print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="1f1b,zbv,dualpipev", help="comma-separated")
    args, comm = bench.start(parser)
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2))
    data = _data(args.microbatches)
    first = dist.get_rank() == 0
    if first and not args.json:
        print(f"load average {bench.load_average()}")
        print("| model | schedule | torch's | pp | m | ours ms | torch ms | ours/torch "
              "(goal <= 1.00) |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for schedule in args.schedules.split(","):
        steps = [ours(state, comm, data, schedule), theirs(state, data, schedule)]
        ours_s, theirs_s = bench.alternate(steps, args.steps + 1, warm_up=1)
        record = {"model": "llama", "schedule": schedule, "pp": 2, "m": args.microbatches,
                  "torch_schedule": TORCH_SCHEDULES[schedule].__name__,
                  "ours_ms": ours_s * 1e3, "torch_ms": theirs_s * 1e3,
                  "ratio": ours_s / theirs_s, "load": bench.load_average()}  # fmt: skip
        if first:
            print(json.dumps(record) if args.json else (
                f"| Hugging Face Llama (hidden 256, 4 layers, seq 128) | {schedule} | "
                f"{record['torch_schedule']} | 2 | {args.microbatches} | {ours_s * 1e3:.1f} | "
                f"{theirs_s * 1e3:.1f} | {ours_s / theirs_s:.3f} |"), flush=True)  # fmt: skip
    state.destroy()
    bench.finish(comm)


if __name__ == "__main__":
    main()
