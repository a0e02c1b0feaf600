"""Runtime: a resolved schedule run on real model chunks, measured and reported on.

Everything here needs torch; it takes what planning (`pp_schedules.planning`) resolved and
runs exactly that.

- The executor: `get_forward_backward_func` / `PipelineExecutor` (Megatron's interface over
  pp-comm) walks a `ResolvedSchedule`'s validated steps, one compute step or one exchange at
  a time (`ScheduleConfig`: loss scaling, no_sync, timers; `RunStats` of the last call);
  `backward_input` and `WeightGradients` split a backward for the zero-bubble schedules.
- Any model as stages: `PipelineModel` splits a model into this rank's `PipelineChunk`s for
  a placement, with the `Boundary` each receives and sends (`TensorSpec`) and tied weights
  (`Tie`) summed between ranks.
- Measuring: `MemoryProbe` (every storage a rank holds, `AllocationCounter` on CPU),
  `measure_stage`; `TimelineRecorder` and `MeasuredSpan`, `chrome_trace` and `summary` beside
  the simulator's; `write_schedule_trace`, `gather_timeline`, `gather_memory`,
  `measured_costs`.
- When a pipeline stops: `FlightRecorder` (each rank's last steps and collectives), the stop
  channel (`report_stop`, `read_position`, `answer_ask`) and the `StopReport` naming where
  every rank was and which one is the cause; `watch_pipeline` (`PipelineWatch`) gives a
  training loop all of it in one ``with``: liveness records and a heartbeat, names by global
  rank and place, the report of a failure outside the executor, a leaving note, SIGTERM
  answered (`report_on_sigterm`, `SigtermOutcome`), the run token (`run_token`) and the
  store kept up by the rank hosting it.
"""

from __future__ import annotations

from pp_schedules.runtime._allocation_counter import AllocationCounter
from pp_schedules.runtime._autograd import custom_backward, deallocate_output_tensor
from pp_schedules.runtime._executor import (
    ChunkIteratorError,
    PipelineExecutor,
    get_forward_backward_func,
    on_demand_for,
    resolve_for,
    transport_of,
)
from pp_schedules.runtime._flight_recorder import (
    DEFAULT_RECORDER_SIZE,
    CollectiveRecord,
    FlightRecorder,
)
from pp_schedules.runtime._memory_probe import MemoryProbe, MemorySample, storage_bytes
from pp_schedules.runtime._overlap import FB_OVERLAPS, communicating
from pp_schedules.runtime._pipeline_model import PipelineModel, Tie, split_module_names
from pp_schedules.runtime._profiling import (
    check_trace_path,
    gather_memory,
    gather_timeline,
    measured_costs,
    write_schedule_trace,
)
from pp_schedules.runtime._schedule_config import (
    FinalizeModelGradsFunc,
    ForwardStepFunc,
    ScheduleConfig,
)
from pp_schedules.runtime._split_backward import WeightGradients, backward_input
from pp_schedules.runtime._stage_measurement import measure_stage
from pp_schedules.runtime._stages import Boundary, PipelineChunk, TensorSpec
from pp_schedules.runtime._stop_channel import (
    DEFAULT_REPORT_WAIT_S,
    answer_ask,
    first_line,
    read_position,
    report_stop,
)
from pp_schedules.runtime._stop_diagnosis import build_stop_report
from pp_schedules.runtime._stop_report import RankPosition, StopReport
from pp_schedules.runtime._timeline import (
    MeasuredSpan,
    TimelineRecorder,
    chrome_trace,
    measured_makespan,
    memory_counters,
    summary,
)
from pp_schedules.runtime._walk_inputs import RunStats
from pp_schedules.runtime._watch import (
    PipelineWatch,
    SigtermOutcome,
    report_on_sigterm,
    run_token,
    watch_pipeline,
)

__all__ = [
    "DEFAULT_RECORDER_SIZE",
    "DEFAULT_REPORT_WAIT_S",
    "FB_OVERLAPS",
    "AllocationCounter",
    "Boundary",
    "ChunkIteratorError",
    "CollectiveRecord",
    "FinalizeModelGradsFunc",
    "FlightRecorder",
    "ForwardStepFunc",
    "MeasuredSpan",
    "MemoryProbe",
    "MemorySample",
    "PipelineChunk",
    "PipelineExecutor",
    "PipelineModel",
    "PipelineWatch",
    "RankPosition",
    "RunStats",
    "ScheduleConfig",
    "SigtermOutcome",
    "StopReport",
    "TensorSpec",
    "Tie",
    "TimelineRecorder",
    "WeightGradients",
    "answer_ask",
    "backward_input",
    "build_stop_report",
    "check_trace_path",
    "chrome_trace",
    "communicating",
    "custom_backward",
    "deallocate_output_tensor",
    "first_line",
    "gather_memory",
    "gather_timeline",
    "get_forward_backward_func",
    "measure_stage",
    "measured_costs",
    "measured_makespan",
    "memory_counters",
    "on_demand_for",
    "read_position",
    "report_on_sigterm",
    "report_stop",
    "resolve_for",
    "run_token",
    "split_module_names",
    "storage_bytes",
    "summary",
    "transport_of",
    "watch_pipeline",
    "write_schedule_trace",
]
