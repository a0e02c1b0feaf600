"""How a run splits its transformer layers over the pipeline, decided before any group starts.

One answer, a tuple of layer counts per virtual stage (pp-state's `PipelineLayerLayout`),
from the first of these that applies:

1. counts given to `pretrain` / `check_world` by the caller;
2. ``--pipeline-model-parallel-layout`` in Megatron's syntax (``Ett|tt|tt|L``);
3. ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``;
4. ``--pipeline-model-parallel-layout auto``, or layers that do not divide over the pipeline:
   the split whose simulated step is shortest (pp-schedules' `balance_layers`), with the
   embedding and the loss weighed in transformer layers (configured, measured by the command
   before the model is built, or 1 layer each);
5. the even split (with ``--num-layers-per-virtual-pipeline-stage``), as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pp_schedules import Costs, schedule_spec
from pp_schedules.planning import LayerBalance, balance_layers
from pp_state import LayerLayoutError, PipelineLayerLayout
from pp_state.numbers import divisors
from pp_train.arguments import ParallelArgs

__all__ = ["LayerSplit", "layer_split", "rebalanced"]

_SOURCES = {
    "counts": "the caller's layer counts",
    "layout": "--pipeline-model-parallel-layout",
    "first/last": "--decoder-first/last-pipeline-num-layers",
}

DEFAULT_END_COST = 1.0
"""The embedding's and the loss's time, in transformer layers, when neither is configured nor
measured (Megatron's ``--account-for-embedding-in-pipeline-split`` heuristic)."""


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """The layers of each virtual stage, and where the split came from."""

    counts: tuple[int, ...]
    """Transformer layers of each virtual stage, in pipeline order."""
    source: str
    """"counts", "layout", "first/last", "balanced" or "even"."""
    balance: LayerBalance | None = None
    """For a balanced split: the choice, the near-even split it replaced, and their times."""
    end_costs: tuple[float, float] | None = None
    """For a balanced split: the embedding's and the loss's time in transformer layers."""
    measured: bool = False
    """For a balanced split: whether its costs were measured in a warm-up."""
    schedule: str | None = None
    """For a balanced split: the named schedule it was balanced for (None: Megatron's
    default for one chunk per rank, as for ``auto``)."""

    def summary(self, layout: PipelineLayerLayout) -> str | None:
        """The line the run prints about its split (None for the even split)."""
        if self.source == "even":
            return None
        if self.balance is None or self.end_costs is None:
            return f"layer layout {layout} (from {_SOURCES[self.source]})"
        balance, (embedding, loss) = self.balance, self.end_costs
        how = "measured" if self.measured else "weighed"
        line = (
            f"layer layout {layout}, chosen by simulation ({balance.schedule}, "
            f"{balance.num_microbatches} microbatches; embedding {embedding:.2f} and loss "
            f"{loss:.2f} transformer layers, {how}): step {balance.makespan:.1f}"
        )
        if balance.even_makespan == balance.even_makespan:  # not NaN: the near-even split runs
            near = PipelineLayerLayout.from_counts(
                balance.even, layout.pp_size, placement=layout.placement
            )
            line += f" against {balance.even_makespan:.1f} for the near-even {near}"
        return line


def layer_split(
    parallel: ParallelArgs,
    num_layers: int,
    *,
    given: Sequence[int] | None = None,
    num_microbatches: int,
    schedule: str | None = None,
) -> LayerSplit:
    """The run's split of `num_layers` layers (see the module docstring for the order).

    Args:
        parallel: The parallel flags.
        num_layers: ``--num-layers``.
        given: Layer counts from the caller; they override the flags.
        num_microbatches: Microbatches per step, for balancing by simulation.
        schedule: The named schedule to balance for (None: Megatron's default for one chunk
            per rank; what ``--pipeline-schedule auto`` balances for).

    Raises:
        ValueError: The counts, layout or first/last counts do not fit; the message names the
            flag, the layout, the position and the rule.
    """
    pp, text = parallel.pipeline_model_parallel_size, parallel.pipeline_model_parallel_layout
    if given is not None:
        return LayerSplit(_given(parallel, given, num_layers), "counts")
    if text is not None and text.strip().lower() != "auto":
        try:
            layout = PipelineLayerLayout.parse(text, pp, num_layers=num_layers)
        except (LayerLayoutError, TypeError) as error:
            raise ValueError(f"--pipeline-model-parallel-layout: {error}") from error
        return LayerSplit(layout.counts, "layout")
    first = parallel.decoder_first_pipeline_num_layers
    last = parallel.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        return LayerSplit(_first_last(num_layers, pp, first, last), "first/last")
    if text is not None or (
        num_layers % pp and parallel.num_layers_per_virtual_pipeline_stage is None
    ):
        costs = end_costs(parallel, (DEFAULT_END_COST, DEFAULT_END_COST))
        return balanced(parallel, num_layers, num_microbatches, costs=costs, schedule=schedule)
    return LayerSplit(_even(parallel, num_layers), "even")


def end_costs(parallel: ParallelArgs, fallback: tuple[float, float]) -> tuple[float, float]:
    """The embedding's and the loss's time in layers: configured, else `fallback`'s."""
    embedding, loss = parallel.pipeline_layout_embedding_cost, parallel.pipeline_layout_loss_cost
    return (
        fallback[0] if embedding is None else float(embedding),
        fallback[1] if loss is None else float(loss),
    )


def balanced(
    parallel: ParallelArgs,
    num_layers: int,
    num_microbatches: int,
    *,
    costs: tuple[float, float],
    layer: Costs | None = None,
    schedule: str | None = None,
) -> LayerSplit:
    """The split with the shortest simulated step, the ends weighing `costs` layers each.

    The schedule simulated is the named one (Megatron's default for the sizes otherwise), on
    the chunks per rank and the placement its registry record gives (two chunks for one that
    takes any number and needs several, as interleaved 1F1B; one otherwise).
    """
    named = schedule
    spec = None if named is None else schedule_spec(named)
    vp = 1 if spec is None else spec.chunks or max(spec.min_chunks, 1)
    per_layer = Costs() if layer is None else layer
    try:
        balance = balance_layers(
            num_layers, parallel.pipeline_model_parallel_size, vp_size=vp,
            layer_cost=per_layer, embedding_cost=_times(per_layer, costs[0]),
            loss_cost=_times(per_layer, costs[1]), schedule=named,
            num_microbatches=num_microbatches,
            placement="looped" if spec is None else spec.placement,
        )  # fmt: skip
    except ValueError as error:
        raise ValueError(
            f"--num-layers {num_layers} cannot be split over --pipeline-model-parallel-size "
            f"{parallel.pipeline_model_parallel_size} x {vp} chunks: {error}"
        ) from error
    return LayerSplit(balance.counts, "balanced", balance, costs, schedule=named)


def rebalanced(
    split: LayerSplit, parallel: ParallelArgs, measured: tuple[Costs, float, float]
) -> LayerSplit:
    """`split` balanced again with measured costs; other splits stay as they are.

    Args:
        split: The split chosen before anything was measured.
        parallel: The parallel flags; configured end costs win over measured ones.
        measured: One layer's step costs, and the embedding's and the loss's time in layers.
    """
    if split.balance is None:
        return split
    layer, embedding, loss = measured
    costs = end_costs(parallel, (embedding, loss))
    again = balanced(
        parallel, sum(split.counts), split.balance.num_microbatches, costs=costs, layer=layer,
        schedule=split.schedule,
    )  # fmt: skip
    return dataclasses.replace(again, measured=True)


def _times(layer: Costs, factor: float) -> Costs | None:
    """`layer`'s compute costs times `factor` (None for nothing to do)."""
    if factor <= 0:
        return None
    halves = (layer.backward_input, layer.backward_weight)
    given, weight = (None if half is None else half * factor for half in halves)
    return Costs(
        forward=layer.forward * factor, backward=layer.backward * factor,
        backward_input=given, backward_weight=weight,
    )  # fmt: skip


def _given(parallel: ParallelArgs, given: Sequence[int], num_layers: int) -> tuple[int, ...]:
    pp, per_chunk = (
        parallel.pipeline_model_parallel_size,
        parallel.num_layers_per_virtual_pipeline_stage,
    )
    counts = tuple(given)
    if per_chunk is not None:
        raise ValueError(
            f"layer counts {counts} and --num-layers-per-virtual-pipeline-stage {per_chunk} "
            "both say how the layers split; give one"
        )
    layout = PipelineLayerLayout.from_counts(counts, pp)
    if layout.num_layers != num_layers:
        raise ValueError(
            f"layer counts {counts} add up to {layout.num_layers} layers, but --num-layers is "
            f"{num_layers}; the counts must add up to the number of layers"
        )
    return layout.counts


def _first_last(num_layers: int, pp: int, first: int | None, last: int | None) -> tuple[int, ...]:
    flags = " and ".join(
        f"--decoder-{name}-pipeline-num-layers {value}"
        for name, value in (("first", first), ("last", last))
        if value is not None
    )
    try:
        return PipelineLayerLayout.from_first_last(num_layers, pp, first=first, last=last).counts
    except ValueError as error:
        raise ValueError(f"{flags} with --num-layers {num_layers}: {error}") from error


def _even(parallel: ParallelArgs, num_layers: int) -> tuple[int, ...]:
    """The even split the flags describe, with the old messages for what does not divide."""
    pp, per_chunk = (
        parallel.pipeline_model_parallel_size,
        parallel.num_layers_per_virtual_pipeline_stage,
    )
    per_stage = num_layers // pp
    if num_layers % pp:
        raise ValueError(
            f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} "
            "(--num-layers-per-virtual-pipeline-stage needs an even split); use a multiple "
            f"of {pp} layers, or give --pipeline-model-parallel-layout"
        )
    if per_chunk is None or per_chunk == per_stage:
        return PipelineLayerLayout.even(num_layers, pp).counts
    if per_stage % per_chunk:
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {per_chunk} does not divide the "
            f"{per_stage} layers of each pipeline stage; use one of {divisors(per_stage)}"
        )
    if pp == 1:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size 2 or more"
        )
    return PipelineLayerLayout.even(num_layers, pp, per_stage // per_chunk).counts
