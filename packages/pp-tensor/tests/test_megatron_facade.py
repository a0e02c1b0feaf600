"""`pp_tensor.megatron` against the unsplit computation, at tensor-parallel sizes 2 and 4.

Written against megatron-core's documented behaviour: every rank builds every rank's input
and gradient (`_of`), so it checks its own forward and backward against what the unsplit
computation gives. Groups are left as None throughout: the facade reads them from pp-state's
default state, as Megatron reads ``parallel_state``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's own convention

import pp_tensor
from pp_state import parallel_state
from pp_tensor import megatron as tp
from pp_tensor.megatron import cross_entropy as megatron_cross_entropy
from pp_tensor.megatron.model_parallel_config import ModelParallelConfig
from pp_tensor.megatron.random import CheckpointWithoutOutputManager
from pp_testing import run_distributed

SIZES = [2, 4]
S, B, H = 8, 2, 12  # sequence, batch, hidden: split by 2 and 4


def _of(rank: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + rank))


def _run(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_(True)
    out = fn(leaf)
    out.backward(grad)
    assert leaf.grad is not None
    return out.detach(), leaf.grad


def _grad(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    assert t.grad is not None
    return t.grad


def _initialized(body: Callable[[int, int], None]) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    try:
        body(dist.get_rank(), dist.get_world_size())
    finally:
        parallel_state.destroy_model_parallel()


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank]


def _mappings(rank: int, size: int) -> None:
    every = range(size)
    full = (S, B, H)
    local_h = (S, B, H // size)
    local_s = (S // size, B, H)

    def total(salt: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.stack([_of(r, shape, salt) for r in every]).sum(dim=0)

    close = torch.testing.assert_close

    out, grad = _run(
        tp.copy_to_tensor_model_parallel_region, _of(rank, full, 1), _of(rank, full, 2)
    )
    close(out, _of(rank, full, 1))
    close(grad, total(2, full))
    out, grad = _run(
        tp.reduce_from_tensor_model_parallel_region, _of(rank, full, 3), _of(rank, full, 4)
    )
    close(out, total(3, full))
    close(grad, _of(rank, full, 4))
    out, grad = _run(
        tp.scatter_to_tensor_model_parallel_region, _of(0, full, 5), _of(rank, local_h, 6)
    )
    close(out, _chunk(_of(0, full, 5), -1, rank, size))
    close(grad, torch.cat([_of(r, local_h, 6) for r in every], -1))
    out, grad = _run(
        tp.gather_from_tensor_model_parallel_region, _of(rank, local_h, 7), _of(0, full, 8)
    )
    close(out, torch.cat([_of(r, local_h, 7) for r in every], -1))
    close(grad, _chunk(_of(0, full, 8), -1, rank, size))
    out, grad = _run(
        tp.scatter_to_sequence_parallel_region, _of(0, full, 9), _of(rank, local_s, 10)
    )
    close(out, _chunk(_of(0, full, 9), 0, rank, size))
    close(grad, torch.cat([_of(r, local_s, 10) for r in every], 0))
    # gather along the sequence: partial gradients reduce-scattered, or whole ones split
    out, grad = _run(
        tp.gather_from_sequence_parallel_region, _of(rank, local_s, 11), _of(rank, full, 12)
    )
    close(out, torch.cat([_of(r, local_s, 11) for r in every], 0))
    close(grad, _chunk(total(12, full), 0, rank, size))
    _, grad = _run(
        lambda t: tp.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False),
        _of(rank, local_s, 13),
        _of(0, full, 14),
    )
    close(grad, _chunk(_of(0, full, 14), 0, rank, size))
    out, grad = _run(
        tp.reduce_scatter_to_sequence_parallel_region, _of(rank, full, 15), _of(rank, local_s, 16)
    )
    close(out, _chunk(total(15, full), 0, rank, size))
    close(grad, torch.cat([_of(r, local_s, 16) for r in every], 0))
    # the last dimension: gather with a reduce-scattered gradient, and the converse
    out, grad = _run(
        tp.all_gather_last_dim_from_tensor_parallel_region,
        _of(rank, local_h, 17),
        _of(rank, full, 18),
    )
    close(out, torch.cat([_of(r, local_h, 17) for r in every], -1))
    close(grad, _chunk(total(18, full), -1, rank, size))
    out, grad = _run(
        tp.reduce_scatter_last_dim_to_tensor_parallel_region,
        _of(rank, full, 19),
        _of(rank, local_h, 20),
    )
    close(out, _chunk(total(19, full), -1, rank, size))
    close(grad, torch.cat([_of(r, local_h, 20) for r in every], -1))


def _uneven_and_all_to_all(rank: int, size: int) -> None:
    close = torch.testing.assert_close
    every = range(size)
    rows = [r + 1 for r in every]  # rank r holds r + 1 rows
    offset = sum(rows[:rank])
    out, grad = _run(
        lambda t: tp.gather_from_sequence_parallel_region(t, output_split_sizes=rows),
        _of(rank, (rows[rank], H), 21),
        _of(rank, (sum(rows), H), 22),
    )
    close(out, torch.cat([_of(r, (rows[r], H), 21) for r in every]))
    close(
        grad,
        torch.stack([_of(r, (sum(rows), H), 22) for r in every]).sum(dim=0)[
            offset : offset + rows[rank]
        ],
    )
    out, grad = _run(
        lambda t: tp.reduce_scatter_to_sequence_parallel_region(t, input_split_sizes=rows),
        _of(rank, (sum(rows), H), 23),
        _of(rank, (rows[rank], H), 24),
    )
    close(
        out,
        torch.stack([_of(r, (sum(rows), H), 23) for r in every]).sum(dim=0)[
            offset : offset + rows[rank]
        ],
    )
    close(grad, torch.cat([_of(r, (rows[r], H), 24) for r in every]))
    # all-to-all, equal then unequal: rank r's part i becomes rank i's part r
    group = parallel_state.get_tensor_model_parallel_group()
    tokens = (size * 2, H)
    out, grad = _run(
        lambda t: tp.all_to_all(group, t), _of(rank, tokens, 25), _of(rank, tokens, 26)
    )
    close(out, torch.cat([_of(r, tokens, 25).chunk(size)[rank] for r in every]))
    close(grad, torch.cat([_of(r, tokens, 26).chunk(size)[rank] for r in every]))
    sends = [[1 + (i + j) % 2 for j in every] for i in every]  # sends[i][j]: rank i to rank j
    mine = (sum(sends[rank]), H)
    received = [sends[r][rank] for r in every]
    out, grad = _run(
        lambda t: tp.all_to_all(group, t, received, sends[rank]),
        _of(rank, mine, 27),
        _of(rank, (sum(received), H), 28),
    )
    parts = [torch.split(_of(r, (sum(sends[r]), H), 27), sends[r])[rank] for r in every]
    close(out, torch.cat(parts))
    back = [
        torch.split(_of(r, (sum(sends[j][r] for j in every), H), 28), [sends[j][r] for j in every])[
            rank
        ]
        for r in every
    ]
    close(grad, torch.cat(back))
    # sequence part <-> hidden part
    x = _of(0, (S, B, H), 29)
    sequence_part = _chunk(x, 0, rank, size).reshape(-1, H)
    hidden_part = tp.all_to_all_sp2hp(sequence_part)
    close(hidden_part, _chunk(x.reshape(-1, H), -1, rank, size))
    close(tp.all_to_all_hp2sp(hidden_part), sequence_part)


@pytest.mark.parametrize("size", SIZES)
def test_mappings_forward_and_backward_equal_the_unsplit_computation(size: int) -> None:
    run_distributed(_initialized, size, _mappings)


@pytest.mark.parametrize("size", SIZES)
def test_uneven_splits_and_all_to_all(size: int) -> None:
    run_distributed(_initialized, size, _uneven_and_all_to_all)


def _config(size: int, **fields: Any) -> ModelParallelConfig:
    return ModelParallelConfig(
        tensor_model_parallel_size=size, use_cpu_initialization=True, **fields
    )


def _init(salt: int) -> Callable[[torch.Tensor], object]:
    return lambda w: w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(salt)))


def _mlp(rank: int, size: int, sequence_parallel: bool) -> None:
    """Column + row parallel MLP (Megatron's) equals the unsplit one, and pp-tensor's layers."""
    config = _config(size, sequence_parallel=sequence_parallel)
    fc1 = tp.ColumnParallelLinear(
        H,
        4 * H,
        config=config,
        init_method=_init(1),
        gather_output=False,
        keep_master_weight_for_test=True,
    )
    fc2 = tp.RowParallelLinear(
        4 * H,
        H,
        config=config,
        init_method=_init(2),
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        keep_master_weight_for_test=True,
    )
    with torch.no_grad():
        fc1.bias.copy_(_chunk(_of(0, (4 * H,), 3), 0, rank, size))  # type: ignore[union-attr]
        fc2.bias.copy_(_of(0, (H,), 4))  # type: ignore[union-attr]
    x, grad = _of(0, (S, B, H), 5), _of(0, (S, B, H), 6)
    local = (lambda t: _chunk(t, 0, rank, size)) if sequence_parallel else (lambda t: t)
    leaf = local(x).clone().requires_grad_(True)
    out = fc2(F.gelu(fc1(leaf)[0]))[0]
    out.backward(local(grad))
    # the unsplit MLP from the full weights
    w1 = fc1.master_weight.clone().requires_grad_(True)  # type: ignore[union-attr]
    w2 = fc2.master_weight.clone().requires_grad_(True)  # type: ignore[union-attr]
    b1, b2 = _of(0, (4 * H,), 3).requires_grad_(True), _of(0, (H,), 4).requires_grad_(True)
    whole = x.clone().requires_grad_(True)
    expected = F.linear(F.gelu(F.linear(whole, w1, b1)), w2, b2)
    expected.backward(grad)
    close = torch.testing.assert_close
    close(out, local(expected.detach()), rtol=1e-5, atol=1e-5)
    close(_grad(leaf), local(_grad(whole)), rtol=1e-5, atol=1e-5)
    close(_grad(fc1.weight), _chunk(_grad(w1), 0, rank, size), rtol=1e-5, atol=1e-5)
    close(_grad(fc2.weight), _chunk(_grad(w2), 1, rank, size), rtol=1e-5, atol=1e-5)
    close(_grad(fc1.bias), _chunk(_grad(b1), 0, rank, size), rtol=1e-5, atol=1e-5)
    if sequence_parallel:  # the row bias's gradient is partial over the sequence
        dist.all_reduce(_grad(fc2.bias))
    close(_grad(fc2.bias), _grad(b2), rtol=1e-5, atol=1e-5)
    # pp-tensor's own layers with the same arguments compute the same
    group = parallel_state.get_tensor_model_parallel_group()
    own1 = pp_tensor.ColumnParallelLinear(
        H, 4 * H, tp_group=group, init_method=_init(1), sequence_parallel=sequence_parallel
    )
    own2 = pp_tensor.RowParallelLinear(
        4 * H,
        H,
        tp_group=group,
        init_method=_init(2),
        input_is_parallel=True,
        sequence_parallel=sequence_parallel,
    )
    own1.load_state_dict(fc1.state_dict())
    own2.load_state_dict(fc2.state_dict())
    close(own2(F.gelu(own1(local(x))[0]))[0], out.detach(), rtol=0, atol=0)
    assert getattr(fc1.weight, "allreduce")  # noqa: B009 - an attribute torch does not type
    assert getattr(fc2.weight, "allreduce")  # noqa: B009
    assert getattr(fc1.weight, "partition_dim") == 0  # noqa: B009
    assert getattr(fc2.weight, "partition_dim") == 1  # noqa: B009


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_column_and_row_parallel_mlp_equals_the_unsplit_one(
    size: int, sequence_parallel: bool
) -> None:
    run_distributed(_initialized, size, _mlp_sp if sequence_parallel else _mlp_tp)


def _mlp_tp(rank: int, size: int) -> None:
    _mlp(rank, size, False)


def _mlp_sp(rank: int, size: int) -> None:
    _mlp(rank, size, True)


def _embedding_and_loss(rank: int, size: int) -> None:
    vocab = 4 * size * 3
    config = _config(size)
    embedding = tp.VocabParallelEmbedding(vocab, H, init_method=_init(7), config=config)
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(8))
    full = torch.randn((vocab, H), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(embedding(ids), F.embedding(ids, full))
    # the loss with Megatron's label smoothing: (1 - s) nll - s mean(log p), s = e V / (V - 1)
    logits = _of(0, (S, B, vocab), 9)
    target = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(10))
    mine = _chunk(logits, -1, rank, size).clone().requires_grad_(True)
    loss = tp.vocab_parallel_cross_entropy(mine, target, label_smoothing=0.1)
    loss.sum().backward()
    whole = logits.clone().requires_grad_(True)
    log_p = F.log_softmax(whole, dim=-1)
    nll = -log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    s = 0.1 * vocab / (vocab - 1)
    expected = (1 - s) * nll - s * log_p.mean(dim=-1)
    expected.sum().backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine.grad, _chunk(whole.grad, -1, rank, size), rtol=1e-5, atol=1e-5)  # type: ignore[arg-type]
    # Megatron's module-level group getter is what a missing group is read through
    calls = []
    original = megatron_cross_entropy.get_tensor_model_parallel_group

    def patched(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original()

    megatron_cross_entropy.get_tensor_model_parallel_group = patched  # type: ignore[assignment]
    try:
        tp.vocab_parallel_cross_entropy(mine.detach(), target)
    finally:
        megatron_cross_entropy.get_tensor_model_parallel_group = original
    assert calls == [1]


@pytest.mark.parametrize("size", SIZES)
def test_embedding_and_cross_entropy_equal_the_unsplit_ones(size: int) -> None:
    run_distributed(_initialized, size, _embedding_and_loss)


def _linear_functions(rank: int, size: int) -> None:
    group = parallel_state.get_tensor_model_parallel_group()
    close = torch.testing.assert_close
    w_full = _of(0, (2 * size, H), 11)
    w = torch.nn.Parameter(_chunk(w_full, 0, rank, size).clone())
    w.main_grad = torch.zeros_like(w)  # type: ignore[attr-defined]
    x, grad = _of(0, (S, B, H), 12), _of(0, (S, B, 2 * size), 13)
    for fusion in (False, True):
        leaf = x.clone().requires_grad_(True)
        out = tp.linear_with_grad_accumulation_and_async_allreduce(
            leaf, w, None, fusion, True, False
        )
        out.backward(_chunk(grad, -1, rank, size))
        close(out, _chunk(F.linear(x, w_full), -1, rank, size), rtol=1e-5, atol=1e-5)
        whole_grad_x = grad.reshape(-1, 2 * size).matmul(w_full).view(S, B, H)
        close(leaf.grad, whole_grad_x, rtol=1e-5, atol=1e-5)  # all-reduced over the group
        expected_w = _chunk(grad, -1, rank, size).reshape(-1, 2).t().matmul(x.reshape(-1, H))
        if fusion:  # added into main_grad, no .grad
            assert w.grad is None
            close(w.main_grad, expected_w, rtol=1e-5, atol=1e-5)  # type: ignore[attr-defined]
        else:
            close(w.grad, expected_w, rtol=1e-5, atol=1e-5)
            w.grad = None
    # sequence parallelism: this rank's part of the sequence in, the gradient reduce-scattered
    w.main_grad.zero_()  # type: ignore[attr-defined]
    leaf = _chunk(x, 0, rank, size).clone().requires_grad_(True)
    out = tp.linear_with_grad_accumulation_and_async_allreduce(leaf, w, None, True, False, True)
    out.backward(_chunk(grad, -1, rank, size))
    close(out, _chunk(F.linear(x, w_full), -1, rank, size), rtol=1e-5, atol=1e-5)
    whole_grad_x = grad.reshape(-1, 2 * size).matmul(w_full).view(S, B, H)
    close(leaf.grad, _chunk(whole_grad_x, 0, rank, size), rtol=1e-5, atol=1e-5)
    expected_w = _chunk(grad, -1, rank, size).reshape(-1, 2).t().matmul(x.reshape(-1, H))
    close(w.main_grad, expected_w, rtol=1e-5, atol=1e-5)  # type: ignore[attr-defined]
    frozen = w.detach()
    leaf = x.clone().requires_grad_(True)
    out = tp.layers.linear_with_frozen_weight(leaf, frozen, None, False, True, False, group)
    out.backward(_chunk(grad, -1, rank, size))
    close(leaf.grad, grad.reshape(-1, 2 * size).matmul(w_full).view(S, B, H), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", SIZES)
def test_linear_functions_fusion_and_frozen_weight(size: int) -> None:
    run_distributed(_initialized, size, _linear_functions)


def _data_utils_and_attributes(rank: int, size: int) -> None:
    data = {"tokens": torch.arange(6).view(2, 3), "labels": torch.arange(4)} if rank == 0 else None
    got = tp.broadcast_data(["tokens", "labels"], data, torch.int64)
    torch.testing.assert_close(got["tokens"], torch.arange(6).view(2, 3))
    torch.testing.assert_close(got["labels"], torch.arange(4))
    t = torch.arange(4.0 * size).view(2, 2 * size)
    part = tp.split_tensor_into_1d_equal_chunks(t)
    torch.testing.assert_close(part, t.view(-1)[4 * rank : 4 * rank + 4])
    torch.testing.assert_close(tp.gather_split_1d_tensor(part), t.view(-1))
    source, destination = torch.zeros(1), torch.zeros(1)
    tp.set_tensor_model_parallel_attributes(source, True, 0, 1)
    source.is_qkv, source.qkv_split_shapes, source.expert_tp = True, [4, 2, 2], True  # type: ignore[attr-defined]
    tp.copy_tensor_model_parallel_attributes(destination, source)
    for name in (
        "tensor_model_parallel",
        "partition_dim",
        "partition_stride",
        "is_qkv",
        "qkv_split_shapes",
        "expert_tp",
    ):
        assert getattr(destination, name) == getattr(source, name), name
    replicated = torch.zeros(1)
    tp.set_defaults_if_not_set_tensor_model_parallel_attributes(replicated)
    assert tp.param_is_not_tensor_parallel_duplicate(replicated) is (rank == 0)
    assert tp.param_is_not_tensor_parallel_duplicate(source)


@pytest.mark.parametrize("size", SIZES)
def test_broadcast_data_1d_split_and_attributes(size: int) -> None:
    run_distributed(_initialized, size, _data_utils_and_attributes)


def _dropout_block(x: torch.Tensor) -> torch.Tensor:
    with tp.get_cuda_rng_tracker().fork():
        y = F.dropout(x * 2.0, p=0.5)
    return F.dropout(y.tanh(), p=0.5)


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return every


def _recompute(rank: int, size: int) -> None:
    tracker = tp.model_parallel_cuda_manual_seed(5)
    # Megatron's rule: the data-parallel state draws alike on every tp rank, the
    # tensor-parallel one differently; the expert one by (ep rank, etp rank).
    drawn = {}
    for name in (
        tp.get_data_parallel_rng_tracker_name(),
        "model-parallel-rng",
        tp.get_expert_parallel_rng_tracker_name(),
    ):
        with tracker.fork(name):
            drawn[name] = _gathered(torch.rand(4))
    assert all(torch.equal(d, drawn["data-parallel-rng"][0]) for d in drawn["data-parallel-rng"])
    assert len({tuple(d.tolist()) for d in drawn["model-parallel-rng"]}) == size
    # expert tensor parallelism defaults to the tensor-parallel size: etp rank = tp rank
    assert len({tuple(d.tolist()) for d in drawn["expert-parallel-rng"]}) == size
    tracker = tp.model_parallel_cuda_manual_seed(5)
    assert tracker is tp.get_cuda_rng_tracker()
    assert list(tracker.get_states()) == [
        tp.get_data_parallel_rng_tracker_name(),
        "model-parallel-rng",
        tp.get_expert_parallel_rng_tracker_name(),
    ]
    x = _of(0, (S, B, H), 14)
    states = tracker.get_states()
    cpu = torch.get_rng_state()
    plain = x.clone().requires_grad_(True)
    expected = _dropout_block(plain)
    expected.sum().backward()
    for distribute in (False, True):
        tracker.set_states(states)
        torch.set_rng_state(cpu)
        leaf = x.clone().requires_grad_(True)
        inner = leaf * 1.0  # what is distributed is the block's input, not a leaf
        out = tp.checkpoint(_dropout_block, distribute, inner)
        if distribute:
            assert inner.numel() == S * B * H // size  # only this rank's part is kept
        out.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(leaf.grad, plain.grad)
    # CheckpointWithoutOutput: outputs freed, recomputed into the same storage
    tracker.set_states(states)
    torch.set_rng_state(cpu)
    leaf = x.clone().requires_grad_(True)
    ckpt = tp.CheckpointWithoutOutput()
    hidden = ckpt.checkpoint(_dropout_block, leaf)
    out = hidden * 3.0
    ckpt.discard_output_and_register_recompute(out)
    assert hidden.untyped_storage().size() == 0
    out.sum().backward()
    torch.testing.assert_close(hidden, expected.detach())
    torch.testing.assert_close(leaf.grad, 3.0 * plain.grad)  # type: ignore[operator]
    manager = CheckpointWithoutOutputManager()
    tracker.set_states(states)
    torch.set_rng_state(cpu)
    leaf = x.clone().requires_grad_(True)
    first = tp.CheckpointWithoutOutput(ckpt_manager=manager)
    hidden = first.checkpoint(_dropout_block, leaf)
    out = hidden * 3.0
    manager.discard_all_outputs_and_register_unified_recompute(out)
    out.sum().backward()
    torch.testing.assert_close(leaf.grad, 3.0 * plain.grad)  # type: ignore[operator]


@pytest.mark.parametrize("size", SIZES)
def test_recomputation_replays_every_rng_state(size: int) -> None:
    run_distributed(_initialized, size, _recompute)


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b  # saves nothing for backward: backward recomputes nothing


def _distributed_first_input(rank: int, size: int) -> None:
    """distribute_saved_activations=True: the first input is split in forward, whole again in
    backward, whether or not backward recomputes (Megatron's CheckpointFunction)."""
    # Megatron's own test: the input keeps only this rank's part after the forward.
    first = torch.ones(4, 4)
    assert torch.equal(tp.checkpoint(_add, True, first, torch.ones(4, 4) * 2), torch.ones(4, 4) * 3)
    assert torch.equal(first, torch.ones(16 // size))
    # A leaf input: its gradient has its shape (8 elements against 4 kept at tp 2).
    leaf = torch.ones(2, 4, requires_grad=True)
    tp.checkpoint(_add, True, leaf, torch.full((2, 4), 2.0)).sum().backward()
    assert leaf.shape == (2, 4)
    torch.testing.assert_close(leaf.grad, torch.ones(2, 4))
    # A block's input (not a leaf), without and with a recomputation: whole after backward.
    for block in (_add, lambda a, b: (a * b).tanh()):
        leaf = torch.full((2, 4), 0.5, requires_grad=True)
        other = torch.full((2, 4), 2.0, requires_grad=True)
        inner = leaf * 1.0
        out = tp.checkpoint(block, True, inner, other)
        assert inner.numel() == 8 // size
        out.sum().backward()
        assert inner.shape == (2, 4)
        torch.testing.assert_close(inner, torch.full((2, 4), 0.5))
        expected_leaf, expected_other = leaf.detach().clone(), other.detach().clone()
        reference = block(expected_leaf.requires_grad_(), expected_other.requires_grad_())
        reference.sum().backward()
        torch.testing.assert_close(leaf.grad, expected_leaf.grad)
        torch.testing.assert_close(other.grad, expected_other.grad)


def test_distributed_saved_activations_are_whole_again_in_backward() -> None:
    run_distributed(_initialized, 2, _distributed_first_input)


def _bad_input(rank: int, size: int) -> None:
    bad = 6 if size == 4 else 3
    with pytest.raises(
        ValueError,
        match=rf"ColumnParallelLinear output size {bad} is not divisible by tensor-parallel size {size}",
    ):
        tp.ColumnParallelLinear(H, bad, config=_config(size), init_method=_init(1))
    with (
        pytest.raises(KeyError, match="RNG state 'nope' is not tracked; known states"),
        tp.get_cuda_rng_tracker().fork("nope"),
    ):
        pass
    others = dist.new_group([r for r in range(size) if r != 1])
    if rank == 1:
        with pytest.raises(
            ValueError,
            match=r"rank 1 is not in the tensor-parallel group given \(its ranks: \[0[,\]]",
        ):
            tp.copy_to_tensor_model_parallel_region(torch.ones(2), group=others)


@pytest.mark.parametrize("size", SIZES)
def test_bad_input_is_refused_with_the_numbers(size: int) -> None:
    run_distributed(_initialized, size, _bad_input)


def test_rng_state_conversion_and_graph_safety() -> None:
    state = torch.get_rng_state()
    assert tp.convert_cuda_rng_state(state) is state
    generator = torch.Generator().manual_seed(3)
    assert torch.equal(tp.convert_cuda_rng_state(generator), generator.get_state())  # type: ignore[arg-type]
    assert tp.convert_cuda_rng_state(generator, to_graphable=True) is generator
    with pytest.raises(ValueError, match="pp keeps no CUDA-graph-safe RNG states"):
        tp.convert_cuda_rng_state(state, to_graphable=True)
    assert not tp.is_graph_safe_cuda_rng_tracker(tp.get_cuda_rng_tracker())
    with pytest.raises(ValueError, match="use_cudagraphable_rng=True: pp has no"):
        tp.random.initialize_rng_tracker(use_cudagraphable_rng=True, force_reset=True)


def test_megatron_0_20_arguments_and_helpers_without_a_state() -> None:
    """Before initialize_model_parallel a group left as None is no tensor parallelism."""
    tracker = tp.model_parallel_cuda_manual_seed(
        7, tp_rank=0, ep_rank=0, etp_rank=0, gtp_remat_rank=0, gtp_remat_world_size=1
    )
    assert sorted(tp.random.get_all_rng_states()) == sorted(tracker.get_states())
    with pytest.raises(ValueError, match="gtp_remat_world_size=2: pp has no generalized"):
        tp.model_parallel_cuda_manual_seed(
            7, tp_rank=0, ep_rank=0, etp_rank=0, gtp_remat_world_size=2
        )
    assert tp.utils.divide(8, 2) == 4
    with pytest.raises(ValueError, match="numerator 9 is not divisible by denominator 2"):
        tp.utils.divide(9, 2)
    seen = []

    def block(t: torch.Tensor) -> torch.Tensor:
        seen.append(tp.random.is_checkpointing())
        return t.sin()  # saves its input: recomputed in backward

    x = torch.ones(3, requires_grad=True)
    out = tp.checkpoint(block, False, x)
    out.sum().backward()
    assert seen == [True, True]  # the forward and the recomputation
    assert not tp.random.is_checkpointing()
    assert tp.copy_to_tensor_model_parallel_region(x) is x  # no state: no tensor parallelism
    with pytest.raises(ValueError, match="has 5 dimensions; at most 4"):
        pp_tensor.broadcast_data(
            ["x"], {"x": torch.zeros(1, 1, 1, 1, 1)}, torch.float32, tp_group=None
        )
    with pytest.raises(ValueError, match="explicit_expert_comm=True returns a partial sum"):
        pp_tensor.RowParallelLinear(
            4, 4, tp_group=None, init_method=_init(1), explicit_expert_comm=True
        )


@pytest.mark.reliability
def test_model_parallel_config_refuses_unknown_and_unsupported_fields() -> None:
    with pytest.raises(
        TypeError, match=r"ModelParallelConfig has no field 'tensor_parallel_size'.*did you mean"
    ):
        ModelParallelConfig(tensor_parallel_size=2)  # type: ignore[call-arg]
    with pytest.raises(
        ValueError,
        match="tp_comm_overlap=True: pp has no Transformer Engine's tensor-parallel communication overlap",
    ):
        ModelParallelConfig(tensor_model_parallel_size=2, tp_comm_overlap=True)
    with pytest.raises(
        ValueError, match="sequence_parallel=True needs tensor_model_parallel_size > 1, got 1"
    ):
        ModelParallelConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=2 needs pipeline_dtype"):
        ModelParallelConfig(pipeline_model_parallel_size=2)
    config = ModelParallelConfig(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=2)
    assert config.expert_tensor_parallel_size == 2
    assert config.autocast_dtype == torch.float32
    assert config.microbatch_group_size_per_vp_stage == 1
