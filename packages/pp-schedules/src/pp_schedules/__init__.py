"""pp-schedules: pipeline schedules as verified data.

- `plan(name, ...)`: per-rank forward/backward order of no-pipelining, GPipe, 1F1B and
  interleaved 1F1B, equal to Megatron-LM's where Megatron accepts the configuration, and of
  the zero-bubble ZB-H1 and ZB-V (backwards split into I and W); `choose_schedule` (and
  ``plan("auto")``) picks the shortest simulated schedule within a memory limit;
  `balanced_counts` splits layers unevenly over the virtual stages where that runs faster.
- `validate(...)`: completeness, order, matching transfers and freedom from deadlock, with a
  rank x step grid on failure; `simulate(...)`: makespan, bubbles, activation memory, ASCII
  and Chrome-trace timelines, with the same costs on every stage (`Costs`) or per virtual
  stage (`StageCosts`).

- `Plan`, `parse_schedule`, `format_schedule`: a plan as data (actions, placement, and its
  own exchanges if written), read from and written to text (torch's action strings too).
- `chrome_trace`, `summary`: measured timelines beside the simulator's (with measured and
  predicted memory as counter tracks: `memory_counters`).
- `SCHEDULE_REGISTRY` (`ScheduleSpec` per schedule: placement, chunks per rank, split
  backward, generator), `default_schedule`, `placement_for`, `schedules_for`: the rules about
  named schedules, written once. `resolve_schedule(...)` -> `ResolvedSchedule`: a run's
  schedule planned and validated once for every microbatch count it steps with, in time
  near-linear in the plan's steps (`PlanCache`: what auto's candidates share; plans over
  `max_plan_steps`, `DEFAULT_MAX_PLAN_STEPS` by default, are refused before planning).
- `get_forward_backward_func(...)`: the executor, Megatron's interface over pp-comm; it walks
  the validated plan's steps (a `ResolvedSchedule`'s, when given one).
- `PipelineModel`: any model split into this rank's chunks (`PipelineChunk`) for a
  placement, by module names or parts; what crosses each boundary (`Boundary`) inferred from
  a sample or declared; tied parameters summed between the ranks holding copies.
- `MemoryProbe`, `MemorySample`: measured memory (every storage a rank holds, counted by an
  `AllocationCounter` on CPU or read from the CUDA allocator, and the tensors saved for
  backward as a breakdown), sampled after each compute step by
  `PipelineExecutor.record_memory`, to compare with the simulator's byte model step by step.

The planning modules import no torch; the executor's names load it on first use.
"""

from __future__ import annotations

import importlib
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

from pp_schedules.actions import (
    BACKWARD,
    COMPUTE,
    Action,
    ActionKind,
    format_plan,
    parse_action,
    parse_plan,
)
from pp_schedules.auto import (
    Candidate,
    Choice,
    MemoryLimitError,
    PlanOption,
    candidates_for,
    choose_fitting,
    choose_schedule,
)
from pp_schedules.balance import LayerBalance, balance_layers, balanced_counts, even_counts
from pp_schedules.generators import (
    ScheduleConfigError,
    gpipe,
    interleaved_1f1b,
    interleaved_table,
    no_pipelining,
    one_f_one_b,
)
from pp_schedules.lowering import (
    Exchange,
    Message,
    Step,
    lower,
    lowered_actions,
    post_receives_early,
)
from pp_schedules.memory import (
    MemoryModel,
    StageMemory,
    StaticBytes,
    TransferBuffers,
    chain,
    format_bytes,
    format_bytes_apart,
)
from pp_schedules.plan_cache import PlanCache
from pp_schedules.planning_cost import DEFAULT_MAX_PLAN_STEPS, check_plan_budget, plan_steps
from pp_schedules.plans import Plan, as_plan, format_schedule, parse_schedule
from pp_schedules.registry import (
    SCHEDULE_REGISTRY,
    SCHEDULES,
    ScheduleSpec,
    default_schedule,
    placement_for,
    schedule_spec,
    schedules_for,
)
from pp_schedules.resolution import ResolvedSchedule, default_prefetch, plan, resolve_schedule
from pp_schedules.simulation import (
    Costs,
    MemoryTrack,
    Simulation,
    Span,
    StageCosts,
    bubble_formula,
    ideal_makespan,
    simulate,
)
from pp_schedules.timeline import (
    MeasuredSpan,
    TimelineRecorder,
    chrome_trace,
    measured_makespan,
    memory_counters,
    summary,
)
from pp_schedules.validation import PlanError, PlanReport, render_grid, validate
from pp_schedules.zero_bubble import list_schedule, zb_h1, zbv
from pp_state.placement import Placement

