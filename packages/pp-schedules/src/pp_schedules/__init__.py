"""pp-schedules: pipeline schedules as verified data, and the executor that runs them.

The names a trainer needs are here; the package has two rooms for the rest:

- `pp_schedules.planning`: a schedule's name and sizes turned into a checked, simulated,
  costed plan (generators, lowering, validation under gloo's and NCCL's rules, the
  simulator, the byte model, the registry, ``auto``, resolution). Pure Python: it imports
  nothing from the runtime, from pp-comm or from ``torch.distributed``.
- `pp_schedules.runtime`: that plan run on real model chunks (the executor, stages and
  `PipelineModel`, the split backward, the memory probe, timelines, the flight recorder and
  the stop report).

A trainer resolves its schedule once (`resolve_schedule` -> `ResolvedSchedule`: the name,
placement and every validated plan of the run), splits its model for the placement
(`PipelineModel`) and runs each step through the executor that takes it
(`get_forward_backward_func(communicator, resolved)`), inside ``with
watch_pipeline(executor, state):`` for the story of a rank that dies (liveness records, the
stop report naming global ranks, SIGTERM answered).
"""

from __future__ import annotations

from importlib.metadata import version as _version

from pp_schedules import planning, runtime
from pp_schedules.planning import (
    SCHEDULES,
    Choice,
    Costs,
    MemoryLimitError,
    Placement,
    Plan,
    PlanError,
    ResolvedSchedule,
    ScheduleConfigError,
    StageCosts,
    parse_schedule,
    resolve_schedule,
    schedule_spec,
)
from pp_schedules.runtime import (
    Boundary,
    ChunkIteratorError,
    ForwardStepFunc,
    MemoryProbe,
    MemorySample,
    PipelineChunk,
    PipelineExecutor,
    PipelineModel,
    RunStats,
    ScheduleConfig,
    StopReport,
    TensorSpec,
    Tie,
    custom_backward,
    deallocate_output_tensor,
    get_forward_backward_func,
    split_module_names,
    watch_pipeline,
    write_schedule_trace,
)

__version__ = _version("pp-schedules")

__all__ = [
    "SCHEDULES",
    "Boundary",
    "Choice",
    "ChunkIteratorError",
    "Costs",
    "ForwardStepFunc",
    "MemoryLimitError",
    "MemoryProbe",
    "MemorySample",
    "PipelineChunk",
    "PipelineExecutor",
    "PipelineModel",
    "Placement",
    "Plan",
    "PlanError",
    "ResolvedSchedule",
    "RunStats",
    "ScheduleConfig",
    "ScheduleConfigError",
    "StageCosts",
    "StopReport",
    "TensorSpec",
    "Tie",
    "__version__",
    "custom_backward",
    "deallocate_output_tensor",
    "get_forward_backward_func",
    "parse_schedule",
    "planning",
    "resolve_schedule",
    "runtime",
    "schedule_spec",
    "split_module_names",
    "watch_pipeline",
    "write_schedule_trace",
]
