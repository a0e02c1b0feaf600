"""What a `PretrainConfig` means on a world of N processes, checked before any group starts.

`check_world` checks that the model splits over the tensor-parallel size, derives the
data-parallel (world / (tensor x pipeline)) and virtual pipeline sizes, the microbatch counts
(several while the batch ramps up) and the split of layers, and resolves the schedule once:
a name, ``auto`` (chosen by simulation) or the plan of ``--pipeline-schedule-file``, planned
and validated for every microbatch count with pp-schedules' `resolve_schedule`. It refuses
what cannot run, with the flags and the numbers that would work. `pretrain` takes its result
instead of checking again, and decides the run from it once (`pp_train.run_plan`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path

from pp_schedules import Choice, Plan, ResolvedSchedule, parse_schedule, resolve_schedule
from pp_schedules.planning import MemoryModel
from pp_schedules.runtime import check_trace_path
from pp_state import PipelineLayerLayout, Placement
from pp_state.numbers import divisors
from pp_train.arguments import PretrainConfig
from pp_train.data import check_data
from pp_train.embeddings import tied_embedding_sync
from pp_train.layer_split import LayerSplit, layer_split
from pp_train.num_microbatches_calculator import (
    NumMicroBatchesCalculator,
    build_num_microbatches_calculator,
)
from pp_train.recompute import RecomputeConfig

__all__ = [
    "RunLayout",
    "ScheduledLayers",
    "check_creatable_folder",
    "check_world",
    "microbatch_calculator",
]


class ScheduledLayers:
    """What a run's resolved schedule and split of layers say, for a record holding both.

    A subclass has ``resolved`` (a `ResolvedSchedule`) and ``layer_split`` (a `LayerSplit`):
    the checked `RunLayout` and the decided `pp_train.run_plan.RunPlan`.
    """

    resolved: ResolvedSchedule
    layer_split: LayerSplit

    @property
    def virtual_pipeline_model_parallel_size(self) -> int | None:
        """Model chunks per rank; None without virtual stages (Megatron's convention)."""
        return self.resolved.vp_size if self.resolved.vp_size > 1 else None

    @property
    def microbatch_counts(self) -> tuple[int, ...]:
        """Every number of microbatches a step runs, smallest first."""
        return self.resolved.microbatch_counts

    @property
    def schedule(self) -> str | None:
        """The schedule's name (``auto`` resolved); None for a ``--pipeline-schedule-file`` plan."""
        return self.resolved.name

    @property
    def plan(self) -> Plan | None:
        """The plan of ``--pipeline-schedule-file``, validated; None for a named schedule."""
        return self.resolved.plan

    @property
    def layer_counts(self) -> tuple[int, ...]:
        """Transformer layers of each virtual stage, in pipeline order."""
        return self.layer_split.counts

    @property
    def placement(self) -> Placement:
        """Which stage each chunk holds: the resolved schedule's."""
        return self.resolved.placement

    @property
    def layer_layout(self) -> PipelineLayerLayout:
        """Which transformer layers, and whether the embedding or the loss, each chunk holds."""
        placement = self.placement
        return PipelineLayerLayout.from_counts(
            self.layer_counts, placement.pp_size, placement=placement
        )


@dataclasses.dataclass(frozen=True)
class RunLayout(ScheduledLayers):
    """A configuration checked on a world: its sizes, split of layers and resolved schedule.

    What the flags name, resolved before any process group starts (``auto`` with default
    costs). `pp_train.run_plan.decide_run` turns it, with what a warm-up measured, into the
    run's one decision (`pp_train.run_plan.RunPlan`), which is what the run reads.
    """

    world_size: int
    data_parallel_size: int
    resolved: ResolvedSchedule
    """The schedule, planned and validated for every microbatch count (and, with evaluation,
    forward only): the one place the run's plans, placement and ``auto`` choice live."""
    layer_split: LayerSplit
    """Transformer layers of each virtual stage, and where that split came from."""
    recompute: RecomputeConfig | None = None
    """The activation recomputation the model is built with: the flags', or the one
    ``--memory-limit-gb`` chose (see `pp_train.memory_plan`)."""
    memory: MemoryModel | None = None
    """The run's byte model, once its parts were measured (the memory report's prediction)."""
    tensor_model_parallel_size: int = 1
    """Ranks each layer is split over: world = tensor x context x pipeline x data parallel."""
    context_parallel_size: int = 1
    """Ranks each sequence is split over (context parallelism)."""

    @property
    def schedule_choice(self) -> Choice | None:
        """With ``--pipeline-schedule auto``: the choice and its table."""
        return self.resolved.choice


def check_world(
    config: PretrainConfig,
    world_size: int,
    *,
    layer_counts: Sequence[int] | None = None,
    transport: str = "gloo",
) -> RunLayout:
    """The run's layout on `world_size` processes; with ``--data-path``, the data checked too.

    Args:
        config: The run's configuration.
        world_size: The number of processes.
        layer_counts: Transformer layers of each virtual stage in pipeline order (the first
            or last may hold none); their number over the pipeline size is the virtual size.
            None: the even split (``--num-layers-per-virtual-pipeline-stage``).
        transport: "gloo" or "nccl": whose matching rules the plans are validated under.

    Raises:
        ValueError: The sizes do not fit the world, the model (its widths, or its sequence
            under sequence or context parallelism) does not split, the batches do not divide,
            the schedule cannot run them, --recompute-num-layers exceeds the fullest chunk's
            layers, the plan file is unreadable, invalid or for other sizes, the TensorBoard
            folder cannot be made, or the data is refused; each message names the flags and
            what would work.
    """
    _check_tensor_parallel(config)
    dp = _check_world_size(config, world_size)
    _check_batches(config, dp)
    counts = _microbatch_counts(config, dp)
    asked = config.parallel.pipeline_schedule
    split = layer_split(
        config.parallel, config.model.num_layers, given=layer_counts,
        num_microbatches=max(counts), schedule=None if asked == "auto" else asked,
    )  # fmt: skip
    _check_recompute_layers(config, split)
    chunks = len(split.counts) // config.parallel.pipeline_model_parallel_size
    vp = chunks if chunks > 1 else None
    if config.parallel.pipeline_schedule_file is not None:
        resolved = _resolve_plan(config, dp, vp, transport)
    else:
        resolved = _resolve_named(config, vp or 1, counts, transport)
    if config.logging.profile_schedule is not None:
        try:
            check_trace_path(config.logging.profile_schedule)
        except ValueError as error:
            raise ValueError(f"--profile-schedule: {error}") from error
    if config.logging.tensorboard_dir is not None:
        check_creatable_folder("--tensorboard-dir", config.logging.tensorboard_dir)
    if config.data.data_path is not None:
        check_data(
            config.data,
            seq_length=config.model.seq_length,
            seed=config.training.seed,
            train_valid_test_num_samples=config.train_valid_test_num_samples,
        )
    return RunLayout(
        world_size, dp, resolved, split, recompute=config.model.recompute,
        tensor_model_parallel_size=config.parallel.tensor_model_parallel_size,
        context_parallel_size=config.parallel.context_parallel_size,
    )  # fmt: skip


def _check_recompute_layers(config: PretrainConfig, split: LayerSplit) -> None:
    """``--recompute-num-layers`` is at most the transformer layers of the fullest chunk.

    A chunk with fewer layers recomputes all of its own (`RecomputeConfig.for_chunk`); a
    number above every chunk's would ask for layers that no chunk holds.

    Raises:
        ValueError: The message names the flag, the split and the valid range.
    """
    wanted = config.model.recompute_num_layers
    fullest = max(split.counts)
    if wanted is None or wanted <= fullest:
        return
    raise ValueError(
        f"--recompute-num-layers {wanted} is more than the {fullest} transformer layer(s) the "
        f"fullest model chunk holds (layers per virtual stage: "
        f"{', '.join(str(c) for c in split.counts)}); use 1 .. {fullest}"
    )


def check_creatable_folder(flag: str, path: str) -> None:
    """Checks, creating nothing, that a folder can be made (or written) at `path`.

    No existing component of the path may be a file, and the nearest existing folder must be
    writable: every rank can check this before the logging rank creates the folder.

    Raises:
        ValueError: The message names `flag`, the path and the component in the way.
    """
    target = Path(path)
    for part in (target, *target.parents):
        if part.is_dir():
            if not os.access(part, os.W_OK | os.X_OK):
                raise ValueError(f"{flag} {path}: folder {part} is not writable")
            return
        if os.path.lexists(part):
            kind = "a file" if part.is_file() else "not a folder"
            raise ValueError(f"{flag} {path}: {part} is {kind}, so no folder can be made there")


def _check_world_size(config: PretrainConfig, world: int) -> int:
    """The data-parallel size: the processes over the tensor x context x pipeline size."""
    parallel = config.parallel
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    if tp == 1 and cp == 1 and world % pp:
        raise ValueError(
            f"--pipeline-model-parallel-size {pp} does not divide the {world} processes; "
            f"use one of {divisors(world)}"
        )
    if world % (tp * cp * pp):
        sizes = [f"--tensor-model-parallel-size {tp}", f"--pipeline-model-parallel-size {pp}"]
        if cp > 1:
            sizes.insert(1, f"--context-parallel-size {cp}")
        raise ValueError(
            f"{' x '.join(sizes)} = {tp * cp * pp} does not divide the {world} processes; "
            f"choose sizes whose product is one of {divisors(world)}"
        )
    return world // (tp * cp * pp)


def _check_context_parallel(config: PretrainConfig) -> None:
    """The sequence splits into ``2 x cp`` chunks (and each rank's part over tp with sp).

    Raises:
        ValueError: The sequence does not split, or an encoder-decoder model (whose encoder
            sequence context parallelism does not split); the message names the flags, the
            numbers and lengths that would work.
    """
    parallel, model = config.parallel, config.model
    cp = parallel.context_parallel_size
    if cp == 1:
        return
    if model.decoder_seq_length is not None:
        raise ValueError(
            f"--context-parallel-size {cp} with --decoder-seq-length "
            f"{model.decoder_seq_length}: context parallelism splits a decoder-only model's "
            "sequence; use --context-parallel-size 1 for an encoder-decoder model"
        )
    tp = parallel.tensor_model_parallel_size if parallel.sequence_parallel_in_use else 1
    # 2 x cp equal chunks, and each rank's part (seq / cp) over tp under sequence parallelism.
    unit = math.lcm(2 * cp, cp * tp)
    if model.seq_length % unit:
        why = f"2 x --context-parallel-size {cp} = {2 * cp}"
        if unit != 2 * cp:
            why = (
                f"{unit} (--context-parallel-size {cp} x 2 chunks, and each rank's part over "
                f"--tensor-model-parallel-size {tp} under sequence parallelism)"
            )
        below = model.seq_length // unit * unit
        choices = " or ".join(str(n) for n in (below, below + unit) if n > 0)
        raise ValueError(
            f"--seq-length {model.seq_length} is not divisible by {why}: each "
            f"context-parallel rank holds 2 of {2 * cp} equal chunks of the sequence; use a "
            f"multiple of {unit}, such as {choices}"
        )


def _check_tensor_parallel(config: PretrainConfig) -> None:
    """The model's widths split over ``--tensor-model-parallel-size`` (and the sequence too).

    Each rank holds whole attention heads and an equal slice of the hidden and FFN widths;
    under sequence parallelism an equal slice of the sequence.

    Raises:
        ValueError: A width (or, with --sequence-parallel, a sequence length) does not
            divide; the message names the flags, the numbers and the sizes that would work.
    """
    model, tp = config.model, config.parallel.tensor_model_parallel_size
    ffn = 4 * model.hidden_size if model.ffn_hidden_size is None else model.ffn_hidden_size
    widths = [
        ("--hidden-size", model.hidden_size),
        ("--num-attention-heads", model.num_attention_heads),
        ("--ffn-hidden-size" if model.ffn_hidden_size is not None else "the FFN size", ffn),
    ]
    if config.parallel.sequence_parallel_in_use:
        widths += [("--seq-length", model.seq_length)]
        if model.decoder_seq_length is not None:
            widths += [("--decoder-seq-length", model.decoder_seq_length)]
    for name, value in widths:
        if value % tp:
            valid = divisors(math.gcd(*(v for _, v in widths)))
            raise ValueError(
                f"{name} {value} is not divisible by --tensor-model-parallel-size {tp}; "
                f"tensor-parallel sizes that split the model: {', '.join(map(str, valid))}"
            )
    _check_context_parallel(config)


def _check_batches(config: PretrainConfig, dp: int) -> None:
    training = config.training
    unit = training.micro_batch_size * dp
    if training.global_batch_size % unit:
        below = max(unit, training.global_batch_size // unit * unit)
        raise ValueError(
            f"--global-batch-size {training.global_batch_size} is not divisible by "
            f"--micro-batch-size {training.micro_batch_size} x data-parallel size {dp} = "
            f"{unit}; use a multiple of {unit} such as {below} or {below + unit}"
        )
    if training.rampup_batch_size is not None:
        _check_rampup(config, dp)


def _check_rampup(config: PretrainConfig, dp: int) -> None:
    training = config.training
    assert training.rampup_batch_size is not None
    start, increment, samples = training.rampup_batch_size
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    try:
        microbatch_calculator(config, dp)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{flag}: {error}") from error
    unit = training.micro_batch_size * dp
    sizes = range(start, training.global_batch_size, increment)
    uneven = [size for size in sizes if size % unit]
    if uneven:
        raise ValueError(
            f"{flag} passes through global batch sizes {uneven} that --micro-batch-size "
            f"{training.micro_batch_size} x data-parallel size {dp} = {unit} does not divide; "
            f"use a start and increment that are multiples of {unit}"
        )


def microbatch_calculator(config: PretrainConfig, dp: int) -> NumMicroBatchesCalculator:
    """Microbatches per step for the run's batch sizes (ramping up with --rampup-batch-size)."""
    training = config.training
    return build_num_microbatches_calculator(
        global_batch_size=training.global_batch_size,
        micro_batch_size=training.micro_batch_size,
        data_parallel_size=dp,
        rampup_batch_size=training.rampup_batch_size,
    )


def _microbatch_counts(config: PretrainConfig, dp: int) -> list[int]:
    """Every number of microbatches a step runs (several while the batch size ramps up)."""
    training = config.training
    unit = training.micro_batch_size * dp
    sizes = {training.global_batch_size}
    if training.rampup_batch_size is not None:
        start, increment, _ = training.rampup_batch_size
        sizes.update(range(start, training.global_batch_size, increment))
    return sorted(size // unit for size in sizes)


def _resolve_named(
    config: PretrainConfig, vp: int, counts: list[int], transport: str
) -> ResolvedSchedule:
    """``--pipeline-schedule`` (Megatron's default when unset, ``auto`` chosen) for every count.

    ``auto`` simulates costs F:I:W = 1:1:1 and takes the shortest schedule that runs every
    microbatch count and holds no more activations than 1F1B's first rank.
    """
    pp, name = config.parallel.pipeline_model_parallel_size, config.parallel.pipeline_schedule
    if name == "auto" and pp < 2:
        raise ValueError("--pipeline-schedule auto needs --pipeline-model-parallel-size 2 or more")
    limit = float(min(pp, max(counts))) if name == "auto" else None
    try:
        return resolve_schedule(
            name, pp_size=pp, vp_size=vp, microbatch_counts=counts,
            include_forward_only=config.training.eval_iters > 0, transport=transport,
            memory_limit=limit,
        )  # fmt: skip
    except ValueError as error:
        if name is None:
            raise ValueError(f"interleaved schedule with {vp} chunks per stage: {error}") from error
        if name == "auto":
            raise ValueError(f"--pipeline-schedule auto: {error}") from error
        hint = (
            "; virtual stages come from --num-layers-per-virtual-pipeline-stage"
            if name == "interleaved_1f1b" and vp == 1
            else ""
        )
        raise ValueError(
            f"--pipeline-schedule {name} with {vp} chunk(s) per rank: {error}{hint}"
        ) from error


def _read_text(flag: str, path: str) -> str:
    """The UTF-8 text of the file a flag names."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        raise ValueError(f"{flag}: cannot be read: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise ValueError(f"{flag}: is not UTF-8 text") from error


def _resolve_plan(
    config: PretrainConfig, dp: int, vp: int | None, transport: str
) -> ResolvedSchedule:
    """The plan of --pipeline-schedule-file: read once, checked against the run's sizes.

    It is validated for its microbatch count (and forward only, with evaluation).
    """
    path = config.parallel.pipeline_schedule_file
    assert path is not None
    flag = f"--pipeline-schedule-file {path}"
    try:
        schedule = parse_schedule(_read_text(flag, path))
    except ValueError as error:
        raise ValueError(error if str(error).startswith(flag) else f"{flag}: {error}") from error
    _check_plan_sizes(config, flag, schedule, vp or 1)
    unit = config.training.micro_batch_size * dp
    count = config.training.global_batch_size // unit
    if schedule.num_microbatches != count:
        raise ValueError(
            f"{flag} covers {schedule.num_microbatches} microbatch(es), but each step runs "
            f"{count} (--global-batch-size {config.training.global_batch_size} / "
            f"(--micro-batch-size {config.training.micro_batch_size} x data-parallel size "
            f"{dp})); write a plan for {count} microbatches or use --global-batch-size "
            f"{schedule.num_microbatches * unit}"
        )
    try:
        resolved = resolve_schedule(
            schedule, pp_size=schedule.pp_size, vp_size=schedule.vp_size,
            microbatch_counts=[count], include_forward_only=config.training.eval_iters > 0,
            transport=transport,
        )  # fmt: skip
        if not config.model.untie_embeddings_and_output_weights:
            tied_embedding_sync(schedule.placement)  # an untied output layer needs no sync
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from error
    return resolved


def _check_plan_sizes(config: PretrainConfig, flag: str, schedule: Plan, vp: int) -> None:
    """The plan's ranks and chunks are the run's; its microbatch count is fixed."""
    pp, layers = config.parallel.pipeline_model_parallel_size, config.model.num_layers
    if schedule.pp_size != pp:
        raise ValueError(
            f"{flag} writes {schedule.pp_size} rank line(s), but --pipeline-model-parallel-size "
            f"is {pp}; write one line per pipeline rank"
        )
    if schedule.vp_size != vp:
        chunks = pp * schedule.vp_size
        fix = (
            "drop --num-layers-per-virtual-pipeline-stage"
            if schedule.vp_size == 1
            else f"use --num-layers-per-virtual-pipeline-stage {layers // chunks}"
            if layers % chunks == 0
            else f"use a number of layers divisible by {chunks}"
        )
        raise ValueError(
            f"{flag} runs {schedule.vp_size} model chunk(s) per rank, but the run has {vp} "
            f"(--num-layers {layers}, --num-layers-per-virtual-pipeline-stage "
            f"{config.parallel.num_layers_per_virtual_pipeline_stage}); {fix}"
        )
    if config.training.rampup_batch_size is not None:
        raise ValueError(
            f"{flag} fixes the number of microbatches per step, but --rampup-batch-size changes "
            "it while the batch grows; a fixed plan needs a fixed microbatch count, so drop "
            "one of the two"
        )
