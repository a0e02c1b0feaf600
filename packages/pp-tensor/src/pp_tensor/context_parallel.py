"""Causal self-attention over a sequence split across a context-parallel group.

The sequence is cut into ``2 * cp`` equal chunks and rank ``r`` of the group holds chunks
``r`` and ``2 * cp - 1 - r``: under a causal mask an early chunk attends to few keys and a late
one to many, so pairing them gives every rank the same work.

- `split_for_context_parallel` takes a full tensor and returns this rank's part along the
  sequence dimension (``seq_dim``: 1 for [batch, sequence, ...], 0 for [sequence, batch, ...]);
  `join_context_parallel_parts` is its inverse; `context_parallel_positions` gives the global
  position of each of this rank's tokens (position ids, rotary embeddings).
- `context_parallel_attention` takes this rank's queries, keys and values as
  [batch, heads, local sequence, head dim] and returns this rank's part of the output of
  causal attention over the whole sequence, forward and backward.

Keys and values travel in one of two ways (``comm_type``): "p2p" passes them around a ring of
ranks with ``batch_isend_irecv`` while the block already held is computed, merging partial
results with their log-sum-exp; its backward passes the key and value gradients around the
ring in the same way. "all_gather" gathers every rank's keys and values at once and attends to
them locally; its backward reduce-scatters their gradients. Scores, softmax statistics and
partial results are computed in fp32 whatever the inputs' dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pp_state.collectives import collective
from pp_tensor._fused_blocks import fused_block_backward, fused_block_forward
from pp_tensor.utils import start_all_gather_first, start_reduce_scatter_first

__all__ = [
    "CP_COMM_TYPES",
    "context_parallel_attention",
    "context_parallel_positions",
    "join_context_parallel_parts",
    "split_for_context_parallel",
]

CP_COMM_TYPES = ("p2p", "all_gather")
"""The ways keys and values are exchanged (Megatron's ``--cp-comm-type``)."""

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_QUERY_TILE = 256
"""Query rows whose scores against a key block are computed at once: the fp32 scores, the
probabilities and their gradients of one block exist for this many rows at a time, so the
working memory of attention grows with the key block's length, not with its square."""
_RING = "context-parallel ring pass of keys and values"
_RING_GRADS = "context-parallel ring pass of key and value gradients"
_GATHER = "context-parallel all-gather of keys and values"
_SCATTER = "context-parallel reduce-scatter of key and value gradients"


# --- The load-balanced split -------------------------------------------------------------


def _chunk_length(seq_len: int, cp_size: int, cp_rank: int) -> int:
    """The length of one of the ``2 * cp_size`` chunks; refuses what does not split."""
    if cp_size < 1:
        raise ValueError(f"context-parallel size must be 1 or more, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(
            f"context-parallel rank {cp_rank} is not in a group of {cp_size}; "
            f"use 0 to {cp_size - 1}"
        )
    chunks = 2 * cp_size
    if cp_size > 1 and seq_len % chunks:
        below = seq_len // chunks * chunks
        choices = " or ".join(str(n) for n in (below, below + chunks) if n > 0)
        raise ValueError(
            f"sequence length {seq_len} does not split into {chunks} equal chunks "
            f"(2 * context-parallel size {cp_size}); use a multiple of {chunks}, such as {choices}"
        )
    return seq_len // chunks


def context_parallel_positions(
    seq_len: int, cp_size: int, cp_rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions of the tokens context-parallel rank `cp_rank` holds, in its order.

    Chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of the ``2 * cp_size`` equal chunks;
    at ``cp_size`` 1, every position (any length).

    Args:
        seq_len: The length of the whole sequence.
        cp_size: The size of the context-parallel group.
        cp_rank: This rank's position in that group.
        device: Where the result lives.

    Returns:
        An int64 tensor of ``seq_len // cp_size`` positions.

    Raises:
        ValueError: `seq_len` does not divide by ``2 * cp_size``, or `cp_rank` is outside
            the group.
    """
    chunk = _chunk_length(seq_len, cp_size, cp_rank)
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
            torch.arange(late * chunk, (late + 1) * chunk, device=device),
        ]
    )


def _sequence_dim(x: torch.Tensor, seq_dim: int) -> int:
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(
            f"seq_dim {seq_dim} is not a dimension of a tensor of shape {tuple(x.shape)}; "
            f"use {-x.dim()} to {x.dim() - 1}"
        )
    return seq_dim % x.dim()


def split_for_context_parallel(
    x: torch.Tensor, cp_size: int, cp_rank: int, *, seq_dim: int = 1
) -> torch.Tensor:
    """This context-parallel rank's part of the full tensor `x` along the sequence dimension.

    What Megatron's ``get_batch_on_this_cp_rank`` does to each tensor of a batch: chunks
    ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``, concatenated. `x` itself
    at ``cp_size`` 1. Differentiable.

    Args:
        x: The tensor of the whole sequence.
        cp_size: The size of the context-parallel group.
        cp_rank: This rank's position in that group.
        seq_dim: The sequence dimension: 1 for [batch, sequence, ...] (the default; tokens,
            labels, loss masks, position ids), 0 for [sequence, batch, ...], 2 for
            [batch, heads, sequence, head dim]; negative counts from the end.

    Returns:
        A new tensor with ``1 / cp_size`` of the sequence.

    Raises:
        ValueError: `seq_dim` is not a dimension of `x`, its length does not divide by
            ``2 * cp_size``, or `cp_rank` is outside the group.
    """
    dim = _sequence_dim(x, seq_dim)
    positions = context_parallel_positions(x.size(dim), cp_size, cp_rank, device=x.device)
    return x if cp_size == 1 else x.index_select(dim, positions)


def join_context_parallel_parts(parts: Sequence[torch.Tensor], *, seq_dim: int = 1) -> torch.Tensor:
    """The full tensor from every context-parallel rank's part, the inverse of the split.

    Args:
        parts: Each rank's `split_for_context_parallel` part, in rank order.
        seq_dim: Their sequence dimension, as for the split.

    Returns:
        The tensor of the whole sequence, in sequence order. Differentiable.

    Raises:
        ValueError: No parts, parts of different shapes, or an odd local length at a
            context-parallel size above 1.
    """
    if not parts:
        raise ValueError("join_context_parallel_parts needs one part per rank, got none")
    shapes = {tuple(part.shape) for part in parts}
    if len(shapes) > 1:
        raise ValueError(f"context-parallel parts must share one shape, got {sorted(shapes)}")
    dim = _sequence_dim(parts[0], seq_dim)
    cp_size, local = len(parts), parts[0].size(dim)
    if cp_size == 1:
        return parts[0]
    if local % 2:
        raise ValueError(
            f"a context-parallel part holds two equal chunks, but its length is {local} (odd)"
        )
    order = torch.cat(
        [
            context_parallel_positions(local * cp_size, cp_size, rank, device=parts[0].device)
            for rank in range(cp_size)
        ]
    )
    return torch.cat(list(parts), dim=dim).index_select(dim, torch.argsort(order))


# --- Checking the inputs, before any communication ---------------------------------------


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every block of one attention call needs: the group, sizes, scale and documents."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    local_len: int
    scale: float
    documents: torch.Tensor | None  # [batch or 1, global sequence], on the inputs' device
    device: torch.device

    @property
    def seq_len(self) -> int:
        return self.local_len * self.size

    def positions(self, rank: int) -> torch.Tensor:
        return context_parallel_positions(self.seq_len, self.size, rank, device=self.device)


def _check_tensors(q: Any, k: Any, v: Any) -> None:
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must be [batch, heads, local sequence, head dim] (4 dimensions), "
                f"got shape {tuple(tensor.shape)}"
            )
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k and v must share one floating dtype (float32, bfloat16, float16 or "
            f"float64), got {q.dtype}, {k.dtype} and {v.dtype}"
        )
    if q.device != k.device or q.device != v.device:
        raise ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    batch, heads, length, dim = q.shape
    if (k.size(0), k.size(2), k.size(3)) != (batch, length, dim):
        raise ValueError(
            f"k and v {tuple(k.shape)} must match q {tuple(q.shape)} in batch (dim 0), "
            "local sequence (dim 2) and head dim (dim 3)"
        )
    if heads % k.size(1):
        divisors = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ValueError(
            f"q's {heads} heads do not share out over k and v's {k.size(1)} heads; "
            f"use a number of key/value heads that divides {heads}: {divisors}"
        )


def _check_local_length(length: int, size: int) -> None:
    if size > 1 and length % 2:
        choices = " or ".join(str(n) for n in (length - 1, length + 1) if n > 0)
        raise ValueError(
            f"local sequence length {length} is odd: context-parallel size {size} cuts the "
            f"sequence into {2 * size} equal chunks, two per rank, so the global length "
            f"({length} * {size} = {length * size}) must be a multiple of {2 * size}; "
            f"use a local length of {choices}"
        )


def _check_documents(
    document_ids: Any, batch: int, seq_len: int, size: int, device: torch.device
) -> torch.Tensor | None:
    if document_ids is None:
        return None
    if not isinstance(document_ids, torch.Tensor):
        raise TypeError(f"document_ids must be a torch.Tensor, got {type(document_ids).__name__}")
    kind = document_ids.dtype
    if kind.is_floating_point or kind.is_complex or kind == torch.bool:
        raise TypeError(f"document_ids must hold integers, got {document_ids.dtype}")
    if tuple(document_ids.shape) not in ((seq_len,), (batch, seq_len)):
        raise ValueError(
            f"document_ids of shape {tuple(document_ids.shape)} must cover the whole sequence: "
            f"({seq_len},) or ({batch}, {seq_len}) (local length {seq_len // size} * "
            f"context-parallel size {size})"
        )
    return document_ids.to(device).reshape(-1, seq_len)


def _prepare(
    q: Any,
    k: Any,
    v: Any,
    *,
    group: dist.ProcessGroup | None,
    comm_type: str,
    document_ids: Any,
    scale: float | None,
) -> _Setup:
    """Every check of one call, then what its blocks need; no communication."""
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(
            f"unknown comm_type {comm_type!r}; use one of {', '.join(map(repr, CP_COMM_TYPES))}"
        )
    _check_tensors(q, k, v)
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    batch, _, length, dim = q.shape
    _check_local_length(length, size)
    documents = _check_documents(document_ids, batch, length * size, size, q.device)
    return _Setup(
        group=group,
        size=size,
        rank=rank,
        local_len=length,
        scale=1.0 / math.sqrt(dim) if scale is None else float(scale),
        documents=documents,
        device=q.device,
    )


# --- One block of attention, in fp32 ------------------------------------------------------
# Queries are [batch, kv heads, group, length, dim] (`_grouped`): query head h uses key/value
# head h // group, as grouped-query attention does; keys and values are [batch, kv heads,
# length, dim] and broadcast over the group.


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    batch, heads, length, dim = x.shape
    return x.float().reshape(batch, kv_heads, heads // kv_heads, length, dim)


def _mask(
    setup: _Setup, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool
) -> torch.Tensor | None:
    """Which keys each query may see: not a later one (when `causal`), not another document."""
    mask = q_pos[:, None] >= k_pos[None, :] if causal else None
    if setup.documents is not None:
        docs = setup.documents
        same = docs[:, q_pos].unsqueeze(-1) == docs[:, k_pos].unsqueeze(-2)
        same = same[:, None, None]  # [batch or 1, 1, 1, queries, keys]
        mask = same if mask is None else same & mask
    return mask


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with 0 for rows that see no key at all (-inf), so they weigh 0 and not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _row_tiles(length: int) -> list[slice]:
    """Query rows in tiles of `_QUERY_TILE`: a block's scores exist one tile at a time."""
    return [
        slice(start, min(start + _QUERY_TILE, length)) for start in range(0, length, _QUERY_TILE)
    ]


def _mask_rows(mask: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if mask is None else mask[..., rows, :]


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of `q` over this block of keys alone, and its log-sum-exp per row."""
    outs, lses = [], []
    for rows in _row_tiles(q.shape[-2]):
        scores = _scores(q[..., rows, :], k, scale, _mask_rows(mask, rows))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
        del scores
        outs.append(torch.matmul(probs, v.unsqueeze(2)))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint sets of keys from attention over each, by log-sum-exp."""
    total = torch.logaddexp(lse, block_lse)
    base = _finite(total)
    merged = out * torch.exp(lse - base).unsqueeze(-1)
    merged += block_out * torch.exp(block_lse - base).unsqueeze(-1)
    return merged, total


def _block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of dq, and dk, dv of its keys.

    `grads` holds the output's gradient, the final log-sum-exp (over all keys) and
    ``delta = sum(grad_out * out)`` per row, so the block's probabilities are final ones.
    """
    grad_out, lse, delta = grads
    grad_q, grad_k, grad_v = (
        [],
        torch.zeros_like(k, dtype=q.dtype),
        torch.zeros_like(v, dtype=q.dtype),
    )
    for rows in _row_tiles(q.shape[-2]):
        q_rows, grad_rows = q[..., rows, :], grad_out[..., rows, :]
        scores = _scores(q_rows, k, scale, _mask_rows(mask, rows))
        probs = torch.exp(scores - lse[..., rows].unsqueeze(-1))
        del scores
        grad_v += torch.matmul(probs.transpose(-1, -2), grad_rows).sum(2)
        grad_probs = torch.matmul(grad_rows, v.unsqueeze(2).transpose(-1, -2))
        grad_scores = probs * (grad_probs - delta[..., rows].unsqueeze(-1)) * scale
        del probs, grad_probs
        grad_q.append(torch.matmul(grad_scores, k.unsqueeze(2)))
        grad_k += torch.matmul(grad_scores.transpose(-1, -2), q_rows).sum(2)
    return torch.cat(grad_q, dim=-2), grad_k, grad_v


def _fused(setup: _Setup) -> bool:
    """Whether ring blocks run torch's fused CPU attention: on the CPU, without documents.

    Every ring block is then causal (a rank's own block, its positions in order) or seen
    whole, which the fused kernel takes as it is; it returns the log-sum-exp the merge needs
    and never materialises a score matrix.
    """
    return setup.documents is None and setup.device.type == "cpu"


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t[..., rows, :]


# --- The ring -----------------------------------------------------------------------------


class _RingPass:
    """Sends a tensor to the next rank of the ring and receives the previous rank's."""

    def __init__(self, tensor: torch.Tensor, setup: _Setup, operation: str) -> None:
        self.operation, self.group = operation, setup.group
        self._works: list[Any] = []
        if setup.size == 1:  # a ring of one: the tensor comes back to itself
            self._received = tensor
            return
        assert setup.group is not None
        self._sent = tensor.contiguous()  # referenced until the send is waited for
        self._received = torch.empty_like(self._sent)
        after = dist.get_global_rank(setup.group, (setup.rank + 1) % setup.size)
        before = dist.get_global_rank(setup.group, (setup.rank - 1) % setup.size)
        ops = [
            dist.P2POp(dist.isend, self._sent, after, setup.group),
            dist.P2POp(dist.irecv, self._received, before, setup.group),
        ]
        with collective(operation, group=setup.group):
            self._works = list(dist.batch_isend_irecv(ops))

    def wait(self) -> torch.Tensor:
        with collective(self.operation, group=self.group):
            for work in self._works:
                work.wait()
        return self._received


@dataclasses.dataclass(frozen=True)
class _RingBlock:
    """At ring step `step`, this rank holds the keys and values of rank `owner`."""

    step: int
    owner: int
    rows: slice  # the queries that see any of those keys
    cols: slice  # the keys any of them sees
    causal: bool  # whether a key in the block may come after a query (its own block only)


def _ring_blocks(setup: _Setup) -> Iterator[_RingBlock]:
    """The blocks in ring order, trimmed to the parts the causal mask leaves visible.

    Its own block: both chunks, causal. An earlier rank's: its first chunk only (its second
    is later than both of ours), seen whole. A later rank's: only our second chunk sees
    it, and sees it whole.
    """
    half = setup.local_len // 2
    for step in range(setup.size):
        owner = (setup.rank - step) % setup.size
        if owner == setup.rank:
            yield _RingBlock(step, owner, slice(None), slice(None), True)
        elif owner < setup.rank:
            yield _RingBlock(step, owner, slice(None), slice(0, half), False)
        else:
            yield _RingBlock(step, owner, slice(half, None), slice(None), False)


def _block_inputs(
    setup: _Setup, block: _RingBlock, kv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The block's keys and values (fp32, trimmed) and its mask.

    No mask for the fused kernel, which takes the block's causality as a flag.
    """
    k = _rows(kv[0], block.cols).float()
    v = _rows(kv[1], block.cols).float()
    if _fused(setup):
        return k, v, None
    q_pos = setup.positions(setup.rank)[block.rows]
    k_pos = setup.positions(block.owner)[block.cols]
    return k, v, _mask(setup, q_pos, k_pos, block.causal)


def _ring_forward(
    setup: _Setup, q: torch.Tensor, kv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log-sum-exp of grouped `q` over every rank's keys and values (`kv`)."""
    out = q.new_zeros((*q.shape[:-1], kv.size(-1)))
    lse = q.new_full(q.shape[:-1], float("-inf"))
    for block in _ring_blocks(setup):
        last = block.step == setup.size - 1
        passing = None if last else _RingPass(kv, setup, _RING)  # overlaps this block
        k, v, mask = _block_inputs(setup, block, kv)
        if _fused(setup):
            block_out, block_lse = fused_block_forward(
                _rows(q, block.rows), k, v, setup.scale, block.causal
            )
        else:
            block_out, block_lse = _block_forward(_rows(q, block.rows), k, v, setup.scale, mask)
        out[..., block.rows, :], lse[..., block.rows] = _merge(
            _rows(out, block.rows), lse[..., block.rows], block_out, block_lse
        )
        if passing is not None:
            kv = passing.wait()
    return out, lse


def _ring_backward(
    setup: _Setup,
    q: torch.Tensor,
    kv: torch.Tensor,
    grads: tuple[torch.Tensor, ...],
    out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of grouped `q` and of this rank's `kv`:'s keys and values.

    Keys and values go round the ring again; each block's gradient travels with them,
    gathering every rank's share, and one more pass brings it home to its owner.
    """
    grad_out, lse, delta = grads
    grad_q = torch.zeros_like(q)
    returning: _RingPass | None = None
    for block in _ring_blocks(setup):
        last = block.step == setup.size - 1
        passing = None if last else _RingPass(kv, setup, _RING)
        k, v, mask = _block_inputs(setup, block, kv)
        rows = block.rows
        if _fused(setup):
            fused_grads = (_rows(grad_out, rows), lse[..., rows], _rows(out, rows))
            dq, dk, dv = fused_block_backward(
                _rows(q, rows), k, v, block.causal, fused_grads, scale=setup.scale
            )
        else:
            block_grads = (_rows(grad_out, rows), lse[..., rows], delta[..., rows])
            dq, dk, dv = _block_backward(_rows(q, rows), k, v, mask, block_grads, scale=setup.scale)
        grad_q[..., rows, :] += dq
        grad_kv = kv.new_zeros(kv.shape, dtype=torch.float32)
        grad_kv[0, ..., block.cols, :] = dk
        grad_kv[1, ..., block.cols, :] = dv
        if returning is not None:
            grad_kv += returning.wait()
        returning = _RingPass(grad_kv, setup, _RING_GRADS)
        if passing is not None:
            kv = passing.wait()
    assert returning is not None
    return grad_q, returning.wait()


class _RingAttention(torch.autograd.Function):
    """Causal attention with keys and values passed around the ring ("p2p")."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, setup: _Setup
    ) -> torch.Tensor:
        """Attention of this rank's queries over every rank's keys."""
        out, lse = _ring_forward(setup, _grouped(q, k.size(1)), torch.stack([k, v]))
        result = out.reshape(q.shape).to(q.dtype)
        ctx.setup = setup
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The gradient of q here; those of k and v by a second trip round the ring."""
        q, k, v, out, lse = ctx.saved_tensors
        grads = _output_grads(grad_output, out, lse, k.size(1))
        grad_q, grad_kv = _ring_backward(
            ctx.setup, _grouped(q, k.size(1)), torch.stack([k, v]), grads,
            _grouped(out, k.size(1)),
        )  # fmt: skip
        return (
            grad_q.reshape(q.shape).to(q.dtype),
            grad_kv[0].to(k.dtype),
            grad_kv[1].to(v.dtype),
            None,
        )


def _output_grads(
    grad_output: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output's gradient (grouped, fp32), the log-sum-exp and delta per row."""
    grad_out = _grouped(grad_output, kv_heads)
    delta = (grad_out * _grouped(out, kv_heads)).sum(-1)
    return grad_out, lse, delta


# --- All-gather ---------------------------------------------------------------------------


def _own_chunks(setup: _Setup) -> list[tuple[slice, int]]:
    """Each of this rank's chunks: its rows and how many keys (from position 0) it sees."""
    half = setup.local_len // 2
    late = 2 * setup.size - 1 - setup.rank
    return [(slice(0, half), (setup.rank + 1) * half), (slice(half, None), (late + 1) * half)]


def _gather_forward(
    setup: _Setup, q: torch.Tensor, kv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log-sum-exp of grouped `q` over the whole sequence's keys (`kv`)."""
    out = q.new_zeros((*q.shape[:-1], kv.size(-1)))
    lse = q.new_empty(q.shape[:-1])
    q_pos = setup.positions(setup.rank)
    for rows, keys in _own_chunks(setup):
        k, v = kv[0, ..., :keys, :].float(), kv[1, ..., :keys, :].float()
        if _fused(setup):
            out[..., rows, :], lse[..., rows] = _fused_chunk_forward(setup, _rows(q, rows), k, v)
            continue
        mask = _mask(setup, q_pos[rows], torch.arange(keys, device=setup.device), True)
        out[..., rows, :], lse[..., rows] = _block_forward(_rows(q, rows), k, v, setup.scale, mask)
    return out, lse


def _fused_chunk_forward(
    setup: _Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of queries over the keys up to its end, by fused kernels.

    The chunk's own keys causally, the earlier ones whole, merged by their log-sum-exp.
    """
    own = slice(k.shape[2] - q.shape[3], None)
    out, lse = fused_block_forward(q, _rows(k, own), _rows(v, own), setup.scale, True)
    if own.start:
        earlier = slice(0, own.start)
        before = fused_block_forward(q, _rows(k, earlier), _rows(v, earlier), setup.scale, False)
        out, lse = _merge(*before, out, lse)
    return out, lse


def _gather_backward(
    setup: _Setup,
    q: torch.Tensor,
    kv: torch.Tensor,
    grads: tuple[torch.Tensor, ...],
    out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the gradients of grouped `q` and of the whole `kv`."""
    grad_out, lse, delta = grads
    grad_q = torch.zeros_like(q)
    grad_kv = kv.new_zeros(kv.shape, dtype=torch.float32)
    q_pos = setup.positions(setup.rank)
    for rows, keys in _own_chunks(setup):
        k, v = kv[0, ..., :keys, :].float(), kv[1, ..., :keys, :].float()
        if _fused(setup):
            final = (_rows(grad_out, rows), lse[..., rows], _rows(out, rows))
            dq, dk, dv = _fused_chunk_backward(setup, _rows(q, rows), k, v, final)
        else:
            mask = _mask(setup, q_pos[rows], torch.arange(keys, device=setup.device), True)
            block_grads = (_rows(grad_out, rows), lse[..., rows], delta[..., rows])
            dq, dk, dv = _block_backward(_rows(q, rows), k, v, mask, block_grads, scale=setup.scale)
        grad_q[..., rows, :] = dq
        grad_kv[0, ..., :keys, :] += dk
        grad_kv[1, ..., :keys, :] += dv
    return grad_q, grad_kv


def _fused_chunk_backward(
    setup: _Setup,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    final: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_fused_chunk_forward`'s gradients: dq, and dk, dv of the keys up to the chunk's end."""
    own = slice(k.shape[2] - q.shape[3], None)
    dq, dk_own, dv_own = fused_block_backward(
        q, _rows(k, own), _rows(v, own), True, final, scale=setup.scale
    )
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk[..., own, :], dv[..., own, :] = dk_own, dv_own
    if own.start:
        earlier = slice(0, own.start)
        dq_before, dk[..., earlier, :], dv[..., earlier, :] = fused_block_backward(
            q, _rows(k, earlier), _rows(v, earlier), False, final, scale=setup.scale
        )
        dq = dq + dq_before
    return dq, dk, dv


def _gather_sequence(setup: _Setup, kv: torch.Tensor) -> torch.Tensor:
    """Every rank's [2, batch, kv heads, local, dim] keys and values, in sequence order."""
    assert setup.group is not None
    gathered = start_all_gather_first(kv, setup.group, _GATHER).wait()
    parts = gathered.view(setup.size, *kv.shape).unbind(0)
    return join_context_parallel_parts(parts, seq_dim=-2)


def _scatter_sequence(setup: _Setup, grad_kv: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of each rank's part of the whole sequence's `grad_kv`, ours kept."""
    assert setup.group is not None
    parts = [
        split_for_context_parallel(grad_kv, setup.size, rank, seq_dim=-2)
        for rank in range(setup.size)
    ]
    return start_reduce_scatter_first(torch.cat(parts), setup.group, _SCATTER).wait()


class _AllGatherAttention(torch.autograd.Function):
    """Causal attention over keys and values gathered from every rank ("all_gather")."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, setup: _Setup
    ) -> torch.Tensor:
        """Attention of this rank's two chunks over the keys before (and at) each."""
        kv = _gather_sequence(setup, torch.stack([k, v]))
        out, lse = _gather_forward(setup, _grouped(q, k.size(1)), kv)
        result = out.reshape(q.shape).to(q.dtype)
        ctx.setup = setup
        ctx.save_for_backward(q, kv, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The gradient of q here; those of k and v summed over ranks, sent to their owners."""
        q, kv, out, lse = ctx.saved_tensors
        kv_heads = kv.size(2)
        grads = _output_grads(grad_output, out, lse, kv_heads)
        grad_q, grad_kv = _gather_backward(
            ctx.setup, _grouped(q, kv_heads), kv, grads, _grouped(out, kv_heads)
        )
        mine = _scatter_sequence(ctx.setup, grad_kv)
        dtype = kv.dtype
        return grad_q.reshape(q.shape).to(q.dtype), mine[0].to(dtype), mine[1].to(dtype), None


# --- The public function ------------------------------------------------------------------


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    comm_type: str = "p2p",
    document_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal self-attention over a sequence split across the context-parallel `group`.

    Each rank passes its part of the sequence (`split_for_context_parallel` with
    ``seq_dim=2``) and gets its part of the output of causal softmax attention over the
    whole sequence: what ``scaled_dot_product_attention(..., is_causal=True)`` on the full
    sequence gives, split the same way. Differentiable in `q`, `k` and `v`.

    Args:
        q: This rank's queries, [batch, heads, local sequence, head dim].
        k: Its keys, [batch, kv heads, local sequence, head dim]; kv heads dividing heads
            (grouped-query attention: query head h uses key head ``h // (heads / kv heads)``).
        v: Its values, the shape of `k`. One floating dtype and device for all three.
        group: The context-parallel process group; None (or a group of one) for plain
            causal attention without communication.
        comm_type: "p2p" (a ring of passes, overlapped with compute) or "all_gather".
        document_ids: Optional integer ids of the document of each token of the WHOLE
            sequence, [global sequence] or [batch, global sequence], the same on every rank;
            a token attends only to tokens with its id (give each packed document its own).
        scale: The factor of the scores; ``1 / sqrt(head dim)`` when None.

    Returns:
        This rank's output, the shape and dtype of `q`.

    Raises:
        TypeError: An input is not a tensor, the dtypes differ or are not floating, or
            `document_ids` does not hold integers.
        ValueError: An unknown `comm_type`, shapes that do not fit together, an odd local
            sequence length at a group size above 1, or `document_ids` of another length
            than the whole sequence. All checks run before any communication.
    """
    setup = _prepare(
        q, k, v, group=group, comm_type=comm_type, document_ids=document_ids, scale=scale
    )
    function = (
        _AllGatherAttention if comm_type == "all_gather" and setup.size > 1 else _RingAttention
    )
    out: torch.Tensor = function.apply(q, k, v, setup)  # type: ignore[no-untyped-call]
    return out
