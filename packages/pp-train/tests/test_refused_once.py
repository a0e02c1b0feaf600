"""Input errors found before start-up: printed once for the whole job, named, exit status 2.

The job-wide part runs `refuse_once` in this process as one rank of a torchrun job whose
agent store is a real TCPStore here; the data and number checks are plain calls.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
import torch.distributed as dist

from pp_train.app import command
from pp_train.app.corpus import check_corpus_seq_length
from pp_train.data import (
    BlendedDataset,
    DataConfig,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    build_gpt_indices,
    check_data,
)
from pp_train.world import check_creatable_folder

pytestmark = pytest.mark.reliability

KEY = "pp-train/job/0/flag-error/printed"


@pytest.fixture
def agent_store() -> dist.TCPStore:
    """The store torchrun's agent would host."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _environ(store: dist.TCPStore, rank: int) -> dict[str, str]:
    return {
        "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0",
    }  # fmt: skip


def _refuse(environ: dict[str, str]) -> int | str | None:
    parser = argparse.ArgumentParser(prog="pp-train")
    with pytest.raises(SystemExit) as exit_info:
        command.refuse_once(parser, "--lr inf is wrong", environ)
    return exit_info.value.code


def _errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


def test_rank_0_prints_usage_and_the_error_then_sets_the_key(
    agent_store: dist.TCPStore, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _refuse(_environ(agent_store, 0)) == 2
    assert _errors(capsys) == ["usage: pp-train [-h]", "pp-train: error: --lr inf is wrong"]
    assert agent_store.get(KEY) == b"--lr inf is wrong"  # the message rank 0 printed


def test_another_rank_waits_for_rank_0_and_leaves_silently(
    agent_store: dist.TCPStore, capsys: pytest.CaptureFixture[str]
) -> None:
    agent_store.set(KEY, "--lr inf is wrong")
    assert _refuse(_environ(agent_store, 1)) == 2
    assert _errors(capsys) == []
    assert agent_store.check([f"{KEY}/seen/1"])


def test_a_rank_whose_error_differs_from_rank_0s_prints_its_own(
    agent_store: dist.TCPStore, capsys: pytest.CaptureFixture[str]
) -> None:
    # Checks that read files can disagree between nodes: no rank's error may be lost.
    agent_store.set(KEY, "--data-path a: cannot be read")
    assert _refuse(_environ(agent_store, 1)) == 2
    assert _errors(capsys) == ["usage: pp-train [-h]", "pp-train: error: --lr inf is wrong"]


def test_a_rank_that_waits_in_vain_prints_the_error_itself(
    agent_store: dist.TCPStore,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(command, "_ERROR_WAIT_SECONDS", 0.3)
    assert _refuse(_environ(agent_store, 1)) == 2
    assert _errors(capsys)[-1] == "pp-train: error: --lr inf is wrong"


def test_without_torchrun_another_rank_leaves_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert _refuse({"RANK": "1", "WORLD_SIZE": "2"}) == 2
    assert _errors(capsys) == []


# --- --seq-length against the data -----------------------------------------------------------


def test_the_corpus_names_the_longest_seq_length_that_fits() -> None:
    tokens = torch.arange(100, dtype=torch.int64)  # valid split: the last 10 tokens
    check_corpus_seq_length(9, tokens)
    with pytest.raises(ValueError, match=r"^--seq-length 10 ") as caught:
        check_corpus_seq_length(10, tokens)
    assert str(caught.value) == (
        "--seq-length 10 is longer than the bundled corpus allows: it holds 100 tokens, 10 of "
        "them in the validation split, and a sample needs --seq-length + 1; use --seq-length 9 "
        "or less, or train on --data-path"
    )


def _prefix(tmp_path: Path, name: str, documents: int) -> str:
    with IndexedDatasetBuilder(tmp_path / name) as builder:
        for start in range(documents):
            builder.add_document(numpy.arange(start, start + 10))
        builder.finalize()
    return str(tmp_path / name)


def test_a_blend_without_weights_needs_a_sample_in_each_split(tmp_path: Path) -> None:
    paths = [_prefix(tmp_path, "a", 20), _prefix(tmp_path, "b", 10)]
    config = DataConfig(data_path=paths, split="90,10,0")
    counts = (8, 8, 0)
    check_data(config, seq_length=9, seed=1, train_valid_test_num_samples=counts)
    with pytest.raises(ValueError, match=r"^--seq-length 10 ") as caught:
        check_data(config, seq_length=10, seed=1, train_valid_test_num_samples=counts)
    assert str(caught.value).startswith(
        f"--seq-length 10 is longer than the valid split of {paths[1]} allows: it holds 10 "
        "tokens and a sample needs --seq-length + 1"
    )
    assert "use --seq-length 9 or less, or give weights in --data-path" in str(caught.value)
    # One prefix repeats its documents for as many epochs as the samples need, as Megatron.
    check_data(
        DataConfig(data_path=paths[:1], split="90,10,0"),
        seq_length=1000,
        seed=1,
        train_valid_test_num_samples=counts,
    )


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"seq_length": 0}, ValueError, "seq_length must be 1 or more, got 0"),
        ({"seq_length": -4}, ValueError, "seq_length must be 1 or more, got -4"),
        ({"seq_length": 2.0}, TypeError, "seq_length must be an int, got 2.0"),
        ({"num_samples": -1}, ValueError, "num_samples must be 0 or more, got -1"),
    ],
)
def test_gpt_dataset_sizes_are_checked(
    tmp_path: Path, change: dict[str, object], error: type[Exception], message: str
) -> None:
    indexed = IndexedDataset(_prefix(tmp_path, "d", 4))
    ids = numpy.arange(4, dtype=numpy.int32)
    arguments: dict[str, object] = {"num_samples": 4, "seq_length": 3, "seed": 1, **change}
    with pytest.raises(error, match=message):
        GPTDataset(indexed, ids, split_name="train", **arguments)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        build_gpt_indices(indexed.sequence_lengths, ids, **arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("weights", "size", "message"),
    [
        ([1.0], 4, "a blend needs one weight per dataset: 2 datasets, 1 weights"),
        ([0.0, 0.0], 4, r"blend weights must be finite, 0 or more and not all 0, got \[0.0, 0.0\]"),
        ([1.0, float("inf")], 4, "blend weights must be finite"),
        ([1.0, -1.0], 4, "blend weights must be finite"),
        ([1.0, 1.0], -1, "size must be 0 or more, got -1"),
    ],
)
def test_blended_dataset_numbers_are_checked(
    tmp_path: Path, weights: list[float], size: int, message: str
) -> None:
    indexed = IndexedDataset(_prefix(tmp_path, "d", 4))
    ids = numpy.arange(4, dtype=numpy.int32)
    part = GPTDataset(indexed, ids, num_samples=4, seq_length=3, seed=1, split_name="train")
    with pytest.raises(ValueError, match=message):
        BlendedDataset([part, part], weights, size)
    with pytest.raises(ValueError, match="a blend needs at least one dataset"):
        BlendedDataset([], [], 4)


