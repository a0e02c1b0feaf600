from __future__ import annotations

import itertools

import pytest
import torch

from pp_train.app.corpus import CorpusDataset, corpus_tokens, load_corpus, split_corpus
from pp_train.data import (
    ByteTokenizer,
    microbatches,
)


def _stream(size: int = 1000) -> torch.Tensor:
    return torch.arange(size, dtype=torch.int64)


def _take(
    dataset: CorpusDataset, count: int, *, consumed: int, mbs: int, rank: int = 0, dp: int = 1
) -> list[dict[str, torch.Tensor]]:
    iterator = microbatches(
        dataset,
        consumed_samples=consumed,
        micro_batch_size=mbs,
        data_parallel_rank=rank,
        data_parallel_size=dp,
    )
    return list(itertools.islice(iterator, count))


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


# --- corpus and tokenizer ------------------------------------------------------------------


def test_corpus_loads_and_is_ascii_text() -> None:
    corpus = load_corpus()
    assert 150_000 <= len(corpus) <= 300_000
    assert all(byte < 128 for byte in corpus)
    text = corpus.decode("ascii")
    assert text.count("\n") > 1000
    assert len(set(text.split())) > 100


def test_corpus_tokens() -> None:
    tokens = corpus_tokens()
    assert tokens.dtype == torch.int64
    assert tokens.dim() == 1
    assert bytes(tokens.tolist()) == load_corpus()


def test_tokenizer_round_trip() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.vocab_size == 256
    text = "Anna has a red cat. 3 + 4 = 7.\nZoe: Thank you, caf\u00e9!"
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert ids[:4] == [65, 110, 110, 97]
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(b"\x00\xff") == [0, 255]


def test_tokenizer_replaces_invalid_utf8_and_refuses_bad_ids() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([104, 0xFF, 105]) == "h\ufffdi"
    with pytest.raises(ValueError, match=r"token ids must lie in 0 \.\. 255; got \[256, -1\]"):
        tokenizer.decode([1, 256, -1])
    with pytest.raises(TypeError, match="text must be str or bytes"):
        tokenizer.encode(5)  # type: ignore[arg-type]


def test_split_corpus() -> None:
    tokens = _stream(1000)
    train, valid = split_corpus(tokens)
    assert train.numel() == 900
    assert valid.numel() == 100
    assert torch.equal(torch.cat([train, valid]), tokens)
    train, valid = split_corpus(tokens, valid_fraction=0.0)
    assert train.numel() == 1000
    assert valid.numel() == 0
    with pytest.raises(ValueError, match=r"valid_fraction must lie in \[0, 1\), got 1.0"):
        split_corpus(tokens, valid_fraction=1.0)
    with pytest.raises(ValueError, match="1-D int64"):
        split_corpus(tokens.view(10, 100))
    with pytest.raises(ValueError, match="1-D int64"):
        split_corpus(tokens.int())


# --- CorpusDataset ----------------------------------------------------------------------------


def test_samples_are_shifted_windows() -> None:
    tokens = _stream(101)
    dataset = CorpusDataset(tokens, seq_length=10, seed=0)
    assert dataset.samples_per_epoch == 10
    starts = sorted(dataset.window_start(i) for i in range(10))
    assert starts == list(range(0, 100, 10))
    for index in range(10):
        sample = dataset[index]
        start = dataset.window_start(index)
        assert sample["tokens"].dtype == torch.int64
        assert torch.equal(sample["tokens"], tokens[start : start + 10])
        assert torch.equal(sample["labels"], tokens[start + 1 : start + 11])


def test_samples_per_epoch_needs_the_label_token() -> None:
    assert CorpusDataset(_stream(100), seq_length=10, seed=0).samples_per_epoch == 9
    assert CorpusDataset(_stream(11), seq_length=10, seed=0).samples_per_epoch == 1


def test_dataset_is_deterministic_and_depends_on_the_seed() -> None:
    a = CorpusDataset(_stream(), seq_length=8, seed=3)
    b = CorpusDataset(_stream(), seq_length=8, seed=3)
    c = CorpusDataset(_stream(), seq_length=8, seed=4)
    order_a = [a.window_start(i) for i in range(a.samples_per_epoch)]
    # Reading backwards must not change what an index means.
    order_b = [b.window_start(i) for i in reversed(range(b.samples_per_epoch))][::-1]
    order_c = [c.window_start(i) for i in range(c.samples_per_epoch)]
    assert order_a == order_b
    assert order_a != order_c
    assert order_a != sorted(order_a)


