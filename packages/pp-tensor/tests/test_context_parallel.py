"""Context-parallel attention against plain attention over the whole sequence.

Every rank builds the whole sequence's q, k, v and output gradient (same seed everywhere),
computes the reference with ``scaled_dot_product_attention`` on it, splits output and
gradients with `split_for_context_parallel` and compares its own part. A ring step that
used another rank's block or positions, a wrong log-sum-exp merge, or a mask that let a token
see a later token or another document would change the output or a gradient.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pp_state.collectives import CollectiveError
from pp_tensor import (
    context_parallel_attention,
    context_parallel_positions,
    join_context_parallel_parts,
    split_for_context_parallel,
)
from pp_testing import run_distributed
from pp_testing.distributed import DistributedTestError

BATCH, HEADS, DIM = 2, 4, 8
THREE_DOCUMENTS = ((5, 8, 3), (9, 4, 3))  # per batch element: uneven lengths, 16 tokens


def _documents(lengths: tuple[tuple[int, ...], ...], repeat: int = 1) -> torch.Tensor:
    """[batch, sequence] ids: each document its own id, each sequence `repeat` packings."""
    rows = []
    for row in lengths:
        ids = [doc for doc, n in enumerate(row * repeat) for _ in range(n)]
        rows.append(torch.tensor(ids))
    return torch.stack(rows)


def _inputs(seq: int, kv_heads: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Whole-sequence q, k, v and output gradient, the same on every rank."""
    gen = torch.Generator().manual_seed(seq * 10 + kv_heads)
    shapes = [(BATCH, HEADS, seq, DIM), (BATCH, kv_heads, seq, DIM), (BATCH, kv_heads, seq, DIM)]
    shapes.append((BATCH, HEADS, seq, DIM))
    return [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]


def _reference(tensors: list[torch.Tensor], documents: torch.Tensor | None) -> list[torch.Tensor]:
    """Output and dq, dk, dv of fp32 sdpa over the whole sequence."""
    q, k, v, grad = (t.float() for t in tensors)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    groups = HEADS // k.size(1)
    seq = q.size(2)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    if documents is not None:
        ids = documents.reshape(-1, seq)  # [seq] is the same packing for every batch element
        mask = mask & (ids[:, :, None] == ids[:, None, :])[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        leaves[0],
        leaves[1].repeat_interleave(groups, 1),
        leaves[2].repeat_interleave(groups, 1),
        attn_mask=mask,
    )
    out.backward(grad)
    return [out.detach()] + [leaf.grad for leaf in leaves if leaf.grad is not None]


def _local(
    tensors: list[torch.Tensor],
    documents: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    comm_type: str,
) -> list[torch.Tensor]:
    """This rank's output and dq, dk, dv from context-parallel attention."""
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    q, k, v, grad = (split_for_context_parallel(t, size, rank, seq_dim=2) for t in tensors)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = context_parallel_attention(
        *leaves, group=group, comm_type=comm_type, document_ids=documents
    )
    assert out.dtype == q.dtype
    assert out.shape == q.shape
    out.backward(grad)
    return [out.detach()] + [leaf.grad for leaf in leaves if leaf.grad is not None]


def _compare(
    seq: int, kv_heads: int, dtype: torch.dtype, comm_type: str, documents: torch.Tensor | None
) -> float:
    """Max error of output and gradients, relative to each reference's largest value."""
    group = dist.group.WORLD if dist.is_initialized() else None
    size = 1 if group is None else dist.get_world_size()
    rank = 0 if group is None else dist.get_rank()
    tensors = _inputs(seq, kv_heads, dtype)
    expected = _reference(tensors, documents)
    got = _local(tensors, documents, group, comm_type)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    worst = 0.0
    for name, whole, have in zip(("out", "dq", "dk", "dv"), expected, got, strict=True):
        want = split_for_context_parallel(whole, size, rank, seq_dim=2)
        error = ((have.float() - want).abs().max() / want.abs().max()).item()
        assert error < tolerance, f"{name} {dtype} {comm_type} cp {size}: error {error}"
        worst = max(worst, error)
    return worst


