"""The ``pp-train`` command: train the bundled GPT on the bundled corpus, with Megatron's flags.

Run it under torchrun (``torchrun --nproc-per-node 4 -m pp_train ...``); the world is split
into pipeline stages and data-parallel replicas. gloo on CPU, NCCL when every local rank has a
GPU. This is the only module that reads the environment (torchrun's variables).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from pp_optim import (
    DDPConfig,
    LRScheduleConfig,
    MegatronOptimizer,
    OptimizerConfig,
    OptimizerParamScheduler,
)
from pp_schedules import (
    Choice,
    PipelineExecutor,
    Plan,
    candidates_for,
    check_trace_path,
    choose_schedule,
    parse_schedule,
    plan,
    validate,
)
from pp_state import ParallelConfig, ParallelState, Placement
from pp_train.app.auto_schedule import choose_measured
from pp_train.app.corpus import CorpusDataset, corpus_tokens, split_corpus
from pp_train.app.gpt import GPTChunk, GPTConfig, chunk_layers
from pp_train.checkpointing import CheckpointError, LoadedCheckpoint
from pp_train.data import ByteTokenizer, microbatches
from pp_train.num_microbatches_calculator import (
    NumMicroBatchesCalculator,
    build_num_microbatches_calculator,
)
from pp_train.reporting import TIMING_LOG_OPTIONS, Timers, TrainingLogger, memory_report
from pp_train.training import (
    TrainingConfig,
    TrainingProgress,
    build_forward_backward_func,
    evaluate,
    setup_model_and_optimizer,
    tied_embedding_sync,
    train,
)
from pp_train.wrappers import unwrap_model

__all__ = ["build_parser", "gpt_forward_step", "main", "validate_args"]

LR_DECAY_STYLES = ["constant", "linear", "cosine", "inverse-square-root", "WSD"]
WSD_STYLES = ["linear", "cosine", "exponential", "minus_sqrt"]
PIPELINE_SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "auto"]
_SCHEDULE_TITLES = {
    "no_pipelining": "no pipelining",
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "interleaved 1F1B",
    "zb_h1": "zero-bubble ZB-H1",
    "zbv": "zero-bubble ZB-V (V placement)",
}


class _Parser(argparse.ArgumentParser):
    """Under torchrun every process parses the flags; only rank 0 prints the error."""

    def error(self, message: str) -> NoReturn:
        """Prints usage and `message` on rank 0 (or without torchrun); exits with status 2."""
        if os.environ.get("RANK", "0") == "0":
            self.print_usage(sys.stderr)
            self.exit(2, f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    """Megatron's flag names, with defaults that train the small GPT on CPU in about a minute."""
    parser = _Parser(
        prog="pp-train",
        description="Train the bundled small GPT with pipeline parallelism (run under torchrun).",
    )
    _model_and_parallel_flags(parser)
    _schedule_flags(parser)
    _optimizer_flags(parser)
    _io_flags(parser)
    return parser


def _model_and_parallel_flags(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=8)
    model.add_argument("--hidden-size", type=int, default=64)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--ffn-hidden-size", type=int, default=None)
    model.add_argument("--seq-length", type=int, default=64)
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="layers per model chunk; fewer than num_layers/pp turns on interleaved 1F1B",
    )
    parallel.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    parallel.add_argument(
        "--overlap-grad-reduce", action="store_true", help="all-reduce grad buckets during backward"
    )
    batch = parser.add_argument_group("batches")
    batch.add_argument("--micro-batch-size", type=int, default=4)
    batch.add_argument("--global-batch-size", type=int, default=32)
    batch.add_argument(
        "--rampup-batch-size",
        type=int,
        nargs=3,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
    )


