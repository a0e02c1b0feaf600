"""pp-schedules: pipeline schedules as verified data.

- `plan(name, ...)`: per-rank forward/backward order of no-pipelining, GPipe, 1F1B and
  interleaved 1F1B, equal to Megatron-LM's where Megatron accepts the configuration.
- `validate(...)`: completeness, order, matching transfers and freedom from deadlock, with a
  rank x step grid on failure; `simulate(...)`: makespan, bubbles, activation memory, ASCII
  and Chrome-trace timelines.

The planning modules import no torch.
"""

from importlib.metadata import version as _version

from pp_schedules.actions import COMPUTE, Action, ActionKind, format_plan, parse_action, parse_plan
from pp_schedules.generators import (
    SCHEDULES,
    gpipe,
    interleaved_1f1b,
    interleaved_table,
    no_pipelining,
    one_f_one_b,
    plan,
)
from pp_schedules.lowering import Exchange, Message, Step, lower, lowered_actions
from pp_schedules.simulation import (
    Costs,
    Simulation,
    Span,
    bubble_formula,
    ideal_makespan,
    simulate,
)
from pp_schedules.validation import PlanError, PlanReport, render_grid, validate

__version__ = _version("pp-schedules")

__all__ = [
    "COMPUTE",
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Costs",
    "Exchange",
    "Message",
    "PlanError",
    "PlanReport",
    "Simulation",
    "Span",
    "Step",
    "__version__",
    "bubble_formula",
    "format_plan",
    "gpipe",
    "ideal_makespan",
    "interleaved_1f1b",
    "interleaved_table",
    "lower",
    "lowered_actions",
    "no_pipelining",
    "one_f_one_b",
    "parse_action",
    "parse_plan",
    "plan",
    "render_grid",
    "simulate",
    "validate",
]
