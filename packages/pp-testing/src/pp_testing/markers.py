"""pytest markers shared by the packages' tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

__all__ = ["cuda_device_count", "requires_gpus"]

_F = TypeVar("_F", bound=Callable[..., Any])


def cuda_device_count() -> int:
    """CUDA devices visible to this process (0 on a CPU build of torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_gpus(count: int) -> Callable[[_F], _F]:
    """Mark a test ``gpu`` and skip it unless `count` CUDA devices are visible.

    NCCL needs one device per rank, so a test on N NCCL ranks asks for N devices.
    """

    def decorate(test: _F) -> _F:
        found = cuda_device_count()
        skip = pytest.mark.skipif(
            found < count, reason=f"needs {count} CUDA devices, found {found}"
        )
        return pytest.mark.gpu(skip(test))  # type: ignore[no-any-return]

    return decorate
