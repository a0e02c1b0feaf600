"""The distributed optimizer in the torch format: Megatron's ``distrib_optim.pt``.

Megatron's legacy format keeps a `DistributedOptimizer`'s state beside each model-parallel
position's ``model_optim_rng.pt``::

    <root>/iter_000000N/mp_rank_TT_PPP/model_optim_rng.pt   "optimizer": a marker (below)
    <root>/iter_000000N/mp_rank_TT_PPP/distrib_optim.pt     the whole fp32 parameters and
                                                            optimizer state of the position

Saving gathers every data-parallel rank's shards to data-parallel rank 0
(`DistributedOptimizer.gather_state_to_dp_zero`, a collective), which writes the file;
loading reads it on data-parallel rank 0 and hands each rank its shards back
(`DistributedOptimizer.load_state_from_dp_zero`). Like the rest of the torch format it loads
at the layout that saved it.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from pp_optim import DistributedOptimizer, MegatronOptimizer
from pp_optim.shard_checkpoint import param_sizes
from pp_train.checkpoint.errors import listed

__all__ = [
    "DISTRIB_OPTIM_FILENAME",
    "DP_ZERO_STATE",
    "dp_zero_state",
    "gather_optimizer_files",
    "optimizer_entry",
]

DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"
"""Megatron's name of the file holding a position's gathered distributed-optimizer state."""

DP_ZERO_STATE = "dp_zero_state"
"""The key a validated load plan keeps ``distrib_optim.pt``'s content under (None off rank 0)."""

_MARKER = "distributed_optimizer"


def optimizer_entry(optimizer: MegatronOptimizer) -> dict[str, Any]:
    """What ``model_optim_rng.pt`` holds as ``"optimizer"``.

    The optimizer's ``state_dict``; for a `DistributedOptimizer` a marker naming the file
    that holds its state instead (each rank's own shard would be of no use to the others).
    """
    if isinstance(optimizer, DistributedOptimizer):
        return {_MARKER: True, "file": DISTRIB_OPTIM_FILENAME}
    return optimizer.state_dict()


def gather_optimizer_files(optimizer: MegatronOptimizer | None) -> dict[str, Any]:
    """The files to write beside ``model_optim_rng.pt``; every rank calls it (a collective).

    Returns:
        ``{"distrib_optim.pt": state}`` on data-parallel rank 0 of a `DistributedOptimizer`;
        nothing elsewhere or for the other optimizers.
    """
    if not isinstance(optimizer, DistributedOptimizer):
        return {}
    gathered = optimizer.gather_state_to_dp_zero()
    return {} if gathered is None else {DISTRIB_OPTIM_FILENAME: gathered}


def dp_zero_state(saved: object, optimizer: MegatronOptimizer, path: Path) -> dict[str, Any] | None:
    """Checks the saved ``"optimizer"`` against the run's kind of optimizer.

    For a distributed one, data-parallel rank 0 reads ``distrib_optim.pt`` beside `path`.

    Args:
        saved: The ``"optimizer"`` entry of ``model_optim_rng.pt``.
        optimizer: The run's optimizer.
        path: That ``model_optim_rng.pt``.

    Returns:
        For a `DistributedOptimizer`: ``{DP_ZERO_STATE: state}`` (None off data-parallel
        rank 0) for ``load_state_from_dp_zero``; else None (the caller checks `saved` itself).

    Raises:
        ValueError: The checkpoint was saved with the other kind of optimizer, or its
            ``distrib_optim.pt`` is missing, unreadable or lacks parameters (the message
            names the file).
    """
    distributed = isinstance(saved, dict) and bool(saved.get(_MARKER))
    if not isinstance(optimizer, DistributedOptimizer):
        if distributed:
            raise ValueError(
                f"optimizer state was saved with --use-distributed-optimizer (in "
                f"{DISTRIB_OPTIM_FILENAME}); this run's optimizer is not distributed: pass "
                "--use-distributed-optimizer, or no_load_optim=True to start it afresh"
            )
        return None
    if not distributed:
        raise ValueError(
            "optimizer state was saved without --use-distributed-optimizer; this run's "
            "optimizer is distributed: drop the flag, load through the torch_dist format (it "
            "reshards), or pass no_load_optim=True to start it afresh"
        )
    if optimizer.data_parallel_rank != 0:
        return {DP_ZERO_STATE: None}
    state = _read(path.parent / DISTRIB_OPTIM_FILENAME)
    _check_covers(state, optimizer, path.parent / DISTRIB_OPTIM_FILENAME)
    return {DP_ZERO_STATE: state}


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(
            f"{path} is missing: the checkpoint was saved with "
            "--use-distributed-optimizer and keeps the optimizer state there (to load without "
            "it: no_load_optim)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as error:
        raise ValueError(f"{path} is corrupt or unsafe: {error}") from error
    if not isinstance(state, dict) or not isinstance(state.get("params"), dict):
        raise ValueError(f"{path} holds no per-parameter 'params' dict")
    return state


def _check_covers(state: dict[str, Any], optimizer: DistributedOptimizer, path: Path) -> None:
    """Every trainable parameter of the run's chunks is in the file, at its size."""
    sizes = param_sizes(optimizer.model_chunks)
    missing = sorted(name for name in sizes if name not in state["params"])
    wrong = []
    for name, size in sizes.items():
        entry = state["params"].get(name)
        value = entry.get("param") if isinstance(entry, dict) else None
        if name not in missing and (not isinstance(value, torch.Tensor) or value.numel() != size):
            found = value.numel() if isinstance(value, torch.Tensor) else "no 'param'"
            wrong.append(f"{name}: {found} elements, the parameter {size}")
    if missing or wrong:
        raise ValueError(
            f"{path} does not cover this run's parameters: missing "
            f"{listed(missing)}, other sizes {listed(wrong, '; ')}"
        )
