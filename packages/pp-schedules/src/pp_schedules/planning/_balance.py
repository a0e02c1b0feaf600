"""Balancing layers over an uneven pipeline: the split with the smallest simulated makespan.

The embedding makes the first virtual stage heavier and the output layer and loss the last;
layer counts rarely divide the number of stages. `balance_layers` tries splits of the layers
over the virtual stages (``counts[s]`` transformer layers on stage ``s``, the first stage also
holding the embedding and the last the loss), times each with the simulator
(`StageCosts.from_layers`) on one validated plan, and keeps the fastest.

The search: every number of layers for the first and the last stage up to the even share
(one more), the rest spread evenly over the middle stages; then, from the best of those,
moves of one layer between any two stages while one shortens the step. Each middle stage
keeps at least one layer; the first and the last may hold none. Ties go to the split
closest to even, then to the smallest counts in order. Pure Python.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec

from pp_schedules.planning._registry import default_schedule, schedules_for
from pp_schedules.planning._resolution import plan
from pp_schedules.planning._simulation import Costs, StageCosts, simulate
from pp_schedules.planning._validation import validate

__all__ = ["LayerBalance", "balance_layers", "balanced_counts", "even_counts"]

Counts = tuple[int, ...]
P = ParamSpec("P")


@dataclasses.dataclass(frozen=True)
class LayerBalance:
    """The chosen split of layers and what it was compared with.

    Attributes:
        counts: Transformer layers of each virtual stage, in pipeline order: the fastest split.
        makespan: Its simulated step time (the costs' unit).
        even: The near-even split (`even_counts`) it replaces.
        even_makespan: The near-even split's simulated step time; NaN where that split
            leaves a middle stage without a layer (fewer layers than stages).
        schedule: The schedule simulated.
        num_microbatches: Microbatches per simulated step.
        tried: Every split simulated, with its makespan.
    """

    counts: Counts
    makespan: float
    even: Counts
    even_makespan: float
    schedule: str
    num_microbatches: int
    tried: dict[Counts, float] = dataclasses.field(repr=False)

    def table(self, limit: int = 5) -> str:
        """The `limit` fastest splits and the near-even one, the choice marked with '*'."""
        ranked = sorted(self.tried.items(), key=lambda item: _rank(item[0], item[1]))
        shown = [counts for counts, _ in ranked[:limit]]
        if self.even not in shown and self.even in self.tried:
            shown.append(self.even)
        lines = [f"  {'layers per virtual stage':<32} {'makespan':>9}"]
        for counts in shown:
            mark = "*" if counts == self.counts else " "
            note = "  near-even" if counts == self.even else ""
            text = ", ".join(map(str, counts))
            lines.append(f"{mark} {text:<32} {self.tried[counts]:>9.1f}{note}")
        return "\n".join(lines)


def even_counts(num_layers: int, num_stages: int) -> Counts:
    """The near-even split: each stage ``num_layers // num_stages``, the first stages one more.

    Raises:
        ValueError: `num_stages` below 1 or `num_layers` below 0.
    """
    if num_stages < 1 or num_layers < 0:
        raise ValueError(
            f"cannot split {num_layers} layers over {num_stages} stages: the layers must be 0 "
            "or more and the stages 1 or more"
        )
    share, extra = divmod(num_layers, num_stages)
    return tuple(share + (1 if stage < extra else 0) for stage in range(num_stages))


def _rank(counts: Counts, makespan: float) -> tuple[float, float, Counts]:
    """Order of preference: faster, then closer to even, then smaller counts first."""
    mean = sum(counts) / len(counts)
    return (round(makespan, 9), round(sum((c - mean) ** 2 for c in counts), 9), counts)


def _seeds(num_layers: int, num_stages: int) -> list[Counts]:
    """First and last counts up to one over the even share, the middle spread evenly."""
    if num_stages == 1:
        return [(num_layers,)]
    if num_stages == 2:
        return [(first, num_layers - first) for first in range(num_layers + 1)]
    middle = num_stages - 2
    bound = min(-(-num_layers // num_stages) + 1, num_layers - middle)
    return [
        (first, *even_counts(num_layers - first - last, middle), last)
        for first in range(bound + 1)
        for last in range(min(bound, num_layers - middle - first) + 1)
    ]


def _moves(counts: Counts) -> list[Counts]:
    """Every split one layer away, middle stages keeping at least one layer."""
    last = len(counts) - 1
    moved = []
    for source, n in enumerate(counts):
        if n <= (0 if source in (0, last) else 1):
            continue
        for target in range(len(counts)):
            if target != source:
                step = list(counts)
                step[source] -= 1
                step[target] += 1
                moved.append(tuple(step))
    return moved


def _search(num_layers: int, num_stages: int, time: Callable[[Counts], float]) -> Counts:
    """The fastest split found from the seeds and then single-layer moves."""
    best = min(_seeds(num_layers, num_stages), key=lambda c: _rank(c, time(c)))
    while True:
        options = [best, *_moves(best)]
        better = min(options, key=lambda c: _rank(c, time(c)))
        if better == best:
            return best
        best = better


def _check(num_layers: int, num_stages: int) -> None:
    for name, value in (("num_layers", num_layers), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_layers < 0:
        raise ValueError(f"num_layers must be 0 or more, got {num_layers}")
    if num_layers < num_stages - 2:
        raise ValueError(
            f"{num_layers} layers cannot fill {num_stages} virtual stages: each of the "
            f"{num_stages - 2} middle stages needs a layer, so at least {num_stages - 2} layers"
        )


def _fastest_schedule(pp_size: int, vp_size: int, placement: str) -> str:
    """The first of ``auto``'s candidates on `placement` (the registry's default if none)."""
    on_placement = [name for name, where in schedules_for(vp_size) if where == placement]
    return on_placement[0] if on_placement else default_schedule(pp_size, vp_size, placement)


def balance_layers(
    num_layers: int,
    pp_size: int,
    *,
    vp_size: int = 1,
    layer_cost: Costs | None = None,
    embedding_cost: Costs | None = None,
    loss_cost: Costs | None = None,
    schedule: str | None = None,
    num_microbatches: int | None = None,
    placement: str = "looped",
) -> LayerBalance:
    """The split of `num_layers` over ``pp_size * vp_size`` virtual stages that runs fastest.

    Args:
        num_layers: Transformer layers of the model.
        pp_size: Pipeline ranks.
        vp_size: Model chunks per rank.
        layer_cost: One transformer layer's costs (F:B = 1:2 by default); its transfer and
            exchange costs are the pipeline's.
        embedding_cost: The embedding's costs (on virtual stage 0); none by default.
        loss_cost: The output layer's and loss's costs (on the last virtual stage); none by
            default.
        schedule: The schedule to time (a `pp_schedules.plan` name): 1F1B with one chunk,
            interleaved 1F1B with more, ZB-V on the V placement by default.
        num_microbatches: Microbatches per step; ``2 * pp_size`` by default.
        placement: "looped" or "v": which (rank, chunk) holds each virtual stage.

    Returns:
        The chosen counts, their makespan, the near-even split's, and every split tried.

    Raises:
        TypeError: A size that is not an int.
        ValueError: Fewer layers than middle stages, or a configuration the schedule refuses.
    """
    num_stages = pp_size * vp_size
    _check(num_layers, num_stages)
    name = schedule or _fastest_schedule(pp_size, vp_size, placement)
    m = num_microbatches or 2 * pp_size
    report = validate(
        plan(name, pp_size=pp_size, num_microbatches=m, vp_size=vp_size, placement=placement)
    )
    layer = layer_cost or Costs()
    tried: dict[Counts, float] = {}

    def time(counts: Counts) -> float:
        if counts not in tried:
            costs = StageCosts.from_layers(
                counts, layer=layer, embedding=embedding_cost, loss=loss_cost
            )
            tried[counts] = simulate(report, costs).makespan
        return tried[counts]

    chosen = _search(num_layers, num_stages, time)
    even = even_counts(num_layers, num_stages)
    if min(even[1:-1], default=1) >= 1:
        time(even)
    return LayerBalance(chosen, tried[chosen], even, tried.get(even, float("nan")), name, m, tried)


def _counts_only(balance: Callable[P, LayerBalance]) -> Callable[P, Counts]:
    """`balance` returning only the chosen counts (same arguments, checked by mypy)."""

    @functools.wraps(balance)
    def counts(*args: P.args, **kwargs: P.kwargs) -> Counts:
        return balance(*args, **kwargs).counts

    counts.__name__ = counts.__qualname__ = "balanced_counts"
    signature = inspect.signature(balance).replace(return_annotation="tuple[int, ...]")
    counts.__signature__ = signature  # type: ignore[attr-defined]
    counts.__doc__ = (
        "The fastest layers per virtual stage: `balance_layers(...).counts` (same arguments)."
    )
    return counts


balanced_counts = _counts_only(balance_layers)
