"""Hugging Face's Llama with every sequence split over 2 context-parallel ranks, and pp 2.

    torchrun --standalone --nproc-per-node 4 docs/examples/hf_llama_cp.py [--all-gather] \
        [1f1b zbv ...]

hf_llama.py's model and data (untied), trained by pipeline_trainer.py, which builds its groups
with `CP`: each rank of a context-parallel pair holds two of the four chunks of every sequence
(Megatron's load balancing), the global position ids of its tokens go to the rotary embedding,
and every decoder layer's attention is pp-tensor's context-parallel attention, registered with
transformers under its attention interface (a ring of key/value passes, or --all-gather). With
8 processes, data parallelism 2 on top.
"""

import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
from hf_llama import ROTARY, SIZES, batches, llama
from pipeline_trainer import lm_loss, main

from pp_schedules import PipelineModel, split_module_names
from pp_state import ParallelState
from pp_tensor import (
    context_parallel_positions,
    register_transformers_attention,
    split_for_context_parallel,
)

CP = 2
COMM = "all_gather" if "--all-gather" in sys.argv else "p2p"
CP_RANK = [0]  # this rank's place in its context-parallel pair, set by build


def mine(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a [batch, sequence] tensor: its two chunks of the sequence."""
    return split_for_context_parallel(tensor, CP, CP_RANK[0])


def keyword_inputs(ids: torch.Tensor) -> dict[str, Any]:
    """Position ids and rotary cos/sin of this rank's tokens: their places in the whole sequence."""
    positions = context_parallel_positions(ids.shape[1] * CP, CP, CP_RANK[0]).unsqueeze(0)
    return {"position_ids": positions, "position_embeddings": ROTARY(torch.ones(1), positions)}


def build(resolved: Any, state: ParallelState) -> PipelineModel:
    """hf_llama.py's split, the attention context-parallel over the state's cp group."""
    CP_RANK[0] = state.group_rank("cp")
    model = llama(tied=False)
    model.set_attn_implementation(register_transformers_attention(group=state.group("cp"),
                                                                  comm_type=COMM))  # fmt: skip
    layers = [f"model.layers.{i}" for i in range(SIZES["num_hidden_layers"])]
    ends = {"first": ["model.embed_tokens"], "last": ["model.norm", "lm_head"]}
    names = split_module_names(layers, resolved.placement.num_stages, **ends)
    pipe = PipelineModel.from_model(model, names, placement=resolved, state=state)
    ids = mine(batches(0, 1)[0][0])  # the contracts: this rank's part of a microbatch
    pipe.infer_contracts(ids, **keyword_inputs(ids))
    return pipe


def forward_step(data: Iterator[Any], chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """One microbatch's part through one chunk; the loss of this rank's tokens."""
    ids, labels = (mine(t) for t in next(data))
    return chunk(ids, **keyword_inputs(ids)), functools.partial(lm_loss, labels)


if __name__ == "__main__":
    main(sys.modules[__name__])
