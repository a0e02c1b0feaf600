"""The transformers-shaped attention function against plain attention over the whole sequence.

The function is called as transformers' attention modules call theirs (the module, q, k, v,
the mask, then keywords); its output comes back [batch, sequence, heads, head dim]. The
registration itself is checked where transformers is installed (the integration tests train
Hugging Face's Llama at context parallelism 2 through it).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pp_tensor import split_for_context_parallel, transformers_attention
from pp_testing import run_distributed


def _outputs(comm_type: str) -> tuple[list[list[float]], list[list[float]]]:
    """This rank's output and the reference's part, flattened."""
    size, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(size)))
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 16, 8, generator=gen)
    k, v = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(2))
    documents = torch.tensor([0] * 6 + [1] * 10)
    same = documents[:, None] == documents[None, :]
    mask = torch.ones(16, 16, dtype=torch.bool).tril() & same
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    attention = transformers_attention(group=group, comm_type=comm_type)
    parts = [split_for_context_parallel(t, size, rank, seq_dim=2) for t in (q, k, v)]
    out, weights = attention(None, *parts, None, dropout=0.0, scaling=0.3, document_ids=documents)
    assert weights is None
    expected = split_for_context_parallel(reference, size, rank, seq_dim=1)
    return out.flatten().tolist(), expected.flatten().tolist()


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_the_function_returns_transformers_layout_of_the_whole_sequence(comm_type: str) -> None:
    for out, expected in run_distributed(_outputs, 2, comm_type):
        assert out == pytest.approx(expected, abs=1e-5)


def test_what_it_cannot_do_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown comm_type 'a2a'; use one of 'p2p', 'all_gather'"):
        transformers_attention(group=None, comm_type="a2a")
    attention = transformers_attention(group=None)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"attention dropout 0\.1: context-parallel attention"):
        attention(None, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"a dense attention mask of shape \(1, 1, 4, 4\)"):
        attention(None, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="a non-causal attention call"):
        attention(None, q, q, q, None, is_causal=False)
