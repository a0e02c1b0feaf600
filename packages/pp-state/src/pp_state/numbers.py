"""Checks of whole numbers that every layer shares: one definition each, no torch.

`bool` subclasses `int`, but ``True`` as a size or a count is always a mistake, so these
refuse it.
"""

from __future__ import annotations

__all__ = ["check_at_least", "check_int", "divisors", "is_int", "is_real"]


def is_int(value: object) -> bool:
    """Whether `value` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """Whether `value` is an int or a float and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: object, least: int) -> int:
    """`value`, checked to be an int of at least `least`.

    Raises:
        TypeError: `value` is not an int (or is a bool); the message names `name`.
        ValueError: `value` is below `least`.
    """
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    assert isinstance(value, int)
    if value < least:
        raise ValueError(f"{name} must be {least} or more, got {value}")
    return value


def check_at_least(name: str, value: object, minimum: int) -> int:
    """`value`, checked as `check_int` does, in the wording of Megatron's batch-size checks.

    Raises:
        TypeError: "NAME must be an int, got V (TYPE)".
        ValueError: "NAME must be >= MINIMUM, got V".
    """
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    assert isinstance(value, int)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def divisors(number: int) -> list[int]:
    """The positive divisors of `number`, smallest first (the sizes that split it evenly)."""
    return [d for d in range(1, number + 1) if number % d == 0]
