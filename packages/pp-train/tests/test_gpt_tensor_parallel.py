"""The bundled GPT at tensor-parallel size 2 and 4 computes what the GPT at size 1 computes.

On 2 and 4 gloo ranks (one tensor-parallel group), with and without sequence parallelism: the
per-token loss and the logits equal tp 1's, and every parameter's gradient equals the matching
slice of tp 1's (parameters marked ``sequence_parallel`` after the sum over tp a trainer does).
Two chunks chained by hand equal one. The fused qkv weight splits per head. With a seeded RNG
tracker the draws follow Megatron's rule (read from the generator state each dropout call
sees), and recomputation replays the tracker, so recomputed runs are bitwise equal to plain
ones. Sizes that do not split are refused naming the numbers.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_tensor import RNGStatesTracker, model_parallel_manual_seed, shard_of
from pp_testing import run_distributed
from pp_train import RecomputeConfig
from pp_train.app.gpt import GPTChunk, GPTConfig, check_tensor_parallel
from pp_train.app.transformer import SelfAttention

CONFIG = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=32)
SEED, BATCH = 11, 2
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_length + 1), generator=generator)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _chunk(
    config: GPTConfig = CONFIG,
    *,
    layers: range = range(CONFIG.num_layers),
    pre: bool = True,
    post: bool = True,
    tp: bool = False,
    sp: bool = False,
    tracker: RNGStatesTracker | None = None,
    share: bool = True,
) -> GPTChunk:
    return GPTChunk(
        config, layers=layers, pre_process=pre, post_process=post, seed=SEED,
        tp_group=dist.group.WORLD if tp else None, sequence_parallel=sp, rng_tracker=tracker,
        share_embeddings_and_output_weights=share,
    )  # fmt: skip


def _grads(chunk: GPTChunk) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in chunk.global_named_parameters():
        assert param.grad is not None, name
        grads[name] = param.grad
    return grads


def _sum_sequence_parallel_grads(chunk: GPTChunk) -> None:
    """What the trainer's finalize does under sequence parallelism."""
    for param in chunk.parameters():
        if getattr(param, "sequence_parallel", False):
            assert param.grad is not None
            dist.all_reduce(param.grad)


def _attention(chunk: GPTChunk) -> SelfAttention:
    attention = chunk.get_submodule("layers.0.self_attention")
    assert isinstance(attention, SelfAttention)
    return attention


def _my_slice(full: torch.Tensor, name: str, dims: dict[str, int]) -> torch.Tensor:
    if name not in dims:
        return full
    return shard_of(full, dims[name], dist.get_rank(), dist.get_world_size())


# ------------------------------------------------------------------------ a whole GPT at tp N
def _whole_gpt_matches_tp1(config: GPTConfig = CONFIG, share: bool = True) -> None:
    tokens, labels = _data()
    reference = _chunk(config, share=share)
    expected_loss = reference(tokens, labels)
    expected_loss.mean().backward()
    expected = _grads(reference)
    for sp in (False, True):
        chunk = _chunk(config, tp=True, sp=sp, share=share)
        dims = chunk.tensor_parallel_dims()
        for name, param in chunk.global_named_parameters():  # the same full weights
            full = dict(reference.global_named_parameters())[name].detach()
            assert torch.equal(param.detach(), _my_slice(full, name, dims)), name
        loss = chunk(tokens, labels)
        torch.testing.assert_close(loss, expected_loss.detach(), **TOLERANCE)  # type: ignore[arg-type]
        loss.mean().backward()
        _sum_sequence_parallel_grads(chunk)
        grads = _grads(chunk)
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            want = _my_slice(expected[name], name, dims)
            torch.testing.assert_close(grad, want, **TOLERANCE, msg=name)  # type: ignore[arg-type]
        with torch.no_grad():
            torch.testing.assert_close(chunk(tokens), reference(tokens), **TOLERANCE)  # type: ignore[arg-type]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_whole_gpt_at_tensor_parallel_size_n_equals_size_1(tp: int) -> None:
    run_distributed(_whole_gpt_matches_tp1, tp)


def test_an_untied_tanh_gelu_gpt_at_tensor_parallel_size_2_equals_size_1() -> None:
    """GPT-2's settings (--untie-embeddings-and-output-weights, --openai-gelu) split too."""
    run_distributed(_whole_gpt_matches_tp1, 2, dataclasses.replace(CONFIG, openai_gelu=True), False)


