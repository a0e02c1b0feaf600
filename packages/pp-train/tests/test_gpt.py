from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest
import torch

from pp_state import Placement
from pp_train.app.gpt import GPTChunk, GPTConfig, chunk_layers, init_parameter_
from pp_train.data import ltor_masks_and_position_ids

CONFIG = GPTConfig(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16)
SEED = 1234


def _layout_chunks(
    config: GPTConfig,
    pp: int,
    vp: int,
    *,
    seed: int = SEED,
    share: bool = True,
    counts: tuple[int, ...] | None = None,
) -> list[GPTChunk]:
    """Every chunk of a layout, in virtual-stage order (the order the data flows)."""
    placement = Placement.looped(pp, vp)
    chunks = []
    for v in range(placement.num_stages):
        rank, chunk = placement.holder(v)
        chunks.append(
            GPTChunk(
                config,
                layers=chunk_layers(config.num_layers, pp, vp, rank, chunk, layer_counts=counts),
                pre_process=placement.is_first(rank, chunk),
                post_process=placement.is_last(rank, chunk),
                seed=seed,
                share_embeddings_and_output_weights=share,
            )
        )
    return chunks


def _tokens(batch: int = 3, seq: int = 16, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (batch, seq + 1), generator=generator)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


# --- GPTConfig -----------------------------------------------------------------------------


def test_config_defaults() -> None:
    assert CONFIG.vocab_size == 256
    assert CONFIG.ffn_hidden_size is None
    assert CONFIG.ffn_size == 128
    assert CONFIG.head_size == 8
    assert dataclasses.replace(CONFIG, ffn_hidden_size=50).ffn_size == 50


def test_config_is_frozen_and_keyword_only() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        CONFIG.num_layers = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        GPTConfig(2, 32, 4, 16)  # type: ignore[call-arg]


