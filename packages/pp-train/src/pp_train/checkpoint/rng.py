"""Random generator states as plain data: saved with a checkpoint, checked before restoring.

A state is parsed (`parse_rng_state`) while a load is still being validated and restored
(`restore_rng`) only once every rank can load, so a malformed state changes nothing. Besides
the process's generators it holds the named states of pp-tensor's RNG tracker
(`pp_tensor.get_rng_tracker`: the tensor-parallel state dropout draws from inside
tensor-parallel regions), as Megatron saves them (``rng_tracker_states``).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from typing import Any

import torch

from pp_state.numbers import is_int
from pp_tensor import get_rng_tracker

__all__ = ["RngState", "get_rng_state", "parse_rng_state", "restore_rng", "set_rng_state"]


@dataclasses.dataclass(frozen=True)
class RngState:
    """An RNG state already checked, ready to apply without failing half-way."""

    python_state: tuple[int, tuple[int, ...], float | None]
    """Python's `random` state, as `random.setstate` takes it."""

    torch_state: torch.Tensor
    """torch's CPU generator state."""

    cuda_states: list[torch.Tensor] | None
    """Each CUDA device's generator state (None: saved without CUDA)."""

    numpy_state: tuple[str, list[int], int, int, float] | None
    """numpy's legacy global state (None: saved without numpy)."""

    tracker_states: dict[str, torch.Tensor] | None = None
    """The RNG tracker's named states (None or empty: saved without any; the tracker is
    then left as this run seeded it)."""


def get_rng_state() -> dict[str, Any]:
    """This process's random generator states, as plain data.

    Returns:
        ``{"random", "torch", "cuda", "numpy", "rng_tracker_states"}``: Python's state as a
        list, torch's CPU state, every CUDA device's state (None without CUDA), numpy's
        legacy global state as a list (None without numpy) and the RNG tracker's named
        states (`pp_tensor.get_rng_tracker`, a dict of byte tensors); loadable with
        ``torch.load(..., weights_only=True)``.
    """
    version, internal, gauss = random.getstate()
    cuda = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else None
    return {
        "random": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "numpy": _numpy_rng_state(),
        "rng_tracker_states": get_rng_tracker().get_states(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restores what `get_rng_state` returned; a malformed state changes nothing.

    CUDA states are restored for the devices present (none without CUDA); numpy's when numpy
    is importable and the state holds one; the RNG tracker's when the state holds any.

    Args:
        state: The states, as `get_rng_state` returns them.

    Raises:
        ValueError: An entry is missing or malformed.
    """
    restore_rng(parse_rng_state(state))


def _numpy_rng_state() -> list[Any] | None:
    try:
        import numpy as np
    except ImportError:
        return None
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return [str(name), [int(key) for key in keys], int(pos), int(has_gauss), float(cached)]


def parse_rng_state(state: Mapping[str, Any]) -> RngState:
    """`state` (as `get_rng_state` returns it) checked and ready for `restore_rng`.

    Raises:
        ValueError: An entry is missing or malformed.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"an RNG state must be a dict, got {type(state).__name__}")
    missing = [key for key in ("random", "torch") if key not in state]
    if missing:
        raise ValueError(
            f"RNG state lacks {missing}; expected keys 'random', 'torch', 'cuda', 'numpy'"
        )
    return RngState(
        python_state=_parse_python_rng(state["random"]),
        torch_state=_parse_byte_tensor(state["torch"], "torch", torch.get_rng_state().numel()),
        cuda_states=_parse_cuda_rng(state.get("cuda")),
        numpy_state=_parse_numpy_rng(state.get("numpy")),
        tracker_states=_parse_tracker_states(state.get("rng_tracker_states")),
    )


def _is_int_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(is_int(item) for item in value)


def _parse_python_rng(value: object) -> tuple[int, tuple[int, ...], float | None]:
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError("RNG state 'random' must be [version, internal state, gauss_next]")
    version, internal, gauss = value
    if not is_int(version) or not _is_int_list(internal):
        raise ValueError("RNG state 'random' must hold an int version and a list of ints")
    if gauss is not None and not isinstance(gauss, float):
        raise ValueError(f"RNG state 'random' gauss_next must be a float or None, got {gauss!r}")
    return version, tuple(internal), gauss


def _parse_byte_tensor(value: object, name: str, numel: int | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise ValueError(f"RNG state {name!r} must be a 1-D uint8 tensor, got {value!r:.80}")
    if numel is not None and value.numel() != numel:
        raise ValueError(
            f"RNG state {name!r} has {value.numel()} bytes; this torch's generator has {numel}"
        )
    return value.cpu()


def _parse_cuda_rng(value: object) -> list[torch.Tensor] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"RNG state 'cuda' must be a list of tensors or None, got {value!r:.80}")
    return [_parse_byte_tensor(item, "cuda", None) for item in value]


def _parse_tracker_states(value: object) -> dict[str, torch.Tensor] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(
            f"RNG state 'rng_tracker_states' must map names to byte tensors, got {value!r:.80}"
        )
    return {
        name: _parse_byte_tensor(item, f"rng_tracker_states[{name!r}]", None)
        for name, item in value.items()
    }


def _parse_numpy_rng(value: object) -> tuple[str, list[int], int, int, float] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 5:
        raise ValueError(
            "RNG state 'numpy' must be [name, keys, pos, has_gauss, cached_gaussian] or None"
        )
    name, keys, pos, has_gauss, cached = value
    if not (
        isinstance(name, str)
        and _is_int_list(keys)
        and is_int(pos)
        and is_int(has_gauss)
        and isinstance(cached, float)
    ):
        raise ValueError("RNG state 'numpy' has entries of the wrong types")
    return name, list(keys), pos, has_gauss, cached


def restore_rng(state: RngState) -> None:
    """Applies a state `parse_rng_state` checked (CUDA for the devices present)."""
    if state.tracker_states:  # a run that saved none keeps this run's tracker seeding
        get_rng_tracker().set_states(state.tracker_states)
    random.setstate(state.python_state)
    torch.set_rng_state(state.torch_state)
    if state.cuda_states is not None and torch.cuda.is_available():
        # A run restarted on fewer visible devices restores the ones it has.
        for device, cuda_state in enumerate(state.cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
    if state.numpy_state is not None:
        try:
            import numpy as np
        except ImportError:
            return
        name, keys, pos, has_gauss, cached = state.numpy_state
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
