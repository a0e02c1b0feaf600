"""Reading checkpoint files in one process without the model: the converter's and exporter's.

`position_files` reads every (tensor, pipeline) position's file of a torch-format iteration
and checks that together they make the one layout their conversion records name;
`single_process` runs torch.distributed.checkpoint without a process group.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pp_train.checkpoint.errors import CheckpointError, DamagedCheckpointError
from pp_train.checkpoint.torch_dist import CONVERSION_KEY
from pp_train.checkpoint.torch_format import torch_header_problem
from pp_train.checkpoint.tracker import CHECKPOINT_FILENAME

__all__ = ["load_file", "no_records", "position_files", "single_process"]


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """DCP without a process group, without its warning that this is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def no_records(where: str) -> CheckpointError:
    """The refusal of files saved without conversion records (and the way round it)."""
    return CheckpointError(
        f"{where} records no global tensor names (saved before conversion records were "
        "written, or by a model without sharded_state_keys()); convert it with the training "
        "command and the flags of the run that saved it: --load IN --ckpt-convert-format "
        "FORMAT --ckpt-convert-save OUT (docs/checkpoints.md); nothing was written"
    )


def load_file(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """A torch file's dict, read with ``weights_only``.

    With `mmap` the file is memory-mapped: its entries are read from disk only when touched.

    Raises:
        DamagedCheckpointError: The file is unreadable, unsafe or holds no dict.
    """
    try:
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
        first = (str(error).strip().splitlines() or [""])[0][:200]
        raise DamagedCheckpointError(
            f"checkpoint {path} is corrupt or unsafe: {type(error).__name__}: {first}; "
            "nothing was written"
        ) from error
    if not isinstance(content, dict):
        raise DamagedCheckpointError(
            f"checkpoint {path} holds a {type(content).__name__}, not a dict; nothing was written"
        )
    return content


def position_files(
    directory: Path, iteration: int, *, mmap: bool = False
) -> list[tuple[Path, dict[str, Any]]]:
    """Every position's ``model_optim_rng.pt`` of a torch iteration, checked to make one layout.

    Raises:
        CheckpointError: A file is damaged, of another version or iteration, has no
            conversion record, or the files do not make the layout their records name.
    """
    files = []
    for path in sorted(directory.glob(f"mp_rank_*/{CHECKPOINT_FILENAME}")):
        content = load_file(path, mmap=mmap)
        problem = torch_header_problem(content, iteration)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} {problem}; nothing was written")
        if not isinstance(content.get(CONVERSION_KEY), dict):
            raise no_records(f"checkpoint {path}")
        files.append((path, content))
    records = [content[CONVERSION_KEY] for _, content in files]
    layout = records[0]["layout"] if records else None
    positions = {(r["tensor_rank"], r["pipeline_rank"]) for r in records if r["layout"] == layout}
    expected = (
        0
        if layout is None
        else layout["tensor_model_parallel_size"] * layout["pipeline_model_parallel_size"]
    )
    if not files or len(positions) != len(files) or len(files) != expected:
        raise DamagedCheckpointError(
            f"checkpoint {directory} holds {len(files)} files of {len(positions)} positions; "
            f"its layout {layout} needs {expected}; nothing was written"
        )
    return files
