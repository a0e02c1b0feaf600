"""pp-comm: point-to-point communication between pipeline stages (skeleton; no API yet)."""

from importlib.metadata import version as _version

__version__ = _version("pp-comm")

__all__ = ["__version__"]
