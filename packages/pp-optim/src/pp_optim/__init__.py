"""pp-optim: optimizer pieces of pipeline-parallel training (skeleton; no API yet)."""

from importlib.metadata import version as _version

__version__ = _version("pp-optim")

__all__ = ["__version__"]
