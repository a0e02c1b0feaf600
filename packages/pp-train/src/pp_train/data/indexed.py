r"""Megatron's indexed dataset: token sequences in ``P.bin``, their index in ``P.idx``.

The ``.bin`` file is every sequence's tokens back to back in one integer type. The ``.idx``
file (all numbers little-endian) is:

======  ==============================================================================
bytes   content
======  ==============================================================================
9       the magic ``MMIDIDX\x00\x00``
8       version, 1 (uint64)
1       the token type's code (uint8): 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
        6 float64, 7 float32, 8 uint16
8       S, the number of sequences (uint64)
8       D, the number of document boundaries: documents + 1 (uint64)
4 S     each sequence's length in tokens (int32)
8 S     each sequence's byte offset in the ``.bin`` file (int64)
8 D     document boundaries as sequence indices: 0, then each document's end (int64)
======  ==============================================================================

Preprocessing writes one sequence per document; a document whose text is a list of strings
has one sequence per non-empty string, and an empty document has none. Megatron's GPT dataset
reads sequences, so it treats each sequence as a document.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy
import numpy.typing as npt

__all__ = [
    "DTYPE_CODES",
    "INDEX_MAGIC",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "optimal_dtype",
]

INDEX_MAGIC = b"MMIDIDX\x00\x00"
"""The first 9 bytes of every ``.idx`` file."""

INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, boundaries

DTYPE_CODES: dict[int, type[numpy.number[Any]]] = {
    1: numpy.uint8,
    2: numpy.int8,
    3: numpy.int16,
    4: numpy.int32,
    5: numpy.int64,
    6: numpy.float64,
    7: numpy.float32,
    8: numpy.uint16,
}
"""Megatron's codes for the ``.bin`` file's token type."""


def optimal_dtype(vocab_size: int) -> type[numpy.number[Any]]:
    """The token type Megatron's preprocessing picks: uint16 below 65500 ids, else int32."""
    return numpy.uint16 if vocab_size < 65500 else numpy.int32


def _dtype_code(dtype: type[numpy.number[Any]]) -> int:
    for code, known in DTYPE_CODES.items():
        if numpy.dtype(known) == numpy.dtype(dtype):
            return code
    names = ", ".join(numpy.dtype(t).name for t in DTYPE_CODES.values())
    raise ValueError(f"token type {numpy.dtype(dtype).name} has no index code; valid: {names}")


def _read_header(idx_path: Path) -> tuple[type[numpy.number[Any]], int, int]:
    with open(idx_path, "rb") as handle:
        raw = handle.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        raise ValueError(
            f"{idx_path}: truncated index, {len(raw)} bytes; a header alone is {_HEADER.size}"
        )
    magic, version, code, sequences, boundaries = _HEADER.unpack(raw)
    if magic != INDEX_MAGIC:
        raise ValueError(
            f"{idx_path}: not a Megatron index, starts with {magic!r}; expected {INDEX_MAGIC!r}"
        )
    if version != INDEX_VERSION:
        raise ValueError(f"{idx_path}: unknown index version {version}; expected {INDEX_VERSION}")
    if code not in DTYPE_CODES:
        raise ValueError(
            f"{idx_path}: unknown token type code {code}; expected one of "
            f"{', '.join(f'{c} ({numpy.dtype(t).name})' for c, t in DTYPE_CODES.items())}"
        )
    return DTYPE_CODES[code], sequences, boundaries


def _check_size(path: Path, actual: int, expected: int, what: str) -> None:
    if actual < expected:
        raise ValueError(f"{path}: truncated, {actual} bytes; {what} needs {expected}")
    if actual > expected:
        raise ValueError(f"{path}: {actual} bytes; {what} needs exactly {expected}")


def _map(path: Path) -> npt.NDArray[numpy.uint8]:
    if path.stat().st_size == 0:
        return numpy.zeros(0, dtype=numpy.uint8)
    return numpy.memmap(path, mode="r", dtype=numpy.uint8)


