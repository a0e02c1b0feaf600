"""The one record both formats' writers take, and the refusals made before a save writes.

Pure: the refusals come before any rank reads its process groups, so none is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pp_train.checkpoint import AsyncCheckpointSaver, save_checkpoint
from pp_train.checkpoint.save_request import SaveRequest

_NO_STATE: Any = None  # never read: every case here is refused first


def _request(**changes: Any) -> SaveRequest:
    fields: dict[str, Any] = {
        "root": Path("ckpt"), "iteration": 3, "state": _NO_STATE,
        "model": [torch.nn.Linear(2, 2)], "optimizer": None, "scheduler": None,
        "args": {"num_layers": 2}, "consumed_train_samples": 12, "consumed_valid_samples": 4,
        "save_rng": True, "ckpt_format": "torch",
    }  # fmt: skip
    return SaveRequest(**{**fields, **changes})


def test_a_request_holds_the_counts_in_megatrons_order() -> None:
    request = _request()
    assert request.consumed == (12, 4)
    assert request.async_saver is None
    request.check_contents()


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"ckpt_format": "zip"}, ValueError,
         r"ckpt_format must be one of \['torch', 'torch_dist'\], got 'zip'"),
        ({"async_saver": AsyncCheckpointSaver()}, ValueError,
         "asynchronous saving needs ckpt_format='torch_dist'"),
    ],
    ids=["format", "async-torch"],
)  # fmt: skip
def test_a_request_refuses_a_format_it_cannot_write(
    changes: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        _request(**changes)


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"iteration": -1}, ValueError, "iteration must be an int >= 0, got -1"),
        ({"consumed_valid_samples": 1.5}, TypeError, "consumed_valid_samples must be an int"),
        ({"model": []}, ValueError, "model must hold at least one chunk"),
        ({"args": {"path": Path("x")}}, TypeError, r"args\['path'\] is a \w*Path"),
    ],
    ids=["iteration", "count", "model", "args"],
)  # fmt: skip
def test_the_contents_are_checked_with_the_same_messages(
    changes: dict[str, Any], error: type[Exception], message: str
) -> None:
    request = _request(**changes)  # built: the writer checks after the directory is tidied
    with pytest.raises(error, match=message):
        request.check_contents()


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"ckpt_format": "zip"}, "ckpt_format must be one of"),
        ({"async_saver": AsyncCheckpointSaver()}, "asynchronous saving needs"),
    ],
    ids=["format", "async-torch"],
)
def test_save_checkpoint_refuses_before_touching_the_directory(
    tmp_path: Path, keywords: dict[str, Any], message: str
) -> None:
    root = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=message):
        save_checkpoint(
            root, 1, state=_NO_STATE, model=[torch.nn.Linear(2, 2)], optimizer=None,
            scheduler=None, args={}, consumed_train_samples=0, **keywords,
        )  # fmt: skip
    assert not root.exists()
