"""What a call's walk is given: the call's arguments, the prepared plan, its executor, its chunks.

`CallArguments` (one call's), `PreparedPlan` (a validated plan with its placement),
`WalkHost` (what a walk reads of its executor) and `RunStats` (what the last call measured);
and how the executor reads a chunk that may be wrapped (DDP, Float16Module): its attributes,
its boundary contracts and the placement it was built for.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from pp_comm import P2PCommunicator, Timers
from pp_schedules.planning import PlanReport
from pp_schedules.runtime._flight_recorder import FlightRecorder
from pp_schedules.runtime._memory_probe import MemoryProbe
from pp_schedules.runtime._schedule_config import ForwardStepFunc, ScheduleConfig
from pp_schedules.runtime._stages import Boundary
from pp_state.placement import Placement

__all__ = [
    "CallArguments",
    "PreparedPlan",
    "RunStats",
    "WalkHost",
    "check_chunk_placement",
    "chunk_contract",
    "with_grads",
    "wrapped_attr",
]


@dataclasses.dataclass
class RunStats:
    """What the last call measured on this rank.

    Attributes:
        peak_activations: Most forwards held at once awaiting their backward.
        peak_activation_bytes: Most bytes held at once by the stage's stored outputs and
            inputs (distinct storages). Tensors that autograd saved for backward are not
            seen here: a deallocated output whose storage the last op also saved (tanh does,
            linear does not) still occupies memory.
        peak_in_flight_bytes: Most bytes held at once by sends not yet completed. gloo
            reports a send complete only once waited for, so there these are kept until the
            end of the step; NCCL reports completions as they happen.
        steps: Compute steps run.
    """

    peak_activations: int = 0
    peak_activation_bytes: int = 0
    peak_in_flight_bytes: int = 0
    steps: int = 0


def _holder(module: torch.nn.Module, name: str) -> Any:
    """The module, or the innermost it wraps (DDP, Float16Module: ``.module``), that has `name`."""
    current: Any = module
    while not hasattr(current, name) and hasattr(current, "module"):
        current = current.module
    return current


def wrapped_attr(module: torch.nn.Module, name: str) -> Any:
    """An attribute of a module or of what it wraps (DDP, Float16Module: ``.module``)."""
    return getattr(_holder(module, name), name)


def chunk_contract(module: torch.nn.Module, name: str) -> Boundary | None:
    """A chunk's ``input_boundary`` or ``output_boundary`` (a `PipelineChunk`'s), if it has one."""
    found = getattr(_holder(module, name), name, None)
    return found if isinstance(found, Boundary) else None


def check_chunk_placement(
    chunks: Sequence[torch.nn.Module], placement: Placement, rank: int, schedule: str
) -> None:
    """Refuse chunks built for another placement than the one the schedule runs.

    Raises:
        ValueError: Naming both placements and how to build the chunks for this one.
    """
    for index, chunk in enumerate(chunks):
        current = _holder(chunk, "pipeline_placement")
        built = getattr(current, "pipeline_placement", None)
        if not isinstance(built, Placement):
            continue
        if built.stages != placement.stages:
            raise ValueError(
                f"pipeline rank {rank}'s model chunks were built for the {built.name} "
                f"placement (virtual stages {list(built.stages[rank])} here), but the "
                f"{schedule} schedule runs the {placement.name} placement (virtual stages "
                f"{list(placement.stages[rank])}); build the chunks with "
                "placement=resolve_schedule(...), the resolved schedule the executor runs"
            )
        held = placement.stages[rank][index]
        if getattr(current, "stage", held) != held:
            raise ValueError(
                f"model chunk {index} of pipeline rank {rank} is virtual stage "
                f"{current.stage}, but the placement puts virtual stage {held} there; pass "
                "the chunks in the order PipelineModel.chunks gives them"
            )


def with_grads(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors whose gradients travel back between stages (the floating-point ones)."""
    return [t for t in tensors if t.is_floating_point() or t.is_complex()]


@dataclasses.dataclass(frozen=True)
class PreparedPlan:
    """A validated plan, its placement and, for this rank, where its sends have arrived."""

    report: PlanReport
    delivered: dict[int, list[int]]
    placement: Placement
    fb_mode: str = "sequential"


class WalkHost(Protocol):
    """What a walk reads of its executor (`PipelineExecutor` is one)."""

    communicator: P2PCommunicator | None
    config: ScheduleConfig
    rank: int
    independent: bool
    """Whether transfers complete each on its own (gloo) rather than in posting order (NCCL)."""
    timers: Timers
    recording: bool
    """Whether the call records its timeline."""
    memory_probe: MemoryProbe | None
    """Samples the rank's bytes after each compute step, when set."""
    recorder: FlightRecorder
    """Keeps the rank's last steps (always on; see `FlightRecorder`)."""
    compute_lock: threading.Lock
    """Held by the half of an F&B step that computes (``fb_overlap="threads"``)."""

    @property
    def exchanges_shapes(self) -> bool:
        """Whether shapes travel with the data (receives need none)."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallArguments:
    """The arguments of one call."""

    chunks: list[torch.nn.Module]
    iterators: Sequence[Any]
    forward_step_func: ForwardStepFunc
    num_microbatches: int
    seq_and_batch: tuple[int | None, int | None]
    decoder_seq_length: int | None
    forward_only: bool
    collect_non_loss_data: bool
