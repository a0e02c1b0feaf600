"""The executor: runs any valid plan on real model chunks with pp-comm, Megatron-style.

`get_forward_backward_func` returns a callable with Megatron-LM's keyword arguments
(``forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
decoder_seq_length, forward_only, collect_non_loss_data``) and Megatron's meaning:
``set_input_tensor`` on each chunk, ``forward_step_func(data_iterator, model)`` returning
``(output, loss_func)``, the loss normalised as Megatron does (over the number of
microbatches, per token, or with per-token loss left a sum whose token count goes to
``finalize_model_grads_func``), loss scaling through an injected ``grad_scale_func``, DDP
gradient sync off for all but the last microbatch of each chunk, outputs deallocated once sent
(with the custom backward that allows it), the list of loss dicts returned on the last stage,
and ``finalize_model_grads_func`` called at the end of a call with a backward.

It runs exactly the plan `validate` approved: for each rank it walks the lowered steps in
order, each compute step one forward or backward and each exchange one pp-comm call posting its
sends and receives together. It waits for an exchange's receives at once and lets its sends
complete in the background; a send is waited for (and its buffers freed) as soon as the plan
shows that the peer has received it, or at the end of the call. Which stage each chunk holds,
and so where tensors go, comes from the plan's placement; between two chunks of one rank (the
turn of a V) a tensor is handed over in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pp_comm import NullTimers, P2PCommunicator, Timers
from pp_schedules.planning import (
    Action,
    PlanLike,
    PlanReport,
    ResolvedSchedule,
    as_plan,
    check_prefetch,
    default_prefetch,
    resolve_on_demand,
    resolve_schedule,
    sends_delivered,
)
from pp_schedules.runtime._autograd import (
    check_torch_ddp_order,
    custom_backward,
    deallocate_output_tensor,
)
from pp_schedules.runtime._flight_recorder import DEFAULT_RECORDER_SIZE, FlightRecorder
from pp_schedules.runtime._memory_probe import MemoryProbe, MemorySample
from pp_schedules.runtime._overlap import check_fb_overlap
from pp_schedules.runtime._plan_walk import PlanWalk
from pp_schedules.runtime._schedule_config import ForwardStepFunc, ScheduleConfig
from pp_schedules.runtime._stop_channel import (
    DEFAULT_REPORT_WAIT_S,
    check_report_wait,
    publish_head,
    report_stop,
)
from pp_schedules.runtime._stop_report import StopReport
from pp_schedules.runtime._timeline import MeasuredSpan
from pp_schedules.runtime._walk_inputs import (
    CallArguments,
    PreparedPlan,
    RunStats,
    check_chunk_placement,
    chunk_contract,
)
from pp_state.coordinates import RankCoordinates
from pp_state.default import get_default_state, has_default_state
from pp_state.placement import Placement
from pp_state.store_channel import StoreChannel

__all__ = [
    "ChunkIteratorError",
    "ForwardStepFunc",
    "PipelineExecutor",
    "RunStats",
    "ScheduleConfig",
    "custom_backward",
    "deallocate_output_tensor",
    "get_forward_backward_func",
    "on_demand_for",
    "resolve_for",
    "transport_of",
]


class ChunkIteratorError(ValueError, RuntimeError):
    """A call's model chunks or data iterators do not fit the executor's chunks per rank.

    A ValueError, and the RuntimeError a port of Megatron's schedule tests expects to catch.
    """

    __module__ = "pp_schedules"  # where users import it from, as tracebacks name it


class PipelineExecutor:
    """Runs a resolved schedule's validated plans on this rank's model chunks.

    See `get_forward_backward_func`.
    """

    def __init__(
        self,
        communicator: P2PCommunicator | None,
        resolved: ResolvedSchedule,
        *,
        config: ScheduleConfig | None = None,
        recorder_size: int = DEFAULT_RECORDER_SIZE,
        channel: StoreChannel | None = None,
        report_wait: float = DEFAULT_REPORT_WAIT_S,
    ) -> None:
        """Bind to a pipeline (None: a single stage), a resolved schedule and a config.

        `recorder_size` steps are kept by the flight recorder (`recorder`). When a call
        fails, this rank publishes its position through `channel` (default: the default
        process group's store) and waits up to `report_wait` seconds for the other ranks'
        to build a `StopReport` (see `report_stop`).

        Raises:
            ValueError: A resolved schedule that does not fit the pipeline, a prefetch the
                communicator cannot take, a split rank with virtual stages, a recorder size
                below 1 or a `report_wait` not above 0.
        """
        self.communicator = communicator
        self.config = config or ScheduleConfig()
        self.pp_size = communicator.num_stages if communicator is not None else 1
        self.rank = communicator.stage if communicator is not None else 0
        # gloo completes each transfer on its own; NCCL in posting order, a batch as one work.
        self.transport = transport_of(communicator)
        self.independent = self.transport == "gloo"
        self._check_resolved(resolved)
        self.resolved = resolved
        """The resolved schedule every call runs (grown by a count for one resolved on
        demand, Megatron's argument-free `get_forward_backward_func`)."""
        self.vp_size = resolved.vp_size
        self.schedule = resolved.name or "plan"
        self.prefetch = resolved.prefetch
        self.timers: Timers = self.config.timers or NullTimers()
        self._check_split_rank()
        self.stats = RunStats()
        self.compute_lock = threading.Lock()
        """One device computes one thing at a time: the halves of an F&B step run with
        ``fb_overlap="threads"`` take turns holding it (`communicating` lets it go)."""
        self.timeline: list[MeasuredSpan] = []
        self.recording = False
        self.memory_probe: MemoryProbe | None = None
        """Counts saved tensors and samples bytes after each compute step (`record_memory`)."""
        self.memory_samples: list[MemorySample] = []
        """The samples of the last call, one per compute step (empty without a probe)."""
        self._plans: dict[tuple[int, bool], PreparedPlan] = {}
        self.total_num_tokens: torch.Tensor | None = None
        """With `ScheduleConfig.calculate_per_token_loss`, on the rank holding the last stage:
        the tokens the last call's microbatches counted (float64, on the loss's device), what
        its ``finalize_model_grads_func`` got; None on other ranks and without per-token loss."""
        self._init_stop_reports(recorder_size, channel, report_wait)

    def _init_stop_reports(
        self, recorder_size: int, channel: StoreChannel | None, report_wait: float
    ) -> None:
        """The flight recorder and what a stop report is published through and named by."""
        self.recorder = FlightRecorder(recorder_size)
        """The last plan steps this rank walked (always on)."""
        self.channel = channel
        """Where positions are published on a stop; None: the default group's store."""
        self.report_wait = check_report_wait(report_wait)
        """Seconds a stopped rank waits, at most, for the other ranks' positions."""
        self.coordinates: Callable[[int], RankCoordinates] | None = None
        """Where any global rank sits, for the stop report's names (pp-train gives
        `ParallelState.coordinates`); None: by its pipeline stage only."""
        self.run_token: str | None = None
        """Names the run in published positions: another run's, left in a shared store, are
        set aside."""

    @property
    def placement(self) -> Placement:
        """Which virtual stage each chunk holds: the resolved schedule's."""
        return self.resolved.placement

    @property
    def _headers(self) -> bool:
        # With shape headers pp-comm waits for a receive's header while posting it.
        return self.communicator is not None and self.communicator.config.exchanges_shapes

    @property
    def exchanges_shapes(self) -> bool:
        """Whether shapes travel with the data (pp-comm's headers): receives need none."""
        return self._headers

    def _check_resolved(self, resolved: ResolvedSchedule) -> None:
        """Refuse a resolved schedule that does not fit the communicator.

        Raises:
            TypeError: Something other than a `ResolvedSchedule`.
            ValueError: Naming the resolved schedule's numbers and the pipeline's.
        """
        if not isinstance(resolved, ResolvedSchedule):
            raise TypeError(
                f"the executor runs a ResolvedSchedule, got {type(resolved).__name__}; resolve "
                "a schedule name or a plan once with pp_schedules.resolve_schedule(...)"
            )
        if resolved.pp_size != self.pp_size:
            raise ValueError(
                f"the resolved schedule is for {resolved.pp_size} pipeline ranks, but the "
                f"communicator has {self.pp_size} stages"
            )
        if resolved.transport != self.transport:
            raise ValueError(
                f"the resolved schedule is for {resolved.transport}, but the communicator's "
                f"tensors go over {self.transport}; resolve it with transport={self.transport!r}"
            )
        check_prefetch(resolved.prefetch, self._headers)

    def _check_split_rank(self) -> None:
        split = self.config.pipeline_model_parallel_split_rank
        if split is not None and (self.vp_size > 1 or not 1 <= split < self.pp_size):
            raise ValueError(
                f"pipeline_model_parallel_split_rank {split} needs a pipeline it splits (1 .. "
                f"{self.pp_size - 1}) and no virtual stages (vp_size {self.vp_size})"
            )

    def record_timeline(self, enabled: bool = True) -> None:
        """Record every compute step and exchange of the following calls in `timeline`."""
        self.recording = enabled

    def set_recorder_size(self, size: int) -> None:
        """Keep the last `size` steps from now on (a new, empty recorder).

        Raises:
            ValueError: `size` is not a whole number of 1 or more.
        """
        self.recorder = FlightRecorder(size)

    def publish_position(self, channel: StoreChannel | None = None) -> bool:
        """Publish where this rank is (its recorder head) for the other ranks' stop report.

        For a trainer stopping on its own (SIGTERM, a non-finite loss): it returns at once.

        Returns:
            Whether it was published (not with a single stage, without a store, or before
            the first call).
        """
        if channel is not None:
            self.channel = channel
        return publish_head(self) is not None

    def report_stop(self, error: BaseException | None = None) -> StopReport | None:
        """Publish this rank's position, gather the others' and build the stop report.

        Waits at most `report_wait` seconds. The lowest rank that answered prints the report
        on stderr; `error`, when given, gets it as ``error.stop_report`` and a one-line note.

        Returns:
            The report, or None (a single stage, no store, or no call run yet).
        """
        report = report_stop(self, error)
        if report is None:
            return None
        if error is not None:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(error, "stop_report", report)  # noqa: B010 - any exception type
            if sys.version_info >= (3, 11):
                error.add_note(f"where every rank was: {report.cause} (error.stop_report)")
        comm = self.communicator
        if comm is not None and report.reporter == comm.rank:  # one write: shared stderr
            sys.stderr.write(report.render() + "\n")
            sys.stderr.flush()
        return report

    def record_memory(self, probe: MemoryProbe | None) -> None:
        """Measure memory in the following calls with `probe`; None stops measuring.

        Each call then runs inside ``probe.counting()`` and takes ``probe.sample(str(
        action))`` right after each compute step (F, B, I, W), so ``probe.samples`` gain one
        sample per compute step of this rank, in plan order: the order of the simulator's
        predicted bytes for the same plan (a sample's ``live_bytes`` against the track's
        ``after``, its ``peak_live_bytes`` against ``during``).
        """
        self.memory_probe = probe

    def plan_for(
        self, num_microbatches: int, forward_only: bool
    ) -> tuple[list[Action], PlanReport]:
        """This rank's compute actions and the validated plan (resolved once per count).

        Raises:
            ValueError: The schedule refuses the configuration, a given plan is for another
                number of microbatches, or a given resolved schedule lacks that count.
            PlanError: The plan is invalid (the message draws the grid).
        """
        report = self._prepared(num_microbatches, forward_only).report
        return [s.compute for s in report.steps[self.rank] if s.compute is not None], report

    def resolution(self, num_microbatches: int) -> ResolvedSchedule:
        """The resolved schedule a step of `num_microbatches` runs.

        The one given; one resolved on demand (`ResolvedSchedule.on_demand`) first grows by
        that count, planned and validated once.

        Raises:
            ValueError: The schedule refuses the count (see `resolve_schedule`).
            PlanError: The plan is invalid.
        """
        resolved = self.resolved
        if resolved.on_demand and num_microbatches not in resolved.microbatch_counts:
            self.resolved = resolved.with_count(num_microbatches)
        return self.resolved

    def _prepared(self, num_microbatches: int, forward_only: bool) -> PreparedPlan:
        key = (num_microbatches, forward_only)
        if key not in self._plans:
            resolved = self.resolution(num_microbatches)
            report = resolved.report(num_microbatches, forward_only)
            self._check_runs(report)
            delivered = sends_delivered(report.steps)[self.rank]
            self._plans[key] = PreparedPlan(report, delivered, resolved.placement)
        return self._plans[key]

    def _check_runs(self, report: PlanReport) -> None:
        """Refuse split backwards with an encoder-decoder split (the model's, not the plan's).

        Raises:
            ValueError: Split backwards (I/W) with a pipeline_model_parallel_split_rank.
        """
        split = any(s.compute.kind in ("I", "W") for r in report.steps for s in r if s.compute)
        if split and self.config.pipeline_model_parallel_split_rank is not None:
            raise ValueError(
                "split backwards (I/W, zero-bubble schedules) do not run with "
                "pipeline_model_parallel_split_rank; use '1f1b' for encoder-decoder models"
            )

    def _prepared_for(
        self, chunks: list[torch.nn.Module], num_microbatches: int, forward_only: bool
    ) -> PreparedPlan:
        """The validated plan of a call, checked against the chunks' DDP wrappers."""
        prepared = self._prepared(num_microbatches, forward_only)
        check_chunk_placement(chunks, prepared.placement, self.rank, self.schedule)
        if not forward_only:
            steps = prepared.report.steps[self.rank]
            check_torch_ddp_order(chunks, [s.compute for s in steps if s.compute])
        overlapped = any(s.overlap for rank in prepared.report.steps for s in rank)
        mode = check_fb_overlap(self.config.fb_overlap, chunks, overlapped, self.schedule)
        return dataclasses.replace(prepared, fb_mode=mode)

    def _chunks_and_iterators(
        self, model: Any, data_iterator: Any
    ) -> tuple[list[torch.nn.Module], Sequence[Any]]:
        """The call's chunks and per-chunk iterators, after checking there is one per chunk.

        Raises:
            ChunkIteratorError: Not `vp_size` chunks and iterators.
        """
        chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
        iterators = (
            data_iterator
            if isinstance(data_iterator, (list, tuple))
            else [data_iterator] * len(chunks)
        )
        if len(chunks) != self.vp_size or len(iterators) != self.vp_size:
            raise ChunkIteratorError(
                f"{self.vp_size} model chunks per rank expected (vp_size), got {len(chunks)} "
                f"chunks and {len(iterators)} data iterators"
            )
        return chunks, iterators

    def _check_call(self, iterators: Sequence[Any], collect: bool, fwd: bool) -> None:
        """Refuse a shared iterator, one no_sync_func for many chunks, or collect with backward.

        Raises:
            ChunkIteratorError: One iterator shared by several chunks.
            ValueError: The other two.
        """
        if self.vp_size > 1 and len({id(i) for i in iterators if i is not None}) < sum(
            i is not None for i in iterators
        ):
            # Each chunk pulls its own microbatches; one shared iterator would skip data.
            raise ChunkIteratorError(
                "with virtual stages, give each model chunk its own data iterator "
                "(a list of distinct iterators, as Megatron's interleaved schedule takes)"
            )
        no_sync = self.config.no_sync_func
        if self.vp_size > 1 and no_sync is not None and not isinstance(no_sync, (list, tuple)):
            raise ValueError(
                f"with {self.vp_size} model chunks, no_sync_func must be a list with one context "
                "factory per chunk (each chunk re-enables gradient sync for its last microbatch)"
            )
        if collect and not fwd:
            raise ValueError(
                "collect_non_loss_data needs forward_only=True: there is no loss to backward"
            )

    def _checked_plan(
        self,
        chunks: list[torch.nn.Module],
        iterators: Sequence[Any],
        num_microbatches: int,
        forward_only: bool,
        collect: bool,
    ) -> PreparedPlan:
        """The call's validated plan, after the call's other checks, in Megatron's order."""
        if self.pp_size > 1:
            # Megatron refuses a microbatch count before it looks at the iterators. One stage
            # runs any count (its only refusal, interleaving without a pipeline, holds for
            # every count), so there the call's own mistakes are named first.
            self._prepared(num_microbatches, forward_only)
        self._check_call(iterators, collect, forward_only)
        return self._prepared_for(chunks, num_microbatches, forward_only)

    def __call__(
        self,
        *,
        forward_step_func: ForwardStepFunc,
        data_iterator: Any,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        num_microbatches: int,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
    ) -> list[Any]:
        """Run forward (and backward) of `num_microbatches` microbatches over the pipeline.

        Walks this rank's steps of the validated plan in order: each compute step is one
        forward or backward, each exchange one pp-comm call; nothing else communicates. Then
        ``config.finalize_model_grads_func``, unless `forward_only` (see `_finalize`).

        Returns:
            On the rank holding the last stage, what each microbatch's ``loss_func`` reported
            (its loss dict, or with `collect_non_loss_data` and `forward_only` its non-loss
            data); elsewhere [].

        Raises:
            ChunkIteratorError: The model chunks or data iterators do not match the virtual
                size, or chunks share an iterator (a ValueError and a RuntimeError).
            ScheduleConfigError: The schedule refuses the microbatch count; checked before
                the iterators are shared or not, as in Megatron (a RuntimeError too).
            ValueError: A single no_sync_func with virtual stages, `collect_non_loss_data`
                without `forward_only`, a plan that does not fit the call, or a
                ``loss_func`` result of neither 2 nor 3 values (2 under
                `ScheduleConfig.calculate_per_token_loss`), naming what it takes.
            PlanError: The plan is invalid; nothing was sent.
        """
        chunks, iterators = self._chunks_and_iterators(model, data_iterator)
        prepared = self._checked_plan(
            chunks, iterators, num_microbatches, forward_only, collect_non_loss_data
        )
        self._check_shapes_known(chunks, seq_length, micro_batch_size)
        run = PlanWalk(
            self,
            CallArguments(
                chunks=chunks,
                iterators=iterators,
                forward_step_func=forward_step_func,
                num_microbatches=num_microbatches,
                seq_and_batch=(seq_length, micro_batch_size),
                decoder_seq_length=decoder_seq_length,
                forward_only=forward_only,
                collect_non_loss_data=collect_non_loss_data,
            ),
            prepared,
        )
        self._walk(run)
        self.stats = run.stats
        self.timeline = run.recorder.spans if run.recorder is not None else []
        self._finalize(chunks, run, forward_only)
        return run.store

    def _finalize(self, chunks: list[torch.nn.Module], run: PlanWalk, forward_only: bool) -> None:
        """Keep the call's token total and hand it to the finalisation hook, as Megatron.

        The hook runs after every call with a backward; it gets the token count on every
        rank under per-token loss (a copy of the total, which it may reduce in place; 0 where
        the last stage is not held, for the broadcast from the rank that holds it), None
        otherwise.
        """
        per_token = self.config.calculate_per_token_loss
        holds_last = self.placement.holds_last(self.rank)
        total = run.num_tokens
        if per_token and holds_last and total is None:  # no microbatch: nothing counted
            total = torch.zeros((), dtype=torch.float64, device=self._device)
        self.total_num_tokens = total if per_token and holds_last else None
        finalize = self.config.finalize_model_grads_func
        if forward_only or finalize is None:
            return
        count = None
        if self.total_num_tokens is not None:  # a copy: the hook reduces it in place
            count = self.total_num_tokens.clone()
        elif per_token:
            count = torch.zeros((), dtype=torch.float64, device=self._device)
        finalize(chunks, count)

    @property
    def _device(self) -> torch.device:
        """Where the communicator's tensors live (the CPU for a single stage)."""
        return self.communicator.device if self.communicator is not None else torch.device("cpu")

    def _check_shapes_known(
        self, chunks: list[torch.nn.Module], seq_length: int | None, micro_batch_size: int | None
    ) -> None:
        """Chunks without contracts receive (seq_length, micro_batch_size, hidden_size).

        Raises:
            ValueError: Such a chunk on a pipeline that sends no shapes, without those sizes.
        """
        if self.pp_size == 1 or self._headers:
            return
        bare = [
            c for c, chunk in enumerate(chunks)
            if chunk_contract(chunk, "input_boundary") is None
            and chunk_contract(chunk, "output_boundary") is None
        ]  # fmt: skip
        sizes = (self.config.hidden_size, seq_length, micro_batch_size)
        if bare and None in sizes:
            raise ValueError(
                f"model chunk {bare[0]} has no contracts, so its tensors travel as (seq_length, "
                f"micro_batch_size, hidden_size), but those are {sizes}; give all three, build "
                "the chunks with pp_schedules.PipelineModel and infer their contracts, or send "
                "shapes (CommConfig(variable_seq_lengths=True))"
            )

    def _walk(self, run: PlanWalk) -> None:
        """Walk the call's plan, measuring memory when asked; a failure stops the pipeline."""
        probe = self.memory_probe
        taken = len(probe.samples) if probe is not None else 0
        if probe is not None and self.communicator is not None:
            # pp-comm's frames kept from steps before the probe started are held here too.
            probe.adopt(self.communicator.kept_frames())
        try:
            with probe.counting() if probe is not None else contextlib.nullcontext():
                run.walk()
        except BaseException as error:
            # Sends of this step may still be pending; a later step would receive them.
            if self.communicator is not None:
                self.communicator.invalidate(f"a pipeline step failed: {type(error).__name__}")
            if isinstance(error, Exception):
                self.report_stop(error)
            raise
        self.memory_samples = probe.samples[taken:] if probe is not None else []


def get_forward_backward_func(
    communicator: P2PCommunicator | None = None,
    resolved: ResolvedSchedule | None = None,
    *,
    config: ScheduleConfig | None = None,
    vp_size: int | None = None,
) -> PipelineExecutor:
    """The function that runs one step's forward and backward passes, as Megatron's.

    The executor runs one thing: a resolved schedule (`resolve_schedule`), whose plans were
    validated for every microbatch count the run steps with. Without one, the schedule is
    Megatron's choice: no pipelining on one stage, interleaved 1F1B with virtual stages,
    1F1B otherwise, resolved on demand for each new microbatch count (as Megatron's
    argument-free ``get_forward_backward_func()``, for ported Megatron code).

    Args:
        communicator: This rank's pipeline communicator; None for a single stage, or, when
            a default parallel state with a pipeline is set (``pp_state.parallel_state.
            initialize_model_parallel``), one over its pipeline group.
        resolved: The run's resolved schedule; its pipeline size, transport and prefetch
            must fit the communicator.
        config: Hidden size, loss scaling, no_sync, timers (`ScheduleConfig`).
        vp_size: Megatron's choice only (no `resolved`): model chunks per rank; by default
            the default state's virtual pipeline size, else 1.

    Returns:
        A callable taking Megatron's keyword arguments (see `PipelineExecutor.__call__`);
        its ``stats`` describe the last call.

    Raises:
        ValueError: `vp_size` beside a resolved schedule, or a resolved schedule that does
            not fit the communicator.
    """
    if resolved is None:
        communicator, resolved = _megatron_choice(communicator, vp_size)
    elif vp_size is not None and vp_size != resolved.vp_size:
        raise ValueError(
            f"the resolved schedule has {resolved.vp_size} model chunks per rank, but "
            f"vp_size is {vp_size}"
        )
    return PipelineExecutor(communicator, resolved, config=config)


def _megatron_choice(
    communicator: P2PCommunicator | None, vp_size: int | None
) -> tuple[P2PCommunicator | None, ResolvedSchedule]:
    """Megatron's schedule for the pipeline, resolved on demand, and its communicator."""
    state = get_default_state() if has_default_state() else None
    if communicator is None and state is not None and state.pipeline_model_parallel_size > 1:
        communicator = P2PCommunicator.from_parallel_state(state)
    if vp_size is None:
        vp_size = (state.virtual_pipeline_model_parallel_size if state is not None else None) or 1
    return communicator, on_demand_for(communicator, vp_size=vp_size)


def on_demand_for(
    communicator: P2PCommunicator | None,
    schedule: str | None = None,
    *,
    vp_size: int = 1,
    placement: Placement | str | None = None,
) -> ResolvedSchedule:
    """`resolve_on_demand` for `communicator`'s pipeline: its size, transport and headers.

    Each microbatch count is planned and validated when a step first runs it.

    Args:
        communicator: The pipeline communicator the executor will run on (None: one stage).
        schedule: A schedule name; None: Megatron's choice (`default_schedule`).
        vp_size: Model chunks per rank.
        placement: "looped", "v" or a `Placement`; the schedule's own by default.

    Raises:
        ValueError: An unknown schedule or placement, or a size below 1.
    """
    headers = communicator is not None and communicator.config.exchanges_shapes
    transport = transport_of(communicator)
    return resolve_on_demand(
        schedule, pp_size=communicator.num_stages if communicator is not None else 1,
        vp_size=vp_size, placement=placement, transport=transport,
        prefetch=default_prefetch(transport, headers), exchanges_shapes=headers,
    )  # fmt: skip


def transport_of(communicator: P2PCommunicator | None) -> str:
    """Whose matching rules `communicator`'s transfers follow: its ``transport``.

    An object standing in for a communicator without that attribute (a test double, a
    loopback) is judged by its device: CUDA tensors travel over NCCL, others over gloo.
    """
    if communicator is None:
        return "gloo"
    transport = getattr(communicator, "transport", None)
    if isinstance(transport, str):
        return transport
    return "nccl" if communicator.device.type == "cuda" else "gloo"


def resolve_for(
    communicator: P2PCommunicator | None,
    schedule: str | PlanLike | None = None,
    **options: Any,
) -> ResolvedSchedule:
    """`resolve_schedule` for `communicator`'s pipeline: its size, transport and shape headers.

    A shorthand for ``resolve_schedule(schedule, pp_size=..., transport=...,
    exchanges_shapes=..., **options)`` with the three read off the communicator (None: one
    stage on gloo), so that the result fits the executor built on it.

    Args:
        communicator: The pipeline communicator the executor will run on.
        schedule: A name, "auto", a plan or its text; None: `default_schedule`.
        **options: `resolve_schedule`'s other keywords (``microbatch_counts`` at least).

    Raises:
        ValueError: As `resolve_schedule`, and for options naming what the communicator sets.
        PlanError: As `resolve_schedule`.
    """
    taken = {"pp_size", "transport", "exchanges_shapes"} & set(options)
    if taken:
        raise ValueError(
            f"resolve_for reads {', '.join(sorted(taken))} off the communicator; use "
            "resolve_schedule to give them yourself"
        )
    return resolve_schedule(
        schedule if isinstance(schedule, (str, type(None))) else as_plan(schedule),
        pp_size=communicator.num_stages if communicator is not None else 1,
        transport=transport_of(communicator),
        exchanges_shapes=communicator is not None and communicator.config.exchanges_shapes,
        **options,
    )
