"""The run decided once: schedule, chunks, layer split, recomputation, prefetch and bytes.

`check_world` checks the flags before any process group starts and resolves what they name
(`RunLayout`); a warm-up may then measure the model (`measure_run`: only what the decision
uses). `decide_run` takes the configuration, the checked layout and those measurements and
returns one frozen `RunPlan`. Everything after it (the parallel state, the model, the
executor, the log lines, the memory report) reads that record only: nothing after it reads
``--pipeline-schedule`` or asks whether it was ``auto``.

What the decision weighs, in order:

1. the split of layers: a split balanced by simulation whose end costs are not both
   configured is balanced again with the measured layer costs;
2. ``--pipeline-schedule auto`` (without ``--memory-limit-gb``): chosen among the schedules
   that run every microbatch count, with the measured step costs of one chunk when measured
   (F:I:W = 1:1:1 otherwise), holding no more activations than 1F1B's first rank;
3. ``--memory-limit-gb``: the fastest schedule, chunks per rank, split and recomputation
   whose predicted peak fits (`pp_train.memory_plan.fit_memory_limit`; with a named schedule,
   the recomputation only), else the byte model of the run as configured, for the memory
   report's prediction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pp_schedules import Choice, Costs, ResolvedSchedule, schedule_spec
from pp_schedules.planning import MemoryModel, Simulation, choose_schedule
from pp_train.arguments import PretrainConfig
from pp_train.layer_split import LayerSplit, rebalanced
from pp_train.memory_plan import (
    MemoryLimit,
    MemoryPlanError,
    ModelFigures,
    fit_memory_limit,
    memory_limit,
    predict_memory,
    with_memory_model,
)
from pp_train.recompute import RecomputeConfig
from pp_train.world import RunLayout, ScheduledLayers

__all__ = [
    "ChunkMeasure",
    "LayoutMeasure",
    "Measurements",
    "Measures",
    "MemoryMeasure",
    "RunPlan",
    "decide_run",
    "measure_run",
]

ChunkMeasure = Callable[[int], Costs]
"""Measures one chunk of the run, the same on every rank: ``(transformer layers per chunk) ->``
its forward, input-gradient and weight-gradient times (ms; `Costs`), the slowest rank's."""

LayoutMeasure = Callable[[], tuple[Costs, float, float]]
"""Measures, the same on every rank: one transformer layer's step costs, and the embedding's
and the loss's time in transformer layers (for balancing an uneven split)."""

MemoryMeasure = Callable[[], ModelFigures]
"""Measures each part of the model alone on one microbatch (`pp_train.memory_plan`)."""

_CHOSEN_BY = {
    "flags": "",
    "simulation": "pipeline schedule chosen by simulation",
    "measured": "pipeline schedule chosen by simulation with step costs measured in a warm-up",
    "memory": "schedule, chunks and recomputation chosen by simulation",
}


@dataclasses.dataclass(frozen=True)
class Measures:
    """The warm-up's measuring functions (None: that measurement is not available)."""

    chunk: ChunkMeasure | None = None
    """One chunk's step costs, for ``auto``."""
    layout: LayoutMeasure | None = None
    """One layer's and the ends' costs, for a split balanced by simulation."""
    memory: MemoryMeasure | None = None
    """The model's parts, for the byte model and ``--memory-limit-gb``."""


