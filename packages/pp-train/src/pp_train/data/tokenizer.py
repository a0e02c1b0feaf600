"""Tokenizers for preprocessing and reading data, named after Megatron's ``--tokenizer-type``.

Every tokenizer `build_tokenizer` returns has ``vocab_size``, ``eod`` (the end-of-document id
``--append-eod`` adds), ``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``:

- ``ByteTokenizer`` (the default, no files needed): the UTF-8 bytes 0 .. 255 plus one
  end-of-document id, 256, so ``vocab_size`` is 257. The extra id follows Megatron's
  ``NullTokenizer`` (EOD is the id after the data's own) and keeps EOD apart from every byte,
  so a NUL byte in the text is never read as a document boundary.
- ``NullTokenizer`` with ``vocab_size`` N: the text is already token ids, separated by
  whitespace, each in 0 .. N - 1; EOD is N and ``vocab_size`` is N + 1, as in Megatron.
- ``HuggingFaceTokenizer`` with ``tokenizer_model``: a local ``tokenizer.json`` (or a
  directory holding one) through the ``tokenizers`` library (``pip install "pp-train[hf]"``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "TOKENIZER_TYPES",
    "ByteTokenizer",
    "EodByteTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "Tokenizer",
    "build_tokenizer",
]

TOKENIZER_TYPES = ("ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer")
"""The ``tokenizer_type`` values `build_tokenizer` accepts."""


class Tokenizer(Protocol):
    """What preprocessing and the data viewer need of a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of ids, EOD included; every id lies in ``0 .. vocab_size - 1``."""

    @property
    def eod(self) -> int:
        """The end-of-document id."""

    def tokenize(self, text: str) -> list[int]:
        """The ids of `text`."""

    def detokenize(self, ids: list[int]) -> str:
        """The text of `ids`."""


def _check_ids(ids: list[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(
            f"token ids must lie in 0 .. {vocab_size - 1}; got {bad[:5]}"
            f"{' ...' if len(bad) > 5 else ''}"
        )


class ByteTokenizer:
    """Tokens are the bytes of the UTF-8 text: a vocabulary of 256 and nothing to learn."""

    vocab_size: int = 256
    """Number of distinct tokens."""

    def encode(self, text: str | bytes) -> list[int]:
        """Token ids of `text`.

        Args:
            text: A string (encoded as UTF-8) or raw bytes.

        Returns:
            One id in ``0 .. 255`` per byte.

        Raises:
            TypeError: `text` is neither str nor bytes.
        """
        if isinstance(text, str):
            return list(text.encode("utf-8"))
        if isinstance(text, (bytes, bytearray)):
            return list(text)
        raise TypeError(f"text must be str or bytes, got {type(text).__name__}")

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD.

        Args:
            ids: Token ids.

        Returns:
            The decoded text.

        Raises:
            ValueError: An id is outside ``0 .. 255``.
        """
        _check_ids(ids, self.vocab_size)
        return bytes(ids).decode("utf-8", errors="replace")