def _schedule_flags(parser: argparse.ArgumentParser) -> None:
    schedule = parser.add_argument_group("pipeline schedule")
    which = schedule.add_mutually_exclusive_group()
    which.add_argument(
        "--pipeline-schedule",
        choices=PIPELINE_SCHEDULES,
        default=None,
        help="default: interleaved_1f1b with virtual stages, 1f1b otherwise (Megatron's choice); "
        "zb_h1 and zbv split backwards (zero bubble; zbv needs 2 chunks per rank); auto picks "
        "the shortest simulated schedule that holds no more activations than 1F1B",
    )
    which.add_argument(
        "--pipeline-schedule-file",
        metavar="PATH",
        default=None,
        help="run the plan in this text file (one line of actions per pipeline rank, e.g. "
        "'rank 0: F0 F1 B0 B1'; an optional 'placement: looped|v' line); checked up front",
    )
    schedule.add_argument(
        "--profile-schedule",
        metavar="PATH",
        default=None,
        help="write one training iteration's measured and simulated schedule to this "
        "Chrome-trace JSON file and print a summary line",
    )
    schedule.add_argument(
        "--profile-schedule-iteration",
        type=int,
        metavar="N",
        default=None,
        help="the iteration --profile-schedule records (default: the second this run trains)",
    )


def _optimizer_flags(parser: argparse.ArgumentParser) -> None:
    optim = parser.add_argument_group("optimizer and schedule")
    optim.add_argument("--train-iters", type=int, default=200)
    optim.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    optim.add_argument("--lr", type=float, default=3e-3)
    optim.add_argument("--min-lr", type=float, default=3e-4)
    optim.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine")
    optim.add_argument("--lr-warmup-iters", type=int, default=0)
    optim.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    optim.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    optim.add_argument("--lr-wsd-decay-style", choices=WSD_STYLES, default="exponential")
    optim.add_argument("--weight-decay", type=float, default=0.01)
    optim.add_argument("--adam-beta1", type=float, default=0.9)
    optim.add_argument("--adam-beta2", type=float, default=0.95)
    optim.add_argument("--adam-eps", type=float, default=1e-8)
    optim.add_argument("--clip-grad", type=float, default=1.0)
    optim.add_argument("--log-num-zeros-in-grad", action="store_true")
    optim.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true")
    optim.add_argument("--override-opt_param-scheduler", action="store_true")
    precision = parser.add_argument_group("precision")
    halves = precision.add_mutually_exclusive_group()
    halves.add_argument("--fp16", action="store_true")
    halves.add_argument("--bf16", action="store_true")
    precision.add_argument("--loss-scale", type=float, default=None)
    precision.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    precision.add_argument("--min-loss-scale", type=float, default=1.0)
    precision.add_argument("--loss-scale-window", type=int, default=1000)
    precision.add_argument("--hysteresis", type=int, default=2)


def _io_flags(parser: argparse.ArgumentParser) -> None:
    io = parser.add_argument_group("checkpoints and logging")
    io.add_argument("--save", default=None)
    io.add_argument("--load", default=None)
    io.add_argument("--save-interval", type=int, default=None)
    io.add_argument("--finetune", action="store_true")
    io.add_argument("--no-load-optim", action="store_true")
    io.add_argument("--no-load-rng", action="store_true")
    io.add_argument("--eval-interval", type=int, default=100)
    io.add_argument("--eval-iters", type=int, default=4)
    io.add_argument("--log-interval", type=int, default=10)
    io.add_argument("--exit-interval", type=int, default=None)
    io.add_argument("--exit-duration-in-mins", type=float, default=None)
    io.add_argument(
        "--exit-signal-handler",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on SIGTERM save and exit cleanly (default on)",
    )
    io.add_argument("--tensorboard-dir", default=None)
    io.add_argument("--seed", type=int, default=1234)
    io.add_argument(
        "--log-params-norm",
        action="store_true",
        help="report the parameters' L2 norm in the log line and TensorBoard",
    )
    io.add_argument(
        "--timing-log-level",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="0: iteration time only (no timer waits); 1: also once-per-iteration phases "
        "(forward-backward, gradient reduction, optimizer); 2: also each forward, backward "
        "and transfer",
    )
    io.add_argument(
        "--timing-log-option",
        choices=list(TIMING_LOG_OPTIONS),
        default="minmax",
        help="what the timers line shows of the ranks' times: the max, min and max, or all",
    )
    io.add_argument(
        "--barrier-with-L1-time",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="level-1 timers start after a barrier and a device synchronisation (default "
        "on); off, no timer waits",
    )


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def _positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: list[str]) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be 1 or more, got {value}")


