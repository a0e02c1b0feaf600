"""`pp_train.checkpointing` (deprecated) re-exports the very objects of `pp_train.checkpoint`."""

from __future__ import annotations

import pytest

from pp_train import checkpoint, checkpointing
from pp_train.checkpoint import agreement, torch_format

# The old name -> its new home; the torch format's own save and load are named for it there.
NEW_HOMES = {
    "CHECKPOINT_FILENAME": (checkpoint, "CHECKPOINT_FILENAME"),
    "CHECKPOINT_VERSION": (checkpoint, "CHECKPOINT_VERSION"),
    "DEFAULT_STRICT_ARGS": (checkpoint, "DEFAULT_STRICT_ARGS"),
    "TRACKER_FILENAME": (checkpoint, "TRACKER_FILENAME"),
    "CheckpointError": (checkpoint, "CheckpointError"),
    "LoadedCheckpoint": (checkpoint, "LoadedCheckpoint"),
    "checkpoint_path": (checkpoint, "checkpoint_path"),
    "collective_device": (agreement, "collective_device"),
    "gather_ints": (agreement, "gather_ints"),
    "get_rng_state": (checkpoint, "get_rng_state"),
    "load_checkpoint": (torch_format, "load_torch_checkpoint"),
    "read_tracker": (checkpoint, "read_tracker"),
    "save_checkpoint": (torch_format, "save_torch_checkpoint"),
    "set_rng_state": (checkpoint, "set_rng_state"),
}


def test_every_old_name_is_listed() -> None:
    assert sorted(checkpointing.__all__) == sorted(NEW_HOMES)


@pytest.mark.parametrize("name", sorted(NEW_HOMES))
def test_the_old_path_gives_the_new_homes_object(name: str) -> None:
    home, new_name = NEW_HOMES[name]
    assert getattr(checkpointing, name) is getattr(home, new_name)


def test_importing_the_deprecated_module_warns_and_names_the_new_home() -> None:
    import importlib

    with pytest.warns(DeprecationWarning, match=r"import from pp_train\.checkpoint"):
        importlib.reload(checkpointing)
