"""Checkpoint temporaries named after their writer, and the removal of dead writers' ones.

A save writes files under temporary names (``<name>.tmp-<host>-<pid>``, then renamed) and
torch_dist directories as ``iter_N.partial`` (global rank 0 writes ``.writer`` in it holding
``<host> <pid>``). A kill -9 leaves them behind; `remove_stale_temporaries` (called by global
rank 0 when a save or load starts) removes those whose writer is dead:

- written on this host: dead when no process has its pid (this process's own are never
  stale: an asynchronous save of its own may be in flight);
- written on another host, or of an unknown writer: dead when nothing in it changed for
  `STALE_AFTER` (a writer's pid cannot be checked from here; a live save keeps writing).

Saving again an iteration that exists moves the published ``iter_N`` aside as
``iter_N.replaced``, renames the new one in and deletes the aside copy. Only global rank 0
does this, within one call, so an ``iter_N.replaced`` seen when a save or load starts is a
killed save's: `restore_moved_aside` renames it back when ``iter_N`` is missing (the
tracker named it; the unpublished ``iter_N.partial`` is then a dead writer's temporary), and
`remove_stale_temporaries` removes it when ``iter_N`` is there (the rename in had happened).

Limits: a pid reused by an unrelated process keeps a temporary until that process ends; a
save on another host that stalls for longer than `STALE_AFTER` loses its temporary (and
fails when it renames it); two jobs saving into one directory are not told apart.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "PARTIAL_SUFFIX",
    "REPLACED_SUFFIX",
    "STALE_AFTER",
    "WRITER_FILENAME",
    "mark_writer",
    "remove_stale_temporaries",
    "restore_moved_aside",
    "temporary_path",
]

PARTIAL_SUFFIX = ".partial"
"""Suffix of the directory a torch_dist save writes into before it is complete."""

REPLACED_SUFFIX = ".replaced"
"""Suffix of a published iteration directory moved aside while that iteration is saved again."""

WRITER_FILENAME = ".writer"
"""The file in a ``.partial`` directory naming its writer (``<host> <pid>``)."""

STALE_AFTER = 3600.0
"""Seconds without a change after which another host's temporary counts as dead."""

_TEMPORARY = re.compile(r"\.tmp-(?:(?P<host>.+)-)?(?P<pid>\d+)$")


@dataclasses.dataclass(frozen=True)
class _Writer:
    host: str | None
    pid: int | None
    gone: bool = False  # known to have no live writer (an aside copy already replaced)


_GONE = _Writer(None, None, gone=True)


def temporary_path(path: Path) -> Path:
    """The name this process writes `path` under before renaming it into place."""
    return path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def mark_writer(directory: Path) -> None:
    """Names this process as the writer of the ``.partial`` `directory`."""
    (directory / WRITER_FILENAME).write_text(f"{socket.gethostname()} {os.getpid()}\n")


def remove_stale_temporaries(
    root: Path, report: Callable[[str], None] | None = print, *, now: float | None = None
) -> list[str]:
    """Removes the temporaries of dead writers under `root`; says what in one line.

    Never raises: a temporary that cannot be inspected or removed is left alone.

    Args:
        root: A checkpoint directory (may be missing).
        report: Gets one line naming what was removed (nothing when nothing was).
        now: The time to measure ages against (seconds since the epoch); now when None.

    Returns:
        The removed paths relative to `root` (directories end with ``/``).
    """
    now = time.time() if now is None else now
    removed: list[str] = []
    total = 0
    for path, writer in _temporaries(root):
        try:
            if not _is_dead(writer, now - _last_change(path)):
                continue
            size = _size(path)
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        total += size
        name = path.relative_to(root).as_posix()
        removed.append(name + "/" if path.suffix in (PARTIAL_SUFFIX, REPLACED_SUFFIX) else name)
    if removed and report is not None:
        report(
            f"removed {len(removed)} stale checkpoint temporaries of dead writers "
            f"({total / 1e6:.1f} MB): {', '.join(removed)}"
        )
    return removed


def restore_moved_aside(root: Path, report: Callable[[str], None] | None = print) -> list[str]:
    """Renames each ``iter_N.replaced`` back to ``iter_N`` where ``iter_N`` is missing.

    A save of an iteration that exists killed between moving the old directory aside and
    renaming the new one in leaves the tracker naming ``iter_N`` while only the aside copy,
    complete and published before, holds it. Never raises: one that cannot be renamed is
    left (the load then names the missing directory).

    Args:
        root: A checkpoint directory (may be missing).
        report: Gets one line naming what was put back (nothing when nothing was).

    Returns:
        The restored directories' names (``iter_N``).
    """
    restored: list[Path] = []
    for path in sorted(root.glob(f"iter_*{REPLACED_SUFFIX}")) if root.is_dir() else []:
        final = path.with_suffix("")
        if not path.is_dir() or final.exists():
            continue
        try:
            os.replace(path, final)
        except OSError:
            continue
        restored.append(final)
    if restored and report is not None:
        moves = ", ".join(f"{final.name}{REPLACED_SUFFIX} -> {final.name}" for final in restored)
        report(
            f"restored {len(restored)} checkpoint(s) moved aside by a save killed before "
            f"renaming their replacement in: {moves}"
        )
    return [final.name for final in restored]


def _temporaries(root: Path) -> Iterator[tuple[Path, _Writer]]:
    if not root.is_dir():
        return
    patterns = ("*.tmp-*", "iter_*/*.tmp-*", "iter_*/mp_rank_*/*.tmp-*")
    for pattern in patterns:
        for path in sorted(root.glob(pattern)):
            match = _TEMPORARY.search(path.name)
            if match is not None and path.is_file() and PARTIAL_SUFFIX not in path.parent.name:
                yield path, _Writer(match["host"], int(match["pid"]))
    for path in sorted(root.glob(f"iter_*{PARTIAL_SUFFIX}")):
        if path.is_dir():
            yield path, _partial_writer(path)
    for path in sorted(root.glob(f"iter_*{REPLACED_SUFFIX}")):
        if path.is_dir() and path.with_suffix("").is_dir():  # its replacement is in place
            yield path, _GONE


def _partial_writer(directory: Path) -> _Writer:
    try:
        host, pid = (directory / WRITER_FILENAME).read_text().split()
        return _Writer(host, int(pid))
    except (OSError, ValueError):
        return _Writer(None, None)


def _is_dead(writer: _Writer, age: float) -> bool:
    if writer.gone:
        return True
    if writer.host != socket.gethostname() or writer.pid is None:
        return age > STALE_AFTER
    if writer.pid == os.getpid():
        return False
    try:
        os.kill(writer.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists but belongs to someone else
        return False
    return False


def _last_change(path: Path) -> float:
    if not path.is_dir():
        return path.stat().st_mtime
    return max([path.stat().st_mtime] + [p.stat().st_mtime for p in path.rglob("*")])


def _size(path: Path) -> int:
    if not path.is_dir():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