def validate_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int
) -> argparse.Namespace:
    """Checks the flags against each other and the world size; adds the derived sizes.

    Calls ``parser.error`` (exit status 2, usage and the message) naming the numbers and what
    would work. Sets ``data_parallel_size``, ``virtual_pipeline_model_parallel_size``,
    ``lr_decay_iters``, ``tensor_model_parallel_size``, ``vocab_size`` and ``pipeline_plan``
    (the validated plan of ``--pipeline-schedule-file``, else None).
    """
    _positive(
        parser,
        args,
        [
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "pipeline_model_parallel_size",
            "num_layers_per_virtual_pipeline_stage",
            "micro_batch_size",
            "global_batch_size",
            "train_iters",
            "log_interval",
            "save_interval",
            "eval_interval",
            "exit_interval",
            "lr_decay_iters",
            "ffn_hidden_size",
            "loss_scale_window",
            "hysteresis",
            "profile_schedule_iteration",
        ],
    )
    dp = _check_layout(parser, args, world_size)
    _check_batches(parser, args, dp)
    args.pipeline_plan = None
    if args.pipeline_schedule_file is not None:
        args.pipeline_plan = _read_plan(parser, args, dp)
    else:
        _check_named_schedule(parser, args, _microbatch_counts(args, dp))
    _check_profile(parser, args)
    _check_schedule(parser, args)
    args.data_parallel_size = dp
    args.tensor_model_parallel_size = 1
    args.vocab_size = ByteTokenizer.vocab_size
    return args


