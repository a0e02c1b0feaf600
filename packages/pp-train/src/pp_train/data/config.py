"""What data to train on, in Megatron's terms: ``--data-path``, ``--split``, the tokenizer."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy

from pp_train.data.tokenizer import TOKENIZER_TYPES

__all__ = [
    "PACKING_FLAGS",
    "Blend",
    "DataConfig",
    "normalize",
    "parse_data_path",
    "parse_split",
]

PACKING_FLAGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
"""`DataConfig`'s fields for packed documents, Megatron's flags of the same names."""

Blend = tuple[list[str], list[float] | None]
"""Dataset prefixes and their weights (None: weigh each by its number of samples)."""


def normalize(weights: Sequence[float]) -> list[float]:
    """`weights` divided by their sum, computed as Megatron does (float64, then floats)."""
    array = numpy.asarray(weights, dtype=numpy.float64)
    return [float(w) for w in (array / numpy.sum(array)).tolist()]


def parse_data_path(data_path: Sequence[str]) -> Blend:
    """Megatron's ``--data-path`` forms: ``P``, ``P1 P2 ...`` or ``W1 P1 W2 P2 ...``.

    Each item may itself hold several whitespace-separated words (``"0.3 A 0.7 B"``). An even
    number of words whose every other word, from the first, is a number is a weighted blend;
    anything else is a list of prefixes.

    Args:
        data_path: The words.

    Returns:
        The prefixes and their weights (None when no weights were given).

    Raises:
        ValueError: No prefix, numbers mixed with prefixes in weight positions, or a weight
            that is not positive.
    """
    words = [word for item in data_path for word in str(item).split()]
    if not words:
        raise ValueError("data_path names no dataset; give a prefix or 'W1 P1 W2 P2 ...'")
    if len(words) % 2 == 1:
        return words, None
    weights: list[float | None] = []
    for word in words[::2]:
        try:
            weights.append(float(word))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return words, None
    if any(w is None for w in weights):
        raise ValueError(
            f"data_path {' '.join(words)!r} mixes weights and prefixes; give 'W1 P1 W2 P2 ...' "
            "(a number before each prefix) or prefixes alone"
        )
    numbers = [w for w in weights if w is not None]
    for weight, prefix in zip(numbers, words[1::2], strict=True):
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"data_path weight {weight} of {prefix} must be a positive number")
    return words[1::2], numbers


def parse_split(split: str) -> list[float]:
    """Megatron's ``--split``: up to three weights for train, valid and test, normalized.

    Args:
        split: Comma- (or slash-) separated non-negative numbers, such as ``"969,30,1"``;
            missing ones are 0.

    Returns:
        The three fractions, summing to 1.

    Raises:
        ValueError: Not 1 to 3 numbers, a negative number, or all zero.
    """
    parts = [part.strip() for part in str(split).replace("/", ",").split(",")]
    try:
        numbers = [float(part) for part in parts]
    except ValueError:
        numbers = []
    if not 1 <= len(numbers) <= 3 or not all(math.isfinite(n) and n >= 0 for n in numbers):
        raise ValueError(
            f"split {split!r} must be 1 to 3 non-negative numbers for train, valid and test, "
            "such as '969,30,1' or '90,10,0'"
        )
    if sum(numbers) <= 0:
        raise ValueError(f"split {split!r} adds up to 0; give train, valid or test a share")
    return normalize(numbers + [0.0] * (3 - len(numbers)))


def _check_optional_int(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Which indexed datasets to read and how to cut them, named after Megatron's flags."""

    data_path: list[str] | None = None
    """Megatron's ``--data-path``: one prefix (``P`` for ``P.bin`` / ``P.idx``), several
    prefixes, or a weighted blend ``["0.3", "A", "0.7", "B"]`` (an item may hold several
    words: ``["0.3 A 0.7 B"]``). None: no data (the command then uses its own corpus)."""

    split: str = "969,30,1"
    """Megatron's ``--split``: train, valid and test weights over each dataset's sequences."""

    data_cache_path: str | None = None
    """Megatron's ``--data-cache-path``: where the sample indices are cached (None: beside
    each dataset, in ``P/cache/GPTDataset_indices``); blends are cached only here."""

    mid_level_dataset_surplus: float = 0.005
    """Megatron's ``--mid-level-dataset-surplus``: in a weighted blend each dataset builds this
    fraction more samples than its share, so the blend never runs past its end."""

    tokenizer_type: str = "ByteTokenizer"
    """Megatron's ``--tokenizer-type``: ``ByteTokenizer``, ``NullTokenizer`` or
    ``HuggingFaceTokenizer`` (see `build_tokenizer`)."""

    tokenizer_model: str | None = None
    """Megatron's ``--tokenizer-model``: HuggingFaceTokenizer's ``tokenizer.json`` or its
    directory."""

    vocab_size: int | None = None
    """Megatron's ``--vocab-size``: NullTokenizer's number of ids in the data."""

    reset_position_ids: bool = False
    """Megatron's ``--reset-position-ids``: position ids restart at 0 after each
    end-of-document token (each sample's ``position_ids``). Needs --data-path."""

    reset_attention_mask: bool = False
    """Megatron's ``--reset-attention-mask``: no token attends to an earlier document of its
    sample (each sample gets ``document_ids``). Needs --data-path."""

    eod_mask_loss: bool = False
    """Megatron's ``--eod-mask-loss``: no loss where the input token is end-of-document (0 in
    each sample's ``loss_mask``). Needs --data-path."""

    def __post_init__(self) -> None:
        """Checks every field.

        Raises:
            ValueError: A field's value is invalid; the message names it and what is valid.
        """
        data_path: object = self.data_path
        if data_path is not None:
            if not isinstance(data_path, list) or not all(isinstance(w, str) for w in data_path):
                raise ValueError(f"data_path must be a list of strings or None, got {data_path!r}")
            parse_data_path(data_path)
        parse_split(self.split)
        surplus = self.mid_level_dataset_surplus
        if isinstance(surplus, bool) or not isinstance(surplus, (int, float)) or surplus < 0:
            raise ValueError(f"mid_level_dataset_surplus must be >= 0, got {surplus!r}")
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(
                f"tokenizer_type {self.tokenizer_type!r} is unknown; valid: "
                f"{', '.join(TOKENIZER_TYPES)}"
            )
        hf, null = (
            self.tokenizer_type == "HuggingFaceTokenizer",
            self.tokenizer_type == "NullTokenizer",
        )
        if hf and self.tokenizer_model is None:
            raise ValueError(
                "tokenizer_type HuggingFaceTokenizer needs tokenizer_model (--tokenizer-model "
                "PATH: a tokenizer.json or its directory)"
            )
        if not hf and self.tokenizer_model is not None:
            raise ValueError(
                f"tokenizer_model {self.tokenizer_model!r} goes with HuggingFaceTokenizer only "
                f"(tokenizer_type is {self.tokenizer_type})"
            )
        _check_optional_int("vocab_size", self.vocab_size)
        self._check_packing()
        if null and self.vocab_size is None:
            raise ValueError(
                "tokenizer_type NullTokenizer needs vocab_size (--vocab-size N: the number of "
                "token ids in the data)"
            )
        if not null and self.vocab_size is not None:
            raise ValueError(
                f"vocab_size {self.vocab_size!r} goes with NullTokenizer only (tokenizer_type "
                f"is {self.tokenizer_type})"
            )

    def _check_packing(self) -> None:
        """The three packed-document flags are bools and come with indexed data."""
        for name in PACKING_FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
            if value and self.data_path is None:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{name} ({flag}) needs indexed data (--data-path P): it works on the "
                    "end-of-document tokens of preprocessed documents (--append-eod), and the "
                    "bundled byte corpus has none"
                )

    @property
    def packing(self) -> dict[str, bool]:
        """The packed-document flags by name (``reset_position_ids``, ...)."""
        return {name: bool(getattr(self, name)) for name in PACKING_FLAGS}

    @property
    def blend(self) -> Blend | None:
        """`data_path` as prefixes and weights (None without data)."""
        return None if self.data_path is None else parse_data_path(self.data_path)
