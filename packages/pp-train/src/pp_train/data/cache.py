"""Index arrays cached on disk, keyed by a description of what determines them.

Each cache entry is ``{md5}-{kind}-{name}.npy`` per array plus ``{md5}-{kind}-description.txt``
(Megatron's file naming), where the MD5 is that of the description. Every file is written to
a temporary name and renamed, and the description last, so processes that build the same
entry at once each leave complete files and a reader never sees a torn one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy

__all__ = ["cached_or_built"]


def _save_atomically(path: Path, write: Callable[[Any], object]) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            write(stream)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _save(
    directory: Path, base: str, names: tuple[str, ...], description: str, arrays: list[Any]
) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, array in zip(names, arrays, strict=True):
            _save_atomically(
                directory / f"{base}-{name}.npy", functools.partial(numpy.save, arr=array)
            )
        text = description.encode("utf-8")
        _save_atomically(directory / f"{base}-description.txt", lambda f: f.write(text))
    except OSError as error:
        raise ValueError(
            f"cannot write the dataset index cache in {directory} ({error.strerror}); "
            "give a writable directory as data_cache_path (--data-cache-path)"
        ) from error


def _load(directory: Path, base: str, names: tuple[str, ...], description: str) -> list[Any] | None:
    try:
        if (directory / f"{base}-description.txt").read_text(encoding="utf-8") != description:
            return None
        return [numpy.load(directory / f"{base}-{n}.npy", mmap_mode="r") for n in names]
    except (OSError, ValueError):
        return None


def cached_or_built(
    cache_dir: Path | None,
    kind: str,
    names: tuple[str, ...],
    identifiers: dict[str, Any],
    build: Callable[[], list[Any]],
) -> list[Any]:
    """The arrays `build` makes, read from `cache_dir` if there, else built and written there.

    Args:
        cache_dir: The cache directory (None: always build, write nothing).
        kind: Part of the file names, such as ``GPTDataset-train``.
        names: The arrays' names, in `build`'s order.
        identifiers: Everything the arrays depend on (JSON-serializable).
        build: Makes the arrays.

    Returns:
        The arrays (memory-mapped when read from the cache).

    Raises:
        ValueError: The cache directory cannot be written.
    """
    if cache_dir is None:
        return build()
    description = json.dumps(identifiers, indent=4)
    digest = hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()
    base = f"{digest}-{kind}"
    cached = _load(cache_dir, base, names, description)
    if cached is not None:
        return cached
    arrays = build()
    _save(cache_dir, base, names, description, arrays)
    return arrays