def _check_layout(parser: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> int:
    """Pipeline, virtual stages and heads; returns the data-parallel size."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    if world % pp:
        parser.error(
            f"--pipeline-model-parallel-size {pp} does not divide the {world} processes; "
            f"use one of {_divisors(world)}"
        )
    if layers % pp:
        parser.error(
            f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp}; "
            f"use a multiple of {pp} layers, or a pipeline size among {_divisors(layers)}"
        )
    args.virtual_pipeline_model_parallel_size = None
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk is not None:
        per_stage = layers // pp
        if per_stage % per_chunk:
            parser.error(
                f"--num-layers-per-virtual-pipeline-stage {per_chunk} does not divide the "
                f"{per_stage} layers of each pipeline stage; use one of {_divisors(per_stage)}"
            )
        if per_stage // per_chunk > 1 and pp == 1:
            parser.error(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size "
                "2 or more"
            )
        if per_stage // per_chunk > 1:
            args.virtual_pipeline_model_parallel_size = per_stage // per_chunk
    if args.hidden_size % args.num_attention_heads:
        parser.error(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}; use one of {_divisors(args.hidden_size)} heads"
        )
    return int(world // pp)


def _check_batches(parser: argparse.ArgumentParser, args: argparse.Namespace, dp: int) -> None:
    unit = args.micro_batch_size * dp
    if args.global_batch_size % unit:
        below = max(unit, args.global_batch_size // unit * unit)
        parser.error(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp} = {unit}; use a multiple of "
            f"{unit} such as {below} or {below + unit}"
        )
    if args.rampup_batch_size is not None:
        _check_rampup(parser, args, dp)


def _check_rampup(parser: argparse.ArgumentParser, args: argparse.Namespace, dp: int) -> None:
    start, increment, samples = args.rampup_batch_size
    try:
        _microbatch_calculator(args, dp)
    except (TypeError, ValueError) as error:
        parser.error(f"--rampup-batch-size {start} {increment} {samples}: {error}")
    unit = args.micro_batch_size * dp
    uneven = [size for size in range(start, args.global_batch_size, increment) if size % unit]
    if uneven:
        parser.error(
            f"--rampup-batch-size {start} {increment} {samples} passes through global batch "
            f"sizes {uneven} that --micro-batch-size {args.micro_batch_size} x data-parallel "
            f"size {dp} = {unit} does not divide; use a start and increment that are "
            f"multiples of {unit}"
        )


def _microbatch_calculator(args: argparse.Namespace, dp: int) -> NumMicroBatchesCalculator:
    """Microbatches per step for the run's batch sizes (ramping up with --rampup-batch-size)."""
    return build_num_microbatches_calculator(
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        data_parallel_size=dp,
        rampup_batch_size=None if args.rampup_batch_size is None else tuple(args.rampup_batch_size),
    )


def _microbatch_counts(args: argparse.Namespace, dp: int) -> list[int]:
    """Every number of microbatches a step runs (several while the batch size ramps up)."""
    unit = args.micro_batch_size * dp
    sizes = {args.global_batch_size}
    if args.rampup_batch_size is not None:
        start, increment, _ = args.rampup_batch_size
        sizes.update(range(start, args.global_batch_size, increment))
    return sorted(size // unit for size in sizes)


def _check_named_schedule(
    parser: argparse.ArgumentParser, args: argparse.Namespace, counts: list[int]
) -> None:
    pp = args.pipeline_model_parallel_size
    vp = args.virtual_pipeline_model_parallel_size or 1
    args.schedule_choice = None
    if args.pipeline_schedule == "auto":
        args.schedule_choice = _choose(parser, pp, vp, counts)
        args.pipeline_schedule = args.schedule_choice.chosen.name
    name = args.pipeline_schedule
    chosen = name or ("interleaved_1f1b" if vp > 1 else "1f1b" if pp > 1 else "no_pipelining")
    for count in counts:
        try:
            plan(chosen, pp_size=pp, num_microbatches=count, vp_size=vp)
        except ValueError as error:
            if name is None:
                parser.error(f"interleaved schedule with {vp} chunks per stage: {error}")
            hint = (
                "; virtual stages come from --num-layers-per-virtual-pipeline-stage"
                if name == "interleaved_1f1b" and vp == 1
                else ""
            )
            parser.error(f"--pipeline-schedule {name} with {vp} chunk(s) per rank: {error}{hint}")


def _choose(parser: argparse.ArgumentParser, pp: int, vp: int, counts: list[int]) -> Choice:
    """--pipeline-schedule auto: the shortest simulated schedule that fits.

    Costs F:I:W = 1:1:1; the schedule must run every microbatch count of the run and hold no
    more activations than 1F1B's first rank.
    """
    if pp < 2:
        parser.error("--pipeline-schedule auto needs --pipeline-model-parallel-size 2 or more")
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
        parser.error(f"--pipeline-schedule auto: {error}")


def _costs_text(choice: Choice) -> str:
    costs = choice.costs
    return (
        f"F {costs.forward:.2f}, I {costs.of('I'):.2f}, W {costs.of('W'):.2f}"
        if costs is not None
        else "-"
    )


def _read_text(parser: argparse.ArgumentParser, flag: str, path: str) -> str:
    """The UTF-8 text of the file a flag names; an argparse error if it cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        parser.error(f"{flag}: cannot be read: {error.strerror}")
    except UnicodeDecodeError:
        parser.error(f"{flag}: is not UTF-8 text")


def _read_plan(parser: argparse.ArgumentParser, args: argparse.Namespace, dp: int) -> Plan:
    """The plan of --pipeline-schedule-file, checked against the run's sizes and validated."""
    flag = f"--pipeline-schedule-file {args.pipeline_schedule_file}"
    text = _read_text(parser, flag, args.pipeline_schedule_file)
    try:
        schedule = parse_schedule(text)
    except ValueError as error:
        parser.error(f"{flag}: {error}")
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    vp = args.virtual_pipeline_model_parallel_size or 1
    if schedule.pp_size != pp:
        parser.error(
            f"{flag} writes {schedule.pp_size} rank line(s), but --pipeline-model-parallel-size "
            f"is {pp}; write one line per pipeline rank"
        )
    if schedule.vp_size != vp:
        per_chunk = (
            layers // (pp * schedule.vp_size) if layers % (pp * schedule.vp_size) == 0 else None
        )
        fix = (
            "drop --num-layers-per-virtual-pipeline-stage"
            if schedule.vp_size == 1
            else f"use --num-layers-per-virtual-pipeline-stage {per_chunk}"
            if per_chunk
            else f"use a number of layers divisible by {pp * schedule.vp_size}"
        )
        parser.error(
            f"{flag} runs {schedule.vp_size} model chunk(s) per rank, but the run has {vp} "
            f"(--num-layers {layers}, --num-layers-per-virtual-pipeline-stage "
            f"{args.num_layers_per_virtual_pipeline_stage}); {fix}"
        )
    if args.rampup_batch_size is not None:
        parser.error(
            f"{flag} fixes the number of microbatches per step, but --rampup-batch-size changes "
            "it while the batch grows; a fixed plan needs a fixed microbatch count, so drop "
            "one of the two"
        )
    unit = args.micro_batch_size * dp
    count = args.global_batch_size // unit
    if schedule.num_microbatches != count:
        parser.error(
            f"{flag} covers {schedule.num_microbatches} microbatch(es), but each step runs "
            f"{count} (--global-batch-size {args.global_batch_size} / (--micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp})); write a plan for {count} "
            f"microbatches or use --global-batch-size {schedule.num_microbatches * unit}"
        )
    try:
        validate(schedule, num_microbatches=count)
        if args.eval_iters > 0:
            validate(schedule.without_backward(), num_microbatches=count, forward_only=True)
        tied_embedding_sync(schedule.placement)
    except ValueError as error:
        parser.error(f"{flag}: {error}")
    return schedule


def _check_profile(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    iteration = args.profile_schedule_iteration
    if args.profile_schedule is None:
        if iteration is not None:
            parser.error("--profile-schedule-iteration needs --profile-schedule PATH")
        return
    try:
        check_trace_path(args.profile_schedule)
    except ValueError as error:
        parser.error(f"--profile-schedule: {error}")
    if iteration is not None and iteration > args.train_iters:
        parser.error(
            f"--profile-schedule-iteration {iteration} is past --train-iters "
            f"{args.train_iters}; use 1 .. {args.train_iters}"
        )


def _check_schedule(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:
        parser.error(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be below the decay length "
            f"{args.lr_decay_iters} (--lr-decay-iters, default --train-iters)"
        )
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None:
        parser.error("--lr-decay-style WSD needs --lr-wsd-decay-iters")
    if args.save_interval is not None and args.save is None:
        parser.error("--save-interval needs --save DIR")
    if args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler:
        parser.error(
            "use at most one of --use-checkpoint-opt_param-scheduler and "
            "--override-opt_param-scheduler"
        )


def gpt_forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    """Megatron's GPT ``forward_step``: the next microbatch through the chunk; mean token loss."""
    batch = next(data_iterator)
    device = next(unwrap_model(model).parameters()).device
    output = model(batch["tokens"].to(device), labels=batch["labels"].to(device))

    def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _distributed_setup(args: argparse.Namespace, init_method: str | None) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    single = {} if init_method is None else {"init_method": init_method, "rank": 0, "world_size": 1}
    if use_gpus:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, **single)  # type: ignore[arg-type]
        return torch.device("cuda", local_rank)
    # Ranks on one machine share its cores; more threads per rank only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    dist.init_process_group("gloo", timeout=timeout, **single)  # type: ignore[arg-type]
    return torch.device("cpu")


def _checkpoint_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        key: (list(value) if isinstance(value, tuple) else value)
        for key, value in vars(args).items()
        if value is None or isinstance(value, (bool, int, float, str, list, tuple))
    }


def _writer(args: argparse.Namespace, is_logging_rank: bool) -> Any:
    if args.tensorboard_dir is None or not is_logging_rank:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "--tensorboard-dir needs the tensorboard package: pip install 'pp-train[tensorboard]'"
        ) from error
    return SummaryWriter(log_dir=args.tensorboard_dir, max_queue=1000)


def _schedule_title(args: argparse.Namespace, name: str, placement: Placement) -> str:
    if args.pipeline_schedule_file is not None:
        return f"plan {args.pipeline_schedule_file} ({placement} placement)"
    return _SCHEDULE_TITLES.get(name, name)


def _placement(args: argparse.Namespace, gpt: GPTConfig, pp: int, vp: int) -> Placement:
    """The run's placement: the plan file's, V for zbv, else looped.

    With ``--pipeline-schedule auto`` the schedule is chosen here, again, with costs measured
    in a short warm-up (`choose_measured`).
    """
    if args.pipeline_plan is not None:
        placement: Placement = args.pipeline_plan.placement
        return placement
    if getattr(args, "schedule_choice", None) is not None:
        counts = _microbatch_counts(args, args.data_parallel_size)
        args.schedule_choice = choose_measured(
            gpt, args.schedule_choice, sizes=(pp, max(counts), vp),
            micro_batch_size=args.micro_batch_size, seed=args.seed,
        )  # fmt: skip
        args.pipeline_schedule = args.schedule_choice.chosen.name
    return Placement.named("v" if args.pipeline_schedule == "zbv" else "looped", pp, vp)


def run(args: argparse.Namespace) -> str:
    """Trains with validated `args` inside an initialised process group; returns the exit reason."""
    state = _parallel_state(args)
    pp, vp = state.pipeline_model_parallel_size, state.virtual_pipeline_model_parallel_size or 1
    gpt = _gpt_config(args)
    placement = _placement(args, gpt, pp, vp)
    is_logging_rank = _is_logging_rank(state, placement)

    def say(text: str) -> None:
        if is_logging_rank:
            print(text, flush=True)

    model, optimizer, scheduler, loaded = _build_model(args, state, gpt, placement)
    progress = _progress(args, loaded, say)
    train_data, valid_data = _datasets(args)
    timers = Timers(args.timing_log_level, args.timing_log_option)
    forward_backward = build_forward_backward_func(
        state,
        model,
        optimizer,
        hidden_size=args.hidden_size,
        device=args.device,
        timers=timers,
        schedule=args.pipeline_schedule,
        plan=args.pipeline_plan,
        placement=placement,
    )
    calculator = _microbatch_calculator(args, state.group_size("dp_cp"))
    logger, writer = _build_logger(args, is_logging_rank)
    for message in _startup_messages(args, state, forward_backward.schedule, placement, train_data):
        say(message)
    reason = train(
        gpt_forward_step,
        model,
        optimizer,
        scheduler,
        _microbatch_iterators(args, state, train_data, progress.consumed_train_samples),
        _microbatch_iterators(args, state, valid_data, progress.consumed_valid_samples),
        state=state,
        config=_training_config(args),
        forward_backward_func=forward_backward,
        calculator=calculator,
        progress=progress,
        logger=logger,
        timers=timers,
        checkpoint_args=_checkpoint_args(args),
        print_fn=say,
    )
    if reason == "train_iters" and args.eval_iters > 0:
        valid = _microbatch_iterators(args, state, valid_data, progress.consumed_valid_samples)
        _final_validation(
            args, state, model, forward_backward, valid, num_microbatches=calculator.get(), say=say
        )
    say(memory_report())
    _release(writer, forward_backward, state)
    return reason


def _parallel_state(args: argparse.Namespace) -> ParallelState:
    return ParallelState.create(
        ParallelConfig(
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        )
    )


def _gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        ffn_hidden_size=args.ffn_hidden_size,
    )


