"""Hugging Face's GPT2LMHeadModel, pipelined from a list of parts, every schedule, dp.

    torchrun --standalone --nproc-per-node 4 docs/examples/hf_gpt2.py [--schedules 1f1b zbv]

A tiny config with random weights (no download). GPT-2 adds two embeddings before its first
block, which no single submodule does, so the model is given as a list of parts: a small
module for the embeddings, then Hugging Face's own blocks, final norm and output layer. The
output layer's weight is the token embedding's (GPT-2 ties them): the tie is declared by the
parts' indices. The causal mask is the attention's own (sdpa).
"""

import functools
import sys
from typing import Any

import sequential
import torch
from pipeline_trainer import main, token_batches
from transformers import GPT2Config, GPT2LMHeadModel

from pp_schedules import PipelineModel
from pp_state import ParallelState

CONFIG = GPT2Config(vocab_size=96, n_embd=32, n_layer=4, n_head=4, n_positions=32,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    bos_token_id=0, eos_token_id=0)  # fmt: skip
batches = functools.partial(token_batches, vocab=CONFIG.vocab_size)


class Embeddings(torch.nn.Module):
    """Token and position embeddings: GPT-2's first part."""

    def __init__(self, wte: torch.nn.Embedding, wpe: torch.nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Batch-first hidden states of token ids (batch, seq)."""
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))


def gpt2() -> GPT2LMHeadModel:
    """The whole model, the same on every rank from one seed."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG)


def parts(model: GPT2LMHeadModel) -> list[torch.nn.Module]:
    """The model in order: embeddings, Hugging Face's blocks, the final norm, the output layer."""
    body = model.transformer
    return [Embeddings(body.wte, body.wpe), *body.h, body.ln_f, model.lm_head]


def build(resolved: Any, state: ParallelState) -> PipelineModel:
    """This rank's chunks for the resolved schedule's placement, contracts inferred."""
    model = gpt2()
    pieces = parts(model)
    stages = resolved.placement.num_stages
    counts = [len(pieces) // stages] * stages
    counts[-1] += len(pieces) - sum(counts)
    tie = ("0.wte.weight", f"{len(pieces) - 1}.weight")
    pipe = PipelineModel.from_parts(pieces, placement=resolved, state=state, counts=counts,
                                    ties=[tie])  # fmt: skip
    pipe.infer_contracts(batches(0, 1)[0][0])
    return pipe


forward_step = sequential.forward_step  # token ids in, the loss of the logits out

if __name__ == "__main__":
    main(sys.modules[__name__])
