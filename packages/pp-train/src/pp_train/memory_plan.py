"""The run's memory in bytes: predicted per rank, and planned to fit ``--memory-limit-gb``.

What a run holds follows from a few figures measured on one microbatch of each part of the
model alone (`ModelFigures`: a transformer layer with each kind of recomputation, the
embedding, the output layer and loss) and the run's settings: pp-schedules' `MemoryModel`
adds the dtypes and the optimizer, and its simulator the activations each schedule holds over
the step. The prediction is checked against the probe's measurement (see docs/memory.md).

`fit_memory_limit` is ``--memory-limit-gb`` (called by the run's one decision,
`pp_train.run_plan.decide_run`): with ``--pipeline-schedule auto`` it considers
every number of chunks per rank the layers allow, every recomputation (unless the flags fix
one) and every schedule, and keeps the shortest simulated step whose peak fits on every rank;
with a named schedule it checks that the run fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from pp_comm import CommConfig, frame_buffers
from pp_schedules import (
    Choice,
    Costs,
    MemoryLimitError,
    ResolvedSchedule,
    StageCosts,
    schedule_spec,
)
from pp_schedules.planning import (
    MemoryModel,
    PlanOption,
    Simulation,
    StageMemory,
    TransferBuffers,
    chain,
    choose_fitting,
    format_bytes_apart,
    schedules_for,
    simulate,
)
from pp_state.numbers import divisors
from pp_train.arguments import PretrainConfig
from pp_train.layer_split import LayerSplit
from pp_train.recompute import RecomputeConfig
from pp_train.world import RunLayout

__all__ = [
    "DEFAULT_MARGIN",
    "MemoryLimit",
    "MemoryPlanError",
    "ModelFigures",
    "PartFigures",
    "fit_memory_limit",
    "memory_limit",
    "memory_model",
    "predict_memory",
    "recompute_label",
    "stage_costs",
    "stage_memory",
    "transfer_buffers",
    "with_memory_model",
]

_GIB = 1024**3


class MemoryPlanError(ValueError):
    """The run cannot be fitted to ``--memory-limit-gb``, or its parts cannot be measured.

    Raised before training starts, by every rank alike; the message names the flag.
    """


@dataclasses.dataclass(frozen=True)
class PartFigures:
    """One microbatch through one part of the model alone.

    Attributes:
        parameters: The part's parameters on one rank (a weight split over tensor
            parallelism counts its rank's share).
        activation_bytes: Bytes its forward saves for backward (parameters excluded): the
            saved-tensor figure.
        forward_ms: Its forward's time.
        backward_ms: Its backward's time (recomputation included, for a recomputed layer).
        memory: Every byte it holds step by step, counted at the allocator level
            (`pp_train.app.auto_schedule.part_memory`); None: only the saved bytes are
            known, and the part is modelled by them (see `part_memory`).
    """

    parameters: int
    activation_bytes: int
    forward_ms: float = 1.0
    backward_ms: float = 2.0
    memory: StageMemory | None = None

    def bytes_figures(self, recompute_bytes: int = 0) -> StageMemory:
        """Its `memory`, or (not measured) its saved bytes with `recompute_bytes` on top."""
        if self.memory is not None:
            return dataclasses.replace(self.memory, parameters=self.parameters)
        return StageMemory(
            parameters=self.parameters,
            activation_bytes=self.activation_bytes,
            recompute_bytes=recompute_bytes,
        )


@dataclasses.dataclass(frozen=True)
class ModelFigures:
    """The parts a model's stages are made of, measured one microbatch at a time.

    Attributes:
        layer: A transformer layer without recomputation.
        layer_full: The same layer checkpointed whole (full granularity): it keeps its input.
        layer_selective: The layer with its core attention recomputed; None when the model
            marks no core attention.
        embedding: The embedding (the first stage's).
        loss: The final layernorm, output layer and loss (the last stage's).
        shared_parameters: Parameters the loss part holds as a copy of the embedding's (a
            tied output layer): one stage holding both keeps them once.
    """

    layer: PartFigures
    layer_full: PartFigures
    layer_selective: PartFigures | None
    embedding: PartFigures
    loss: PartFigures
    shared_parameters: int = 0


def _layer_parts(
    figures: ModelFigures, layers: int, recompute: RecomputeConfig | None
) -> list[StageMemory]:
    """The figures of `layers` layers in a row, with `recompute` applied to them.

    Measured parts (`PartFigures.memory`) carry their recomputation in their backward
    transients. Parts known by their saved bytes only take the recomputed segment's saved
    bytes as `recompute_bytes`: one layer's for a checkpointed layer, the attention's for
    selective recomputation.
    """
    plain, full = figures.layer, figures.layer_full
    if recompute is None or layers == 0:
        return [plain.bytes_figures()] * layers
    if recompute.granularity == "selective":
        selective = figures.layer_selective
        assert selective is not None
        transient = max(plain.activation_bytes - selective.activation_bytes, 0)
        return [selective.bytes_figures(transient)] * layers
    assert recompute.num_layers is not None
    one = full.bytes_figures(plain.activation_bytes)
    if recompute.method == "block":
        checkpointed = min(recompute.num_layers, layers)
        return [one] * checkpointed + [plain.bytes_figures()] * (layers - checkpointed)
    group = min(recompute.num_layers, layers)
    sizes = [group] * (layers // group) + ([layers % group] if layers % group else [])
    return [_checkpointed_group(figures, size) for size in sizes]


def _checkpointed_group(figures: ModelFigures, size: int) -> StageMemory:
    """`size` consecutive layers checkpointed as one (full granularity, uniform method).

    The group keeps its input, as one checkpointed layer does; its backward recomputes all
    `size` layers before going back through them, so it holds ``size - 1`` more layers'
    activations than one checkpointed layer's backward (measured parts), or `size` layers'
    saved bytes on top (parts known by their saved bytes).
    """
    plain, full = figures.layer, figures.layer_full
    one = full.bytes_figures(size * plain.activation_bytes)
    if full.memory is None or size == 1:
        return dataclasses.replace(one, parameters=size * plain.parameters)
    extra = (size - 1) * (plain.bytes_figures().activation_bytes + one.output_bytes)
    return dataclasses.replace(
        one,
        parameters=size * plain.parameters,
        backward_transient_bytes=one.backward_transient_bytes + extra,
        input_transient_bytes=one.input_transient_bytes + extra,
        deferred_bytes=size * one.deferred_bytes,
        weight_kept_bytes=size * one.weight_kept_bytes,
        weight_transient_bytes=one.weight_transient_bytes + extra,
    )


def stage_memory(
    figures: ModelFigures,
    layers: int,
    *,
    first: bool,
    last: bool,
    recompute: RecomputeConfig | None,
) -> StageMemory:
    """The figures of a virtual stage of `layers` layers, with `recompute` applied to them.

    The first stage also holds the embedding (`first`), the last the loss (`last`); the
    stage is the `pp_schedules.chain` of its parts. A stage holding both keeps the tied
    output weight once.
    """
    parts = [figures.embedding.bytes_figures()] if first else []
    parts += _layer_parts(figures, layers, recompute)
    parts += [figures.loss.bytes_figures()] if last else []
    stage = chain(parts)
    shared = figures.shared_parameters if first and last else 0
    return dataclasses.replace(stage, parameters=stage.parameters - shared)


def _layer_backward(figures: ModelFigures, layers: int, recompute: RecomputeConfig | None) -> float:
    """The backward time of `layers` layers: recomputed ones take the recomputing figure."""
    plain = figures.layer.backward_ms
    if recompute is None:
        return layers * plain
    if recompute.granularity == "selective":
        assert figures.layer_selective is not None
        return layers * figures.layer_selective.backward_ms
    recomputed = layers if recompute.method == "uniform" else min(recompute.num_layers or 0, layers)
    return recomputed * figures.layer_full.backward_ms + (layers - recomputed) * plain


def stage_costs(
    figures: ModelFigures,
    layers: int,
    *,
    first: bool,
    last: bool,
    recompute: RecomputeConfig | None,
) -> Costs:
    """The step times (ms) of such a stage.

    A split backward recomputes a checkpointed forward in both halves (``I`` and ``W``, see
    `pp_schedules.split_backward`), so each half is half the plain backward plus the whole
    recomputation.
    """
    ends = [part for part, here in ((figures.embedding, first), (figures.loss, last)) if here]
    forward = layers * figures.layer.forward_ms + sum(p.forward_ms for p in ends)
    plain = layers * figures.layer.backward_ms + sum(p.backward_ms for p in ends)
    backward = _layer_backward(figures, layers, recompute) + sum(p.backward_ms for p in ends)
    extra = backward - plain
    return Costs(
        forward=max(forward, 1e-6),
        backward=max(backward, 1e-6),
        backward_input=max(plain / 2 + extra, 1e-6),
        backward_weight=max(plain / 2 + extra, 1e-6),
    )


def memory_model(
    config: PretrainConfig,
    counts: Sequence[int],
    figures: ModelFigures,
    *,
    data_parallel_size: int,
    recompute: RecomputeConfig | None,
    transfers: TransferBuffers | None = None,
) -> MemoryModel:
    """The run's `MemoryModel`: one stage per layer count, its precision and optimizer.

    With ``--use-distributed-optimizer`` the optimizer state (moments and fp32 main copies)
    is counted over the data-parallel size, as each rank keeps only its shard. `transfers`
    are the pipeline transport's frames (`transfer_buffers`).
    """
    optimizer, last = config.optimizer, len(counts) - 1
    half = "bf16" if optimizer.bf16 else "fp16" if optimizer.fp16 else "fp32"
    stages = tuple(
        stage_memory(figures, n, first=s == 0, last=s == last, recompute=recompute)
        for s, n in enumerate(counts)
    )
    return MemoryModel(
        stages=stages,
        params_dtype=half,
        grad_dtype="fp32" if config.ddp.grad_reduce_in_fp32 else half,
        optimizer=optimizer.optimizer,
        sgd_momentum=optimizer.sgd_momentum > 0,
        data_parallel_size=data_parallel_size,
        distributed_optimizer=config.ddp.use_distributed_optimizer,
        transfers=transfers,
    )


def _stage_costs(
    figures: ModelFigures, counts: Sequence[int], recompute: RecomputeConfig | None
) -> StageCosts:
    last = len(counts) - 1
    return StageCosts.from_stages(
        [
            stage_costs(figures, n, first=s == 0, last=s == last, recompute=recompute)
            for s, n in enumerate(counts)
        ]
    )


def recompute_label(recompute: RecomputeConfig | None) -> str:
    """How the planner's table names a recomputation."""
    if recompute is None:
        return "no recompute"
    if recompute.granularity == "selective":
        return "recompute selective"
    return f"recompute full {recompute.method} {recompute.num_layers}"


def _recompute_choices(
    config: PretrainConfig, figures: ModelFigures, most_layers: int
) -> list[RecomputeConfig | None]:
    """The flags' recomputation when they set one; else none, selective and full ones."""
    if config.model.recompute is not None:
        return [config.model.recompute]
    choices: list[RecomputeConfig | None] = [None]
    if figures.layer_selective is not None:
        choices.append(RecomputeConfig(granularity="selective"))
    choices += [
        RecomputeConfig(granularity="full", method="block", num_layers=n)
        for n in range(1, most_layers)
    ]
    if most_layers:
        choices.append(RecomputeConfig(granularity="full", method="uniform", num_layers=1))
    return choices


def _chunk_choices(
    config: PretrainConfig, layout: RunLayout, *, auto: bool
) -> list[tuple[int, LayerSplit]]:
    """The chunks per rank the planner may pick, with their even split of the layers.

    With `auto` (``--pipeline-schedule auto``) and the even split of flags that fix no
    virtual stages, every number of chunks that splits the layers evenly (at most 4 per
    rank); otherwise the run's own.
    """
    parallel, layers = config.parallel, config.model.num_layers
    pp = parallel.pipeline_model_parallel_size
    own = [(layout.resolved.vp_size, layout.layer_split)]
    if not auto or layout.layer_split.source != "even":
        return own
    if parallel.num_layers_per_virtual_pipeline_stage is not None or layers % pp:
        return own
    choices = []
    for vp in (v for v in divisors(layers // pp) if v <= 4):
        per = layers // (pp * vp)
        choices.append((vp, LayerSplit((per,) * (pp * vp), "even")))
    return choices


def _options(
    config: PretrainConfig, layout: RunLayout, figures: ModelFigures, *, auto: bool
) -> dict[str, tuple[PlanOption, LayerSplit, RecomputeConfig | None]]:
    """Every (chunks per rank, split, recomputation) the planner weighs, by label."""
    named = None if auto else layout.resolved.name
    options = {}
    for vp, split in _chunk_choices(config, layout, auto=auto):
        for recompute in _recompute_choices(config, figures, max(split.counts)):
            label = f"vp {vp}, {recompute_label(recompute)}"
            model = memory_model(
                config, split.counts, figures, data_parallel_size=layout.data_parallel_size,
                recompute=recompute, transfers=transfer_buffers(layout),
            )  # fmt: skip
            placement = None if named is None else schedule_spec(named).placement
            option = PlanOption(label, vp, _stage_costs(figures, split.counts, recompute), model,
                                placement)  # fmt: skip
            options[label] = (option, split, recompute)
    return options


def fit_memory_limit(
    layout: RunLayout, config: PretrainConfig, figures: ModelFigures, *, auto: bool
) -> tuple[RunLayout, Choice | None]:
    """``--memory-limit-gb``: the layout whose simulated step is shortest within the limit.

    With `auto` (``--pipeline-schedule auto``, as `pp_train.run_plan.decide_run` tells)
    every option is weighed (`_options`). A named schedule
    (or Megatron's default) that auto could pick runs on the run's own chunks and split,
    with the recomputation that fits and is fastest (unless the flags set one). Any other
    (one stage, a plan file) is checked as configured.

    Returns:
        The run's layout (the chosen schedule resolved for every microbatch count, its split,
        recomputation and byte model), and the choice whose table the run prints (None when
        the run was only checked).

    Raises:
        MemoryPlanError: Nothing fits; the message names the limit, the smallest peak, its
            rank and what would fit.
    """
    limit = memory_limit(config, layout.resolved.transport)
    assert limit is not None
    resolved = layout.resolved
    runnable = {name for name, _ in schedules_for(resolved.vp_size)}
    if not auto and resolved.name not in runnable:
        return _check_limit(with_memory_model(layout, config, figures), limit), None
    options = _options(config, layout, figures, auto=auto)
    try:
        choice = choose_fitting(
            [option for option, _, _ in options.values()],
            pp_size=resolved.pp_size, num_microbatches=max(layout.microbatch_counts),
            memory_limit_bytes=limit.bytes, names=None if auto else [resolved.name or ""],
            prefetch=resolved.prefetch, transport=resolved.transport,
        )  # fmt: skip
    except MemoryLimitError as error:
        raise MemoryPlanError(
            f"{limit.flags}: {error}; flags to try: "
            f"{_flag_hints(config, auto=auto, static_too_large=error.static_too_large)}"
        ) from error
    assert choice.option is not None
    option, split, recompute = options[choice.option.label]
    resolved = resolved.with_schedule(
        choice.chosen.name, vp_size=option.vp_size, choice=choice if auto else resolved.choice
    )
    fitted = dataclasses.replace(
        layout, resolved=resolved, layer_split=split, recompute=recompute, memory=option.memory
    )
    return fitted, choice


def _flag_hints(config: PretrainConfig, *, auto: bool, static_too_large: bool) -> str:
    """The flags that would lower the peak: recomputation, the microbatch, the pipeline.

    When the static bytes alone are over the limit only more stages help (or sharding the
    optimizer state over data parallelism).
    """
    pp = config.parallel.pipeline_model_parallel_size
    more_stages = f"--pipeline-model-parallel-size {2 * pp} (on more processes)"
    if static_too_large:
        return more_stages
    hints = []
    if config.model.recompute is not None:
        hints.append("other --recompute-* flags (or none: the planner then weighs them all)")
    elif not auto:
        hints.append("--pipeline-schedule auto (chunks per rank weighed too)")
    batch = config.training.micro_batch_size
    if batch > 1:
        hints.append(f"--micro-batch-size {batch // 2}")
    return ", ".join([*hints, more_stages])


def _check_limit(layout: RunLayout, limit: MemoryLimit) -> RunLayout:
    """`layout` when its predicted peak fits on every rank.

    Raises:
        MemoryPlanError: A rank's predicted peak is over the limit; the message names it.
    """
    simulation = predict_memory(layout, max(layout.microbatch_counts))
    assert simulation is not None
    peaks = simulation.peak_memory
    worst = peaks.index(max(peaks))
    if peaks[worst] > limit.bytes:
        allowed, (need,) = format_bytes_apart([peaks[worst]], limit.bytes)
        raise MemoryPlanError(
            f"{limit.flags}: rank {worst} is predicted to need {need}, over {allowed}; "
            "recompute activations (--recompute-granularity full), use a smaller "
            "--micro-batch-size or more pipeline stages"
        )
    return layout


@dataclasses.dataclass(frozen=True)
class MemoryLimit:
    """What ``--memory-limit-gb`` allows the byte model's predicted peak, after the margin.

    Attributes:
        gb: The flag's value (GiB).
        margin: The share kept free (``--memory-limit-margin``, or its default).
        bytes: What a predicted peak may reach: ``gb`` GiB less the margin.
    """

    gb: float
    margin: float

    @property
    def bytes(self) -> float:
        """The bytes a plan's predicted peak may reach."""
        return self.gb * _GIB * (1 - self.margin)

    @property
    def flags(self) -> str:
        """How messages name the limit: the flag, and the margin when there is one."""
        text = f"--memory-limit-gb {self.gb:g}"
        return f"{text} less a {self.margin:.0%} margin" if self.margin else text


DEFAULT_MARGIN = {"nccl": 0.1, "gloo": 0.0}
"""``--memory-limit-margin``'s default per transport: CUDA's caching allocator fragments and
rounds what it allocates; CPU runs have no caching allocator."""


def memory_limit(config: PretrainConfig, transport: str) -> MemoryLimit | None:
    """``--memory-limit-gb`` with its margin (the flag's, or the transport's default)."""
    parallel = config.parallel
    if parallel.memory_limit_gb is None:
        return None
    margin = parallel.memory_limit_margin
    return MemoryLimit(
        parallel.memory_limit_gb, DEFAULT_MARGIN.get(transport, 0.1) if margin is None else margin
    )


def transfer_buffers(layout: RunLayout, comm: CommConfig | None = None) -> TransferBuffers | None:
    """What the run's pipeline transport holds beyond the tensors (pp-comm's frames).

    None with one stage (nothing travels). pp-train's communicator checks contracts in
    frames on gloo (`pp_comm.frame_buffers`).
    """
    if layout.resolved.pp_size == 1:
        return None
    frames = frame_buffers(comm or CommConfig(), layout.resolved.transport)
    return TransferBuffers(**dataclasses.asdict(frames))


def with_memory_model(
    layout: RunLayout, config: PretrainConfig, figures: ModelFigures
) -> RunLayout:
    """`layout` with its byte model (for the memory report's prediction), as configured."""
    model = memory_model(
        config, layout.layer_counts, figures, data_parallel_size=layout.data_parallel_size,
        recompute=layout.recompute, transfers=transfer_buffers(layout),
    )  # fmt: skip
    return dataclasses.replace(layout, memory=model)


class _WithBytes(Protocol):
    """A run with a byte model: the checked `RunLayout` or the decided `RunPlan`."""

    @property
    def memory(self) -> MemoryModel | None: ...

    @property
    def resolved(self) -> ResolvedSchedule: ...


def predict_memory(layout: _WithBytes, num_microbatches: int) -> Simulation | None:
    """The simulated step of `layout` with its byte model; None without one."""
    if layout.memory is None:
        return None
    report = layout.resolved.report(num_microbatches, forward_only=False)
    return simulate(report, memory=layout.memory)
