"""Train, valid and test datasets from a `DataConfig`, as Megatron's dataset builder makes them.

Each prefix's sequences are cut by ``split`` into three contiguous ranges (fraction bounds
times the number of sequences, rounded half to even). One prefix without a weight gives a
`GPTDataset` per split with the requested number of samples. Several prefixes, or any weight,
give a `BlendedDataset` per split: with weights, each dataset is built for its share of the
samples (rounded up) plus ``mid_level_dataset_surplus`` and the blend holds the sum of the
shares; without, each dataset gives one epoch, weighs its number of samples, and the blend
holds the requested count (at most all of them).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy
import numpy.typing as npt

from pp_train.data.blended_dataset import BlendedDataset
from pp_train.data.config import DataConfig, normalize, parse_split
from pp_train.data.gpt_dataset import GPTDataset
from pp_train.data.indexed import IndexedDataset
from pp_train.data.masks import SampleMasks
from pp_train.data.tokenizer import build_tokenizer

__all__ = [
    "SPLIT_NAMES",
    "TokenDataset",
    "build_train_valid_test_datasets",
    "check_data",
    "sample_masks",
    "split_matrix",
    "split_sequences",
]

SPLIT_NAMES = ("train", "valid", "test")
"""The three splits, in `split`'s order."""

TokenDataset = GPTDataset | BlendedDataset
"""A split's dataset: ``dataset[i]`` is ``{"tokens", "labels", "loss_mask", "position_ids"}``
(and ``"document_ids"`` with ``reset_attention_mask``), ``dataset.window(i)`` the
``seq_length + 1`` tokens, ``len(dataset)`` the number of samples."""

Splits = tuple[TokenDataset | None, TokenDataset | None, TokenDataset | None]


def split_matrix(fractions: list[float]) -> list[tuple[float, float] | None]:
    """Each split's ``(start, end)`` fraction bounds, or None for an empty share."""
    bounds = [0.0]
    for fraction in fractions:
        bounds.append(bounds[-1] + fraction)
    return [(a, b) if b > a else None for a, b in itertools.pairwise(bounds)]


def split_sequences(bounds: tuple[float, float], count: int) -> npt.NDArray[numpy.int32]:
    """The sequence ids between fraction `bounds` of `count` sequences."""
    start, end = (round(bound * float(count)) for bound in bounds)
    return numpy.arange(start, end, dtype=numpy.int32)


