"""pp_train.data against megatron-core 0.16.1 itself: the files and the samples, token for token.

Skipped where megatron-core is missing, except under ``PP_TRAIN_MEGATRON_ORACLE=1`` (the
``megatron_oracles`` nox session), where a missing oracle is a failure.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy
import pytest

from pp_train.data import (
    DataConfig,
    GPTDataset,
    IndexedDataset,
    attention_mask_from_document_ids,
    build_train_valid_test_datasets,
)
from pp_train.preprocess import main as preprocess

if os.environ.get("PP_TRAIN_MEGATRON_ORACLE") != "1":
    pytest.importorskip("megatron.core.datasets.gpt_dataset")

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder

# megatron-core's builder hands torch tensors to numpy.array(copy=False).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog;",
    "pipeline",
    "stages",
    "pass",
    "activations",
]


class _Tokenizer:
    """What megatron-core's GPT dataset asks of a tokenizer (the byte tokenizer's ids)."""

    vocab_size = 257
    eod = 256

    @property
    def unique_identifiers(self) -> OrderedDict[str, Any]:
        return OrderedDict(tokenizer="bytes")


def _write_jsonl(path: Path, documents: int, seed: int) -> Path:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(documents):
            words = [rng.choice(WORDS) for _ in range(rng.choice([0, 1, 3, 8, 20, 40]))]
            handle.write(json.dumps({"text": " ".join(words)}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Prefixes A and B (different sizes), each with and without EOD."""
    root = tmp_path_factory.mktemp("oracle")
    prefixes = {}
    for name, documents in (("A", 1500), ("B", 700)):
        source = _write_jsonl(root / f"{name}.jsonl", documents, seed=len(name) + documents)
        for eod in (False, True):
            out = root / f"{name}{'_eod' if eod else ''}"
            argv = ["--input", str(source), "--output-prefix", str(out), "--log-interval", "999"]
            assert preprocess(argv + (["--append-eod"] if eod else [])) == 0
            prefixes[name + ("_eod" if eod else "")] = f"{out}_text_document"
    return prefixes


def _megatron_splits(
    blend: tuple[list[str], list[float] | None],
    split: str,
    seq_length: int,
    seed: int,
    counts: list[int],
    **packing: bool,
) -> list[Any]:
    flags = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        # A BlendedDataset with a cache path asks torch.distributed for the rank; without
        # one, megatron-core caches the GPT indices beside the data (a temporary directory).
        path_to_cache=None,
        tokenizer=_Tokenizer(),
        create_attention_mask=True,
        **(flags | packing),
    )
    builder = BlendedMegatronDatasetBuilder(MegatronGPTDataset, counts, lambda: True, config)
    return list(builder.build())


def _megatron_window(sample: dict[str, torch.Tensor]) -> list[int]:
    return [*sample["tokens"].tolist(), int(sample["labels"][-1])]


_FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


def _assert_same_sample(sample: dict[str, torch.Tensor], expected: Any, index: int) -> None:
    """Every field equal (dtype too); the attention mask made from ``document_ids``.

    (megatron-core's blend adds the int ``dataset_id``, which pp-train's samples leave out.)
    """
    assert set(sample) - {"document_ids"} == set(expected) - {"attention_mask", "dataset_id"}
    for key in _FIELDS:
        assert sample[key].dtype == expected[key].dtype, (index, key)
        assert torch.equal(sample[key], expected[key]), (index, key)
    documents = sample.get("document_ids", torch.zeros_like(sample["tokens"]))
    mask = attention_mask_from_document_ids(documents)
    assert torch.equal(mask, expected["attention_mask"]), index


def _assert_same_samples(ours: Any, theirs: Any) -> int:
    assert (ours is None) == (theirs is None)
    if ours is None:
        return 0
    assert len(ours) == len(theirs)
    for index in range(len(ours)):
        _assert_same_sample(ours[index], theirs[index], index)
    if isinstance(ours, GPTDataset):
        assert numpy.array_equal(ours.document_index, theirs.document_index)
        assert numpy.array_equal(ours.sample_index, theirs.sample_index)
        assert numpy.array_equal(ours.shuffle_index, theirs.shuffle_index)
    return len(ours)