def test_epochs_wrap_and_reshuffle() -> None:
    dataset = CorpusDataset(_stream(), seq_length=8, seed=3)
    n = dataset.samples_per_epoch
    epochs = [[dataset.window_start(e * n + i) for i in range(n)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(0, 8 * n, 8))
    assert epochs[0] != epochs[1]
    assert epochs[1] != epochs[2]
    # Epoch e is shuffled with seed + e.
    shifted = CorpusDataset(_stream(), seq_length=8, seed=4)
    assert epochs[1] == [shifted.window_start(i) for i in range(n)]


def test_dataset_errors() -> None:
    with pytest.raises(ValueError, match=r"holds 10 tokens, fewer than the seq_length \+ 1 = 11"):
        CorpusDataset(_stream(10), seq_length=10, seed=0)
    with pytest.raises(ValueError, match="seq_length must be 1 or more, got 0"):
        CorpusDataset(_stream(), seq_length=0, seed=0)
    with pytest.raises(ValueError, match="seed must be 0 or more, got -1"):
        CorpusDataset(_stream(), seq_length=4, seed=-1)
    with pytest.raises(TypeError, match=r"tokens must be a torch\.Tensor"):
        CorpusDataset(list(range(100)), seq_length=4, seed=0)  # type: ignore[arg-type]
    dataset = CorpusDataset(_stream(), seq_length=4, seed=0)
    with pytest.raises(IndexError, match="sample index must be 0 or more, got -1"):
        dataset[-1]


# --- microbatches --------------------------------------------------------------------------


def test_microbatches_stack_consecutive_samples() -> None:
    dataset = CorpusDataset(_stream(), seq_length=8, seed=1)
    first, second = _take(dataset, 2, consumed=0, mbs=3)
    assert first["tokens"].shape == (3, 8)
    assert first["labels"].shape == (3, 8)
    for row in range(3):
        assert torch.equal(first["tokens"][row], dataset[row]["tokens"])
        assert torch.equal(second["labels"][row], dataset[3 + row]["labels"])


@pytest.mark.parametrize(("mbs", "dp"), [(1, 1), (2, 1), (2, 2), (1, 4), (3, 2)])
def test_resume_continues_the_unbroken_run(mbs: int, dp: int) -> None:
    dataset = CorpusDataset(_stream(), seq_length=8, seed=5)
    steps = 40  # crosses epochs: 124 samples per epoch
    for rank in range(dp):
        unbroken = _take(dataset, steps, consumed=0, mbs=mbs, rank=rank, dp=dp)
        for k in (1, 7, 25):
            resumed = _take(dataset, steps - k, consumed=k * mbs * dp, mbs=mbs, rank=rank, dp=dp)
            assert _same(resumed, unbroken[k:])


@pytest.mark.parametrize(("mbs", "dp"), [(1, 2), (2, 2), (2, 4), (3, 3)])
def test_data_parallel_ranks_partition_the_global_batch(mbs: int, dp: int) -> None:
    dataset = CorpusDataset(_stream(), seq_length=8, seed=5)
    consumed = 17
    steps = 30
    per_rank = [_take(dataset, steps, consumed=consumed, mbs=mbs, rank=r, dp=dp) for r in range(dp)]
    global_batches = _take(dataset, steps, consumed=consumed, mbs=mbs * dp)
    for step in range(steps):
        for key in ("tokens", "labels"):
            joined = torch.cat([per_rank[r][step][key] for r in range(dp)])
            assert torch.equal(joined, global_batches[step][key])


def test_microbatches_wrap_into_the_next_epoch() -> None:
    dataset = CorpusDataset(_stream(81), seq_length=8, seed=2)
    assert dataset.samples_per_epoch == 10
    batches = _take(dataset, 7, consumed=0, mbs=3)
    starts = [int(b["tokens"][row, 0]) for b in batches for row in range(3)]
    assert sorted(starts[:10]) == list(range(0, 80, 8))
    assert sorted(starts[10:20]) == list(range(0, 80, 8))
    assert starts[:10] != starts[10:20]


def test_microbatch_errors() -> None:
    dataset = CorpusDataset(_stream(), seq_length=8, seed=0)
    with pytest.raises(
        ValueError,
        match=r"data_parallel_rank 2 is out of range for data-parallel size 2; valid: 0 \.\. 1",
    ):
        _take(dataset, 1, consumed=0, mbs=1, rank=2, dp=2)
    with pytest.raises(ValueError, match="micro_batch_size must be 1 or more, got 0"):
        _take(dataset, 1, consumed=0, mbs=0)
    with pytest.raises(ValueError, match="data_parallel_size must be 1 or more, got 0"):
        _take(dataset, 1, consumed=0, mbs=1, rank=0, dp=0)
    with pytest.raises(ValueError, match="consumed_samples must be 0 or more, got -3"):
        _take(dataset, 1, consumed=-3, mbs=1)
    with pytest.raises(TypeError, match="consumed_samples must be an int"):
        _take(dataset, 1, consumed=1.0, mbs=1)  # type: ignore[arg-type]
    # The errors come at the call, not at the first next().
    with pytest.raises(ValueError, match="micro_batch_size"):
        microbatches(
            dataset,
            consumed_samples=0,
            micro_batch_size=0,
            data_parallel_rank=0,
            data_parallel_size=1,
        )