class IndexedDataset:
    """A memory-mapped reader of a ``P.bin`` / ``P.idx`` pair.

    ``dataset[i]`` is sequence ``i`` as a numpy array of the file's token type.

    Args:
        path_prefix: ``P``, the path of both files without the suffix.

    Raises:
        ValueError: A file is missing, truncated or inconsistent, or its header names an
            unknown version or token type; the message names the file and what was expected.
    """

    def __init__(self, path_prefix: str | os.PathLike[str]) -> None:
        self.path_prefix = str(path_prefix)
        idx_path, bin_path = Path(self.path_prefix + ".idx"), Path(self.path_prefix + ".bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise ValueError(f"{path}: no such file (data prefix {self.path_prefix})")
        self.dtype, sequences, boundaries = _read_header(idx_path)
        index = _map(idx_path)
        end = _HEADER.size + 12 * sequences + 8 * boundaries
        # Multimodal indices carry one more int8 per sequence; the tokens read the same.
        if index.size != end + sequences:
            _check_size(idx_path, index.size, end, f"an index of {sequences} sequences")
        start = _HEADER.size
        self.sequence_lengths: npt.NDArray[numpy.int32] = index[start : start + 4 * sequences].view(
            numpy.int32
        )
        start += 4 * sequences
        self.sequence_pointers: npt.NDArray[numpy.int64] = index[
            start : start + 8 * sequences
        ].view(numpy.int64)
        start += 8 * sequences
        self.document_indices: npt.NDArray[numpy.int64] = index[
            start : start + 8 * boundaries
        ].view(numpy.int64)
        self._check_documents(idx_path, sequences)
        self._bin = _map(bin_path)
        itemsize = numpy.dtype(self.dtype).itemsize
        expected = int(self.sequence_lengths.sum(dtype=numpy.int64)) * itemsize
        _check_size(bin_path, self._bin.size, expected, f"the index ({idx_path.name})")

    def _check_documents(self, idx_path: Path, sequences: int) -> None:
        bounds = self.document_indices
        if bounds.size == 0 or bounds[0] != 0 or bounds[-1] != sequences:
            raise ValueError(
                f"{idx_path}: document boundaries must run from 0 to the {sequences} "
                f"sequences; got {bounds[:1].tolist()} .. {bounds[-1:].tolist()}"
            )
        if bool((numpy.diff(bounds) < 0).any()):
            raise ValueError(f"{idx_path}: document boundaries decrease")
        if bool((self.sequence_lengths < 0).any()):
            raise ValueError(f"{idx_path}: a sequence length is negative")

    def __len__(self) -> int:
        """The number of sequences."""
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        """The number of documents (each one or more sequences, or none)."""
        return int(self.document_indices.shape[0]) - 1

    def get(self, index: int, offset: int = 0, length: int | None = None) -> npt.NDArray[Any]:
        """Tokens ``offset .. offset + length`` of sequence `index` (to its end by default)."""
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        itemsize = numpy.dtype(self.dtype).itemsize
        start = int(self.sequence_pointers[index]) + offset * itemsize
        return self._bin[start : start + length * itemsize].view(self.dtype)

    def __getitem__(self, index: int) -> npt.NDArray[Any]:
        """Sequence `index`'s tokens."""
        return self.get(index)

    def document(self, index: int) -> npt.NDArray[Any]:
        """Document `index`'s tokens: its sequences joined."""
        first, last = (int(i) for i in self.document_indices[index : index + 2])
        if first == last:
            return numpy.zeros(0, dtype=self.dtype)
        start = int(self.sequence_pointers[first])
        itemsize = numpy.dtype(self.dtype).itemsize
        size = int(self.sequence_lengths[first:last].sum(dtype=numpy.int64)) * itemsize
        return self._bin[start : start + size].view(self.dtype)


class IndexedDatasetBuilder:
    """Writes a ``P.bin`` / ``P.idx`` pair, document by document.

    Both files are written under temporary names and renamed into place by `finalize`, so an
    interrupted run leaves no pair that looks complete. Use it as a context manager to
    remove the temporary files when an error stops the writing.

    Args:
        path_prefix: ``P``.
        dtype: The token type (see `optimal_dtype`).

    Raises:
        ValueError: `dtype` is not one of Megatron's token types.
    """

    def __init__(
        self, path_prefix: str | os.PathLike[str], dtype: type[numpy.number[Any]] = numpy.int32
    ) -> None:
        self._code = _dtype_code(dtype)
        self.dtype = dtype
        self.path_prefix = str(path_prefix)
        self._tmp = {s: Path(f"{self.path_prefix}{s}.tmp-{os.getpid()}") for s in (".bin", ".idx")}
        self._bin = open(self._tmp[".bin"], "wb")  # noqa: SIM115 - closed by finalize/close
        self._lengths: list[int] = []
        self._documents: list[int] = [0]

    def add_document(self, tokens: npt.ArrayLike, lengths: list[int] | None = None) -> None:
        """Append one document.

        Args:
            tokens: Its tokens (all its sequences back to back).
            lengths: Its sequences' lengths (default: one sequence of all the tokens, none
                without tokens: an empty document).

        Raises:
            ValueError: `lengths` do not add up to the number of tokens.
        """
        array = numpy.asarray(tokens, dtype=self.dtype)
        if lengths is None:
            lengths = [int(array.size)] if array.size else []
        lengths = [int(n) for n in lengths]
        if sum(lengths) != array.size:
            raise ValueError(f"sequence lengths {lengths} do not add up to {array.size} tokens")
        self._bin.write(array.tobytes(order="C"))
        self._lengths.extend(lengths)
        self._documents.append(len(self._lengths))

    def finalize(self) -> None:
        """Write the index and move both files to their names."""
        self._bin.close()
        lengths = numpy.asarray(self._lengths, dtype=numpy.int32)
        itemsize = numpy.dtype(self.dtype).itemsize
        pointers = numpy.zeros(lengths.size, dtype=numpy.int64)
        numpy.cumsum(lengths[:-1], dtype=numpy.int64, out=pointers[1:])
        with open(self._tmp[".idx"], "wb") as handle:
            header = (INDEX_MAGIC, INDEX_VERSION, self._code, lengths.size, len(self._documents))
            handle.write(_HEADER.pack(*header))
            handle.write(lengths.tobytes())
            handle.write((pointers * itemsize).tobytes())
            handle.write(numpy.asarray(self._documents, dtype=numpy.int64).tobytes())
        for suffix, path in self._tmp.items():
            os.replace(path, self.path_prefix + suffix)

    def close(self) -> None:
        """Drop the temporary files of an unfinished build."""
        self._bin.close()
        for path in self._tmp.values():
            path.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetBuilder:
        """The builder."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Drop the temporary files if the block raised."""
        if exc_type is not None:
            self.close()