def _compare(
    tmp_path: Path,
    data_path: list[str],
    blend: tuple[list[str], list[float] | None],
    *,
    split: str,
    seq_length: int,
    seed: int,
    counts: tuple[int, int, int],
    **packing: Any,
) -> int:
    cache = str(tmp_path / "ours")
    ours = build_train_valid_test_datasets(
        DataConfig(data_path=data_path, split=split, data_cache_path=cache, **packing),
        seq_length=seq_length,
        seed=seed,
        train_valid_test_num_samples=counts,
    )
    theirs = _megatron_splits(blend, split, seq_length, seed, list(counts), **packing)
    return sum(_assert_same_samples(a, b) for a, b in zip(ours, theirs, strict=True))


# --- the files ----------------------------------------------------------------------------


def test_megatron_reads_our_files_document_for_document(
    corpora: dict[str, str], tmp_path: Path
) -> None:
    source = tmp_path / "mixed.jsonl"
    lines = [{"text": "héllo wörld"}, {"text": ""}, {"text": ["one.", "", "two three."]}]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    prefix = str(tmp_path / "mixed")
    assert preprocess(["--input", str(source), "--output-prefix", prefix, "--append-eod"]) == 0
    for path in [*corpora.values(), f"{prefix}_text_document"]:
        ours, theirs = IndexedDataset(path), MegatronIndexedDataset(path)
        assert theirs.index.dtype == numpy.uint16
        assert numpy.array_equal(ours.document_indices, theirs.document_indices)
        assert numpy.array_equal(ours.sequence_lengths, theirs.sequence_lengths)
        for i in range(len(ours)):
            assert numpy.array_equal(ours[i], theirs[i])
    mixed = MegatronIndexedDataset(f"{prefix}_text_document")
    assert mixed.document_indices.tolist() == [0, 1, 1, 3]
    assert bytes(mixed[1].tolist()) == b"one."
    assert mixed[2].tolist() == [*b"two three.", 256]


def test_we_read_files_written_by_megatron(tmp_path: Path) -> None:
    rng = numpy.random.default_rng(0)
    for dtype in (numpy.uint16, numpy.int32, numpy.int64, numpy.uint8):
        prefix = str(tmp_path / numpy.dtype(dtype).name)
        builder = MegatronBuilder(prefix + ".bin", dtype=dtype)
        documents = []
        for length in (5, 0, 17, 1, 9):
            tokens = rng.integers(0, 200, size=length)
            builder.add_document(torch.from_numpy(tokens), [length] if length else [])
            documents.append(tokens)
        builder.add_item(torch.tensor([1, 2, 3]))
        builder.add_item(torch.tensor([4]))
        builder.end_document()
        builder.finalize(prefix + ".idx")
        ours = IndexedDataset(prefix)
        assert ours.dtype == dtype
        assert ours.num_documents == 6
        for i, tokens in enumerate(documents):
            assert ours.document(i).tolist() == tokens.tolist()
        assert ours.document(5).tolist() == [1, 2, 3, 4]
        assert [ours[i].tolist() for i in range(len(ours) - 2, len(ours))] == [[1, 2, 3], [4]]


# --- the samples --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "split", "seq_length", "seed", "counts"),
    [
        ("A", "969,30,1", 16, 1234, (50, 5, 1)),
        ("A_eod", "90,10,0", 16, 1234, (50, 8, 0)),
        # 3 epochs with the last one shuffled apart (train, valid); test 3 epochs, not apart
        ("A_eod", "969,30,1", 64, 5, (3310, 100, 3)),
        # 3 and 2 epochs, the last one shuffled in with the others (over 80% of an epoch)
        ("A", "80,20", 32, 0, (5704, 1200, 0)),
        ("B_eod", "1", 7, 77, (9000, 0, 0)),  # 2 epochs, the last apart
    ],
)
def test_single_prefix_samples_equal_megatron(  # noqa: PLR0917 - pytest's parameters
    corpora: dict[str, str],
    tmp_path: Path,
    name: str,
    split: str,
    seq_length: int,
    seed: int,
    counts: tuple[int, int, int],
) -> None:
    prefix = corpora[name]
    compared = _compare(
        tmp_path,
        [prefix],
        ([prefix], None),
        split=split,
        seq_length=seq_length,
        seed=seed,
        counts=counts,
    )
    assert compared >= sum(counts)


