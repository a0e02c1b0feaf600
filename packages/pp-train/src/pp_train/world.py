"""What a `PretrainConfig` means on a world of N processes, checked before any group starts.

`check_world` derives the data-parallel and virtual pipeline sizes, the microbatch counts
(several while the batch ramps up), the schedule (``auto`` chosen by simulation) or the plan
of ``--pipeline-schedule-file`` (validated), and refuses what cannot run, with the flags and
the numbers that would work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pp_schedules import (
    Choice,
    Plan,
    candidates_for,
    check_trace_path,
    choose_schedule,
    parse_schedule,
    plan,
    validate,
)
from pp_state import PipelineLayerLayout, Placement
from pp_train.arguments import PretrainConfig
from pp_train.data import check_data
from pp_train.layer_split import LayerSplit, layer_split
from pp_train.num_microbatches_calculator import (
    NumMicroBatchesCalculator,
    build_num_microbatches_calculator,
)
from pp_train.training import tied_embedding_sync

__all__ = ["RunLayout", "check_world", "microbatch_calculator"]


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """The sizes and the schedule a configuration runs with on its world."""

    world_size: int
    data_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    """None without virtual stages (Megatron's convention)."""
    microbatch_counts: tuple[int, ...]
    """Every number of microbatches a step runs, smallest first."""
    schedule: str | None
    """The named schedule (``auto`` resolved); None: Megatron's default for the sizes."""
    plan: Plan | None
    """The plan of ``--pipeline-schedule-file``, validated."""
    schedule_choice: Choice | None
    """With ``--pipeline-schedule auto``: the choice and its table."""
    layer_split: LayerSplit
    """Transformer layers of each virtual stage, and where that split came from."""

    @property
    def layer_counts(self) -> tuple[int, ...]:
        """Transformer layers of each virtual stage, in pipeline order."""
        return self.layer_split.counts

    @property
    def placement(self) -> Placement:
        """Which stage each chunk holds: the plan's, V for zbv, else Megatron's looped."""
        if self.plan is not None:
            return self.plan.placement
        pp = self.world_size // self.data_parallel_size
        vp = self.virtual_pipeline_model_parallel_size or 1
        return Placement.named("v" if self.schedule == "zbv" else "looped", pp, vp)

    @property
    def layer_layout(self) -> PipelineLayerLayout:
        """Which transformer layers, and whether the embedding or the loss, each chunk holds."""
        placement = self.placement
        return PipelineLayerLayout.from_counts(
            self.layer_counts, placement.pp_size, placement=placement
        )


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def check_world(
    config: PretrainConfig, world_size: int, *, layer_counts: Sequence[int] | None = None
) -> RunLayout:
    """The run's layout on `world_size` processes; with ``--data-path``, the data checked too.

    Args:
        config: The run's configuration.
        world_size: The number of processes.
        layer_counts: Transformer layers of each virtual stage, in pipeline order (uneven
            stages; the first or last may hold none). Their number over the pipeline size is
            the virtual size. None: the even split of ``--num-layers`` (with
            ``--num-layers-per-virtual-pipeline-stage``).

    Raises:
        ValueError: The sizes do not fit the world, the batches do not divide, the schedule
            cannot run them, or the plan file is unreadable, invalid or for other sizes; the
            message names the flags and what would work.
    """
    dp = _check_world_size(config, world_size)
    _check_batches(config, dp)
    counts = _microbatch_counts(config, dp)
    split = layer_split(
        config.parallel, config.model.num_layers, given=layer_counts,
        num_microbatches=max(counts),
    )  # fmt: skip
    chunks = len(split.counts) // config.parallel.pipeline_model_parallel_size
    vp = chunks if chunks > 1 else None
    schedule: str | None = config.parallel.pipeline_schedule
    choice, read = None, None
    if config.parallel.pipeline_schedule_file is not None:
        read = _read_plan(config, dp, vp)
    else:
        pp = config.parallel.pipeline_model_parallel_size
        if schedule == "auto":
            choice = _choose(pp, vp or 1, counts)
            schedule = choice.chosen.name
        _check_named_schedule(schedule, pp, vp or 1, counts)
    if config.logging.profile_schedule is not None:
        try:
            check_trace_path(config.logging.profile_schedule)
        except ValueError as error:
            raise ValueError(f"--profile-schedule: {error}") from error
    if config.data.data_path is not None:
        check_data(
            config.data,
            seq_length=config.model.seq_length,
            seed=config.training.seed,
            train_valid_test_num_samples=config.train_valid_test_num_samples,
        )
    return RunLayout(world_size, dp, vp, tuple(counts), schedule, read, choice, split)


def _check_world_size(config: PretrainConfig, world: int) -> int:
    """The data-parallel size: the processes over the pipeline size."""
    pp = config.parallel.pipeline_model_parallel_size
    if world % pp:
        raise ValueError(
            f"--pipeline-model-parallel-size {pp} does not divide the {world} processes; "
            f"use one of {_divisors(world)}"
        )
    return world // pp


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


def _check_named_schedule(name: str | None, pp: int, vp: int, counts: list[int]) -> None:
    chosen = name or ("interleaved_1f1b" if vp > 1 else "1f1b" if pp > 1 else "no_pipelining")
    for count in counts:
        try:
            plan(chosen, pp_size=pp, num_microbatches=count, vp_size=vp)
        except ValueError as error:
            if name is None:
                raise ValueError(
                    f"interleaved schedule with {vp} chunks per stage: {error}"
                ) from error
            hint = (
                "; virtual stages come from --num-layers-per-virtual-pipeline-stage"
                if name == "interleaved_1f1b" and vp == 1
                else ""
            )
            raise ValueError(
                f"--pipeline-schedule {name} with {vp} chunk(s) per rank: {error}{hint}"
            ) from error


def _choose(pp: int, vp: int, counts: list[int]) -> Choice:
    """--pipeline-schedule auto: the shortest simulated schedule that fits.

    Costs F:I:W = 1:1:1; the schedule must run every microbatch count of the run and hold no
    more activations than 1F1B's first rank.
    """
    if pp < 2:
        raise ValueError("--pipeline-schedule auto needs --pipeline-model-parallel-size 2 or more")
    runnable = []
    for name, _ in candidates_for(vp):
        try:
            for count in counts:
                plan(name, pp_size=pp, num_microbatches=count, vp_size=vp)
        except ValueError:
            continue
        runnable.append(name)
    try:
        return choose_schedule(
            pp_size=pp, num_microbatches=max(counts), vp_size=vp,
            memory_limit=float(min(pp, max(counts))), names=runnable,
        )  # fmt: skip
    except ValueError as error:
        raise ValueError(f"--pipeline-schedule auto: {error}") from error


def _read_text(flag: str, path: str) -> str:
    """The UTF-8 text of the file a flag names."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        raise ValueError(f"{flag}: cannot be read: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise ValueError(f"{flag}: is not UTF-8 text") from error


def _read_plan(config: PretrainConfig, dp: int, vp: int | None) -> Plan:
    """The plan of --pipeline-schedule-file, checked against the run's sizes and validated."""
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
        validate(schedule, num_microbatches=count)
        if config.training.eval_iters > 0:
            validate(schedule.without_backward(), num_microbatches=count, forward_only=True)
        tied_embedding_sync(schedule.placement)
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from error
    return schedule


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
