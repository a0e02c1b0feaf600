"""Megatron's .bin/.idx format: the writer and reader round trip, and every bad file refused."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy
import pytest

from pp_train.data import IndexedDataset, IndexedDatasetBuilder, optimal_dtype


def _write(prefix: Path, documents: list[list[int]], dtype: type = numpy.uint16) -> str:
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for tokens in documents:
            builder.add_document(tokens)
        builder.finalize()
    return str(prefix)


def test_round_trip_documents_sequences_and_header(tmp_path: Path) -> None:
    prefix = str(tmp_path / "d")
    with IndexedDatasetBuilder(prefix, numpy.int32) as builder:
        builder.add_document([5, 6, 7])
        builder.add_document([])  # an empty document: no sequence
        builder.add_document([1, 2, 3, 4, 70000], lengths=[2, 3])
        builder.finalize()
    data = IndexedDataset(prefix)
    assert data.dtype == numpy.int32
    assert len(data) == 3
    assert data.num_documents == 3
    assert data.document_indices.tolist() == [0, 1, 1, 3]
    assert data.sequence_lengths.tolist() == [3, 2, 3]
    assert data.sequence_pointers.tolist() == [0, 12, 20]
    assert [data[i].tolist() for i in range(3)] == [[5, 6, 7], [1, 2], [3, 4, 70000]]
    assert data.document(1).tolist() == []
    assert data.document(2).tolist() == [1, 2, 3, 4, 70000]
    assert data.get(2, offset=1, length=1).tolist() == [4]
    raw = Path(prefix + ".idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 4, 3, 4)
    assert not list(tmp_path.glob("*.tmp*"))


def test_optimal_dtype_follows_megatron() -> None:
    assert optimal_dtype(257) == numpy.uint16
    assert optimal_dtype(65499) == numpy.uint16
    assert optimal_dtype(65500) == numpy.int32


def _interrupted_build(prefix: Path) -> None:
    with IndexedDatasetBuilder(prefix) as builder:
        builder.add_document([1, 2])
        raise RuntimeError("stop")


def test_an_interrupted_build_leaves_no_files(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="stop"):
        _interrupted_build(tmp_path / "d")
    assert list(tmp_path.iterdir()) == []


def test_lengths_must_add_up(tmp_path: Path) -> None:
    with IndexedDatasetBuilder(tmp_path / "d") as builder:
        with pytest.raises(ValueError, match=r"lengths \[1, 1\] do not add up to 3 tokens"):
            builder.add_document([1, 2, 3], lengths=[1, 1])
        builder.close()


def test_unknown_token_type_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="token type bool has no index code; valid: uint8"):
        IndexedDatasetBuilder(tmp_path / "d", numpy.bool_)  # type: ignore[arg-type]


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_a_missing_file_is_named(tmp_path: Path, suffix: str) -> None:
    prefix = _write(tmp_path / "d", [[1, 2]])
    Path(prefix + suffix).unlink()
    with pytest.raises(ValueError, match=rf"d{suffix}: no such file \(data prefix .*d\)"):
        IndexedDataset(prefix)


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("offset", "data", "message"),
    [
        (0, b"NOTANIDX\x00", r"not a Megatron index, starts with b'NOTANIDX\\x00'; expected"),
        (9, struct.pack("<Q", 2), "unknown index version 2; expected 1"),
        (17, struct.pack("<B", 9), r"unknown token type code 9; expected one of 1 \(uint8\)"),
    ],
)
def test_bad_headers_are_named(tmp_path: Path, offset: int, data: bytes, message: str) -> None:
    prefix = _write(tmp_path / "d", [[1, 2, 3]])
    _patch(Path(prefix + ".idx"), offset, data)
    with pytest.raises(ValueError, match=message):
        IndexedDataset(prefix)


def test_truncated_files_are_named_with_their_sizes(tmp_path: Path) -> None:
    prefix = _write(tmp_path / "d", [[1, 2, 3], [4, 5]])
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    full_idx, full_bin = idx.read_bytes(), bin_.read_bytes()
    bin_.write_bytes(full_bin[:-2])
    with pytest.raises(
        ValueError, match=r"d\.bin: truncated, 8 bytes; the index \(d\.idx\) needs 10"
    ):
        IndexedDataset(prefix)
    bin_.write_bytes(full_bin)
    idx.write_bytes(full_idx[:-8])
    with pytest.raises(
        ValueError, match=r"d\.idx: truncated, 74 bytes; an index of 2 sequences needs 82"
    ):
        IndexedDataset(prefix)
    idx.write_bytes(full_idx[:20])
    with pytest.raises(ValueError, match="truncated index, 20 bytes; a header alone is 34"):
        IndexedDataset(prefix)


def test_inconsistent_document_boundaries_are_refused(tmp_path: Path) -> None:
    prefix = _write(tmp_path / "d", [[1, 2, 3], [4, 5]])
    idx = Path(prefix + ".idx")
    _patch(idx, len(idx.read_bytes()) - 8, struct.pack("<q", 5))
    with pytest.raises(ValueError, match="boundaries must run from 0 to the 2 sequences"):
        IndexedDataset(prefix)
