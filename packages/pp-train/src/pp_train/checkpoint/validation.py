"""Checks of what a save or load is handed, made before any rank writes or changes anything."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pp_optim import OptimizerParamScheduler
from pp_state.numbers import is_int

__all__ = [
    "check_chunks",
    "check_count",
    "check_load_arguments",
    "check_plain",
    "check_save_arguments",
    "check_scheduler_state",
]

_PLAIN_SCALARS = (type(None), bool, int, float, str)


def check_count(name: str, value: object) -> None:
    """Raises unless `value` is an int >= 0 (not a bool).

    Raises:
        TypeError: `value` is not an int; the message names `name`.
        ValueError: `value` is negative.
    """
    if not is_int(value):
        raise TypeError(f"{name} must be an int >= 0, got {value!r}")
    assert isinstance(value, int)
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value}")


def check_chunks(model: object) -> None:
    """Raises unless `model` is a non-empty list of modules (a rank's model chunks).

    Raises:
        TypeError: `model` is not a list of `torch.nn.Module`.
        ValueError: `model` is empty.
    """
    if not isinstance(model, list) or not all(isinstance(c, torch.nn.Module) for c in model):
        raise TypeError(f"model must be a list of torch.nn.Module chunks, got {model!r:.80}")
    if not model:
        raise ValueError("model must hold at least one chunk, got an empty list")


def check_plain(value: object, where: str) -> None:
    """Raises TypeError unless `value` unpickles with ``weights_only=True`` as itself."""
    if isinstance(value, _PLAIN_SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where} has a key {key!r} of type {type(key).__name__}; keys must be str"
                )
            check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; checkpoint args hold only None, bool, int, "
        "float, str, and lists, tuples and str-keyed dicts of them"
    )


def check_save_arguments(
    iteration: int, consumed: tuple[int, int], model: object, args: object
) -> None:
    """Raises unless a save's iteration, consumed samples, model and args are well formed.

    Raises:
        TypeError: A count is not an int, `model` not a list of modules, or `args` holds
            something other than plain values.
        ValueError: A count is negative or `model` is empty.
    """
    check_count("iteration", iteration)
    check_count("consumed_train_samples", consumed[0])
    check_count("consumed_valid_samples", consumed[1])
    check_chunks(model)
    check_plain(args, "args")


def check_load_arguments(model: object, args: object, strict_args: object) -> None:
    """Raises unless a load's model, args and strict args are well formed.

    Raises:
        TypeError: `model` is not a list of modules, `args` not a dict or `strict_args` not
            a tuple of str.
        ValueError: `model` is empty.
    """
    check_chunks(model)
    if not isinstance(args, dict):
        raise TypeError(f"args must be a dict, got {type(args).__name__}")
    if not isinstance(strict_args, tuple) or not all(isinstance(k, str) for k in strict_args):
        raise TypeError(f"strict_args must be a tuple of str, got {strict_args!r}")


def check_scheduler_state(scheduler: OptimizerParamScheduler, saved: object) -> None:
    """Raises unless `scheduler` would accept `saved`, without touching it.

    Raises:
        ValueError: `saved` is not a dict, or the scheduler refuses it.
    """
    if not isinstance(saved, Mapping):
        raise ValueError(f"'opt_param_scheduler' state is a {type(saved).__name__}, not a dict")
    # A scheduler over a throwaway optimizer runs the real checks on a copy of the config.
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    OptimizerParamScheduler(probe, scheduler.config).load_state_dict(saved)