def _check_min_int(name: str, value: object, minimum: int) -> None:
    """Checks that `value` is an int (not a bool) of at least `minimum`.

    Not `pp_state.numbers.check_int`: the dataset builder's messages read "NAME must be an int
    >= MINIMUM" and raise ValueError for a wrong type too, and tests pin that wording.

    Raises:
        ValueError: `value` is not an int, or is below `minimum`.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_arguments(seq_length: int, seed: int, counts: tuple[int, int, int]) -> None:
    _check_min_int("seq_length", seq_length, 1)
    _check_min_int("seed", seed, 0)
    if seed >= 2**32:
        raise ValueError(f"seed must be below 2**32 (numpy's RandomState), got {seed}")
    if not isinstance(counts, tuple) or len(counts) != 3:
        raise ValueError(f"train_valid_test_num_samples must be 3 ints, got {counts!r}")
    for name, count in zip(SPLIT_NAMES, counts, strict=True):
        _check_min_int(f"{name} samples", count, 0)


def sample_masks(config: DataConfig) -> SampleMasks:
    """The masks `config`'s packed-document flags ask for, with its tokenizer's EOD id.

    The tokenizer is built only when a flag is set (without one the EOD id is not used).

    Raises:
        ValueError: The tokenizer cannot be built or has no end-of-document id, or that id
            lies outside its vocabulary.
        ImportError: ``HuggingFaceTokenizer`` without the ``tokenizers`` library.
    """
    flags = config.packing
    if not any(flags.values()):
        return SampleMasks()
    tokenizer = build_tokenizer(config.tokenizer_type, config.tokenizer_model, config.vocab_size)
    eod, vocab_size = tokenizer.eod, tokenizer.vocab_size
    if isinstance(eod, bool) or not isinstance(eod, int) or not 0 <= eod < vocab_size:
        named = " ".join("--" + name.replace("_", "-") for name, on in flags.items() if on)
        raise ValueError(
            f"{named}: the {config.tokenizer_type}'s end-of-document id {eod!r} lies outside "
            f"its vocabulary 0 .. {vocab_size - 1}; these flags need an EOD id the data holds"
        )
    return SampleMasks(eod_token=eod, **flags)


def check_data(
    config: DataConfig,
    *,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: tuple[int, int, int],
) -> list[IndexedDataset]:
    """Everything `build_train_valid_test_datasets` can check without building indices.

    Opens every prefix (both files there, header, version, token type, sizes), checks that
    each split with a share holds tokens in every dataset, and, with a packed-document flag,
    the tokenizer's EOD id (`sample_masks`). Quick: call it before any process group starts.

    Returns:
        The opened datasets, in `config.data_path`'s order.

    Raises:
        ValueError: A bad argument or file; the message names the value or file.
    """
    _check_arguments(seq_length, seed, train_valid_test_num_samples)
    blend = config.blend
    if blend is None:
        raise ValueError("data_path is None: name a dataset prefix (--data-path)")
    matrix = split_matrix(parse_split(config.split))
    opened = [IndexedDataset(prefix) for prefix in blend[0]]
    tokens: dict[tuple[str, str], int] = {}
    for indexed in opened:
        for name, bounds in zip(SPLIT_NAMES, matrix, strict=True):
            if bounds is None:
                continue
            ids = split_sequences(bounds, len(indexed))
            tokens[indexed.path_prefix, name] = int(
                indexed.sequence_lengths[ids].sum(dtype=numpy.int64)
            )
            if tokens[indexed.path_prefix, name] == 0:
                raise ValueError(
                    f"{indexed.path_prefix}: the {name} split ({bounds[1] - bounds[0]:.2%} of "
                    f"{len(indexed)} sequences: {ids.size}) holds no tokens; give {name} a "
                    f"larger share in split {config.split!r}, or 0, or use more documents"
                )
    if len(opened) > 1 and blend[1] is None:
        _check_one_epoch_holds_a_sample(tokens, seq_length)
    sample_masks(config)
    return opened


def _check_one_epoch_holds_a_sample(tokens: dict[tuple[str, str], int], seq_length: int) -> None:
    """Unweighted blends take one epoch of each split: it must hold ``seq_length + 1`` tokens.

    (A single prefix or a weighted blend repeats its documents for as many epochs as the
    samples need, as Megatron does, so any ``seq_length`` works there.)
    """
    (prefix, name), least = min(tokens.items(), key=lambda item: item[1])
    if seq_length >= least:
        raise ValueError(
            f"--seq-length {seq_length} is longer than the {name} split of {prefix} allows: it "
            f"holds {least} tokens and a sample needs --seq-length + 1, and a blend without "
            f"weights takes one epoch of each dataset; use --seq-length {least - 1} or less, "
            "or give weights in --data-path"
        )


def _cache_dir(config: DataConfig, indexed: IndexedDataset) -> Path:
    if config.data_cache_path is not None:
        return Path(config.data_cache_path)
    return Path(indexed.path_prefix) / "cache" / "GPTDataset_indices"


def _gpt_splits(
    indexed: IndexedDataset,
    config: DataConfig,
    counts: list[int | None],
    *,
    seq_length: int,
    seed: int,
    masks: SampleMasks,
) -> list[GPTDataset | None]:
    matrix = split_matrix(parse_split(config.split))
    return [
        None
        if bounds is None
        else GPTDataset(
            indexed,
            split_sequences(bounds, len(indexed)),
            num_samples=count,
            seq_length=seq_length,
            seed=seed,
            split_name=name,
            cache_dir=_cache_dir(config, indexed),
            masks=masks,
        )
        for name, bounds, count in zip(SPLIT_NAMES, matrix, counts, strict=True)
    ]


def build_train_valid_test_datasets(
    config: DataConfig,
    *,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: tuple[int, int, int],
) -> Splits:
    """The train, valid and test datasets megatron-core's builder makes for the same numbers.

    Their samples equal megatron-core's ``GPTDataset`` / ``BlendedDataset`` samples token for
    token (``tokens`` and ``labels`` from each ``seq_length + 1`` window, ``loss_mask`` and
    ``position_ids``; ``document_ids`` with ``reset_attention_mask`` hold its attention
    mask). The indices are cached (see `DataConfig.data_cache_path`); every process builds or
    reads them itself and cache files are written atomically, so concurrent builders are
    safe, but with many ranks it is cheaper to let one rank build first.

    Args:
        config: The data.
        seq_length: Tokens per sample.
        seed: Megatron's ``--seed``.
        train_valid_test_num_samples: Samples wanted per split (each may get more).

    Returns:
        The three datasets; None for a split whose share in ``config.split`` is 0.

    Raises:
        ValueError: A bad argument, file or split (see `check_data`), or a blend that needs
            more samples of a dataset than it has.
    """
    opened = check_data(
        config,
        seq_length=seq_length,
        seed=seed,
        train_valid_test_num_samples=train_valid_test_num_samples,
    )
    prefixes, weights = config.blend or ([], None)
    sizes = list(train_valid_test_num_samples)
    masks = sample_masks(config)
    if len(prefixes) == 1 and weights is None:
        single = _gpt_splits(
            opened[0], config, list(sizes), seq_length=seq_length, seed=seed, masks=masks
        )
        return single[0], single[1], single[2]
    surplus = 1 + config.mid_level_dataset_surplus
    shares = [[math.ceil(size * w) for size in sizes] for w in normalize(weights or [1.0])]
    counts: list[list[int | None]] = [[None] * 3 for _ in prefixes]
    if weights is not None:
        counts = [[math.ceil(share * surplus) for share in row] for row in shares]
    mids = [
        _gpt_splits(indexed, config, row, seq_length=seq_length, seed=seed, masks=masks)
        for indexed, row in zip(opened, counts, strict=True)
    ]
    blends: list[TokenDataset | None] = []
    for i in range(3):
        parts = [splits[i] for splits in mids]
        blends.append(_blend(parts, weights, [row[i] for row in shares], sizes[i], config))
    return blends[0], blends[1], blends[2]


def _blend(
    parts: list[GPTDataset | None],
    weights: list[float] | None,
    shares: list[int],
    size: int,
    config: DataConfig,
) -> BlendedDataset | None:
    datasets = [part for part in parts if part is not None]
    if not datasets:
        return None
    cache = None if config.data_cache_path is None else Path(config.data_cache_path)
    if weights is not None:
        total = sum(shares)
        return BlendedDataset(datasets, normalize(weights), total, cache_dir=cache)
    lengths = [len(d) for d in datasets]
    for dataset, length in zip(datasets, lengths, strict=True):
        if length == 0:
            raise ValueError(
                f"{dataset.indexed.path_prefix}: the {dataset.split_name} split gives no "
                "samples, so it cannot be weighed by its size; give weights in data_path"
            )
    return BlendedDataset(datasets, lengths, min(size, sum(lengths)), cache_dir=cache)