if TYPE_CHECKING:
    from pp_schedules.executor import (
        ChunkIteratorError,
        ForwardStepFunc,
        PipelineExecutor,
        PlanLike,
        RunStats,
        ScheduleConfig,
        custom_backward,
        deallocate_output_tensor,
        get_forward_backward_func,
    )
    from pp_schedules.memory_probe import (
        AllocationCounter,
        MemoryProbe,
        MemorySample,
        measure_stage,
    )
    from pp_schedules.pipeline_model import PipelineModel, Tie, split_module_names
    from pp_schedules.profiling import (
        check_trace_path,
        gather_memory,
        gather_timeline,
        measured_costs,
        write_schedule_trace,
    )
    from pp_schedules.stages import Boundary, PipelineChunk, TensorSpec

__version__ = _version("pp-schedules")

_EXECUTOR = {
    "ChunkIteratorError",
    "ForwardStepFunc",
    "PipelineExecutor",
    "PlanLike",
    "RunStats",
    "ScheduleConfig",
    "custom_backward",
    "deallocate_output_tensor",
    "get_forward_backward_func",
}


_PROFILING = {
    "check_trace_path",
    "gather_memory",
    "gather_timeline",
    "measured_costs",
    "write_schedule_trace",
}
_MEMORY_PROBE = {"AllocationCounter", "MemoryProbe", "MemorySample", "measure_stage"}
_STAGES = {"Boundary", "PipelineChunk", "TensorSpec"}
_PIPELINE_MODEL = {"PipelineModel", "Tie", "split_module_names"}


def __getattr__(name: str) -> Any:
    if name in _EXECUTOR:
        return getattr(importlib.import_module("pp_schedules.executor"), name)
    if name in _PROFILING:
        return getattr(importlib.import_module("pp_schedules.profiling"), name)
    if name in _MEMORY_PROBE:
        return getattr(importlib.import_module("pp_schedules.memory_probe"), name)
    if name in _STAGES:
        return getattr(importlib.import_module("pp_schedules.stages"), name)
    if name in _PIPELINE_MODEL:
        return getattr(importlib.import_module("pp_schedules.pipeline_model"), name)
    raise AttributeError(f"module 'pp_schedules' has no attribute {name!r}")


__all__ = [
    "BACKWARD",
    "COMPUTE",
    "DEFAULT_MAX_PLAN_STEPS",
    "SCHEDULES",
    "SCHEDULE_REGISTRY",
    "Action",
    "ActionKind",
    "AllocationCounter",
    "Boundary",
    "Candidate",
    "Choice",
    "ChunkIteratorError",
    "Costs",
    "Exchange",
    "ForwardStepFunc",
    "LayerBalance",
    "MeasuredSpan",
    "MemoryLimitError",
    "MemoryModel",
    "MemoryProbe",
    "MemorySample",
    "MemoryTrack",
    "Message",
    "PipelineChunk",
    "PipelineExecutor",
    "PipelineModel",
    "Placement",
    "Plan",
    "PlanCache",
    "PlanError",
    "PlanLike",
    "PlanOption",
    "PlanReport",
    "ResolvedSchedule",
    "RunStats",
    "ScheduleConfig",
    "ScheduleConfigError",
    "ScheduleSpec",
    "Simulation",
    "Span",
    "StageCosts",
    "StageMemory",
    "StaticBytes",
    "Step",
    "TensorSpec",
    "Tie",
    "TimelineRecorder",
    "TransferBuffers",
    "__version__",
    "as_plan",
    "balance_layers",
    "balanced_counts",
    "bubble_formula",
    "candidates_for",
    "chain",
    "check_plan_budget",
    "check_trace_path",
    "choose_fitting",
    "choose_schedule",
    "chrome_trace",
    "custom_backward",
    "deallocate_output_tensor",
    "default_prefetch",
    "default_schedule",
    "even_counts",
    "format_bytes",
    "format_bytes_apart",
    "format_plan",
    "format_schedule",
    "gather_memory",
    "gather_timeline",
    "get_forward_backward_func",
    "gpipe",
    "ideal_makespan",
    "interleaved_1f1b",
    "interleaved_table",
    "list_schedule",
    "lower",
    "lowered_actions",
    "measure_stage",
    "measured_costs",
    "measured_makespan",
    "memory_counters",
    "no_pipelining",
    "one_f_one_b",
    "parse_action",
    "parse_plan",
    "parse_schedule",
    "placement_for",
    "plan",
    "plan_steps",
    "post_receives_early",
    "render_grid",
    "resolve_schedule",
    "schedule_spec",
    "schedules_for",
    "simulate",
    "split_module_names",
    "summary",
    "validate",
    "write_schedule_trace",
    "zb_h1",
    "zbv",
]
