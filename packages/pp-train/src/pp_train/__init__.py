"""pp-train: training loop, logging and checkpoints (skeleton; no API yet)."""

from importlib.metadata import version as _version

__version__ = _version("pp-train")

__all__ = ["__version__"]