def _marks_and_dims() -> None:
    chunk = _chunk(tp=True, sp=True)
    marked = {
        name for name, param in chunk.global_named_parameters()
        if getattr(param, "sequence_parallel", False)
    }  # fmt: skip
    assert marked == {
        "final_layernorm.weight", "final_layernorm.bias",
        *(f"layers.{i}.{part}_layernorm.{kind}" for i in range(2)
          for part in ("input", "post_attention") for kind in ("weight", "bias")),
        *(f"layers.{i}.{bias}" for i in range(2)
          for bias in ("self_attention.proj.bias", "mlp.fc2.bias")),
    }  # fmt: skip
    dims = chunk.tensor_parallel_dims()
    for name, param in chunk.global_named_parameters():
        assert getattr(param, "tensor_model_parallel", False) == (name in dims), name
    assert dims == _chunk().tensor_parallel_dims()  # the same at tp 1
    hidden = _chunk(layers=range(0), post=False, tp=True, sp=True)(_data()[0])
    assert hidden.shape == (CONFIG.seq_length // 2, BATCH, CONFIG.hidden_size)


def test_sequence_parallel_marks_and_partition_dims() -> None:
    run_distributed(_marks_and_dims, 2)


def test_partition_dims_name_every_split_parameter_and_the_tied_key() -> None:
    layer = {
        "self_attention.qkv.weight": 0, "self_attention.qkv.bias": 0,
        "self_attention.proj.weight": 1, "mlp.fc1.weight": 0, "mlp.fc1.bias": 0,
        "mlp.fc2.weight": 1,
    }  # fmt: skip
    whole = _chunk().tensor_parallel_dims()
    assert whole == {
        "embedding.word_embeddings.weight": 0,
        **{f"layers.{i}.{name}": dim for i in range(2) for name, dim in layer.items()},
    }
    last = _chunk(layers=range(1, 2), pre=False).tensor_parallel_dims()
    assert last["output_layer.weight"] == 0  # by name
    assert last["embedding.word_embeddings.weight"] == 0  # and by its checkpoint key
    assert "layers.1.mlp.fc2.weight" in last


def test_sequence_parallel_is_off_at_size_1() -> None:
    chunk = _chunk(sp=True)
    assert not chunk.parallel.sequence_parallel
    assert not any(getattr(p, "sequence_parallel", False) for p in chunk.parameters())
    hidden = _chunk(layers=range(0), post=False, sp=True)(_data()[0])
    assert hidden.shape == (CONFIG.seq_length, BATCH, CONFIG.hidden_size)


# ------------------------------------------------------------------------ two chunks at tp 2
def _two_chunks_match_one() -> None:
    tokens, labels = _data()
    for sp in (False, True):
        whole = _chunk(tp=True, sp=sp)
        whole_loss = whole(tokens, labels)
        whole_loss.mean().backward()
        first, last = (_chunk(layers=range(0, 1), post=False, tp=True, sp=sp),
                       _chunk(layers=range(1, 2), pre=False, tp=True, sp=sp))  # fmt: skip
        hidden = first(tokens)
        sent = hidden.detach().requires_grad_()
        last.set_input_tensor([sent])
        loss = last(None, labels)
        torch.testing.assert_close(loss, whole_loss.detach(), **TOLERANCE)  # type: ignore[arg-type]
        loss.mean().backward()
        torch.autograd.backward(hidden, grad_tensors=sent.grad)
        for chunk in (whole, first, last):
            _sum_sequence_parallel_grads(chunk)
        split = {**_grads(first), **_grads(last)}
        split["embedding.word_embeddings.weight"] += split.pop("output_layer.weight")
        expected = _grads(whole)
        assert split.keys() == expected.keys()
        for name, grad in split.items():
            torch.testing.assert_close(grad, expected[name], **TOLERANCE, msg=name)  # type: ignore[arg-type]


def test_two_chunks_at_tensor_parallel_size_2_equal_one() -> None:
    run_distributed(_two_chunks_match_one, 2)


# ------------------------------------------------------------------------ the qkv layout
def _qkv_holds_whole_heads() -> None:
    rank, heads, size = dist.get_rank(), CONFIG.num_attention_heads, CONFIG.head_size
    full = _attention(_chunk()).qkv.weight
    local = _attention(_chunk(tp=True)).qkv.weight
    assert full is not None
    assert local is not None
    per_head = full.detach().view(heads, 3 * size, CONFIG.hidden_size)  # [q; k; v] per head
    mine = per_head[rank * heads // 2 : (rank + 1) * heads // 2]
    assert torch.equal(local.detach(), mine.reshape(-1, CONFIG.hidden_size))


def test_the_fused_qkv_weight_splits_per_head() -> None:
    run_distributed(_qkv_holds_whole_heads, 2)


def test_the_qkv_rows_are_read_per_head() -> None:
    attention = _attention(_chunk())
    x = torch.randn(CONFIG.seq_length, BATCH, CONFIG.hidden_size)
    weight = attention.qkv.weight
    assert weight is not None
    rows = weight.detach().view(CONFIG.num_attention_heads, 3, CONFIG.head_size, -1)
    # Head h's query, key and value are rows [h, 0], [h, 1] and [h, 2] (biases are zero).
    query, key, value = (torch.einsum("sbi,hdi->bhsd", x, rows[:, j]) for j in range(3))
    context = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
    expected = attention.proj(context.permute(2, 0, 1, 3).reshape(*x.shape[:2], -1))[0]
    with torch.no_grad():
        torch.testing.assert_close(attention(x), expected, **TOLERANCE)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ Megatron's RNG rule
@contextmanager
def _recorded_draws() -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each dropout call's kind and the default generator's state it draws from."""
    functional = torch.nn.functional
    dropout, attention = functional.dropout, functional.scaled_dot_product_attention
    draws: list[tuple[str, torch.Tensor]] = []

    def hidden_dropout(*args: Any, **kwargs: Any) -> torch.Tensor:
        draws.append(("hidden", torch.get_rng_state()))
        return dropout(*args, **kwargs)

    def attention_dropout(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("dropout_p", 0.0):
            draws.append(("attention", torch.get_rng_state()))
        return attention(*args, **kwargs)

    functional.dropout = hidden_dropout
    functional.scaled_dot_product_attention = attention_dropout
    try:
        yield draws
    finally:
        functional.dropout, functional.scaled_dot_product_attention = dropout, attention


def _draws_follow_megatrons_rule() -> None:
    config = dataclasses.replace(CONFIG, hidden_dropout=0.1, attention_dropout=0.1)
    tracker = RNGStatesTracker()
    for sp in (False, True):
        model_parallel_manual_seed(SEED, tp_rank=dist.get_rank(), tracker=tracker)
        chunk = _chunk(config, tp=True, sp=sp, tracker=tracker)
        with _recorded_draws() as draws:
            chunk(*_data())
        kinds = [kind for kind, _ in draws]
        assert kinds == ["hidden"] + ["attention", "hidden", "hidden"] * 2
        both: list[Any] = [None, None]
        dist.all_gather_object(both, draws)
        for (kind, mine), (_, other) in zip(*both, strict=True):
            same = torch.equal(mine, other)
            assert same == (kind == "hidden" and not sp), (kind, sp)
        defaults: list[Any] = [None, None]
        dist.all_gather_object(defaults, torch.get_rng_state())
        assert torch.equal(*defaults)  # the default generator stays in step over tp
        embedded = _chunk(config, layers=range(0), post=False, tp=True, sp=sp, tracker=tracker)(
            _data()[0]
        )
        masks: list[Any] = [None, None]
        dist.all_gather_object(masks, embedded == 0)
        assert torch.equal(*masks) == (not sp)  # hidden-dropout masks, tp rank against tp rank


def test_dropout_draws_follow_megatrons_rule_at_tensor_parallel_size_2() -> None:
    run_distributed(_draws_follow_megatrons_rule, 2)


# ------------------------------------------------------------------------ recompute at tp 2
MODES = {
    "none": None,
    "full-uniform": RecomputeConfig(granularity="full", method="uniform", num_layers=1),
    "full-block": RecomputeConfig(granularity="full", method="block", num_layers=1),
    "selective": RecomputeConfig(granularity="selective"),
}


def _interleaved_run(recompute: RecomputeConfig | None, sp: bool) -> list[torch.Tensor]:
    """Three microbatches in a 1F1B-like order (F1 F2 B1 F3 B2 B3); losses, then grads."""
    config = dataclasses.replace(
        CONFIG, hidden_dropout=0.1, attention_dropout=0.1, recompute=recompute
    )
    tracker = model_parallel_manual_seed(SEED, tp_rank=dist.get_rank(), tracker=RNGStatesTracker())
    chunk = _chunk(config, tp=True, sp=sp, tracker=tracker)
    batches = [_data(seed) for seed in range(3)]
    losses = [chunk(*batches[0]).mean(), chunk(*batches[1]).mean()]
    losses[0].backward()
    losses.append(chunk(*batches[2]).mean())
    losses[1].backward()
    losses[2].backward()
    return [loss.detach() for loss in losses] + list(_grads(chunk).values())


def _recompute_is_bitwise() -> None:
    for sp in (False, True):
        plain = _interleaved_run(None, sp)
        for mode, recompute in MODES.items():
            if recompute is None:
                continue
            again = _interleaved_run(recompute, sp)
            for index, (a, b) in enumerate(zip(plain, again, strict=True)):
                assert torch.equal(a, b), (mode, sp, index)


def test_recompute_with_dropout_at_tensor_parallel_size_2_changes_no_bit() -> None:
    run_distributed(_recompute_is_bitwise, 2)


# ------------------------------------------------------------------------ errors
@pytest.mark.reliability
@pytest.mark.parametrize(
    ("shape", "tp", "sp", "message"),
    [
        ({"hidden_size": 48, "num_attention_heads": 6}, 4, False,
         "attention heads 6 do not divide over tensor-parallel size 4; use a tensor-parallel "
         "size among 1, 2, 3, 6"),
        ({"hidden_size": 10, "num_attention_heads": 5}, 4, False,
         "hidden size 10 does not divide over tensor-parallel size 4; use a tensor-parallel "
         "size among 1, 5"),
        ({"ffn_hidden_size": 50}, 4, False,
         "FFN hidden size 50 does not divide over tensor-parallel size 4; use a "
         "tensor-parallel size among 1, 2"),
        ({"vocab_size": 257}, 2, False,
         "vocabulary size 257 does not divide over tensor-parallel size 2; pad it with "
         "--make-vocab-size-divisible-by"),
        ({"seq_length": 10}, 4, True,
         "sequence length 10 does not divide over tensor-parallel size 4 under "
         "--sequence-parallel; use a sequence length that is a multiple of 4"),
    ],
    ids=["heads", "hidden", "ffn", "vocab", "sequence"],
)  # fmt: skip
def test_sizes_that_do_not_split_over_tensor_parallelism_are_refused(
    shape: dict[str, Any], tp: int, sp: bool, message: str
) -> None:
    config = dataclasses.replace(CONFIG, **shape)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_tensor_parallel(config, tp, sequence_parallel=sp)
    check_tensor_parallel(config, 1, sequence_parallel=sp)  # tp 1 always splits


@pytest.mark.reliability
def test_check_tensor_parallel_refuses_a_bad_size_or_config() -> None:
    with pytest.raises(ValueError, match="tensor-parallel size must be 1 or more, got 0"):
        check_tensor_parallel(CONFIG, 0)
    with pytest.raises(TypeError, match="tensor-parallel size must be an int"):
        check_tensor_parallel(CONFIG, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a GPTConfig, got dict"):
        check_tensor_parallel({}, 2)  # type: ignore[arg-type]
    check_tensor_parallel(dataclasses.replace(CONFIG, seq_length=10), 4)  # no sequence split


def _chunk_refuses_what_does_not_split() -> None:
    with pytest.raises(ValueError, match="attention heads 2 do not divide over tensor-parallel"):
        _chunk(dataclasses.replace(CONFIG, num_attention_heads=2, hidden_size=8), tp=True)
    chunk = _chunk(layers=range(0), post=False, tp=True, sp=True)
    with pytest.raises(
        ValueError,
        match=r"sequence length 6 does not divide over tensor-parallel size 4 under sequence "
        r"parallelism; use a multiple of 4",
    ):
        chunk(torch.zeros(BATCH, 6, dtype=torch.int64))
    assert math.prod(chunk(torch.zeros(BATCH, 4, dtype=torch.int64)).shape) == BATCH * 16


@pytest.mark.reliability
def test_a_chunk_refuses_sizes_that_do_not_split_over_its_group() -> None:
    run_distributed(_chunk_refuses_what_does_not_split, 4)