class EodByteTokenizer:
    """`ByteTokenizer`'s 256 byte ids plus the end-of-document id 256 (``vocab_size`` 257).

    This is what ``--tokenizer-type ByteTokenizer`` builds for data: preprocessing appends
    256 after each document with ``--append-eod``, and a model trained on such data needs an
    embedding of 257 rows.
    """

    vocab_size: int = 257
    """Number of ids: the 256 bytes and EOD."""

    eod: int = 256
    """The end-of-document id."""

    eod_text: str = "<eod>"
    """How `detokenize` shows EOD."""

    def tokenize(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        """The text of `ids`, EOD shown as ``<eod>`` and invalid UTF-8 as U+FFFD.

        Raises:
            ValueError: An id is outside ``0 .. 256``.
        """
        _check_ids(ids, self.vocab_size)
        parts: list[str] = []
        start = 0
        for position, token in enumerate([*ids, self.eod]):
            if token == self.eod:
                parts.append(bytes(ids[start:position]).decode("utf-8", errors="replace"))
                start = position + 1
        return self.eod_text.join(parts)


class NullTokenizer:
    """Already-tokenized text: whitespace-separated ids in ``0 .. N - 1``; EOD is N.

    Args:
        vocab_size: N, the number of ids the data may hold (``vocab_size`` is N + 1).

    Raises:
        ValueError: `vocab_size` is not a positive int.
    """

    def __init__(self, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"NullTokenizer needs a positive vocab_size, got {vocab_size!r}")
        self._data_vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        """N + 1: the data's ids and EOD."""
        return self._data_vocab_size + 1

    @property
    def eod(self) -> int:
        """N, the id after the data's own."""
        return self._data_vocab_size

    def tokenize(self, text: str) -> list[int]:
        """The ids written in `text`.

        Raises:
            ValueError: A word is not an integer, or an id is outside ``0 .. N - 1``.
        """
        try:
            ids = [int(word) for word in text.split()]
        except ValueError as error:
            raise ValueError(
                f"NullTokenizer reads whitespace-separated integers; {error}"
            ) from None
        _check_ids(ids, self._data_vocab_size)
        return ids

    def detokenize(self, ids: list[int]) -> str:
        """The ids as decimal numbers separated by spaces.

        Raises:
            ValueError: An id is outside ``0 .. N`` (N is EOD).
        """
        _check_ids(ids, self.vocab_size)
        return " ".join(str(i) for i in ids)


_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


def _tokenizer_file(path: Path) -> Path:
    candidate = path / "tokenizer.json" if path.is_dir() else path
    if not candidate.is_file():
        raise ValueError(
            f"tokenizer model {path} not found: give a tokenizer.json file or a directory "
            "holding one"
        )
    return candidate


def _configured_eos(directory: Path) -> str | None:
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    token = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


class HuggingFaceTokenizer:
    """A local Hugging Face tokenizer (``tokenizer.json``) through the ``tokenizers`` library.

    EOD is the ``eos_token`` of a ``tokenizer_config.json`` beside the file, else the first
    of ``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>``, ``<|eot_id|>``, ``[SEP]``
    in the vocabulary. ``tokenize`` adds no special tokens (no post-processor template), as
    megatron-core's ``HuggingFaceTokenizer`` by default.

    Args:
        tokenizer_model: A ``tokenizer.json`` file or a directory holding one.

    Raises:
        ImportError: The ``tokenizers`` library is missing (install ``pp-train[hf]``).
        ValueError: No tokenizer file is at `tokenizer_model`.
    """

    def __init__(self, tokenizer_model: str | Path) -> None:
        try:
            import tokenizers
        except ImportError as error:
            raise ImportError(
                "HuggingFaceTokenizer needs the 'tokenizers' library: pip install \"pp-train[hf]\""
            ) from error
        path = _tokenizer_file(Path(tokenizer_model))
        self._tokenizer: Any = tokenizers.Tokenizer.from_file(str(path))
        self._path = path
        self._eos = _configured_eos(path.parent)

    @property
    def vocab_size(self) -> int:
        """Ids in the vocabulary, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def eod(self) -> int:
        """The end-of-sequence token's id.

        Raises:
            ValueError: The tokenizer has no end-of-sequence token.
        """
        names = (self._eos,) if self._eos is not None else _EOS_NAMES
        for name in names:
            token = self._tokenizer.token_to_id(name)
            if token is not None:
                return int(token)
        raise ValueError(
            f"tokenizer {self._path} has no end-of-document token: looked for "
            f"{', '.join(names)}; add eos_token to a tokenizer_config.json beside it"
        )

    def tokenize(self, text: str) -> list[int]:
        """The ids of `text`, without added special tokens."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens kept."""
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))


def build_tokenizer(
    tokenizer_type: str = "ByteTokenizer",
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
) -> Tokenizer:
    """The tokenizer named as Megatron's ``--tokenizer-type``, ``--tokenizer-model``, ...

    Args:
        tokenizer_type: One of `TOKENIZER_TYPES`.
        tokenizer_model: ``HuggingFaceTokenizer``: a ``tokenizer.json`` or its directory.
        vocab_size: ``NullTokenizer``: the number of ids in the data.

    Returns:
        The tokenizer.

    Raises:
        ValueError: An unknown type, or a missing or needless model or vocabulary size.
        ImportError: ``HuggingFaceTokenizer`` without the ``tokenizers`` library.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"unknown tokenizer type {tokenizer_type!r}; valid: {', '.join(TOKENIZER_TYPES)}"
        )
    if (tokenizer_type == "HuggingFaceTokenizer") != (tokenizer_model is not None):
        raise ValueError(
            "a tokenizer model (--tokenizer-model) goes with HuggingFaceTokenizer only; "
            f"got tokenizer type {tokenizer_type} and model {tokenizer_model!r}"
        )
    if (tokenizer_type == "NullTokenizer") != (vocab_size is not None):
        raise ValueError(
            "a vocabulary size (--vocab-size) goes with NullTokenizer only; "
            f"got tokenizer type {tokenizer_type} and vocab size {vocab_size!r}"
        )
    if tokenizer_type == "NullTokenizer":
        assert vocab_size is not None
        return NullTokenizer(vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        assert tokenizer_model is not None
        return HuggingFaceTokenizer(tokenizer_model)
    return EodByteTokenizer()