def _is_logging_rank(state: ParallelState, placement: Placement) -> bool:
    # Megatron logs from the last rank: the last stage (the losses) of the last replica.
    return placement.holds_last(state.pipeline_model_parallel_rank) and (
        state.group_rank("dp_cp") == state.group_size("dp_cp") - 1
    )


def _build_model(
    args: argparse.Namespace, state: ParallelState, gpt: GPTConfig, placement: Placement
) -> tuple[
    list[torch.nn.Module], MegatronOptimizer, OptimizerParamScheduler, LoadedCheckpoint | None
]:
    """This rank's chunks of the GPT, with optimizer and scheduler, restored from --load."""
    pp, vp = state.pipeline_model_parallel_size, state.virtual_pipeline_model_parallel_size or 1
    pp_rank = state.pipeline_model_parallel_rank

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        layers = chunk_layers(gpt.num_layers, pp, vp, pp_rank, vp_stage, placement=placement)
        return GPTChunk(
            gpt, layers=layers, pre_process=pre_process, post_process=post_process, seed=args.seed
        )

    return setup_model_and_optimizer(
        provider,
        state,
        optimizer_config=_optimizer_config(args),
        lr_schedule=_lr_schedule_config(args),
        ddp_config=DDPConfig(overlap_grad_reduce=args.overlap_grad_reduce),
        device=args.device,
        load=args.load,
        checkpoint_args=_checkpoint_args(args),
        finetune=args.finetune,
        no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng,
        placement=placement,
    )


