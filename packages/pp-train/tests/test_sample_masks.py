"""Packed documents: loss mask, position ids and document ids on hand-made rows and datasets.

megatron-core itself is compared in test_megatron_data_oracle.py; here the rules are checked
by hand and against a plain per-token reading of them.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from pp_train.data import (
    DataConfig,
    EodByteTokenizer,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    SampleMasks,
    attention_mask_from_document_ids,
    build_train_valid_test_datasets,
    check_data,
    ltor_masks_and_position_ids,
    microbatches,
    sample_masks,
)
from pp_train.data import builder as builder_module

EOD = 99
ROW = torch.tensor([5, EOD, 7, 8, EOD, 9])
ALL: dict[str, Any] = {
    "reset_position_ids": True,
    "reset_attention_mask": True,
    "eod_mask_loss": True,
}
COMBINATIONS: list[dict[str, Any]] = [
    dict(zip(ALL, values, strict=True)) for values in itertools.product((False, True), repeat=3)
]


def _by_hand(row: list[int], eod: int, flags: dict[str, bool]) -> dict[str, list[Any]]:
    """The rules token by token: what each field must be, read off the row."""
    loss: list[float] = []
    positions: list[int] = []
    documents: list[int] = []
    position = document = 0
    for token in row:
        loss.append(0.0 if flags["eod_mask_loss"] and token == eod else 1.0)
        positions.append(position if flags["reset_position_ids"] else len(positions))
        documents.append(document)
        position += 1
        if token == eod:  # the next token starts a new document
            position, document = 0, document + 1
    fields: dict[str, list[Any]] = {"loss_mask": loss, "position_ids": positions}
    if flags["reset_attention_mask"]:
        fields["document_ids"] = documents
    return fields


# --- the function ---------------------------------------------------------------------------


def test_a_hand_made_row() -> None:
    fields = ltor_masks_and_position_ids(ROW, eod_token=EOD, **ALL)
    assert fields["loss_mask"].tolist() == [1, 0, 1, 1, 0, 1]
    assert fields["loss_mask"].dtype == torch.float32
    assert fields["position_ids"].tolist() == [0, 1, 0, 1, 2, 0]
    assert fields["position_ids"].dtype == torch.int64
    assert fields["document_ids"].tolist() == [0, 0, 1, 1, 1, 2]
    assert fields["document_ids"].dtype == torch.int64


def test_without_flags_megatrons_defaults() -> None:
    for eod in (EOD, None):
        fields = ltor_masks_and_position_ids(ROW, eod_token=eod)
        assert set(fields) == {"loss_mask", "position_ids"}
        assert fields["loss_mask"].tolist() == [1.0] * 6
        assert fields["position_ids"].tolist() == list(range(6))


@pytest.mark.parametrize("flags", COMBINATIONS, ids=lambda f: "-".join(k for k in f if f[k]))
def test_every_combination_matches_the_rules_token_by_token(flags: dict[str, Any]) -> None:
    rows = [
        [EOD, EOD, 3, EOD, 4, 5, 6, EOD],  # EOD first, twice in a row, last
        [1, 2, 3, 4, 5, 6, 7, 8],  # one document throughout
        [EOD] * 8,
    ]
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows.append(torch.randint(95, 100, (8,), generator=generator).tolist())
    for row in rows:
        fields = ltor_masks_and_position_ids(torch.tensor(row), eod_token=EOD, **flags)
        assert {k: v.tolist() for k, v in fields.items()} == _by_hand(row, EOD, flags), row


def test_a_batch_is_each_row_alone() -> None:
    batch = torch.tensor([[5, EOD, 7, 8, EOD, 9], [EOD, 1, 2, 3, 4, EOD], [1, 2, 3, 4, 5, 6]])
    for flags in COMBINATIONS:
        together = ltor_masks_and_position_ids(batch, eod_token=EOD, **flags)
        alone = [ltor_masks_and_position_ids(row, eod_token=EOD, **flags) for row in batch]
        assert set(together) == set(alone[0])
        for key, value in together.items():
            assert value.shape == batch.shape
            assert torch.equal(value, torch.stack([fields[key] for fields in alone]))


def test_int32_tokens_and_a_sample_of_one() -> None:
    fields = ltor_masks_and_position_ids(ROW.to(torch.int32), eod_token=EOD, **ALL)
    assert fields["position_ids"].tolist() == [0, 1, 0, 1, 2, 0]
    one = ltor_masks_and_position_ids(torch.tensor([EOD]), eod_token=EOD, **ALL)
    assert {k: v.tolist() for k, v in one.items()} == {
        "loss_mask": [0.0],
        "position_ids": [0],
        "document_ids": [0],
    }


def test_the_attention_mask_of_document_ids() -> None:
    documents = ltor_masks_and_position_ids(ROW, eod_token=EOD, reset_attention_mask=True)
    mask = attention_mask_from_document_ids(documents["document_ids"])
    allowed = [  # row i: the tokens i may attend to (1)
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert mask.dtype == torch.bool
    assert mask.shape == (1, 6, 6)
    assert (~mask[0]).int().tolist() == allowed
    causal = attention_mask_from_document_ids(torch.zeros(2, 6, dtype=torch.int64))
    assert causal.shape == (2, 1, 6, 6)
    assert torch.equal(~causal[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    batch = torch.stack([documents["document_ids"], torch.zeros(6, dtype=torch.int64)])
    both = attention_mask_from_document_ids(batch)
    assert torch.equal(both[0], mask)
    assert torch.equal(both[1], causal[0])


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: ltor_masks_and_position_ids(ROW.float(), eod_token=EOD), TypeError, "dtype"),
        (
            lambda: ltor_masks_and_position_ids(ROW.view(1, 2, 3), eod_token=EOD),
            ValueError,
            r"\[seq\] or \[batch, seq\] with seq >= 1, got shape \(1, 2, 3\)",
        ),
        (
            lambda: ltor_masks_and_position_ids(torch.zeros(2, 0, dtype=torch.int64), eod_token=1),
            ValueError,
            r"got shape \(2, 0\)",
        ),
        (
            lambda: ltor_masks_and_position_ids(ROW, eod_token=None, eod_mask_loss=True),
            ValueError,
            "--eod-mask-loss needs the end-of-document id: give eod_token",
        ),
        (
            lambda: ltor_masks_and_position_ids(ROW, eod_token=-1, reset_position_ids=True),
            ValueError,
            "eod_token must be an int 0 or more",
        ),
        (
            lambda: ltor_masks_and_position_ids(ROW, eod_token=EOD, reset_position_ids=1),  # type: ignore[arg-type]
            TypeError,
            "reset_position_ids must be a bool, got 1",
        ),
        (lambda: attention_mask_from_document_ids([0, 1]), TypeError, "must be a torch.Tensor"),  # type: ignore[arg-type]
        (
            lambda: SampleMasks(reset_attention_mask=True, reset_position_ids=True),
            ValueError,
            "--reset-position-ids and --reset-attention-mask need the end-of-document id",
        ),
    ],
)
def test_bad_input_is_refused(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


# --- the configuration ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALL))
def test_a_flag_without_indexed_data_is_refused(name: str) -> None:
    flag = "--" + name.replace("_", "-")
    on: dict[str, Any] = {name: True}
    with pytest.raises(ValueError, match=rf"{name} \({flag}\) needs indexed data \(--data-path"):
        DataConfig(**on)
    with pytest.raises(ValueError, match=f"{name} must be a bool, got 'yes'"):
        DataConfig(data_path=["P"], **{**on, name: "yes"})


def test_sample_masks_take_the_tokenizers_eod() -> None:
    assert sample_masks(DataConfig(data_path=["P"])) == SampleMasks()
    masks = sample_masks(DataConfig(data_path=["P"], eod_mask_loss=True))
    assert masks == SampleMasks(eod_token=EodByteTokenizer.eod, eod_mask_loss=True)
    null = DataConfig(
        data_path=["P"], tokenizer_type="NullTokenizer", vocab_size=50, reset_position_ids=True
    )
    assert sample_masks(null) == SampleMasks(eod_token=50, reset_position_ids=True)


class _BrokenTokenizer(EodByteTokenizer):
    eod = 300


def test_an_eod_outside_the_vocabulary_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = _prefix(tmp_path, [[1, 2, 3, 256]] * 40)
    monkeypatch.setattr(builder_module, "build_tokenizer", lambda *args: _BrokenTokenizer())
    config = DataConfig(data_path=[prefix], split="1", reset_attention_mask=True)
    message = (
        r"--reset-attention-mask: the ByteTokenizer's end-of-document id 300 lies outside its "
        r"vocabulary 0 \.\. 256"
    )
    with pytest.raises(ValueError, match=message):
        check_data(config, seq_length=4, seed=1, train_valid_test_num_samples=(10, 0, 0))
    # Without a flag the EOD id is not used, so it is not asked for.
    check_data(DataConfig(data_path=[prefix], split="1"), seq_length=4, seed=1,
               train_valid_test_num_samples=(10, 0, 0))  # fmt: skip


# --- datasets and microbatches --------------------------------------------------------------


def _prefix(tmp_path: Path, documents: list[list[int]], name: str = "d") -> str:
    with IndexedDatasetBuilder(tmp_path / name) as builder:
        for tokens in documents:
            builder.add_document(tokens)
        builder.finalize()
    return str(tmp_path / name)


def _documents(count: int, seed: int) -> list[list[int]]:
    rng = numpy.random.default_rng(seed)
    return [[*rng.integers(0, 256, int(rng.integers(0, 12))).tolist(), 256] for _ in range(count)]


@pytest.mark.parametrize("flags", COMBINATIONS, ids=lambda f: "-".join(k for k in f if f[k]))
def test_a_datasets_samples_carry_the_fields(tmp_path: Path, flags: dict[str, Any]) -> None:
    prefix = _prefix(tmp_path, _documents(60, 0))
    config = DataConfig(data_path=[prefix], split="1", data_cache_path=str(tmp_path), **flags)
    train, _, _ = build_train_valid_test_datasets(
        config, seq_length=16, seed=5, train_valid_test_num_samples=(30, 0, 0)
    )
    assert isinstance(train, GPTDataset)
    for index in range(len(train)):
        sample, window = train[index], train.window(index)
        assert sample["tokens"].tolist() == window[:-1].tolist()
        assert sample["labels"].tolist() == window[1:].tolist()
        fields = {k: v.tolist() for k, v in sample.items() if k not in ("tokens", "labels")}
        assert fields == _by_hand(window[:-1].tolist(), 256, flags), index


def test_microbatches_stack_every_field_of_a_blend(tmp_path: Path) -> None:
    prefixes = [_prefix(tmp_path, _documents(50, seed), f"d{seed}") for seed in (1, 2)]
    config = DataConfig(
        data_path=[f"0.4 {prefixes[0]} 0.6 {prefixes[1]}"], split="1",
        data_cache_path=str(tmp_path), **ALL,
    )  # fmt: skip
    train, _, _ = build_train_valid_test_datasets(
        config, seq_length=12, seed=9, train_valid_test_num_samples=(40, 0, 0)
    )
    assert train is not None
    stream = microbatches(
        train, consumed_samples=4, micro_batch_size=3, data_parallel_rank=1, data_parallel_size=2
    )
    batch = next(stream)
    expected = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
                "position_ids": torch.int64, "document_ids": torch.int64}  # fmt: skip
    assert {key: value.dtype for key, value in batch.items()} == expected
    assert all(value.shape == (3, 12) for value in batch.values())
    for row, index in enumerate(range(7, 10)):  # rank 1 of 2 from sample 4: 7, 8, 9
        for key, value in train[index].items():
            assert torch.equal(batch[key][row], value), (index, key)
    again = ltor_masks_and_position_ids(batch["tokens"], eod_token=256, **ALL)
    assert all(torch.equal(batch[key], value) for key, value in again.items())


def test_a_gpt_dataset_without_masks_still_gives_megatrons_defaults(tmp_path: Path) -> None:
    indexed = IndexedDataset(_prefix(tmp_path, _documents(20, 3)))
    ids = numpy.arange(20, dtype=numpy.int32)
    dataset = GPTDataset(indexed, ids, num_samples=5, seq_length=8, seed=1, split_name="train")
    sample = dataset[0]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert sample["loss_mask"].tolist() == [1.0] * 8
    assert sample["position_ids"].tolist() == list(range(8))
