"""Megatron's GPT dataset: fixed-length windows over shuffled documents, sample for sample.

A split's sequences (Megatron calls them documents here) are repeated for as many epochs as
the requested samples need and shuffled (the document index). Their tokens, read in that
order, are one long stream; sample ``k`` is the ``seq_length + 1`` tokens from position
``k * seq_length`` (the sample index records where each starts), and samples are visited in a
shuffled order (the shuffle index). All randomness comes from one
``numpy.random.RandomState(seed)``, drawn in Megatron's order, so the samples equal
megatron-core's ``GPTDataset``'s token for token.

When the last epoch would give fewer than 80% of an epoch's samples, it is shuffled apart
from the others (documents and samples), as in Megatron, so the few samples drawn from it are
not spread over the whole run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import numpy.typing as npt
import torch

from pp_state.numbers import check_int
from pp_train.data.cache import cached_or_built
from pp_train.data.indexed import IndexedDataset
from pp_train.data.masks import SampleMasks
from pp_train.data.sampler import Microbatch

__all__ = [
    "GPTDataset",
    "GPTIndices",
    "build_document_index",
    "build_gpt_indices",
    "build_sample_index",
    "build_shuffle_index",
    "num_epochs",
    "sample_of_window",
]

GPTIndices = tuple[npt.NDArray[numpy.int32], npt.NDArray[Any], npt.NDArray[Any]]
"""The document index, the sample index and the shuffle index."""

_SEPARATE_FINAL_EPOCH_BELOW = 0.80
_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


def num_epochs(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Epochs needed for `num_samples` windows of ``seq_length + 1`` tokens (1 for None)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(
    documents: npt.NDArray[Any],
    epochs: int,
    rng: numpy.random.RandomState,
    separate_final_epoch: bool,
) -> npt.NDArray[numpy.int32]:
    """`documents` repeated `epochs` times and shuffled (the last epoch apart if asked)."""
    if separate_final_epoch and epochs > 1:
        first = build_document_index(documents, epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return numpy.concatenate((first, last))
    index = numpy.tile(numpy.asarray(documents), epochs).astype(numpy.int32)
    rng.shuffle(index)
    return index


def build_sample_index(
    sequence_lengths: npt.NDArray[Any],
    document_index: npt.NDArray[numpy.int32],
    seq_length: int,
    tokens_per_epoch: int,
    epochs: int,
) -> npt.NDArray[Any]:
    """Where each sample starts: rows ``(position in document_index, token offset)``.

    Row ``k`` locates stream position ``k * seq_length``, the first token of sample ``k``
    and the last of sample ``k - 1``; there is one row more than samples. Row 0 is always
    ``(0, 0)``.
    """
    samples = (epochs * tokens_per_epoch - 1) // seq_length
    lengths = numpy.asarray(sequence_lengths)[document_index].astype(numpy.int64)
    ends = numpy.cumsum(lengths)
    positions = numpy.arange(samples + 1, dtype=numpy.int64) * seq_length
    # The document holding a position is the first whose end lies beyond it: empty documents
    # never hold one.
    where = numpy.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[where] - lengths[where])
    where[0], offsets[0] = 0, 0
    limit = max(document_index.shape[0], int(numpy.max(sequence_lengths, initial=0)))
    dtype = numpy.int32 if limit <= numpy.iinfo(numpy.int32).max else numpy.int64
    return numpy.stack((where, offsets), axis=1).astype(dtype)


def build_shuffle_index(
    num_samples: int, total_size: int, rng: numpy.random.RandomState
) -> npt.NDArray[Any]:
    """``0 .. total_size - 1`` with ``[0, num_samples)`` and the rest each shuffled."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return numpy.concatenate((first, last))


def build_gpt_indices(
    sequence_lengths: npt.NDArray[Any],
    documents: npt.NDArray[Any],
    *,
    num_samples: int | None,
    seq_length: int,
    seed: int,
) -> GPTIndices:
    """Megatron's three GPT indices for the split holding `documents` (sequence ids).

    Args:
        sequence_lengths: Every sequence's length in the indexed dataset.
        documents: The split's sequence ids.
        num_samples: Samples wanted (None: one epoch's).
        seq_length: Tokens per sample (each window holds one more).
        seed: Seeds the one random state all shuffles draw from.

    Returns:
        The document index, the sample index and the shuffle index.

    Raises:
        TypeError: `seq_length` or `num_samples` is not an int.
        ValueError: The split holds no tokens, `seq_length` is below 1 or `num_samples`
            below 0.
    """
    _check_sizes(seq_length, num_samples)
    tokens_per_epoch = int(numpy.asarray(sequence_lengths)[documents].sum(dtype=numpy.int64))
    if tokens_per_epoch == 0:
        raise ValueError(f"the split's {len(documents)} sequences hold no tokens")
    epochs = num_epochs(tokens_per_epoch, num_samples, seq_length)
    separate, before_final = False, 0
    if epochs > 1:
        assert num_samples is not None
        before_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = num_samples - before_final < int(_SEPARATE_FINAL_EPOCH_BELOW * per_epoch)
    rng = numpy.random.RandomState(seed)
    document_index = build_document_index(documents, epochs, rng, separate)
    sample_index = build_sample_index(
        sequence_lengths, document_index, seq_length, tokens_per_epoch, epochs
    )
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(before_final if separate else total, total, rng)
    return document_index, sample_index, shuffle_index


