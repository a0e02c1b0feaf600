"""What planning costs: a budget on a plan's size, checked before planning starts.

Generating, lowering, validating (gloo and NCCL rules) and simulating a plan each take time
near-linear in its compute steps: ``pp_size * vp_size * num_microbatches`` times 2 (F and B)
or 3 (F, I and W for the zero-bubble schedules), or 1 forward-only. On one core of the
machines this was measured on, a resolution costs about 50 to 150 microseconds per step
(pp 64 with 512 microbatches: 65,536 to 196,608 steps, seconds), so sizes far beyond any
run (a million microbatches) are refused with the numbers instead of planned for hours:
`check_plan_budget` raises before the generator runs. ``max_plan_steps`` on `plan`,
`resolve_schedule`, `choose_schedule` and `choose_fitting` raises (or, None, lifts) it.

Pure Python, no torch.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["DEFAULT_MAX_PLAN_STEPS", "check_plan_budget", "collection_paused", "plan_steps"]

DEFAULT_MAX_PLAN_STEPS = 4_000_000
"""The most compute steps a plan may have unless raised: 20 times ZB-V's at pp 64 with 512
microbatches (196,608), a few minutes of planning on one core."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def plan_steps(*, pp_size: int, vp_size: int, num_microbatches: int, kinds: int) -> int:
    """Compute steps of a plan: every rank runs `kinds` steps per (microbatch, chunk)."""
    return pp_size * vp_size * num_microbatches * kinds


def check_plan_budget(
    name: str,
    *,
    pp_size: int,
    vp_size: int,
    num_microbatches: int,
    kinds: int,
    max_plan_steps: int | None,
) -> None:
    """Refuse a plan larger than `max_plan_steps` compute steps before it is made.

    Raises:
        ValueError: The plan's size is over the budget; the message names the sizes, the
            steps, the budget and how to raise it.
    """
    steps = plan_steps(
        pp_size=pp_size, vp_size=vp_size, num_microbatches=num_microbatches, kinds=kinds
    )
    if max_plan_steps is not None and steps > max_plan_steps:
        raise ValueError(
            f"planning {name} for {pp_size} ranks x {vp_size} chunks with {num_microbatches:,} "
            f"microbatches makes {steps:,} compute steps ({kinds} per microbatch and chunk), "
            f"over the planning budget of {max_plan_steps:,} steps (about 100 us each); use "
            "fewer microbatches, or raise max_plan_steps (None: no limit) to plan it anyway"
        )


def collection_paused(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """`function` with Python's cyclic garbage collector paused while it runs.

    Planning allocates millions of small objects and makes no reference cycles; each
    collection would walk them all again, for up to half of planning's time. Collection
    resumes afterwards (if it was on), whatever `function` raised.
    """

    @functools.wraps(function)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not gc.isenabled():
            return function(*args, **kwargs)
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            gc.enable()

    return paused
