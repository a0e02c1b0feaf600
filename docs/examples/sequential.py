"""A plain nn.Sequential language model, pipelined from its list of parts, every schedule, dp.

    torchrun --standalone --nproc-per-node 4 docs/examples/sequential.py [--schedules 1f1b]

No model code beyond torch's own modules: an embedding, residual-free blocks of Linear and
Tanh, and an output layer, split evenly over the stages by count. Nothing else is needed
from the model: the boundaries' shapes come from one forward of a sample microbatch.
"""

import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
from pipeline_trainer import lm_loss, main, token_batches

from pp_schedules import PipelineModel
from pp_state import ParallelState

VOCAB, HIDDEN, BLOCKS = 96, 32, 6
batches = functools.partial(token_batches, vocab=VOCAB)


def sequential() -> torch.nn.Sequential:
    """The whole model, the same on every rank from one seed: 8 parts."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
              for _ in range(BLOCKS)]  # fmt: skip
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, HIDDEN), *blocks, torch.nn.Linear(HIDDEN, VOCAB)
    )


def build(resolved: Any, state: ParallelState) -> PipelineModel:
    """This rank's chunks for the resolved schedule's placement, contracts inferred."""
    pipe = PipelineModel.from_parts(sequential(), placement=resolved, state=state)
    pipe.infer_contracts(batches(0, 1)[0][0])
    return pipe


def forward_step(data: Iterator[Any], chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """One microbatch through one chunk (the first reads the ids, the others what they got)."""
    ids, labels = next(data)
    return chunk(ids), functools.partial(lm_loss, labels)


if __name__ == "__main__":
    main(sys.modules[__name__])