def _equivalence(comm_type: str) -> dict[str, float]:
    """fp32 and bf16, multi-head and grouped-query, without and with three documents."""
    size = dist.get_world_size()
    seq = 8 * size  # 4 tokens per chunk
    docs = _documents(THREE_DOCUMENTS, repeat=size // 2)  # 3 documents per 16 tokens
    return {
        "fp32": _compare(seq, HEADS, torch.float32, comm_type, None),
        "fp32 gqa": _compare(seq, 2, torch.float32, comm_type, None),
        "fp32 documents": _compare(seq, HEADS, torch.float32, comm_type, docs),
        "fp32 documents 1-d": _compare(seq, 1, torch.float32, comm_type, docs[0]),
        "bf16": _compare(seq, HEADS, torch.bfloat16, comm_type, None),
        "bf16 documents": _compare(seq, 2, torch.bfloat16, comm_type, docs),
    }


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_equals_attention_over_the_whole_sequence(cp: int, comm_type: str) -> None:
    errors = run_distributed(_equivalence, cp, comm_type)
    print(f"cp {cp} {comm_type}: max relative errors over ranks", _worst(errors))


def _worst(per_rank: list[dict[str, float]]) -> dict[str, str]:
    return {key: f"{max(r[key] for r in per_rank):.1e}" for key in per_rank[0]}


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_cp_1_is_plain_causal_attention_any_length(comm_type: str) -> None:
    for seq in (7, 16):
        _compare(seq, HEADS, torch.float32, comm_type, None)
        _compare(seq, 2, torch.float32, comm_type, _documents(((3, seq - 3), (seq - 1, 1))))
    _compare(16, 1, torch.bfloat16, comm_type, None)
    _compare(16, 2, torch.float16, comm_type, None)


# --- The load-balanced split -------------------------------------------------------------


def test_positions_pair_an_early_chunk_with_a_late_one() -> None:
    assert context_parallel_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context_parallel_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert context_parallel_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert context_parallel_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert context_parallel_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    for cp in (2, 4):
        every = torch.cat([context_parallel_positions(24, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(24))


@pytest.mark.parametrize("seq_dim", [0, 1, -1])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_takes_the_positions_and_join_undoes_it(cp: int, seq_dim: int) -> None:
    full = torch.arange(3 * 16 * 5).reshape(3, 16, 5) if seq_dim == 1 else None
    if full is None:
        full = torch.arange(16 * 3).reshape(16, 3) if seq_dim == 0 else torch.arange(48).view(3, 16)
    length = full.size(seq_dim)
    parts = [split_for_context_parallel(full, cp, r, seq_dim=seq_dim) for r in range(cp)]
    for rank, part in enumerate(parts):
        positions = context_parallel_positions(length, cp, rank)
        assert torch.equal(part, full.index_select(seq_dim % full.dim(), positions))
    assert torch.equal(join_context_parallel_parts(parts, seq_dim=seq_dim), full)


def test_split_refusals_name_the_numbers() -> None:
    x = torch.zeros(2, 10)
    with pytest.raises(
        ValueError, match=r"sequence length 10 .* 4 equal chunks .* size 2.*8 or 12"
    ):
        split_for_context_parallel(x, 2, 0)
    with pytest.raises(ValueError, match=r"rank 2 is not in a group of 2; use 0 to 1"):
        context_parallel_positions(8, 2, 2)
    with pytest.raises(ValueError, match=r"seq_dim 2 .* shape \(2, 10\); use -2 to 1"):
        split_for_context_parallel(x, 2, 0, seq_dim=2)
    with pytest.raises(ValueError, match=r"one shape, got \[\(2, 4\), \(2, 6\)\]"):
        join_context_parallel_parts([torch.zeros(2, 4), torch.zeros(2, 6)])
    with pytest.raises(ValueError, match="length is 3"):
        join_context_parallel_parts([torch.zeros(2, 3), torch.zeros(2, 3)])


# --- Refusals of the attention, before any communication ---------------------------------


def _qkv(seq: int = 8, kv_heads: int = HEADS) -> tuple[torch.Tensor, ...]:
    return (
        torch.zeros(BATCH, HEADS, seq, DIM),
        torch.zeros(BATCH, kv_heads, seq, DIM),
        torch.zeros(BATCH, kv_heads, seq, DIM),
    )


def test_attention_refusals_name_the_numbers_and_choices() -> None:
    q, k, v = _qkv()
    with pytest.raises(
        ValueError, match=re.escape("unknown comm_type 'a2a'; use one of 'p2p', 'all_gather'")
    ):
        context_parallel_attention(q, k, v, group=None, comm_type="a2a")
    with pytest.raises(
        TypeError, match=r"float32, bfloat16.* got torch.float32, torch.bfloat16 and torch.float32"
    ):
        context_parallel_attention(q, k.bfloat16(), v, group=None)
    with pytest.raises(TypeError, match=r"got torch\.int64"):
        context_parallel_attention(q.long(), k.long(), v.long(), group=None)
    with pytest.raises(ValueError, match=re.escape("(4 dimensions), got shape (4, 8, 8)")):
        context_parallel_attention(q[0], k, v, group=None)
    with pytest.raises(ValueError, match=re.escape("k (2, 4, 6, 8) and v (2, 4, 8, 8)")):
        context_parallel_attention(q, k[:, :, :6], v, group=None)
    with pytest.raises(
        ValueError, match=re.escape("k and v (2, 4, 6, 8) must match q (2, 4, 8, 8)")
    ):
        context_parallel_attention(q, k[:, :, :6], v[:, :, :6], group=None)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "q's 4 heads do not share out over k and v's 3 heads; use a number of key/value heads that divides 4: [1, 2, 4]"
        ),
    ):
        context_parallel_attention(*_qkv(kv_heads=3), group=None)
    with pytest.raises(TypeError, match=r"integers, got torch\.float32"):
        context_parallel_attention(q, k, v, group=None, document_ids=torch.zeros(8))
    ids = torch.zeros(8, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"integers, got torch\.bool"):
        context_parallel_attention(q, k, v, group=None, document_ids=ids)
    with pytest.raises(
        ValueError, match=re.escape("shape (2, 6) must cover the whole sequence: (8,) or (2, 8)")
    ):
        context_parallel_attention(
            q, k, v, group=None, document_ids=torch.zeros(2, 6, dtype=torch.long)
        )


def _refusals_at_cp_2() -> None:
    odd = _qkv(seq=7)
    with pytest.raises(
        ValueError,
        match=r"local sequence length 7 is odd: .* size 2 .* 4 equal chunks.*\(7 \* 2 = 14\) must be a multiple of 4; use a local length of 6 or 8",
    ):
        context_parallel_attention(*odd, group=dist.group.WORLD, comm_type="all_gather")
    q, k, v = _qkv()
    local_ids = torch.zeros(BATCH, 8, dtype=torch.long)  # this rank's part, not the whole
    with pytest.raises(
        ValueError,
        match=re.escape(
            "(2, 8) must cover the whole sequence: (16,) or (2, 16) (local length 8 * context-parallel size 2)"
        ),
    ):
        context_parallel_attention(q, k, v, group=dist.group.WORLD, document_ids=local_ids)
    with pytest.raises(ValueError, match="unknown comm_type 'ring'"):
        context_parallel_attention(q, k, v, group=dist.group.WORLD, comm_type="ring")


def test_refusals_at_cp_2_come_before_any_communication() -> None:
    run_distributed(_refusals_at_cp_2, 2, timeout=30.0, pg_timeout=5.0)


def _lose_a_rank(marks: str, victim: int, comm_type: str) -> tuple[str, str, float]:
    """Every rank runs attention forward and backward; `victim` is killed before it starts."""

    size, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, grad = (split_for_context_parallel(t, size, rank, seq_dim=2)
                     for t in _inputs(32, HEADS, torch.float32))  # fmt: skip
    if rank == victim:
        Path(marks, "killed").write_text(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    try:
        for _ in range(100):
            out = context_parallel_attention(*leaves, group=dist.group.WORLD, comm_type=comm_type)
            out.backward(grad)
    except CollectiveError as error:
        return type(error).__name__, str(error), time.monotonic()
    return "none", "", time.monotonic()


@pytest.mark.reliability
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_a_rank_lost_mid_attention_is_an_error_naming_the_exchange(
    comm_type: str, tmp_path: Path
) -> None:
    """No wait hangs: every survivor raises within twice the group's timeout, naming the
    context-parallel exchange it was in and the peer's address (a lost peer closes the ring
    and the all-gather; where endpoints are published, as `watch_pipeline` does, pp-state
    names the peer's rank from that address)."""
    timeout = 10.0
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(
            _lose_a_rank, 4, str(tmp_path), 2, comm_type, pg_timeout=timeout, timeout=90
        )
    killed_at = float((tmp_path / "killed").read_text())
    outcomes = caught.value.results
    assert sorted(outcomes) == [0, 1, 3]
    for rank, (kind, message, raised_at) in outcomes.items():
        assert kind == "CollectiveError", (rank, message)
        assert message.startswith(f"rank {rank}: context-parallel "), message
        assert "over ranks [0, 1, 2, 3] failed: peer rank" in message, message
        assert raised_at - killed_at < 2 * timeout
