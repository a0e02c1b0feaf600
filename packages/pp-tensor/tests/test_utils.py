"""Sizes, vocabulary ranges, shards and parameter attributes: one process, no group."""

from __future__ import annotations

import pytest
import torch

from pp_tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabUtility,
    copy_tensor_model_parallel_attributes,
    divide,
    join_shards,
    mark_sequence_parallel,
    pad_vocab_size,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    shard_of,
    split_tensor_along_last_dim,
    tp_rank,
    tp_size,
)


def _attributes(param: torch.Tensor) -> tuple[object, object, object]:
    return (
        getattr(param, "tensor_model_parallel", None),
        getattr(param, "partition_dim", None),
        getattr(param, "partition_stride", None),
    )


def test_no_group_is_size_one_rank_zero() -> None:
    assert tp_size(None) == 1
    assert tp_rank(None) == 0


@pytest.mark.parametrize(
    ("vocab", "divisible_by", "tp", "expected"),
    [(257, 128, 1, 384), (257, 128, 2, 512), (257, 256, 1, 512), (256, 128, 2, 256), (1, 1, 1, 1)],
)
def test_pad_vocab_size(vocab: int, divisible_by: int, tp: int, expected: int) -> None:
    assert pad_vocab_size(vocab, divisible_by, tp) == expected


def test_divide_and_vocab_ranges() -> None:
    assert divide(12, 4, "hidden size") == 3
    assert VocabUtility.vocab_range_from_global_vocab_size(16, 2, 4) == (8, 12)
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(5, 3, 4) == (15, 20)


def test_split_along_last_dim() -> None:
    tensor = torch.arange(24.0).view(2, 12)
    parts = split_tensor_along_last_dim(tensor, 3)
    assert [tuple(part.shape) for part in parts] == [(2, 4)] * 3
    assert not parts[1].is_contiguous()
    contiguous = split_tensor_along_last_dim(tensor, 3, contiguous_split_chunks=True)
    assert all(part.is_contiguous() for part in contiguous)
    torch.testing.assert_close(torch.cat(contiguous, dim=-1), tensor)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shard_of_and_join_shards_are_inverse(dim: int) -> None:
    full = torch.arange(48.0).view(4, 12)
    shards = [shard_of(full, dim, rank, 4) for rank in range(4)]
    torch.testing.assert_close(shards[1], full.chunk(4, dim=dim)[1])
    torch.testing.assert_close(join_shards(shards, dim), full)
    shards[0].zero_()  # a clone: the full tensor is untouched
    assert full[0, 1] == 1.0


def test_attribute_helpers() -> None:
    split, plain, copy = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    set_tensor_model_parallel_attributes(split, True, 0, 1)
    set_defaults_if_not_set_tensor_model_parallel_attributes(split)  # keeps what is set
    set_defaults_if_not_set_tensor_model_parallel_attributes(plain)
    copy_tensor_model_parallel_attributes(copy, split)
    assert _attributes(split) == (True, 0, 1)
    assert _attributes(plain) == (False, -1, 1)
    assert _attributes(copy) == (True, 0, 1)
    assert param_is_not_tensor_parallel_duplicate(split, 1)
    assert param_is_not_tensor_parallel_duplicate(plain, 0)
    assert not param_is_not_tensor_parallel_duplicate(plain, 1)
    norm = torch.nn.LayerNorm(4)
    mark_sequence_parallel(norm)
    mark_sequence_parallel([plain])
    assert all(p.sequence_parallel for p in [*norm.parameters(), plain])  # type: ignore[attr-defined]


def test_layer_parameters_carry_their_attributes() -> None:
    column = ColumnParallelLinear(4, 6, tp_group=None, init_method=torch.nn.init.ones_)
    row = RowParallelLinear(
        6,
        4,
        tp_group=None,
        init_method=torch.nn.init.ones_,
        input_is_parallel=True,
        sequence_parallel=True,
    )
    embedding = VocabParallelEmbedding(8, 4, tp_group=None, init_method=torch.nn.init.ones_)
    assert column.weight is not None
    assert column.bias is not None
    assert row.bias is not None
    assert _attributes(column.weight) == (True, 0, 1)
    assert _attributes(column.bias) == (True, 0, 1)
    assert _attributes(row.weight) == (True, 1, 1)
    assert _attributes(row.bias) == (False, -1, 1)
    assert row.bias.sequence_parallel  # type: ignore[attr-defined]
    assert _attributes(embedding.weight) == (True, 0, 1)
    assert torch.count_nonzero(column.bias) == 0
    assert torch.count_nonzero(row.bias) == 0


def test_params_dtype_and_skip_weight_allocation() -> None:
    column = ColumnParallelLinear(
        4,
        6,
        tp_group=None,
        init_method=torch.nn.init.ones_,
        params_dtype=torch.bfloat16,
        skip_weight_param_allocation=True,
    )
    assert column.weight is None
    assert column.bias is not None
    assert column.bias.dtype == torch.bfloat16
    weight = torch.ones(6, 4)
    output, bias = ColumnParallelLinear(
        4, 6, tp_group=None, init_method=torch.nn.init.zeros_, skip_bias_add=True
    )(torch.ones(3, 4), weight)
    torch.testing.assert_close(output, torch.full((3, 6), 4.0))
    assert bias is not None


@pytest.mark.reliability
def test_size_errors_name_the_numbers() -> None:
    with pytest.raises(
        ValueError, match="hidden size 10 is not divisible by tensor-parallel size 4"
    ):
        divide(10, 4, "hidden size")
    with pytest.raises(
        ValueError, match="last dimension 5 is not divisible by number of partitions 2"
    ):
        split_tensor_along_last_dim(torch.zeros(5), 2)
    with pytest.raises(
        ValueError, match=r"dimension 1 of shape \(2, 5\): 5 is not divisible by shard count 2"
    ):
        shard_of(torch.zeros(2, 5), 1, 0, 2)
    with pytest.raises(ValueError, match="rank 2 is out of range for 2 shards"):
        shard_of(torch.zeros(2, 4), 1, 2, 2)
    with pytest.raises(ValueError, match="vocab_size must be 1 or more, got 0"):
        pad_vocab_size(0, 128, 1)


@pytest.mark.reliability
def test_layer_argument_errors() -> None:
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        RowParallelLinear(
            4, 4, tp_group=None, init_method=torch.nn.init.ones_, sequence_parallel=True
        )
    no_weight = ColumnParallelLinear(
        4, 4, tp_group=None, init_method=torch.nn.init.ones_, skip_weight_param_allocation=True
    )
    with pytest.raises(
        ValueError, match="skip_weight_param_allocation=True: forward needs weight="
    ):
        no_weight(torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"has shape \(4, 3\), expected \(4, 4\)"):
        no_weight(torch.ones(2, 4), torch.ones(4, 3))