# --- --tensorboard-dir -----------------------------------------------------------------------


def test_a_folder_under_a_file_is_refused_creating_nothing(tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("a file")
    with pytest.raises(ValueError, match=r"^--tensorboard-dir ") as caught:
        check_creatable_folder("--tensorboard-dir", str(tmp_path / "notes" / "runs" / "tb"))
    assert str(caught.value) == (
        f"--tensorboard-dir {tmp_path}/notes/runs/tb: {tmp_path}/notes is a file, so no folder "
        "can be made there"
    )
    check_creatable_folder("--tensorboard-dir", str(tmp_path / "new" / "tb"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


def test_a_folder_in_a_read_only_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root may write into any folder, so the folder's refusal of writes is stood in for.
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    real_access = os.access

    def access(path: Any, mode: int, *args: Any, **kwargs: Any) -> bool:
        if Path(path) == locked and mode & os.W_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr("pp_train.world.os.access", access)
    with pytest.raises(ValueError, match=f"folder {locked} is not writable"):
        check_creatable_folder("--tensorboard-dir", str(locked / "tb"))
    assert not (locked / "tb").exists()


_RANK = """
import argparse, sys
from pp_train.app import command
command.refuse_once(argparse.ArgumentParser(prog="pp-train"), "--lr inf is wrong", {
    "RANK": sys.argv[1], "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[2],
})
"""


def test_without_an_agent_store_rank_0_hosts_one_and_the_others_wait_for_it() -> None:
    # Launchers other than torchrun (no agent store): rank 0 hosts the store on MASTER_PORT,
    # as torch's env:// rendezvous would, and waits until every other rank has read the key.
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    environ = {**os.environ, "PYTHONUNBUFFERED": "1"}
    environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)

    def start(rank: int) -> subprocess.Popen[str]:
        command_line = [sys.executable, "-c", _RANK, str(rank), port]
        return subprocess.Popen(command_line, env=environ, stderr=subprocess.PIPE, text=True)

    other = start(1)  # starts first and waits for rank 0's store and key
    time.sleep(1.0)
    first = start(0)
    errors = [process.communicate(timeout=60)[1] for process in (first, other)]
    assert [process.returncode for process in (first, other)] == [2, 2]
    assert errors[0].splitlines() == ["usage: pp-train [-h]", "pp-train: error: --lr inf is wrong"]
    assert errors[1] == ""
