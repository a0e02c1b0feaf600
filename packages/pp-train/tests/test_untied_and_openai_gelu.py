"""GPT-2's two settings in the bundled GPT: an untied output layer and the tanh GELU.

With ``share_embeddings_and_output_weights=False`` (``--untie-embeddings-and-output-weights``)
the output layer is a weight of its own: it trains apart from the word embedding, and at
pipeline size 2 neither the build nor `finalize_model_grads` sums it with the embedding over
the embedding group (every gradient equals the one-process model's). ``openai_gelu``
(``--openai-gelu``) makes the MLP's activation torch's ``gelu(approximate="tanh")``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from pp_state import ParallelConfig, ParallelState
from pp_testing import run_distributed
from pp_train import finalize_model_grads, get_model, unwrap_model
from pp_train.app.gpt import GPTChunk, GPTConfig, chunk_layers

CONFIG = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=32)
SEED, BATCH = 5, 2
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_length + 1), generator=generator)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _untied(
    config: GPTConfig = CONFIG, *, layers: range = range(2), pre: bool = True, post: bool = True
) -> GPTChunk:
    return GPTChunk(
        config, layers=layers, pre_process=pre, post_process=post, seed=SEED,
        share_embeddings_and_output_weights=False,
    )  # fmt: skip


# ------------------------------------------------------------------------ the untied output layer
def test_an_untied_gpt_has_two_weights_that_train_apart() -> None:
    chunk = _untied()
    params = dict(chunk.global_named_parameters())
    embedding, output = params[EMBEDDING], params[OUTPUT]
    assert embedding is not output
    assert embedding.untyped_storage().data_ptr() != output.untyped_storage().data_ptr()
    assert not torch.equal(embedding, output)  # drawn under their own names
    assert not any(hasattr(w, "shared_embedding") or hasattr(w, "shared") for w in params.values())
    assert chunk.sharded_state_keys()[OUTPUT] == OUTPUT  # saved under its own key
    assert chunk.tensor_parallel_dims()[OUTPUT] == 0
    optimizer = torch.optim.Adam(chunk.parameters(), lr=1e-2)
    tokens, labels = _data()
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = chunk(tokens, labels).mean()
        loss.backward()
        assert embedding.grad is not None
        assert output.grad is not None
        assert not torch.allclose(embedding.grad, output.grad)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5  # it learns the batch
    assert not torch.equal(embedding, output)


def _built_untouched_and_grads_unsummed() -> None:
    """At pp 2: the last stage's output weight is its own, before and after finalize."""
    tokens, labels = _data()
    reference = _untied()
    reference(tokens, labels).mean().backward()
    expected = dict(reference.global_named_parameters())
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2))
    rank = state.pipeline_model_parallel_rank

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        layers = chunk_layers(CONFIG.num_layers, 2, 1, rank, vp_stage)
        return _untied(layers=layers, pre=pre_process, post=post_process)

    model = get_model(provider, state, wrap_with_ddp=False)
    chunk = unwrap_model(model[0])
    assert isinstance(chunk, GPTChunk)
    for name, param in chunk.global_named_parameters():  # no embedding copy sync at build
        assert torch.equal(param, expected[name]), name
    if rank == 0:
        hidden = chunk(tokens)
        dist.send(hidden.detach(), dst=1)
        grad = torch.empty_like(hidden)
        dist.recv(grad, src=1)
        hidden.backward(grad)
    else:
        received = torch.empty(CONFIG.seq_length, BATCH, CONFIG.hidden_size)
        dist.recv(received, src=0)
        received.requires_grad_()
        chunk.set_input_tensor([received])
        chunk(None, labels).mean().backward()
        assert received.grad is not None
        dist.send(received.grad, dst=0)
    finalize_model_grads(model, state)
    held = dict(chunk.global_named_parameters())
    assert (EMBEDDING in held, OUTPUT in held) == (rank == 0, rank == 1)
    for name, param in held.items():
        want = expected[name].grad
        assert param.grad is not None, name
        assert want is not None, name
        torch.testing.assert_close(param.grad, want, **TOLERANCE, msg=name)  # type: ignore[arg-type]


def test_at_pipeline_size_2_the_untied_output_layer_is_never_summed_with_the_embedding() -> None:
    run_distributed(_built_untouched_and_grads_unsummed, 2)


# ------------------------------------------------------------------------ --openai-gelu
def _mlp_output(chunk: GPTChunk, x: torch.Tensor, approximate: str) -> torch.Tensor:
    """The first layer's MLP computed by hand with `approximate`'s GELU on its weights."""
    w1, b1, w2, b2 = (
        chunk.get_parameter(f"layers.0.mlp.{name}")
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    )
    hidden = torch.nn.functional.linear(x, w1, b1)
    activated = torch.nn.functional.gelu(hidden, approximate=approximate)
    return torch.nn.functional.linear(activated, w2, b2)


def test_openai_gelu_is_torchs_tanh_gelu_and_differs_from_the_exact_one() -> None:
    tanh = _untied(dataclasses.replace(CONFIG, openai_gelu=True))
    exact = _untied()
    # Large inputs: the fc1 outputs reach |x| ~ 2, where the two GELUs differ most.
    x = 40 * torch.randn(CONFIG.seq_length, BATCH, CONFIG.hidden_size, generator=torch.Generator())
    with torch.no_grad():
        tanh_out = tanh.get_submodule("layers.0.mlp")(x)
        exact_out = exact.get_submodule("layers.0.mlp")(x)
        torch.testing.assert_close(tanh_out, _mlp_output(tanh, x, "tanh"), rtol=0, atol=0)
        torch.testing.assert_close(exact_out, _mlp_output(exact, x, "none"), rtol=0, atol=0)
        assert not torch.allclose(tanh_out, exact_out, rtol=1e-3, atol=0)
        # The same weights (drawn by name), so only the activation differs.
        for (name, a), (_, b) in zip(
            tanh.named_parameters(), exact.named_parameters(), strict=True
        ):
            assert torch.equal(a, b), name


def test_openai_gelu_must_be_a_bool() -> None:
    assert not CONFIG.openai_gelu
    with pytest.raises(TypeError, match="openai_gelu must be a bool, got int 1"):
        dataclasses.replace(CONFIG, openai_gelu=1)  # type: ignore[arg-type]