def _optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        fp16=args.fp16,
        bf16=args.bf16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        clip_grad=args.clip_grad,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
    )


def _lr_schedule_config(args: argparse.Namespace) -> LRScheduleConfig:
    # The scheduler steps in samples, as Megatron's does: iterations times the global batch.
    gbs = args.global_batch_size
    return LRScheduleConfig(
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        wsd_decay_steps=None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


def _progress(
    args: argparse.Namespace, loaded: LoadedCheckpoint | None, say: Callable[[str], None]
) -> TrainingProgress:
    """Where training starts: the loaded checkpoint's counters, else zero; says which."""
    if loaded is None:
        if args.load is not None:
            say(f"no checkpoint in {args.load}: starting from scratch")
        return TrainingProgress()
    say(
        f"loaded checkpoint from {args.load} at iteration {loaded.iteration} "
        f"({loaded.consumed_train_samples} samples consumed)"
    )
    return TrainingProgress(
        iteration=loaded.iteration,
        consumed_train_samples=loaded.consumed_train_samples,
        consumed_valid_samples=loaded.consumed_valid_samples,
    )


def _datasets(args: argparse.Namespace) -> tuple[CorpusDataset, CorpusDataset]:
    """The bundled corpus's training and validation samples."""
    train_tokens, valid_tokens = split_corpus(corpus_tokens())
    return (
        CorpusDataset(train_tokens, args.seq_length, seed=args.seed),
        CorpusDataset(valid_tokens, args.seq_length, seed=args.seed + 1),
    )


def _microbatch_iterators(
    args: argparse.Namespace, state: ParallelState, dataset: CorpusDataset, consumed: int
) -> Any:
    """This data-parallel rank's microbatches from `consumed` on: one stream per model chunk."""
    vp = state.virtual_pipeline_model_parallel_size or 1
    streams = [
        microbatches(
            dataset,
            consumed_samples=consumed,
            micro_batch_size=args.micro_batch_size,
            data_parallel_rank=state.group_rank("dp_cp"),
            data_parallel_size=state.group_size("dp_cp"),
        )
        for _ in range(vp)
    ]
    return streams if vp > 1 else streams[0]


def _build_logger(args: argparse.Namespace, is_logging_rank: bool) -> tuple[TrainingLogger, Any]:
    """The training log and the TensorBoard writer it writes to (None without one)."""
    writer = _writer(args, is_logging_rank)
    logger = TrainingLogger(
        train_iters=args.train_iters,
        log_interval=args.log_interval,
        writer=writer,
        is_logging_rank=is_logging_rank,
    )
    return logger, writer


def _startup_messages(
    args: argparse.Namespace,
    state: ParallelState,
    schedule: str,
    placement: Placement,
    train_data: CorpusDataset,
) -> list[str]:
    """The line that describes the run; with ``auto``, also the schedule choice and its table."""
    pp, vp = state.pipeline_model_parallel_size, state.virtual_pipeline_model_parallel_size or 1
    dp_size = state.group_size("dp_cp")
    messages = [
        f"pp-train: GPT with {args.num_layers} layers, hidden {args.hidden_size}, on "
        f"{dist.get_world_size()} processes ({dist.get_backend()}): pipeline {pp}"
        f"{f' x {vp} virtual stages' if vp > 1 else ''}, data parallel {dp_size}, "
        f"{_schedule_title(args, schedule, placement)}; "
        f"{train_data.samples_per_epoch} training samples per epoch"
    ]
    if getattr(args, "schedule_choice", None) is not None:
        messages.append(
            "pipeline schedule chosen by simulation with step costs measured in a warm-up "
            f"(ms per chunk: {_costs_text(args.schedule_choice)}):\n" + args.schedule_choice.table()
        )
    return messages


def _training_config(args: argparse.Namespace) -> TrainingConfig:
    return TrainingConfig(
        train_iters=args.train_iters,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        log_interval=args.log_interval,
        save=args.save,
        save_interval=args.save_interval,
        exit_interval=args.exit_interval,
        exit_duration_in_mins=args.exit_duration_in_mins,
        exit_signal_handler=args.exit_signal_handler,
        profile_schedule_path=args.profile_schedule,
        profile_schedule_iteration=args.profile_schedule_iteration,
        log_params_norm=args.log_params_norm,
        barrier_with_l1_time=args.barrier_with_L1_time,
    )


def _final_validation(
    args: argparse.Namespace,
    state: ParallelState,
    model: list[torch.nn.Module],
    forward_backward: PipelineExecutor,
    valid: Any,
    *,
    num_microbatches: int,
    say: Callable[[str], None],
) -> None:
    """Evaluates the trained model on `valid` and says each loss, as Megatron does at the end."""
    losses = evaluate(
        gpt_forward_step,
        valid,
        model,
        forward_backward_func=forward_backward,
        state=state,
        eval_iters=args.eval_iters,
        num_microbatches=num_microbatches,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
    )
    for key, value in losses.items():
        say(f"validation at the end of training | {key}: {value:.6E}")


def _release(writer: Any, forward_backward: PipelineExecutor, state: ParallelState) -> None:
    if writer is not None:
        writer.close()
    # Release the pipeline's and the state's process groups before the default one goes.
    communicator = getattr(forward_backward, "communicator", None)
    if communicator is not None:
        communicator.destroy()
    state.destroy()


def main(argv: Sequence[str] | None = None) -> int:
    """Parses `argv` (default: the command line), trains, and returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_args(parser, args, world_size)
    with tempfile.TemporaryDirectory() as scratch:
        # Without torchrun this is a one-process job: rendezvous through a file, no port.
        init_method = None if "RANK" in os.environ else f"file://{scratch}/rendezvous"
        args.device = _distributed_setup(args, init_method)
        try:
            run(args)
        except CheckpointError as error:
            # Every rank refuses together; one clear line instead of a traceback per rank.
            if dist.get_rank() == 0:
                print(f"pp-train: error: {error}", file=sys.stderr, flush=True)
            return 1
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