def test_config_heads_must_divide_hidden() -> None:
    message = (
        "hidden size 48 is not divisible by 5 attention heads; "
        "use one of 1, 2, 3, 4, 6, 8, 12, 16, 24, 48"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        GPTConfig(num_layers=2, hidden_size=48, num_attention_heads=5, seq_length=8)


@pytest.mark.parametrize(
    "field", ["num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"]
)
def test_config_sizes_must_be_positive(field: str) -> None:
    zero: dict[str, Any] = {field: 0}
    real: dict[str, Any] = {field: 2.0}
    boolean: dict[str, Any] = {field: True}
    with pytest.raises(ValueError, match=rf"{field} must be a positive int .* got 0"):
        dataclasses.replace(CONFIG, **zero)
    with pytest.raises(TypeError, match=f"{field} must be an int"):
        dataclasses.replace(CONFIG, **real)
    with pytest.raises(TypeError, match=f"{field} must be an int"):
        dataclasses.replace(CONFIG, **boolean)


def test_config_ffn_and_floats() -> None:
    with pytest.raises(ValueError, match=r"ffn_hidden_size must be a positive int .* got -4"):
        dataclasses.replace(CONFIG, ffn_hidden_size=-4)
    with pytest.raises(ValueError, match="init_method_std must be positive and finite, got 0"):
        dataclasses.replace(CONFIG, init_method_std=0.0)
    with pytest.raises(ValueError, match="layernorm_epsilon must be positive and finite"):
        dataclasses.replace(CONFIG, layernorm_epsilon=math.inf)
    with pytest.raises(TypeError, match="init_method_std must be a float"):
        dataclasses.replace(CONFIG, init_method_std="0.02")  # type: ignore[arg-type]


# --- chunk_layers --------------------------------------------------------------------------


def test_chunk_layers_without_interleaving() -> None:
    assert chunk_layers(8, 1, 1, 0, 0) == range(8)
    assert [chunk_layers(8, 2, 1, r, 0) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [chunk_layers(8, 4, 1, r, 0) for r in range(4)] == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
        range(6, 8),
    ]


def test_chunk_layers_interleaved() -> None:
    assert chunk_layers(8, 2, 2, 0, 0) == range(0, 2)
    assert chunk_layers(8, 2, 2, 1, 0) == range(2, 4)
    assert chunk_layers(8, 2, 2, 0, 1) == range(4, 6)
    assert chunk_layers(8, 2, 2, 1, 1) == range(6, 8)
    assert chunk_layers(12, 2, 3, 1, 2) == range(10, 12)
    assert chunk_layers(8, 4, 2, 3, 0) == range(3, 4)
    assert chunk_layers(8, 4, 2, 0, 1) == range(4, 5)


def test_chunk_layers_cover_every_layer_once() -> None:
    for pp, vp in [(1, 1), (2, 1), (4, 1), (2, 2), (2, 4), (4, 2), (8, 1)]:
        covered = [
            layer for v in range(vp) for r in range(pp) for layer in chunk_layers(8, pp, vp, r, v)
        ]
        assert covered == list(range(8))


def test_chunk_layers_follow_the_v_placement() -> None:
    v = Placement.v_shape(2, 2)
    # Rank 0 holds stages 0 and 3 (both ends), rank 1 stages 1 and 2.
    assert [chunk_layers(8, 2, 2, 0, c, placement=v) for c in range(2)] == [
        range(0, 2),
        range(6, 8),
    ]
    assert [chunk_layers(8, 2, 2, 1, c, placement=v) for c in range(2)] == [
        range(2, 4),
        range(4, 6),
    ]
    assert chunk_layers(8, 2, 2, 1, 1, placement=Placement.looped(2, 2)) == range(6, 8)


def test_chunk_layers_follow_uneven_counts() -> None:
    counts = (0, 3, 3, 2)
    assert [chunk_layers(8, 4, 1, r, 0, layer_counts=counts) for r in range(4)] == [
        range(0, 0),
        range(0, 3),
        range(3, 6),
        range(6, 8),
    ]
    v = Placement.v_shape(2, 2)
    assert chunk_layers(8, 2, 2, 0, 1, placement=v, layer_counts=(1, 3, 4, 0)) == range(8, 8)
    with pytest.raises(ValueError, match=r"add up to 9 layers, but the model has 8"):
        chunk_layers(8, 2, 1, 0, 0, layer_counts=(4, 5))
    with pytest.raises(ValueError, match=r"stage 1 of 4 holds nothing"):
        chunk_layers(8, 2, 2, 0, 0, layer_counts=(4, 0, 2, 2))


def test_empty_end_chunks_hold_only_the_embedding_or_the_output_layer() -> None:
    first = GPTChunk(CONFIG, layers=range(0, 0), pre_process=True, post_process=False, seed=1)
    last = GPTChunk(CONFIG, layers=range(8, 8), pre_process=False, post_process=True, seed=1)
    assert {name.split(".")[0] for name, _ in first.named_parameters()} == {"embedding"}
    assert {name.split(".")[0] for name, _ in last.named_parameters()} == {
        "final_layernorm",
        "output_layer",
    }
    assert torch.equal(last.output_layer.weight, first.embedding.word_embeddings.weight)  # type: ignore[union-attr]


def test_chunk_layers_refuse_a_placement_of_another_size() -> None:
    with pytest.raises(ValueError, match=r"covers 4 ranks x 2 chunks, but the pipeline has 2 x 2"):
        chunk_layers(8, 2, 2, 0, 0, placement=Placement.v_shape(4, 2))


def test_chunk_layers_errors() -> None:
    with pytest.raises(
        ValueError,
        match=r"8 layers do not split evenly .* 3 x virtual size 1 = 3 .* one of 1, 2, 4, 8",
    ):
        chunk_layers(8, 3, 1, 0, 0)
    with pytest.raises(ValueError, match=r"= 16 virtual stages"):
        chunk_layers(8, 4, 4, 0, 0)
    with pytest.raises(ValueError, match=r"pp_rank 2 is out of range; valid: 0 \.\. 1"):
        chunk_layers(8, 2, 2, 2, 0)
    with pytest.raises(ValueError, match=r"vp_stage -1 is out of range; valid: 0 \.\. 1"):
        chunk_layers(8, 2, 2, 0, -1)
    with pytest.raises(ValueError, match="pp_size must be a positive int"):
        chunk_layers(8, 0, 1, 0, 0)
    with pytest.raises(TypeError, match="num_layers must be an int"):
        chunk_layers(8.0, 1, 1, 0, 0)  # type: ignore[arg-type]


# --- initialisation ------------------------------------------------------------------------


def _global_values(chunks: list[GPTChunk]) -> dict[str, torch.Tensor]:
    values: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, param in chunk.global_named_parameters():
            assert name not in values or name == "output_layer.weight"
            values[name] = param.detach()
    return values


@pytest.mark.parametrize(("pp", "vp"), [(2, 1), (4, 1), (2, 2), (4, 2), (8, 1)])
def test_init_does_not_depend_on_the_layout(pp: int, vp: int) -> None:
    reference = _global_values(_layout_chunks(CONFIG, 1, 1))
    values = _global_values(_layout_chunks(CONFIG, pp, vp))
    # The split model has an output layer of its own; the single chunk ties it.
    output = values.pop("output_layer.weight")
    assert values.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(values[name], value), name
    assert torch.equal(output, reference["embedding.word_embeddings.weight"])


def test_init_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    _layout_chunks(CONFIG, 2, 1)
    assert torch.equal(torch.rand(3), expected)


def test_init_depends_on_seed_and_name() -> None:
    first = _global_values(_layout_chunks(CONFIG, 1, 1, seed=1))
    second = _global_values(_layout_chunks(CONFIG, 1, 1, seed=2))
    name = "layers.3.mlp.fc1.weight"
    assert not torch.equal(first[name], second[name])
    assert not torch.equal(first["layers.3.mlp.fc1.weight"], first["layers.4.mlp.fc1.weight"])


def test_init_statistics() -> None:
    config = dataclasses.replace(CONFIG, hidden_size=64, num_attention_heads=4)
    values = _global_values(_layout_chunks(config, 1, 1))
    scaled = 0.02 / math.sqrt(2 * config.num_layers)
    assert values["layers.0.mlp.fc1.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert values["layers.0.mlp.fc2.weight"].std().item() == pytest.approx(scaled, rel=0.05)
    assert values["layers.0.self_attention.proj.weight"].std().item() == pytest.approx(
        scaled, rel=0.1
    )
    assert values["embedding.word_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(values["layers.2.self_attention.qkv.bias"] == 0)
    assert torch.all(values["layers.2.input_layernorm.weight"] == 1)
    assert torch.all(values["layers.2.post_attention_layernorm.bias"] == 0)
    assert torch.all(values["final_layernorm.weight"] == 1)


def test_init_parameter_is_reproducible() -> None:
    a, b = torch.empty(4, 5), torch.empty(4, 5, dtype=torch.bfloat16)
    init_parameter_(a, seed=3, name="x", std=1.0)
    init_parameter_(b, seed=3, name="x", std=1.0)
    assert torch.equal(a.bfloat16(), b)


def test_parameter_names_are_stable() -> None:
    chunk = _layout_chunks(CONFIG, 2, 2)[1]
    names = dict(chunk.named_parameters()).keys()
    assert set(names) == {
        f"layers.{i}.{suffix}"
        for i in range(2)
        for suffix in [
            "input_layernorm.weight",
            "input_layernorm.bias",
            "self_attention.qkv.weight",
            "self_attention.qkv.bias",
            "self_attention.proj.weight",
            "self_attention.proj.bias",
            "post_attention_layernorm.weight",
            "post_attention_layernorm.bias",
            "mlp.fc1.weight",
            "mlp.fc1.bias",
            "mlp.fc2.weight",
            "mlp.fc2.bias",
        ]
    }
    assert chunk.global_name("layers.1.mlp.fc2.weight") == "layers.3.mlp.fc2.weight"


# --- tied output layer ---------------------------------------------------------------------


def test_output_layer_copies_the_embedding_and_carries_the_marks() -> None:
    first, *_, last = _layout_chunks(CONFIG, 4, 1)
    embedding = first.shared_embedding_or_output_weight()
    output = last.shared_embedding_or_output_weight()
    assert first.embedding is not None
    assert embedding is first.embedding.word_embeddings.weight
    assert last.output_layer is not None
    assert output is last.output_layer.weight
    assert output.shape == (256, 32)
    assert torch.equal(output, embedding)
    assert getattr(output, "shared", None) is True
    assert getattr(output, "shared_embedding", None) is True
    assert not hasattr(embedding, "shared")
    assert first.output_layer is None
    assert first.final_layernorm is None
    assert last.embedding is None


def test_middle_chunk_has_no_shared_weight() -> None:
    middle = _layout_chunks(CONFIG, 4, 1)[1]
    assert middle.shared_embedding_or_output_weight() is None


def test_single_chunk_ties_the_output_to_the_embedding() -> None:
    (chunk,) = _layout_chunks(CONFIG, 1, 1)
    assert chunk.output_layer is None
    assert chunk.shared_embedding_or_output_weight() is chunk.embedding.word_embeddings.weight  # type: ignore[union-attr]
    assert "output_layer.weight" not in dict(chunk.named_parameters())


def test_untied_output_layer() -> None:
    (chunk,) = _layout_chunks(CONFIG, 1, 1, share=False)
    assert chunk.output_layer is not None
    weight = chunk.output_layer.weight
    assert not torch.equal(weight, chunk.embedding.word_embeddings.weight)  # type: ignore[union-attr]
    assert not hasattr(weight, "shared")
    last = _layout_chunks(CONFIG, 2, 1, share=False)[-1]
    assert last.output_layer is not None
    assert not hasattr(last.output_layer.weight, "shared_embedding")
    assert torch.equal(last.output_layer.weight, weight)


# --- numerics ------------------------------------------------------------------------------


def _run_single(tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, GPTChunk]:
    (chunk,) = _layout_chunks(CONFIG, 1, 1)
    loss = chunk(tokens, labels).mean()
    loss.backward()
    return loss.detach(), chunk


def _run_chain(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    pp: int,
    vp: int,
    counts: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, list[GPTChunk]]:
    """Runs the chunks as a pipeline does: detached activations, backward chunk by chunk."""
    chunks = _layout_chunks(CONFIG, pp, vp, counts=counts)
    inputs: list[torch.Tensor | None] = [None]
    outputs = []
    for chunk in chunks:
        chunk.set_input_tensor([inputs[-1]])
        output = chunk(tokens, labels)
        outputs.append(output)
        inputs.append(output.detach().requires_grad_())
    loss = outputs[-1].mean()
    loss.backward()
    for index in range(len(chunks) - 2, -1, -1):
        next_input = inputs[index + 1]  # chunk index's output is chunk index + 1's input
        assert next_input is not None
        grad = next_input.grad
        assert grad is not None
        torch.autograd.backward(outputs[index], grad_tensors=grad)
    return loss.detach(), chunks


@pytest.mark.parametrize(
    ("pp", "vp", "counts"),
    [
        (2, 1, None),
        (4, 1, None),
        (2, 2, None),
        (2, 1, (3, 5)),
        (4, 1, (0, 3, 3, 2)),  # E|ttt|ttt|ttL
        (4, 1, (3, 3, 2, 0)),  # Ettt|ttt|tt|L
        (2, 2, (0, 4, 4, 0)),  # E|tttt|tttt|L
    ],
)
def test_pipelined_chunks_match_the_single_chunk(
    pp: int, vp: int, counts: tuple[int, ...] | None
) -> None:
    tokens, labels = _tokens()
    loss_a, single = _run_single(tokens, labels)
    loss_b, chunks = _run_chain(tokens, labels, pp, vp, counts)
    assert torch.allclose(loss_a, loss_b, atol=1e-5, rtol=1e-5)

    grads_b: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, param in chunk.global_named_parameters():
            assert param.grad is not None, name
            grads_b[name] = param.grad
    # The tied weight's gradient is the sum of its two uses.
    tied = grads_b.pop("embedding.word_embeddings.weight") + grads_b.pop("output_layer.weight")
    embedding = single.embedding.word_embeddings.weight  # type: ignore[union-attr]
    assert embedding.grad is not None
    assert torch.allclose(embedding.grad, tied, atol=1e-5, rtol=1e-5)
    single_grads = {
        name: param.grad
        for name, param in single.global_named_parameters()
        if name != "embedding.word_embeddings.weight"
    }
    assert single_grads.keys() == grads_b.keys()
    for name, grad in single_grads.items():
        assert grad is not None
        assert torch.allclose(grad, grads_b[name], atol=1e-5, rtol=1e-5), name


def test_output_shapes() -> None:
    tokens, labels = _tokens(batch=2, seq=10)
    first, last = _layout_chunks(CONFIG, 2, 1)
    hidden = first(tokens)
    assert hidden.shape == (10, 2, 32)
    last.set_input_tensor([hidden])
    assert last(None).shape == (2, 10, 256)
    loss = last(None, labels)
    assert loss.shape == (2, 10)
    assert loss.dtype == torch.float32


def test_logits_give_the_loss() -> None:
    tokens, labels = _tokens(batch=2, seq=12)
    (chunk,) = _layout_chunks(CONFIG, 1, 1)
    logits = chunk(tokens)
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 256), labels.reshape(-1), reduction="none"
    ).view(2, 12)
    assert torch.allclose(chunk(tokens, labels), expected, atol=1e-6)
    # An untrained model predicts about uniformly.
    assert expected.mean().item() == pytest.approx(math.log(256), rel=0.05)


def test_bf16_forward_returns_an_fp32_loss() -> None:
    tokens, labels = _tokens()
    (chunk,) = _layout_chunks(CONFIG, 1, 1)
    reference = chunk(tokens, labels)
    chunk.to(torch.bfloat16)
    loss = chunk(tokens, labels)
    assert loss.dtype == torch.float32
    assert loss.shape == (3, 16)
    assert torch.isfinite(loss).all()
    assert torch.allclose(loss, reference, atol=0.1)
    loss.mean().backward()
    grad = chunk.embedding.word_embeddings.weight.grad  # type: ignore[union-attr]
    assert grad is not None
    assert grad.dtype == torch.bfloat16


def test_causality() -> None:
    tokens, _ = _tokens(batch=2, seq=16)
    (chunk,) = _layout_chunks(CONFIG, 1, 1)
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    with torch.no_grad():
        before, after = chunk(tokens), chunk(changed)
    assert torch.equal(before[:, :9], after[:, :9])
    assert not torch.allclose(before[:, 9:], after[:, 9:])


# --- errors --------------------------------------------------------------------------------


def test_forward_errors() -> None:
    first, last = _layout_chunks(CONFIG, 2, 1)
    with pytest.raises(ValueError, match=r"needs tokens shaped \[batch, seq\], got None"):
        first(None)
    with pytest.raises(ValueError, match=r"sequence length 17 exceeds .* seq_length 16"):
        first(torch.zeros(1, 17, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="call set_input_tensor"):
        last(None)


def test_constructor_errors() -> None:
    with pytest.raises(TypeError, match="layers must be a range"):
        GPTChunk(CONFIG, layers=[0, 1], pre_process=True, post_process=True, seed=0)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"layers range\(6, 10\) must be consecutive indices inside 0 \.\. 7"
    ):
        GPTChunk(CONFIG, layers=range(6, 10), pre_process=True, post_process=True, seed=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        GPTChunk(CONFIG, layers=range(2), pre_process=True, post_process=True, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a GPTConfig"):
        GPTChunk({}, layers=range(2), pre_process=True, post_process=True, seed=0)  # type: ignore[arg-type]


def test_a_packed_document_is_trained_as_if_it_were_alone() -> None:
    """With document ids and restarting positions, a document's token losses in a packed
    sample equal those of the document on its own: attention stays inside it."""
    config = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=12,
                       vocab_size=32)  # fmt: skip
    chunk = GPTChunk(config, layers=range(2), pre_process=True, post_process=True, seed=3)
    first, second = torch.tensor([5, 9, 4, 0]), torch.tensor([7, 3, 8, 2, 6, 1, 11])
    packed = torch.cat([first, second]).unsqueeze(0)  # 0 is the end of the first document
    labels = torch.randint(32, packed.shape, generator=torch.Generator().manual_seed(0))
    masks = ltor_masks_and_position_ids(
        packed, eod_token=0, reset_position_ids=True, reset_attention_mask=True
    )
    losses = chunk(packed, labels, position_ids=masks["position_ids"],
                   document_ids=masks["document_ids"])  # fmt: skip
    alone = chunk(second.unsqueeze(0), labels[:, 4:])
    torch.testing.assert_close(losses[:, 4:], alone, rtol=1e-5, atol=1e-6)
    unmasked = chunk(packed, labels)
    assert not torch.allclose(unmasked[:, 4:], alone, atol=1e-3)  # the test can fail
