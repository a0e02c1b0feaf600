"""Writes and renames that a crash cannot leave half done (both formats' files and tracker)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO

from pp_train.temporaries import REPLACED_SUFFIX, WRITER_FILENAME, temporary_path

__all__ = ["atomic_write", "fsync_directory", "move_in"]


def fsync_directory(directory: Path) -> None:
    """Makes a rename or new entry in `directory` survive a power loss."""
    if os.name != "posix":  # other systems cannot open a directory to sync it
        return
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def atomic_write(
    path: Path,
    write: Callable[[IO[bytes]], object],
    *,
    sync_directory: Callable[[Path], None] = fsync_directory,
) -> None:
    """Writes `path` so that it holds either its old content or all of the new one.

    Args:
        path: The file to write; its directory is created when missing.
        write: Writes the content into the open temporary file.
        sync_directory: Syncs `path`'s directory once the file is renamed into place (a
            format passes its own step, so that a test can stop a save there).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # Host and pid keep two writers of one name from sharing a temporary and tell whether a
    # leftover's writer is dead (`pp_train.temporaries`); a failure removes it below.
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    sync_directory(path.parent)


def move_in(staging: Path, final: Path) -> Path:
    """Renames the complete directory `staging` to `final`; an existing `final` is moved aside.

    The writer's marker (``.writer``) is removed once renamed in: it names the writer of a
    temporary (a kill before the rename leaves it, so the next start removes the dead
    writer's ``.partial``), and a published directory has none. The aside copy
    (``iter_N.replaced``) is returned, to be deleted once the tracker moved; a failed rename
    in puts it back. A kill between the two renames is repaired by the next save or load
    (`pp_train.temporaries.restore_moved_aside`). The caller syncs the parent.

    Raises:
        OSError: A rename failed; `final` is as it was.
    """
    replaced = final.with_name(final.name + REPLACED_SUFFIX)
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        os.replace(final, replaced)
    try:
        os.replace(staging, final)
    except OSError as error:
        if replaced.exists() and not final.exists():
            os.replace(replaced, final)  # the tracker may name it: keep it loadable
        detail = f"could not rename {staging.name} to {final.name}: {error.strerror or error}"
        if error.errno is None:
            raise OSError(detail) from error
        raise OSError(error.errno, detail) from error
    with contextlib.suppress(FileNotFoundError):
        (final / WRITER_FILENAME).unlink()
    return replaced
