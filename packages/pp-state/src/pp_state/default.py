"""The process-wide default `ParallelState`, set once, for entry points and ported code.

Library layers never read it: they take groups as arguments. Only entry points (a training
script, pp-train's command) and the Megatron-compatible facade do.
"""

from __future__ import annotations

from pp_state.state import ParallelState

__all__ = [
    "NotInitializedError",
    "get_default_state",
    "has_default_state",
    "reset_default_state",
    "set_default_state",
]


class NotInitializedError(RuntimeError, AssertionError):
    """The default parallel state was read before it was set (Megatron asserts it)."""


_DEFAULT: ParallelState | None = None
OVERRIDES: dict[str, int | None] = {}
"""Megatron's module-level overrides (``set_tensor_model_parallel_rank``, the virtual
pipeline rank, ...): the mutable part of the `pp_state.parallel_state` facade, which alone
writes it (its `set_*` calls); cleared whenever the default state is set or reset."""


def set_default_state(state: ParallelState) -> None:
    """Make `state` the process-wide default.

    Raises:
        TypeError: `state` is not a ParallelState.
        RuntimeError: A default is set already; destroy it (``destroy_model_parallel()``) or
            `reset_default_state` first.
    """
    global _DEFAULT  # noqa: PLW0603 - the one set-once global of this package
    if not isinstance(state, ParallelState):
        raise TypeError(f"expected a ParallelState, got {type(state).__name__}")
    if _DEFAULT is not None and not _DEFAULT.destroyed:
        raise RuntimeError(
            "the default parallel state is already set (model parallel is initialized); "
            "call destroy_model_parallel() before initializing again"
        )
    _DEFAULT = state
    # Overrides belong to the state they were set on.
    OVERRIDES.clear()


def get_default_state() -> ParallelState:
    """The process-wide default state.

    Raises:
        NotInitializedError: None was set, or it was destroyed.
    """
    if _DEFAULT is None or _DEFAULT.destroyed:
        raise NotInitializedError(
            "model parallel state is not initialized: call "
            "pp_state.initialize_model_parallel(...) (or set_default_state) first"
        )
    return _DEFAULT


def has_default_state() -> bool:
    """Whether a live default state is set."""
    return _DEFAULT is not None and not _DEFAULT.destroyed


def reset_default_state(*, destroy: bool = True) -> None:
    """Forget the default state (tests call this between cases).

    Args:
        destroy: Also destroy its process groups.
    """
    global _DEFAULT  # noqa: PLW0603
    if destroy and _DEFAULT is not None:
        _DEFAULT.destroy()
    _DEFAULT = None
    OVERRIDES.clear()