@pytest.mark.parametrize(
    ("weights", "split", "seq_length", "seed", "counts"),
    [
        ((0.3, 0.7), "969,30,1", 16, 1234, (200, 20, 4)),
        ((0.3, 0.7), "969,30,1", 64, 8, (2000, 100, 4)),  # B's share spans 2 epochs
        ((2.0, 1.0), "90,10,0", 9, 42, (500, 30, 0)),
        ((1.0,), "969,30,1", 16, 3, (60, 6, 1)),  # one weighted prefix is still a blend
        (None, "969,30,1", 16, 1234, (150, 10, 1)),  # no weights: weighed by size
    ],
)
def test_blend_samples_equal_megatron(  # noqa: PLR0917 - pytest's parameters
    corpora: dict[str, str],
    tmp_path: Path,
    weights: tuple[float, ...] | None,
    split: str,
    seq_length: int,
    seed: int,
    counts: tuple[int, int, int],
) -> None:
    prefixes = [corpora["A_eod"], corpora["B_eod"]][: len(weights) if weights else 2]
    if weights is None:
        data_path = prefixes
    else:
        data_path = [" ".join(f"{w} {p}" for w, p in zip(weights, prefixes, strict=True))]
    blend = (prefixes, None if weights is None else list(weights))
    compared = _compare(
        tmp_path, data_path, blend, split=split, seq_length=seq_length, seed=seed, counts=counts
    )
    assert compared >= sum(counts) if weights else compared > 0


# --- packed documents -----------------------------------------------------------------------


def _coverage(dataset: GPTDataset, eod: int) -> dict[str, int]:
    """How many samples start mid-document, start with EOD, or hold 3 EODs or more."""
    windows = [dataset.window(i) for i in range(len(dataset))]
    starts = dataset.sample_index[numpy.asarray(dataset.shuffle_index[: len(dataset)])]
    return {
        "mid-document": int(numpy.count_nonzero(starts[:, 1] > 0)),
        "EOD first": sum(int(w[0] == eod) for w in windows),
        "3+ EODs": sum(int(numpy.count_nonzero(w[:-1] == eod) >= 3) for w in windows),
        "no EOD": sum(int(not numpy.any(w[:-1] == eod)) for w in windows),
    }


@pytest.mark.parametrize(
    ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"),
    list(itertools.product((False, True), repeat=3)),
)
def test_packed_document_fields_equal_megatron(
    corpora: dict[str, str],
    tmp_path: Path,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> None:
    packing: dict[str, Any] = {
        "reset_position_ids": reset_position_ids,
        "reset_attention_mask": reset_attention_mask,
        "eod_mask_loss": eod_mask_loss,
    }
    prefix, counts = corpora["A_eod"], (300, 40, 10)
    compared = _compare(
        tmp_path, [prefix], ([prefix], None), split="90,8,2", seq_length=48, seed=11,
        counts=counts, **packing,
    )  # fmt: skip
    assert compared >= sum(counts)
    cache = str(tmp_path / "ours")
    config = DataConfig(data_path=[prefix], split="90,8,2", data_cache_path=cache, **packing)
    train = build_train_valid_test_datasets(
        config, seq_length=48, seed=11, train_valid_test_num_samples=counts
    )[0]
    assert isinstance(train, GPTDataset)
    assert ("document_ids" in train[0]) == reset_attention_mask
    seen = _coverage(train, _Tokenizer.eod)
    # The data exercises every case: windows cut into documents, several documents per
    # window, an EOD first, and windows inside one long document.
    assert min(seen.values()) > 0, seen


@pytest.mark.parametrize("reset_attention_mask", [False, True])
def test_packed_document_fields_of_a_blend_equal_megatron(
    corpora: dict[str, str], tmp_path: Path, reset_attention_mask: bool
) -> None:
    prefixes = [corpora["A_eod"], corpora["B_eod"]]
    data_path = [f"0.3 {prefixes[0]} 0.7 {prefixes[1]}"]
    compared = _compare(
        tmp_path, data_path, (prefixes, [0.3, 0.7]), split="969,30,1", seq_length=40, seed=3,
        counts=(200, 20, 4), reset_position_ids=True, reset_attention_mask=reset_attention_mask,
        eod_mask_loss=True,
    )  # fmt: skip
    assert compared >= 224
