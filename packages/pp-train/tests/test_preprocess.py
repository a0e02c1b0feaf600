"""python -m pp_train.preprocess and python -m pp_train.data show, end to end on temp files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pp_train.data import IndexedDataset
from pp_train.data.__main__ import main as data_main
from pp_train.data.__main__ import parse_indices
from pp_train.preprocess import main as preprocess


def _jsonl(path: Path, documents: list[object]) -> str:
    path.write_text("".join(json.dumps(d) + "\n" for d in documents), encoding="utf-8")
    return str(path)


def _documents(count: int) -> list[object]:
    return [{"text": f"document {i} " + "word " * (i % 7), "id": i} for i in range(count)]


def test_one_and_two_workers_write_identical_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _jsonl(tmp_path / "docs.jsonl", _documents(300))
    for workers in (1, 2):
        argv = ["--input", source, "--output-prefix", str(tmp_path / f"w{workers}")]
        assert preprocess([*argv, "--append-eod", "--workers", str(workers)]) == 0
    for suffix in (".bin", ".idx"):
        one = (tmp_path / f"w1_text_document{suffix}").read_bytes()
        assert one == (tmp_path / f"w2_text_document{suffix}").read_bytes()
    data = IndexedDataset(tmp_path / "w1_text_document")
    assert data.num_documents == 300
    assert data.document(5).tolist() == [*b"document 5 word word word word word ", 256]
    assert "done: 300 documents (" in capsys.readouterr().err


def test_progress_names_documents_and_megabytes_per_second(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _jsonl(tmp_path / "docs.jsonl", _documents(5))
    argv = ["--input", source, "--output-prefix", str(tmp_path / "p"), "--log-interval", "2"]
    assert preprocess(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("processed 2 documents (")
    assert err[0].endswith(" MB/s)")
    assert err[2].startswith("done: 5 documents (")


def test_several_keys_lists_and_empty_documents(tmp_path: Path) -> None:
    source = _jsonl(
        tmp_path / "docs.jsonl",
        [{"a": "4 5", "b": ["1 2", "", "3"]}, {"a": "", "b": ""}],
    )
    argv = ["--input", source, "--output-prefix", str(tmp_path / "p"), "--json-keys", "a", "b"]
    assert preprocess([*argv, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]) == 0
    a, b = IndexedDataset(tmp_path / "p_a_document"), IndexedDataset(tmp_path / "p_b_document")
    assert a.document_indices.tolist() == [0, 1, 1]
    assert b.document_indices.tolist() == [0, 2, 2]  # sequences "1 2" and "3"; an empty one
    assert b[0].tolist() == [1, 2]
    assert b[1].tolist() == [3]
    assert IndexedDataset(tmp_path / "p_a_document").dtype.__name__ == "uint16"


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("", [], r"docs\.jsonl: the input file is empty; expected JSON lines"),
        ("\n  \n", [], "no documents, only blank lines"),
        (
            '{"text": "a"}\n{"body": "b"}\n',
            [],
            r"docs\.jsonl:2: no key 'text'; the line has \['body'\]",
        ),
        ('{"text": "a"}\nnot json\n', [], r"docs\.jsonl:2: not valid JSON"),
        ('{"text": 5}\n', [], "key 'text' holds int; expected a string or a list of strings"),
        (
            '{"text": "1 2"}\n{"text": "7 300"}\n',
            ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"],
            r"docs\.jsonl:2: key 'text': token ids must lie in 0 \.\. 299; got \[300\]",
        ),
        ('{"text": "a"}\n', ["--workers", "0"], "--workers must be 1 or more, got 0"),
    ],
)
def test_bad_input_stops_with_exit_status_2_and_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str,
    extra: list[str],
    message: str,
) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text(content, encoding="utf-8")
    argv = ["--input", str(source), "--output-prefix", str(tmp_path / "p"), *extra]
    assert preprocess(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("python -m pp_train.preprocess: error: ")
    assert re.search(message, err), err
    assert not [p for p in tmp_path.iterdir() if p.name != "docs.jsonl"]


def test_bad_input_in_a_worker_is_reported_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _jsonl(tmp_path / "docs.jsonl", [*_documents(100), {"body": "x"}])
    argv = ["--input", source, "--output-prefix", str(tmp_path / "p"), "--workers", "2"]
    assert preprocess(argv) == 2
    assert "docs.jsonl:101: no key 'text'" in capsys.readouterr().err


# --- data show ----------------------------------------------------------------------------


@pytest.fixture
def prefix(tmp_path: Path) -> str:
    source = _jsonl(tmp_path / "docs.jsonl", _documents(200))
    assert (
        preprocess(["--input", source, "--output-prefix", str(tmp_path / "p"), "--append-eod"]) == 0
    )
    return str(tmp_path / "p_text_document")


def _show(prefix: str, *extra: str) -> list[str]:
    argv = ["show", "--data-path", prefix, "--split", "90,10,0", "--seq-length", "8"]
    assert data_main([*argv, "--seed", "3", "--train-samples", "20", *extra]) == 0
    return []


def test_show_prints_one_json_object_per_sample(
    prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    _show(prefix, "--valid-samples", "4", "--indices", "0:3", "--json", "--text")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["split"], r["index"]) for r in lines] == [("train", i) for i in range(3)] + [
        ("valid", i) for i in range(3)
    ]
    for record in lines:
        assert len(record["tokens"]) == 9
        assert (
            record["text"]
            == bytes(t for t in record["tokens"] if t != 256).decode(errors="replace")
            or "<eod>" in record["text"]
        )
    _show(prefix, "--indices", "5", "--splits", "train")
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("train 5: ")
    assert len(line.split()) == 2 + 9


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--split", "90,10,0,1"], "split '90,10,0,1' must be 1 to 3"),
        (["--indices", "a:b"], "--indices 'a:b' must be A:B"),
        (["--splits", "training"], "--splits 'training': choose from train, valid, test"),
        (["--data-path", "/nowhere/x"], r"/nowhere/x\.idx: no such file"),
        (
            ["--text", "--tokenizer-type", "NullTokenizer", "--vocab-size", "5"],
            r"train sample 0: token ids must lie in 0 \.\. 5",
        ),
    ],
)
def test_show_bad_input_exits_2_with_one_line(
    prefix: str, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    capsys.readouterr()
    argv = ["show", "--data-path", prefix, "--split", "90,10,0", "--seq-length", "8", *extra]
    assert data_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err


def test_parse_indices() -> None:
    assert parse_indices("0:8") == (0, 8)
    assert parse_indices("3") == (3, 4)
    assert parse_indices("2:") == (2, None)
