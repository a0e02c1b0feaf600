"""Hugging Face's LlamaForCausalLM, pipelined by module names, every schedule, dp, tied or not.

    torchrun --standalone --nproc-per-node 4 docs/examples/hf_llama.py [--tied] \
        [1f1b zbv ...] [--distributed-optimizer]

A tiny config with random weights (no download), the same on every rank from one seed. The
stages run Hugging Face's own modules (the embedding, decoder layers, final norm and output
layer), named as in the model. Activations travel batch-first as the model makes them; rotary
cos/sin and position ids are computed on every stage from the microbatch (keyword inputs reach
the parts that take them); the causal mask is the attention's own (sdpa).
"""

import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
from pipeline_trainer import lm_loss, main, token_batches
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pp_schedules import PipelineModel, split_module_names
from pp_state import ParallelState

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
TIED = "--tied" in sys.argv  # the output layer's weight is the embedding's
ROTARY = LlamaRotaryEmbedding(LlamaConfig(**SIZES))  # no weights: each stage computes cos/sin
batches = functools.partial(token_batches, vocab=SIZES["vocab_size"])


def llama(tied: bool = TIED) -> LlamaForCausalLM:
    """The whole model, the same on every rank from one seed."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=tied))


def keyword_inputs(ids: torch.Tensor) -> dict[str, Any]:
    """What every decoder layer takes beside the hidden states, from the microbatch alone."""
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    return {"position_ids": positions, "position_embeddings": ROTARY(torch.ones(1), positions)}


def build(resolved: Any, state: ParallelState) -> PipelineModel:
    """This rank's chunks for the resolved schedule's placement, contracts inferred."""
    layers = [f"model.layers.{i}" for i in range(SIZES["num_hidden_layers"])]
    ends = {"first": ["model.embed_tokens"], "last": ["model.norm", "lm_head"]}
    names = split_module_names(layers, resolved.placement.num_stages, **ends)
    pipe = PipelineModel.from_model(llama(), names, placement=resolved, state=state)
    ids = batches(0, 1)[0][0]  # a sample microbatch: the contracts come from its forward
    pipe.infer_contracts(ids, **keyword_inputs(ids))
    return pipe


def forward_step(data: Iterator[Any], chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """One microbatch through one chunk (the first reads the ids, the others what they got)."""
    ids, labels = next(data)
    return chunk(ids, **keyword_inputs(ids)), functools.partial(lm_loss, labels)


if __name__ == "__main__":
    main(sys.modules[__name__])