def _check_sizes(seq_length: int, num_samples: int | None) -> None:
    check_int("seq_length", seq_length, 1)
    if num_samples is not None:
        check_int("num_samples", num_samples, 0)


def sample_of_window(
    window: npt.NDArray[numpy.int64], masks: SampleMasks | None = None
) -> Microbatch:
    """A window's tokens as ``tokens`` (all but the last) and ``labels`` (all but the first).

    With `masks`, the sample also holds the fields they make of ``tokens`` (``loss_mask``,
    ``position_ids``, and ``document_ids`` with ``reset_attention_mask``).
    """
    tensor = torch.from_numpy(window)
    sample = {"tokens": tensor[:-1], "labels": tensor[1:]}
    if masks is not None:
        sample.update(masks(sample["tokens"]))
    return sample


class GPTDataset:
    """Samples of one split of one indexed dataset, as megatron-core's ``GPTDataset``.

    ``dataset[i]`` is ``{"tokens": [seq_length], "labels": [seq_length]}`` (int64), the
    ``seq_length + 1`` tokens of window ``i`` without its last and without its first token,
    with Megatron's ``loss_mask`` (float32) and ``position_ids`` (int64), and
    ``document_ids`` (int64) with ``reset_attention_mask`` (see `SampleMasks`).

    Args:
        indexed: The indexed dataset.
        documents: This split's sequence ids.
        num_samples: Samples wanted (None: one epoch's); there may be more.
        seq_length: Tokens per sample.
        seed: The random seed.
        split_name: ``train``, ``valid`` or ``test``.
        cache_dir: Where the indices are cached (None: not cached).
        identifiers: What else identifies the indices in the cache (the split, ...).
        masks: Megatron's ``--reset-position-ids``, ``--reset-attention-mask``,
            ``--eod-mask-loss`` and the EOD id (None: no flag; the indices do not depend on
            them).

    Raises:
        TypeError: `seq_length` or `num_samples` is not an int.
        ValueError: `seq_length` is below 1, `num_samples` below 0, or the split holds no
            tokens.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: npt.NDArray[numpy.int32],
        *,
        num_samples: int | None,
        seq_length: int,
        seed: int,
        split_name: str,
        cache_dir: Path | None = None,
        identifiers: dict[str, Any] | None = None,
        masks: SampleMasks | None = None,
    ) -> None:
        _check_sizes(seq_length, num_samples)
        self.indexed = indexed
        self.masks = SampleMasks() if masks is None else masks
        self.seq_length = seq_length
        self.split_name = split_name
        self.num_samples = num_samples

        def build() -> list[Any]:
            lengths = indexed.sequence_lengths
            return list(
                build_gpt_indices(
                    lengths, documents, num_samples=num_samples, seq_length=seq_length, seed=seed
                )
            )

        key = {
            "class": "GPTDataset",
            "dataset_path": indexed.path_prefix,
            "num_samples": num_samples,
            "index_split": split_name,
            "random_seed": seed,
            "sequence_length": seq_length,
            "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [],
            "indexed": [len(indexed), indexed.num_documents, int(indexed.sequence_lengths.sum())],
            **(identifiers or {}),
        }
        arrays = cached_or_built(cache_dir, f"GPTDataset-{split_name}", _INDEX_NAMES, key, build)
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def __len__(self) -> int:
        """The number of samples."""
        return int(self.sample_index.shape[0]) - 1

    def host_bytes(self) -> int:
        """Host memory its indices hold (the tokens are read from a memory-mapped file)."""
        return sum(
            int(a.nbytes) for a in (self.document_index, self.sample_index, self.shuffle_index)
        )

    def window(self, index: int) -> npt.NDArray[numpy.int64]:
        """Sample `index`'s ``seq_length + 1`` tokens."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {len(self)} samples")
        position = int(self.shuffle_index[index])
        (first, start), (last, end) = (
            (int(a), int(b)) for a, b in self.sample_index[position : position + 2]
        )
        parts = []
        for i in range(first, last + 1):
            offset = start if i == first else 0
            length = end + 1 - offset if i == last else None
            parts.append(self.indexed.get(int(self.document_index[i]), offset, length))
        tokens = numpy.concatenate(parts).astype(numpy.int64)
        assert tokens.shape == (self.seq_length + 1,), tokens.shape
        return tokens

    def __getitem__(self, index: int) -> Microbatch:
        """Sample `index`: ``tokens``, ``labels`` and the fields of `masks`."""
        return sample_of_window(self.window(index), self.masks)
