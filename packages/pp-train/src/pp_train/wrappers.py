"""Reaching a model chunk through the wrappers training puts around it, and making it whole."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["finish_param_sync", "unwrap_model"]


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside any wrappers that hold it as ``.module`` (DDP, Float16Module)."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module  # type: ignore[assignment]
    return module


def finish_param_sync(model: Sequence[torch.nn.Module]) -> None:
    """Waits for the parameters' all-gathers still in flight, so every chunk is whole.

    With ``--overlap-param-gather`` the distributed optimizer's step leaves each bucket's
    all-gather running until the next forward needs it; whoever reads the parameters outside
    a forward (the params norm, a checkpoint) waits here first. Chunks without pp-optim's
    ``finish_param_sync`` (no distributed optimizer) are whole already.

    Args:
        model: This rank's model chunks (wrapped or not).
    """
    for chunk in model:
        finish = getattr(chunk, "finish_param_sync", None)
        if callable(finish):
            finish()
