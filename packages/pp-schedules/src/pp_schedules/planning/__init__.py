"""Planning: a schedule's name and sizes turned into a checked, simulated, costed plan.

Everything here is pure Python over plans as data: it imports nothing from the runtime
(`pp_schedules.runtime`), from pp-comm or from ``torch.distributed`` (the project's layering
check holds it so), and runs without processes or tensors.

- Plans as data: `Action` (``F``, ``B``, ``I``, ``W`` of a microbatch on a chunk), `Plan`
  (each rank's actions and the `Placement` they run on), their text forms (`parse_schedule`,
  `format_schedule`, `parse_plan`, `format_plan`; torch's action strings too).
- Generators: `no_pipelining`, `gpipe`, `one_f_one_b`, `interleaved_1f1b` (Megatron's order),
  the zero-bubble `zb_h1` and `zbv` (`list_schedule`), and `dualpipev` (DeepSeek's DualPipeV,
  its F&B steps marked: `PairedActions`, `Plan.overlapped`); `SCHEDULE_REGISTRY` holds one
  `ScheduleSpec` per name (placement, chunks per rank, split backward), and `plan(name, ...)`
  makes any of them, ``auto`` included.
- Lowering and validation: `lower` inserts the exchanges (`Step`, `Exchange`, `Message`),
  `validate` checks completeness, order, matched transfers and freedom from deadlock under
  gloo's or NCCL's rules (`PlanReport`; `PlanError` draws the rank x step grid).
- Simulation and bytes: `simulate` gives the makespan, bubbles and each rank's bytes step by
  step (`Costs`, `StageCosts`, `MemoryModel`, `StageMemory`, `Simulation`).
- Choosing: `choose_schedule` (``auto``), `choose_fitting` (a byte budget), `balance_layers`
  (an uneven split of layers), sharing work through a `PlanCache`.
- Resolution: `resolve_schedule` -> `ResolvedSchedule`, the one object the executor takes.
"""

from __future__ import annotations

from pp_schedules.planning._actions import (
    BACKWARD,
    CATEGORIES,
    COMPUTE,
    Action,
    ActionKind,
    format_plan,
    parse_action,
    parse_plan,
)
from pp_schedules.planning._auto import (
    Candidate,
    Choice,
    MemoryLimitError,
    PlanOption,
    candidates_for,
    choose_fitting,
    choose_schedule,
)
from pp_schedules.planning._balance import (
    LayerBalance,
    balance_layers,
    balanced_counts,
    even_counts,
)
from pp_schedules.planning._dualpipe import PairedActions, dualpipev
from pp_schedules.planning._generators import (
    ScheduleConfigError,
    gpipe,
    interleaved_1f1b,
    interleaved_table,
    no_pipelining,
    one_f_one_b,
)
from pp_schedules.planning._lowering import (
    Exchange,
    Message,
    Step,
    lower,
    lowered_actions,
    post_receives_early,
)
from pp_schedules.planning._memory import (
    DTYPE_BYTES,
    OPTIMIZERS,
    MemoryModel,
    StageMemory,
    StaticBytes,
    TransferBuffers,
    chain,
    format_bytes,
    format_bytes_apart,
)
from pp_schedules.planning._nccl_rules import TRANSPORTS, check_transport
from pp_schedules.planning._plan_cache import PlanCache
from pp_schedules.planning._planning_cost import (
    DEFAULT_MAX_PLAN_STEPS,
    check_plan_budget,
    plan_steps,
)
from pp_schedules.planning._plans import Plan, PlanLike, as_plan, format_schedule, parse_schedule
from pp_schedules.planning._registry import (
    SCHEDULE_REGISTRY,
    SCHEDULES,
    ScheduleSpec,
    default_schedule,
    placement_for,
    schedule_spec,
    schedules_for,
)
from pp_schedules.planning._resolution import (
    ResolvedSchedule,
    check_plan_fits,
    check_prefetch,
    default_prefetch,
    plan,
    resolve_on_demand,
    resolve_schedule,
)
from pp_schedules.planning._simulation import (
    Costs,
    MemoryTrack,
    Simulation,
    Span,
    StageCosts,
    bubble_formula,
    fb_time,
    ideal_makespan,
    simulate,
)
from pp_schedules.planning._validation import (
    PlanError,
    PlanReport,
    render_grid,
    sends_delivered,
    validate,
)
from pp_schedules.planning._zero_bubble import list_schedule, zb_h1, zbv
from pp_state.placement import Placement

__all__ = [
    "BACKWARD",
    "CATEGORIES",
    "COMPUTE",
    "DEFAULT_MAX_PLAN_STEPS",
    "DTYPE_BYTES",
    "OPTIMIZERS",
    "SCHEDULES",
    "SCHEDULE_REGISTRY",
    "TRANSPORTS",
    "Action",
    "ActionKind",
    "Candidate",
    "Choice",
    "Costs",
    "Exchange",
    "LayerBalance",
    "MemoryLimitError",
    "MemoryModel",
    "MemoryTrack",
    "Message",
    "PairedActions",
    "Placement",
    "Plan",
    "PlanCache",
    "PlanError",
    "PlanLike",
    "PlanOption",
    "PlanReport",
    "ResolvedSchedule",
    "ScheduleConfigError",
    "ScheduleSpec",
    "Simulation",
    "Span",
    "StageCosts",
    "StageMemory",
    "StaticBytes",
    "Step",
    "TransferBuffers",
    "as_plan",
    "balance_layers",
    "balanced_counts",
    "bubble_formula",
    "candidates_for",
    "chain",
    "check_plan_budget",
    "check_plan_fits",
    "check_prefetch",
    "check_transport",
    "choose_fitting",
    "choose_schedule",
    "default_prefetch",
    "default_schedule",
    "dualpipev",
    "even_counts",
    "fb_time",
    "format_bytes",
    "format_bytes_apart",
    "format_plan",
    "format_schedule",
    "gpipe",
    "ideal_makespan",
    "interleaved_1f1b",
    "interleaved_table",
    "list_schedule",
    "lower",
    "lowered_actions",
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
    "resolve_on_demand",
    "resolve_schedule",
    "schedule_spec",
    "schedules_for",
    "sends_delivered",
    "simulate",
    "validate",
    "zb_h1",
    "zbv",
]
