"""JSON lines to Megatron's indexed dataset: ``python -m pp_train.preprocess``.

``--input docs.jsonl --output-prefix P --json-keys text`` tokenizes the ``text`` of every line
and writes ``P_text_document.bin`` / ``.idx`` (one pair per key), readable by megatron-core's
``IndexedDataset`` and by `pp_train.data.IndexedDataset`. Documents keep the input's order,
with any number of ``--workers``. A value may be a string (one sequence) or a list of strings
(one sequence per non-empty string, as Megatron's preprocessing writes sentences); empty
documents are kept, with no sequence. Blank lines are skipped. ``--append-eod`` ends each
non-empty document with the tokenizer's EOD id. Without tokenizer flags the bundled byte
tokenizer is used (257 ids: the bytes and EOD 256).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import numpy
import numpy.typing as npt

from pp_train.data.command import run_command
from pp_train.data.indexed import IndexedDatasetBuilder, optimal_dtype
from pp_train.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer

__all__ = ["build_parser", "main"]

Encoded = tuple[dict[str, tuple[npt.NDArray[Any], list[int]]], int]
"""Per key: the document's ids and its sequences' lengths; and the line's size in bytes."""


def build_parser() -> argparse.ArgumentParser:
    """The command line, with Megatron's ``tools/preprocess_data.py`` flag names."""
    parser = argparse.ArgumentParser(
        prog="python -m pp_train.preprocess",
        description="Tokenize JSON lines into Megatron's indexed dataset (.bin/.idx).",
    )
    parser.add_argument("--input", required=True, help="JSON lines file, one document a line")
    parser.add_argument(
        "--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx"
    )
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)"
    )
    parser.add_argument("--append-eod", action="store_true", help="end documents with EOD")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--tokenizer-type", default="ByteTokenizer", choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer's file")
    parser.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's ids")
    parser.add_argument(
        "--log-interval", type=int, default=1000, help="print progress every N documents"
    )
    return parser


class _Encoder:
    """Tokenizes one JSON line; built once per worker process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.tokenizer: Tokenizer = _tokenizer(args)
        self.keys: list[str] = list(args.json_keys)
        self.eod: int | None = self.tokenizer.eod if args.append_eod else None
        # Arrays of the file's token type: workers send them back much faster than lists.
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)
        self.path: str = args.input

    def encode(self, numbered: tuple[int, str]) -> Encoded:
        number, line = numbered
        where = f"{self.path}:{number}"
        try:
            document = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
        if not isinstance(document, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(document).__name__}")
        encoded = {}
        for key in self.keys:
            if key not in document:
                raise ValueError(
                    f"{where}: no key {key!r}; the line has {sorted(document)[:10]} "
                    "(choose with --json-keys)"
                )
            encoded[key] = self._encode_value(document[key], where, key)
        return encoded, len(line.encode("utf-8"))

    def _encode_value(
        self, value: object, where: str, key: str
    ) -> tuple[npt.NDArray[Any], list[int]]:
        parts = [value] if isinstance(value, str) else value
        if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
            raise ValueError(
                f"{where}: key {key!r} holds {type(value).__name__}; expected a string "
                "or a list of strings"
            )
        ids: list[int] = []
        lengths: list[int] = []
        for part in parts:
            try:
                tokens = self.tokenizer.tokenize(part)
            except ValueError as error:
                raise ValueError(f"{where}: key {key!r}: {error}") from None
            if tokens:
                ids.extend(tokens)
                lengths.append(len(tokens))
        if ids and self.eod is not None:
            ids.append(self.eod)
            lengths[-1] += 1
        return numpy.asarray(ids, dtype=self.dtype), lengths


def _tokenizer(args: argparse.Namespace) -> Tokenizer:
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)


_WORKER: _Encoder | None = None


def _start_worker(args: argparse.Namespace) -> None:
    global _WORKER  # noqa: PLW0603 - one encoder per pool process
    _WORKER = _Encoder(args)


def _encode_in_worker(numbered: tuple[int, str]) -> Encoded:
    assert _WORKER is not None
    return _WORKER.encode(numbered)


def _numbered_lines(path: str, stream: BinaryIO) -> Iterator[tuple[int, str]]:
    for number, raw in enumerate(stream, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}:{number}: not UTF-8 ({error.reason})") from None
        if line.strip():
            yield number, line


def _check_args(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise ValueError(f"--workers must be 1 or more, got {args.workers}")
    if args.log_interval < 1:
        raise ValueError(f"--log-interval must be 1 or more, got {args.log_interval}")
    path = Path(args.input)
    if not path.is_file():
        raise ValueError(f"{path}: no such input file")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the input file is empty; expected JSON lines")
    parent = Path(args.output_prefix).parent
    if not parent.is_dir():
        raise ValueError(f"{parent}: no such directory for --output-prefix {args.output_prefix}")
    tokenizer = _tokenizer(args)
    if args.append_eod:
        tokenizer.eod  # noqa: B018 - raises now if the tokenizer has no EOD


class _Progress:
    """Documents/s and MB/s on stderr every `interval` documents and at the end."""

    def __init__(self, interval: int, stream: TextIO) -> None:
        self.interval, self.stream = interval, stream
        self.start = time.perf_counter()
        self.documents = self.bytes = 0

    def add(self, size: int) -> None:
        self.documents += 1
        self.bytes += size
        if self.documents % self.interval == 0:
            self.report("processed")

    def report(self, what: str) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        print(
            f"{what} {self.documents} documents ({self.documents / elapsed:.1f} documents/s, "
            f"{self.bytes / elapsed / 2**20:.2f} MB/s)",
            file=self.stream,
            flush=True,
        )


def _write(
    args: argparse.Namespace, encoded: Iterable[Encoded], dtype: type[numpy.number[Any]]
) -> _Progress:
    progress = _Progress(args.log_interval, sys.stderr)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(prefix, dtype) for key, prefix in prefixes.items()}
    try:
        for document, size in encoded:
            for key, (ids, lengths) in document.items():
                builders[key].add_document(ids, lengths)
            progress.add(size)
        if progress.documents == 0:
            raise ValueError(f"{args.input}: no documents, only blank lines")
        for builder in builders.values():
            builder.finalize()
    finally:
        for builder in builders.values():
            builder.close()
    return progress


def _run(args: argparse.Namespace) -> _Progress:
    dtype = optimal_dtype(_tokenizer(args).vocab_size)
    with open(args.input, "rb") as stream:
        lines = _numbered_lines(args.input, stream)
        if args.workers == 1:
            return _write(args, map(_Encoder(args).encode, lines), dtype)
        with multiprocessing.Pool(args.workers, _start_worker, (args,)) as pool:
            return _write(args, pool.imap(_encode_in_worker, lines, chunksize=32), dtype)


def main(argv: list[str] | None = None) -> int:
    """Run the command.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 2 for bad input (the reason printed as one line on stderr).
    """
    return run_command(build_parser(), argv, _preprocess)


def _preprocess(args: argparse.Namespace) -> None:
    _check_args(args)
    _run(args).report("done:")
    for key in args.json_keys:
        print(f"{args.output_prefix}_{key}_document.bin/.idx", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
