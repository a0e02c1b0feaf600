"""Megatron's GPT sample indices, split and blend rules, on small hand-checked cases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import pytest

from pp_train.data import (
    BlendedDataset,
    DataConfig,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    build_blending_indices,
    build_train_valid_test_datasets,
    parse_data_path,
    parse_split,
    split_matrix,
    split_sequences,
)
from pp_train.data.gpt_dataset import build_sample_index, num_epochs

# --- split and blend parsing ----------------------------------------------------------------


def test_parse_split_normalizes_and_pads() -> None:
    assert parse_split("969,30,1") == [0.969, 0.03, 0.001]
    assert parse_split("90, 10") == [0.9, 0.1, 0.0]
    assert parse_split("1/1/2") == [0.25, 0.25, 0.5]


@pytest.mark.parametrize("split", ["", "a,b", "1,2,3,4", "90,-10", "0,0,0", "nan"])
def test_a_split_that_does_not_add_up_is_refused(split: str) -> None:
    with pytest.raises(ValueError, match=f"split {split!r}"):
        parse_split(split)


def test_split_matrix_and_rounding() -> None:
    assert split_matrix([0.9, 0.1, 0.0]) == [(0.0, 0.9), (0.9, 1.0), None]
    assert split_sequences((0.9, 1.0), 10).tolist() == [9]
    # Python rounds half to even, as Megatron does: 2.5 -> 2, 7.5 -> 8.
    assert split_sequences((0.25, 0.75), 10).tolist() == [2, 3, 4, 5, 6, 7]


def test_parse_data_path_forms() -> None:
    assert parse_data_path(["P"]) == (["P"], None)
    assert parse_data_path(["A", "B"]) == (["A", "B"], None)
    assert parse_data_path(["0.3 A 0.7 B"]) == (["A", "B"], [0.3, 0.7])
    assert parse_data_path(["0.3", "A", "0.7", "B"]) == (["A", "B"], [0.3, 0.7])
    with pytest.raises(ValueError, match="mixes weights and prefixes"):
        parse_data_path(["0.3", "A", "B", "C"])
    with pytest.raises(ValueError, match=r"weight -1\.0 of B must be a positive number"):
        parse_data_path(["1 A -1 B"])
    with pytest.raises(ValueError, match="names no dataset"):
        parse_data_path([" "])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"data_path": "P"}, "data_path must be a list of strings or None, got 'P'"),
        ({"split": "1,2,3,4"}, "split '1,2,3,4' must be 1 to 3"),
        ({"tokenizer_type": "GPT2"}, "tokenizer_type 'GPT2' is unknown; valid: ByteTokenizer"),
        ({"tokenizer_type": "NullTokenizer"}, "tokenizer_type NullTokenizer needs vocab_size"),
        (
            {"tokenizer_type": "HuggingFaceTokenizer"},
            "tokenizer_type HuggingFaceTokenizer needs tokenizer_model",
        ),
        ({"tokenizer_model": "t.json"}, "tokenizer_model 't.json' goes with HuggingFaceTokenizer"),
        ({"mid_level_dataset_surplus": -1.0}, "mid_level_dataset_surplus must be >= 0, got -1.0"),
    ],
)
def test_data_config_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)


def test_data_config_defaults() -> None:
    config = DataConfig(data_path=["0.3 A 0.7 B"])
    assert config.split == "969,30,1"
    assert config.tokenizer_type == "ByteTokenizer"
    assert config.blend == (["A", "B"], [0.3, 0.7])
    assert DataConfig().blend is None


# --- the GPT indices ------------------------------------------------------------------------


def test_num_epochs_covers_the_windows() -> None:
    assert num_epochs(10, None, 4) == 1
    assert num_epochs(10, 2, 4) == 1  # 2 windows of 5 tokens need 9
    assert num_epochs(10, 3, 4) == 2  # 13 tokens
    assert num_epochs(10, 0, 4) == 1


def test_sample_index_by_hand() -> None:
    lengths = numpy.array([3, 0, 5], dtype=numpy.int32)
    document_index = numpy.array([0, 1, 2], dtype=numpy.int32)
    # Stream positions 0, 2, 4, 6: document 0 offset 0 and 2, document 2 offset 1 and 3 (the
    # empty document 1 never holds a position).
    index = build_sample_index(lengths, document_index, 2, tokens_per_epoch=8, epochs=1)
    assert index.tolist() == [[0, 0], [0, 2], [2, 1], [2, 3]]
    assert index.dtype == numpy.int32


def test_blending_indices_by_hand() -> None:
    dataset, sample = build_blending_indices([0.5, 0.5], 4)
    assert dataset.tolist() == [0, 1, 0, 1]
    assert sample.tolist() == [0, 0, 1, 1]
    dataset, sample = build_blending_indices([0.25, 0.75], 4)
    assert dataset.tolist() == [1, 0, 1, 1]
    assert sample.tolist() == [0, 0, 1, 2]


def _prefix(tmp_path: Path, documents: list[list[int]], name: str = "d") -> str:
    with IndexedDatasetBuilder(tmp_path / name) as builder:
        for tokens in documents:
            builder.add_document(tokens)
        builder.finalize()
    return str(tmp_path / name)


def test_samples_are_windows_of_the_shuffled_stream(tmp_path: Path) -> None:
    documents = [[10 * d + t for t in range(d + 2)] for d in range(8)]
    indexed = IndexedDataset(_prefix(tmp_path, documents))
    ids = numpy.arange(8, dtype=numpy.int32)
    dataset = GPTDataset(indexed, ids, num_samples=20, seq_length=3, seed=7, split_name="train")
    stream = numpy.concatenate([documents[d] for d in dataset.document_index])
    assert sorted(dataset.document_index.tolist()) == sorted(list(range(8)) * 2)  # 2 epochs
    assert len(dataset) == (len(stream) - 1) // 3 >= 20
    for index in range(len(dataset)):
        k = int(dataset.shuffle_index[index])
        assert dataset.window(index).tolist() == stream[3 * k : 3 * k + 4].tolist()
        sample = dataset[index]
        assert sample["tokens"].tolist() == stream[3 * k : 3 * k + 3].tolist()
        assert sample["labels"].tolist() == stream[3 * k + 1 : 3 * k + 4].tolist()
    with pytest.raises(IndexError, match="sample 99 is out of range for"):
        dataset.window(99)


# --- building splits, blends and the cache --------------------------------------------------


def test_splits_are_none_for_a_zero_share_and_cached_beside_the_data(tmp_path: Path) -> None:
    prefix = _prefix(tmp_path, [[d] * (d + 3) for d in range(20)])
    config = DataConfig(data_path=[prefix], split="90,10,0")
    train, valid, test = build_train_valid_test_datasets(
        config, seq_length=4, seed=1, train_valid_test_num_samples=(10, 2, 0)
    )
    assert test is None
    assert train is not None
    assert valid is not None
    assert len(train) >= 10
    assert len(valid) >= 2
    cache = Path(prefix) / "cache" / "GPTDataset_indices"
    assert len(list(cache.glob("*-GPTDataset-train-*"))) == 4
    assert not list(cache.glob("*.tmp"))
    again = build_train_valid_test_datasets(
        config, seq_length=4, seed=1, train_valid_test_num_samples=(10, 2, 0)
    )[0]
    assert isinstance(again, GPTDataset)
    assert isinstance(again.shuffle_index, numpy.memmap)
    assert all(again.window(i).tolist() == train.window(i).tolist() for i in range(len(train)))


def test_a_corrupt_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    prefix = _prefix(tmp_path, [[1, 2, 3, 4, 5]] * 4)
    config = DataConfig(data_path=[prefix], split="1", data_cache_path=str(tmp_path / "c"))
    first = build_train_valid_test_datasets(
        config, seq_length=2, seed=0, train_valid_test_num_samples=(5, 0, 0)
    )[0]
    for path in (tmp_path / "c").glob("*-shuffle_index.npy"):
        path.write_bytes(b"garbage")
    second = build_train_valid_test_datasets(
        config, seq_length=2, seed=0, train_valid_test_num_samples=(5, 0, 0)
    )[0]
    assert first is not None
    assert second is not None
    assert [first.window(i).tolist() for i in range(5)] == [
        second.window(i).tolist() for i in range(5)
    ]


def test_weighted_blend_draws_each_share(tmp_path: Path) -> None:
    a = _prefix(tmp_path, [[1] * 9] * 10, "a")
    b = _prefix(tmp_path, [[2] * 9] * 10, "b")
    config = DataConfig(data_path=[f"1 {a} 3 {b}"], split="1")
    train, valid, test = build_train_valid_test_datasets(
        config, seq_length=4, seed=3, train_valid_test_num_samples=(40, 0, 0)
    )
    assert isinstance(train, BlendedDataset)
    assert valid is None
    assert test is None
    assert len(train) == 40  # ceil(40 * 0.25) + ceil(40 * 0.75)
    firsts = [int(train[i]["tokens"][0]) for i in range(40)]
    assert firsts.count(1) == 10
    assert firsts.count(2) == 30


@pytest.mark.parametrize(
    ("split", "counts", "message"),
    [
        ("969,30,1", (4, 1, 1), r"the test split \(0.10% of 20 sequences: 0\) holds no tokens"),
        ("1", (-1, 0, 0), "train samples must be an int >= 0, got -1"),
    ],
)
def test_bad_splits_and_counts_are_named(
    tmp_path: Path, split: str, counts: tuple[int, int, int], message: str
) -> None:
    prefix = _prefix(tmp_path, [[1, 2, 3]] * 20)
    with pytest.raises(ValueError, match=message):
        build_train_valid_test_datasets(
            DataConfig(data_path=[prefix], split=split),
            seq_length=2,
            seed=0,
            train_valid_test_num_samples=counts,
        )


def test_an_oversampled_blend_is_refused(tmp_path: Path) -> None:
    a = _prefix(tmp_path, [[1] * 9] * 10, "a")
    b = _prefix(tmp_path, [[2] * 9] * 10, "b")
    config = DataConfig(data_path=[a, b], split="1")
    blend = build_train_valid_test_datasets(
        config, seq_length=4, seed=3, train_valid_test_num_samples=(1000, 0, 0)
    )[0]
    assert blend is not None
    assert len(blend) == 44
    datasets = blend.datasets  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"takes \d+ samples from dataset 0 .*a\), which has 22"):
        BlendedDataset(datasets, [0.9, 0.1], 40)
