"""pp-schedules: pipeline schedules as verified data (skeleton; no API yet)."""

from importlib.metadata import version as _version

__version__ = _version("pp-schedules")

__all__ = ["__version__"]