@dataclasses.dataclass(frozen=True)
class Measurements:
    """What a warm-up measured: inputs of `decide_run` (None: not measured)."""

    chunk_costs: Costs | None = None
    """F, I and W (ms) of one chunk of the run's transformer layers, the slowest rank's."""
    layer_costs: tuple[Costs, float, float] | None = None
    """One layer's step costs, and the embedding's and the loss's time in layers."""
    figures: ModelFigures | None = None
    """Each part of the model alone on one microbatch: parameters, bytes and times."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPlan(ScheduledLayers):
    """The run, decided once: what every part of `pretrain` after the decision reads."""

    world_size: int
    """Processes in the job."""
    data_parallel_size: int
    """Replicas: world / (tensor x context x pipeline)."""
    tensor_model_parallel_size: int
    """Ranks each layer is split over."""
    context_parallel_size: int = 1
    """Ranks each sequence is split over."""
    resolved: ResolvedSchedule
    """The schedule, its placement and prefetch, and the validated plan of every microbatch
    count (and, with evaluation, forward only): what the executor runs."""
    layer_split: LayerSplit
    """Transformer layers of each virtual stage, and where that split came from."""
    recompute: RecomputeConfig | None
    """The activation recomputation the model is built with."""
    memory: MemoryModel | None = None
    """The byte model of the run (the memory report's prediction); None when not measured."""
    choice: Choice | None = None
    """The choice whose table the run prints: ``auto``'s, or ``--memory-limit-gb``'s."""
    chosen_by: str = "flags"
    """How the schedule was decided: "flags" (named, Megatron's default or a plan file),
    "simulation" (``auto`` with default costs), "measured" (``auto`` with warm-up costs) or
    "memory" (``--memory-limit-gb``)."""
    limit: MemoryLimit | None = None
    """``--memory-limit-gb`` with its margin; None without it."""
    plan_file: str | None = None
    """The ``--pipeline-schedule-file`` the plan came from; None for a named schedule."""

    @property
    def schedule_title(self) -> str:
        """How the log names the schedule: its title, or the plan file and its placement."""
        if self.schedule is not None:
            return schedule_spec(self.schedule).title
        return f"plan {self.plan_file} ({self.placement} placement)"

    @property
    def chosen_line(self) -> str | None:
        """The line above the choice's table (None when the flags named the schedule)."""
        if self.choice is None or self.chosen_by == "flags":
            return None
        head = _CHOSEN_BY[self.chosen_by]
        if self.chosen_by == "memory":
            assert self.limit is not None
            return (
                f"{head} within {self.limit.flags} (warm-up costs and bytes; peaks of every "
                f"byte allocated):\n{self.choice.table()}"
            )
        costs = self.choice.costs
        text = "-" if costs is None else (
            f"F {costs.forward:.2f}, I {costs.of('I'):.2f}, W {costs.of('W'):.2f}"
        )  # fmt: skip
        return f"{head} (ms per chunk: {text}):\n{self.choice.table()}"

    @property
    def prefetch(self) -> int:
        """How many exchanges early receives are posted."""
        return self.resolved.prefetch

    def predicted(self, num_microbatches: int) -> Simulation | None:
        """The simulated step of `num_microbatches` with the byte model; None without one."""
        return predict_memory(self, num_microbatches)

    def predicted_peaks(self) -> tuple[float, ...] | None:
        """Each rank's predicted peak bytes at the largest microbatch count (None: unknown)."""
        simulation = self.predicted(max(self.microbatch_counts))
        return None if simulation is None else tuple(simulation.peak_memory)


def _auto(config: PretrainConfig) -> bool:
    """Whether the flags leave the schedule to the decision (``--pipeline-schedule auto``)."""
    return config.parallel.pipeline_schedule == "auto"


def measure_run(config: PretrainConfig, layout: RunLayout, measures: Measures) -> Measurements:
    """What the decision uses of the warm-up, measured (each at most once).

    Args:
        config: The run's configuration.
        layout: The checked layout (`check_world`).
        measures: The warm-up's measuring functions.

    Raises:
        MemoryPlanError: ``--memory-limit-gb`` without a way to measure the model, or the
            measurement failed.
    """
    parallel, split = config.parallel, layout.layer_split
    ends = (parallel.pipeline_layout_embedding_cost, parallel.pipeline_layout_loss_cost)
    layer_costs = None
    if measures.layout is not None and split.balance is not None and None in ends:
        layer_costs = measures.layout()
    chunk_costs = None
    if measures.chunk is not None and _auto(config) and parallel.memory_limit_gb is None:
        vp = layout.resolved.vp_size
        chunk_costs = measures.chunk(
            config.model.num_layers // (parallel.pipeline_model_parallel_size * vp)
        )
    if measures.memory is None and parallel.memory_limit_gb is not None:
        raise MemoryPlanError(
            "--memory-limit-gb needs the model's activation bytes, measured on one "
            "microbatch: pass measure_memory to pretrain (the pp-train command does)"
        )
    figures = None if measures.memory is None else measures.memory()
    return Measurements(chunk_costs=chunk_costs, layer_costs=layer_costs, figures=figures)


def decide_run(
    config: PretrainConfig, layout: RunLayout, measured: Measurements | None = None
) -> RunPlan:
    """The run, decided once from the configuration, its checked layout and the warm-up.

    Args:
        config: The run's configuration.
        layout: `check_world`'s layout for it (the flags checked, what they name resolved).
        measured: What the warm-up measured (`measure_run`); None: nothing.

    Returns:
        The `RunPlan` every later part of the run reads.

    Raises:
        MemoryPlanError: ``--memory-limit-gb`` cannot be met; the message names the limit,
            the smallest peak and what would fit.
    """
    measured = measured or Measurements()
    auto = _auto(config)
    split = layout.layer_split
    if measured.layer_costs is not None:
        split = rebalanced(split, config.parallel, measured.layer_costs)
    base = dataclasses.replace(layout, layer_split=split, recompute=config.model.recompute)
    chosen_by = "simulation" if auto else "flags"
    if auto and measured.chunk_costs is not None:
        base = _choose_measured(base, measured.chunk_costs)
        chosen_by = "measured"
    limit = memory_limit(config, layout.resolved.transport)
    choice = base.resolved.choice
    if measured.figures is not None and limit is not None:
        base, fitted = fit_memory_limit(base, config, measured.figures, auto=auto)
        if fitted is not None:
            choice, chosen_by = fitted, "memory"
    elif measured.figures is not None:
        base = with_memory_model(base, config, measured.figures)
    return RunPlan(
        world_size=base.world_size, data_parallel_size=base.data_parallel_size,
        tensor_model_parallel_size=base.tensor_model_parallel_size,
        context_parallel_size=base.context_parallel_size, resolved=base.resolved,
        layer_split=base.layer_split, recompute=base.recompute, memory=base.memory,
        choice=choice, chosen_by=chosen_by, limit=limit,
        plan_file=config.parallel.pipeline_schedule_file,
    )  # fmt: skip


def _choose_measured(layout: RunLayout, costs: Costs) -> RunLayout:
    """``auto`` chosen with measured costs among the candidates that run every count.

    The candidates and the activation limit are the check's (1F1B's first rank: ``min(pp,
    m)`` microbatches); the pick is resolved for every count (nothing is planned again when
    it is the check's pick).
    """
    resolved = layout.resolved
    assert resolved.choice is not None
    pp, m, vp = resolved.pp_size, max(resolved.microbatch_counts), resolved.vp_size
    runnable = [c.name for c in resolved.choice.candidates if c.makespan is not None]
    choice = choose_schedule(
        pp_size=pp, num_microbatches=m, vp_size=vp, costs=costs,
        memory_limit=float(min(pp, m)), names=runnable,
    )  # fmt: skip
    return dataclasses.replace(
        layout, resolved=resolved.with_schedule(choice.chosen.name, choice=choice)
    )
