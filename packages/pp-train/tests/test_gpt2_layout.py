"""GPT-2's layout table against a small GPT, in one process (no files, no process group).

Every name of the GPT, tied and untied, goes to its GPT-2 name and back; the table's shapes
are the export's; the export and the import undo each other bitwise (the vocabulary's
padding aside); the qkv reordering puts each head's query, key and value where GPT-2 reads
them; the split dimensions are the GPT's own.
"""

from __future__ import annotations

import pytest
import torch

from pp_train.app.gpt import GPTChunk, GPTConfig
from pp_train.checkpoint.gpt2_layout import (
    GPT2_LAYOUT,
    HF_NAMES,
    from_hf_name,
    gpt2_names,
    hf_shapes,
    split_dims,
    to_hf_name,
)
from pp_train.checkpoint.hf import from_hf_tensors, to_hf_tensors

LAYERS, HIDDEN, HEADS, SEQ, PADDED, VOCAB = 2, 16, 4, 8, 40, 37


def _gpt(*, tied: bool) -> GPTChunk:
    config = GPTConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
        vocab_size=PADDED,
    )  # fmt: skip
    return GPTChunk(
        config, layers=range(LAYERS), pre_process=True, post_process=True, seed=1,
        share_embeddings_and_output_weights=tied,
    )  # fmt: skip


def _global_tensors(chunk: GPTChunk) -> dict[str, torch.Tensor]:
    """The chunk's tensors by global name, as a checkpoint holds them."""
    keys = chunk.sharded_state_keys()
    return {keys[local]: value.detach().clone() for local, value in chunk.state_dict().items()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_every_name_of_a_small_gpt_goes_to_gpt2_and_back(tied: bool) -> None:
    names = sorted(_global_tensors(_gpt(tied=tied)))
    listed = list(gpt2_names(layers=LAYERS, tied=tied))
    assert sorted(ours for _, ours, _ in listed) == names
    for parameter, ours, hf in listed:
        assert to_hf_name(ours) == (parameter, hf)
        assert from_hf_name(hf) == (parameter, ours)
    assert len({hf for _, _, hf in listed}) == len(names)
    assert to_hf_name("layers.0.mlp.gate.weight") is None
    assert from_hf_name("transformer.h.0.attn.masked_bias") is None


def test_each_row_of_the_table_is_consistent() -> None:
    assert [(p.ours, p.hf) for p in GPT2_LAYOUT] == list(HF_NAMES)
    assert len({p.ours for p in GPT2_LAYOUT}) == len({p.hf for p in GPT2_LAYOUT}) == 17
    for p in GPT2_LAYOUT:
        assert p.ours.rsplit(".", 1)[1] == p.hf.rsplit(".", 1)[1], p  # weight or bias alike
        assert p.layered == ("{i}" in p.hf), p
        assert not p.transposed or len(p.hf_shape) == 2, p
        assert p.qkv == ("qkv" in p.hf_shape), p
        assert p.vocabulary == (p.hf_shape[0] == "vocab"), p
        assert p.split_dim is None or p.split_dim < len(p.hf_shape), p


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_split_dimensions_are_the_gpts_own(tied: bool) -> None:
    chunk = _gpt(tied=tied)
    assert split_dims(_global_tensors(chunk)) == chunk.tensor_parallel_dims()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_export_has_the_tables_shapes_and_import_undoes_it(tied: bool) -> None:
    tensors = _global_tensors(_gpt(tied=tied))
    exported = to_hf_tensors(dict(tensors), num_attention_heads=HEADS, vocab_size=VOCAB)
    sizes = {"vocab": VOCAB, "positions": SEQ, "hidden": HIDDEN, "qkv": 3 * HIDDEN,
             "inner": 4 * HIDDEN}  # fmt: skip
    shapes = hf_shapes(sizes, layers=LAYERS, tied=tied)
    assert {name: tuple(value.shape) for name, value in exported.items()} == shapes
    back = from_hf_tensors(exported, num_attention_heads=HEADS, padded_vocab_size=PADDED)
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():
        parameter, _ = to_hf_name(name) or (None, "")
        assert parameter is not None
        if parameter.vocabulary:  # rows past the tokenizer's come back as zeros
            assert torch.equal(back[name][:VOCAB], value[:VOCAB])
            assert not back[name][VOCAB:].any()
        else:
            assert torch.equal(back[name], value), name


def test_the_qkv_reordering_puts_each_heads_query_key_and_value_in_gpt2s_blocks() -> None:
    size = HIDDEN // HEADS
    # Row r of the fused weight: head r // (3 size), part (r // size) % 3, row r % size.
    rows = torch.arange(3 * HIDDEN, dtype=torch.float32)
    weight = rows[:, None].expand(3 * HIDDEN, HIDDEN).clone()
    converted = to_hf_tensors(
        {"layers.0.self_attention.qkv.weight": weight, "layers.0.self_attention.qkv.bias": rows},
        num_attention_heads=HEADS, vocab_size=VOCAB,
    )  # fmt: skip
    columns = converted["transformer.h.0.attn.c_attn.weight"]
    bias = converted["transformer.h.0.attn.c_attn.bias"]
    assert columns.shape == (HIDDEN, 3 * HIDDEN)
    for part in range(3):  # q, k, v: one block of HIDDEN columns each in GPT-2
        for head in range(HEADS):
            start = part * HIDDEN + head * size
            expected = torch.arange(size) + head * 3 * size + part * size
            assert torch.equal(bias[start : start + size], expected.float())
            assert torch.equal(columns[0, start : start + size], expected.float())
