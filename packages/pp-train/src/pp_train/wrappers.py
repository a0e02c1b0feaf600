"""Reaching a model chunk through the wrappers training puts around it."""

from __future__ import annotations

import torch

__all__ = ["unwrap_model"]


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside any wrappers that hold it as ``.module`` (DDP, Float16Module)."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module  # type: ignore[assignment]
    return module
