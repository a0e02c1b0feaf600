r"""Memory as a number: predicted against measured bytes, recomputation, torch's pipelining.

Four ranks over gloo; every table is measured in one run, on the bundled GPT with hidden and
attention dropout 0.1, Adam in fp32. pp 2 runs as pp 2 x dp 2 on the four ranks, pp 4 alone.
Bytes are what pp-schedules' `MemoryProbe` counts. Measured (live): every storage a rank holds,
counted at the allocator level (its `AllocationCounter` sees each storage torch allocates and
frees) on top of the static storages (parameters, gradient buffers, optimizer state); saved,
a breakdown: tensors autograd saved for backward.

1. **Predicted against measured** (goal: predicted / measured in 0.95 .. 1.05 on every row).
   pp 2 and pp 4, schedules 1f1b, interleaved_1f1b (vp 2), zb_h1, zbv (vp 2) and dualpipev
   (vp 2, its F&B steps one half after the other), each with no recomputation, selective, and
   full uniform 1; 8 microbatches of 2 sequences. Predicted:
   `pp_train.app.auto_schedule.model_figures` measures each part of the GPT alone on one
   microbatch (a layer with each recomputation, the embedding, the loss; every storage each
   step of it holds), `memory_plan`'s `memory_model` turns them into the run's byte model
   (with pp-comm's frames) and pp-schedules' simulator follows the plan's steps to each rank's
   peak. Measured: pp-train's real training step (GPT chunks, DDP, Megatron optimizer,
   pp-schedules' executor, `train_step`) counted whole from the first step, the most live
   bytes over steps 2 and 3. Beside them: the same peak by a second instrument (one more step
   under torch.profiler, its allocator events added up from the probe's count at the step's
   start) over the measured one, and the byte model of pp-train 0.12 (saved tensors only, no
   frames, no transients) over the measured one. Then tensor parallelism on the four ranks:
   tp 2 x pp 2 1f1b (sequence parallelism off and on), tp 2 x pp 2 zbv with sequence
   parallelism, tp 2 x dp 2, each without and with full recomputation, the parts measured
   split over the run's tensor-parallel groups (the ranks of data-parallel replica 0 shown);
   beside them the model of parts measured whole (parameters per rank, the whole layer's
   bytes: pp-train before per-rank figures) over the measured peak.
2. **Recomputation** (goals: full recompute cuts activation bytes by >= 70% at <= 1.4x step
   time; selective measured and reported). pp 2 x dp 2, 1f1b, 8 microbatches, a GPT of 8
   layers, hidden 128, sequence 128 (compute dominates, a step takes about a second). Peak
   saved bytes (the probe's, largest rank) over one step of each, and step time: steps
   alternate A B B A between no recomputation (A) and the mode (B); medians. Selective
   recompute checkpoints only the core attention (softmax, dropout and the weighted sum). What
   it saves depends on the attention kernel: without dropout, PyTorch's fused CPU
   scaled-dot-product attention (flash) saves only its inputs, output and log-sum-exp, no
   seq x seq scores, so selective would save next to nothing; with attention dropout SDPA
   takes the math path, which saves the attention probabilities, the dropout mask (fp32) and
   the dropped-out probabilities (batch x heads x seq x seq each): those are what selective
   recomputes instead of keeping.
   The heading line gives one layer's forward and backward timed alone, which bound the time
   ratio: full recompute adds a layer's forward to its backward. On a GPU a backward costs
   about two forwards (+33%); on this CPU with dropout a forward costs about as much as a
   backward (drawing the dropout masks, ``bernoulli_``, is a fifth of a layer's time, and the
   masking, softmax and GELU are forward work as well), so full recompute adds about half a
   layer's step, and the 1.4x goal is out of reach here.
3. **Ours against torch.distributed.pipelining** (goal: ours / torch <= 1.00). One GPT chunk
   per rank, the same chunk, the same microbatches and the same loss (cross-entropy on the
   last stage's logits) under this package's executor and under torch's `PipelineStage` with
   `Schedule1F1B` or `ScheduleGPipe`, at pp 4 and pp 2 (x dp 2), in the same processes; the
   same probe (saved-tensor hooks around each executor's step, static bytes left out): the
   peak saved bytes per rank. One warm-up step each first (torch infers shapes there), then
   ours and torch's in turn.

4. **What counting costs**: pp 2 x dp 2, 1f1b, the GPT of table 1; a step with the probe
   counting every storage against one without, alternating A B B A, medians (the command
   counts only until its first memory line).

Prints the load average at the start and the end; ``--json`` prints one JSON record per row
instead of the tables. ``--tables 1,3`` runs some of them.

    torchrun --standalone --nproc-per-node 4 packages/pp-train/benchmarks/memory_bench.py
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _memory_runs as runs
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from pp_comm import CommConfig, frame_buffers
from pp_schedules import MemoryProbe
from pp_schedules.planning import MemoryTrack, TransferBuffers, simulate
from pp_train import RecomputeConfig
from pp_train.app import GPTConfig
from pp_train.app.auto_schedule import model_figures, warmup_tensor_parallel_group
from pp_train.memory_plan import ModelFigures, memory_model

GPT = GPTConfig(
    num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=64,
    hidden_dropout=0.1, attention_dropout=0.1,
)  # fmt: skip
"""Tables 1 and 3: small enough that 30 configurations train in about a minute."""
BIG_GPT = dataclasses.replace(GPT, hidden_size=128, num_attention_heads=8, seq_length=128)
"""Table 2: compute dominates the step."""
RECOMPUTE: dict[str, RecomputeConfig | None] = {
    "none": None,
    "selective": RecomputeConfig(granularity="selective"),
    "full uniform 1": RecomputeConfig(granularity="full", method="uniform", num_layers=1),
}
ACCURACY = (0.95, 1.05)
FULL_BYTES, FULL_TIME = 0.30, 1.40


def schedules(pp: int) -> list[runs.Setup]:
    """Table 1's schedules at `pp` stages."""
    return [
        runs.Setup(pp, "1f1b"),
        runs.Setup(pp, "interleaved_1f1b", vp=2),
        runs.Setup(pp, "zb_h1"),
        runs.Setup(pp, "zbv", vp=2, placement="v"),
        runs.Setup(pp, "dualpipev", vp=2, placement="v"),
    ]


def gathered(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's record, in rank order (every rank gets them)."""
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


# ------------------------------------------------------------------- 1: predicted vs measured
FRAMES = TransferBuffers(**dataclasses.asdict(frame_buffers(CommConfig(), "gloo")))
"""pp-comm's frames on gloo, as the Training's communicator keeps them."""


def predicted_track(
    training: runs.Training, figures: ModelFigures, *, saved_only: bool = False
) -> MemoryTrack:
    """This rank's simulated `MemoryTrack` for the configuration training runs.

    `saved_only`: the byte model pp-train had before counting every storage (each part's
    saved tensors only, no frames), for comparison.
    """
    setup, recompute = training.setup, training.gpt.recompute
    if saved_only:
        figures = dataclasses.replace(figures, **{
            name: dataclasses.replace(getattr(figures, name), memory=None)
            for name in ("layer", "layer_full", "layer_selective", "embedding", "loss")
        })  # fmt: skip
    model = memory_model(
        runs.PRETRAIN, setup.layer_counts(GPT.num_layers), figures,
        data_parallel_size=training.data_parallel_size, recompute=recompute,
        transfers=None if saved_only else FRAMES,
    )  # fmt: skip
    report = training.executor.plan_for(setup.microbatches, False)[1]
    simulation = simulate(report, memory=model)
    assert simulation.memory is not None
    return simulation.memory[training.state.pipeline_model_parallel_rank]


def profiled_peak(training: runs.Training, probe: MemoryProbe) -> int:
    """One more step under torch.profiler: the most bytes held, by its allocator events.

    What `probe` (which counted the steps before) says is held at the step's start, plus the
    most the profiler's events add up to during it: the second instrument for the measured
    column.
    """
    start = probe.live_bytes
    assert start is not None
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            training.step()
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    held = peak = 0
    for event in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        held += event["args"]["Bytes"]
        peak = max(peak, held)
    return start + peak


def accuracy_record(
    setup: runs.Setup, mode: str, figures: ModelFigures, *, whole: ModelFigures | None = None
) -> dict[str, Any]:
    """One rank's predicted and measured peak for one configuration.

    With `whole`, the prediction from parts measured whole over the measured peak too.
    """
    training = runs.Training(setup, dataclasses.replace(GPT, recompute=RECOMPUTE[mode]))
    probe = training.probed_steps(2, warm=1)  # Adam's moments and the frames made in step 1
    peak = max(probe.samples, key=lambda s: s.peak_live_bytes or 0)
    assert peak.peak_live_bytes is not None
    track = predicted_track(training, figures)
    old = predicted_track(training, figures, saved_only=True)
    measured = peak.peak_live_bytes
    record: dict[str, Any] = {
        "benchmark": "memory_bench", "table": "predicted_vs_measured",
        "configuration": f"{setup.label} {mode}", "rank": dist.get_rank(),
        "stage": training.state.pipeline_model_parallel_rank, "microbatches": setup.microbatches,
        "predicted_bytes": track.peak, "measured_bytes": measured,
        "measured_peak_step": peak.label, "profiled_bytes": profiled_peak(training, probe),
        "saved_only_bytes": old.peak, "predicted_static_bytes": track.static.total,
        "measured_static_bytes": peak.static_bytes,
    }  # fmt: skip
    record["ratio"] = track.peak / measured
    record["saved_only_ratio"] = old.peak / measured
    record["profiled_ratio"] = record["profiled_bytes"] / measured
    record["passed"] = ACCURACY[0] <= record["ratio"] <= ACCURACY[1]
    record["first_replica"] = training.state.group_rank("dp") == 0
    record["whole_parts_ratio"] = (
        record["ratio"] if whole is None else predicted_track(training, whole).peak / measured
    )
    return record


def accuracy_records(emit: Callable[[dict[str, Any]], None]) -> None:
    """Table 1, every configuration; rank 0 emits the rows."""
    figures = model_figures(GPT, micro_batch_size=2, seed=runs.SEED, rounds=1)
    for pp in (2, 4):
        for setup in schedules(pp):
            for mode in RECOMPUTE:
                for record in gathered(accuracy_record(setup, mode, figures)):
                    emit(record)
    tensor_parallel_records(emit)


TENSOR_PARALLEL = (
    runs.Setup(2, "1f1b", tp=2),
    runs.Setup(2, "1f1b", tp=2, sequence_parallel=True),
    runs.Setup(2, "zbv", vp=2, placement="v", tp=2, sequence_parallel=True),
    runs.Setup(1, "1f1b", tp=2),
)
"""Table 1's tensor-parallel rows: tp 2 x pp 2 (sequence parallelism off and on) and
tp 2 x dp 2 (pp 1), on the four ranks."""


def tensor_parallel_records(emit: Callable[[dict[str, Any]], None]) -> None:
    """Table 1's tensor-parallel rows, with and without full recomputation.

    The parts are measured split over the run's tensor-parallel groups, as the command's
    warm-up measures them; beside the ratio, the model of parts measured whole (pp-train
    before tensor-parallel figures: parameters per rank, bytes of the whole layer) over the
    measured peak.
    """
    whole = model_figures(GPT, micro_batch_size=2, seed=runs.SEED, rounds=1,
                          tensor_model_parallel_size=2)  # fmt: skip
    for setup in TENSOR_PARALLEL:
        with warmup_tensor_parallel_group(2, setup.pp) as group:
            figures = model_figures(GPT, micro_batch_size=2, seed=runs.SEED, rounds=1,
                                    tp_group=group,
                                    sequence_parallel=setup.sequence_parallel)  # fmt: skip
        for mode in ("none", "full uniform 1"):
            record = accuracy_record(setup, mode, figures, whole=whole)
            for each in gathered(record):
                if each["first_replica"]:
                    emit(each)


ACCURACY_COLUMNS = (
    runs.Column("configuration", -40, runs.text("configuration")),
    runs.Column("stage", 5, runs.text("stage")),
    runs.Column("rank", 4, runs.text("rank")),
    runs.Column("predicted MB", 12, runs.megabytes("predicted_bytes")),
    runs.Column("measured MB", 11, runs.megabytes("measured_bytes")),
    runs.Column("ratio", 6, runs.fixed("ratio", 3)),
    runs.Column("profiler/measured", 17, runs.fixed("profiled_ratio", 4)),
    runs.Column("saved-only model", 16, runs.fixed("saved_only_ratio", 3)),
    runs.Column("whole-parts model", 17, runs.fixed("whole_parts_ratio", 3)),
    runs.Column("pass", -4, runs.verdict),
)


def accuracy_line(record: dict[str, Any]) -> str:
    """One row of table 1."""
    return runs.row(ACCURACY_COLUMNS, record)


# ------------------------------------------------------------------------- 2: recomputation
def recompute_record(plain: runs.Training, saved: int, mode: str, rounds: int) -> dict[str, Any]:
    """Peak saved bytes and median step time of `mode` beside no recomputation (all ranks).

    `plain` is warmed up already; `saved` its peak saved bytes over one step on this rank.
    """
    shape = dataclasses.replace(plain.gpt, recompute=RECOMPUTE[mode])
    other = runs.Training(plain.setup, shape)
    other.step()
    seconds = runs.alternate(plain.step, other.step, rounds)
    everyone = gathered({"saved": (saved, other.probed_steps(1).peak_saved_bytes)})
    none_bytes = max(r["saved"][0] for r in everyone)
    mode_bytes = max(r["saved"][1] for r in everyone)
    record = {
        "benchmark": "memory_bench", "table": "recomputation",
        "mode": f"{mode}, dropout {shape.hidden_dropout:g}",
        "configuration": plain.setup.label, "microbatches": plain.setup.microbatches,
        "none_bytes": none_bytes, "mode_bytes": mode_bytes,
        "none_bytes_per_rank": [r["saved"][0] for r in everyone],
        "mode_bytes_per_rank": [r["saved"][1] for r in everyone],
        "none_ms": seconds[0] * 1e3, "mode_ms": seconds[1] * 1e3, "rounds": rounds,
        "bytes_ratio": mode_bytes / none_bytes, "time_ratio": seconds[1] / seconds[0],
    }  # fmt: skip
    if mode.startswith("full"):
        record["goal"] = f"bytes <= {FULL_BYTES:.2f}x at time <= {FULL_TIME:.2f}x"
        record["passed"] = record["bytes_ratio"] <= FULL_BYTES and record["time_ratio"] <= FULL_TIME
    else:
        record["goal"], record["passed"] = "measured and reported", True
    return record


def layer_times(shape: GPTConfig) -> str:
    """One layer of table 2's GPT alone: forward, and backward with each recomputation."""
    figures = model_figures(shape, micro_batch_size=2, seed=runs.SEED, rounds=10)
    selective = figures.layer_selective
    assert selective is not None
    return (
        f"dropout {shape.hidden_dropout:g}, one layer alone (slowest rank): F "
        f"{figures.layer.forward_ms:.1f} ms, B "
        f"{figures.layer.backward_ms:.1f} ms; B with selective recompute "
        f"{selective.backward_ms:.1f} ms, with full {figures.layer_full.backward_ms:.1f} ms"
    )


def recompute_records(args: argparse.Namespace, emit: Callable[[dict[str, Any]], None]) -> None:
    """Table 2: selective and full uniform 1 against none; rank 0 emits the rows.

    With dropout (a forward costs about a backward on this CPU) and without (matrix products
    dominate: a backward costs about two forwards, as the 1.4x goal assumes).
    """
    for dropout in (0.1, 0.0):
        shape = dataclasses.replace(BIG_GPT, hidden_dropout=dropout, attention_dropout=dropout)
        title(args, layer_times(shape))  # every rank: the times are all-reduced
    title(args, runs.header(RECOMPUTE_COLUMNS))
    for dropout in (0.1, 0.0):
        shape = dataclasses.replace(BIG_GPT, hidden_dropout=dropout, attention_dropout=dropout)
        plain = runs.Training(runs.Setup(2, "1f1b"), shape)
        plain.step()
        saved = plain.probed_steps(1).peak_saved_bytes
        for mode in ("selective", "full uniform 1"):
            emit(recompute_record(plain, saved, mode, args.rounds))


RECOMPUTE_COLUMNS = (
    runs.Column("mode", -29, runs.text("mode")),
    runs.Column("none MB", 8, runs.megabytes("none_bytes", 2)),
    runs.Column("mode MB", 8, runs.megabytes("mode_bytes", 2)),
    runs.Column("bytes ratio", 11, runs.fixed("bytes_ratio", 3)),
    runs.Column("none ms", 8, runs.fixed("none_ms", 1)),
    runs.Column("mode ms", 8, runs.fixed("mode_ms", 1)),
    runs.Column("time ratio", 10, runs.fixed("time_ratio", 3)),
    runs.Column("goal", -33, runs.text("goal")),
    runs.Column("pass", -4, runs.verdict),
)


# ---------------------------------------------------------------------- 3: ours against torch
def torch_records(emit: Callable[[dict[str, Any]], None]) -> None:
    """Table 3: peak saved bytes per rank, ours and torch's; rank 0 emits the rows."""
    for pp in (4, 2):
        for name in ("1f1b", "gpipe"):
            pair = runs.PipelinePair(runs.Setup(pp, name), GPT)
            pair.torch_step()  # torch infers the shapes in its first step
            pair.ours_step()
            ours = pair.peak_saved(pair.ours_step)
            theirs = pair.peak_saved(pair.torch_step)
            pair.close()
            record = {
                "benchmark": "memory_bench", "table": "ours_vs_torch",
                "configuration": f"{pair.setup.label} m{pair.setup.microbatches}",
                "torch_schedule": runs.TORCH_SCHEDULES[name].__name__,
                "rank": dist.get_rank(), "stage": pair.stage, "ours_bytes": ours,
                "torch_bytes": theirs, "ratio": ours / theirs, "passed": ours <= theirs,
            }  # fmt: skip
            for row in gathered(record):
                emit(row)


TORCH_COLUMNS = (
    runs.Column("configuration", -20, runs.text("configuration")),
    runs.Column("stage", 5, runs.text("stage")),
    runs.Column("rank", 4, runs.text("rank")),
    runs.Column("ours MB", 8, runs.megabytes("ours_bytes")),
    runs.Column("torch MB", 8, runs.megabytes("torch_bytes")),
    runs.Column("ours/torch", 10, runs.fixed("ratio", 3)),
    runs.Column("pass", -4, runs.verdict),
)


# ------------------------------------------------------------------------ 4: counting's cost
def counting_record(rounds: int) -> dict[str, Any]:
    """Step time with the probe counting every storage, against without (all ranks)."""
    training = runs.Training(runs.Setup(2, "1f1b"), GPT)
    training.step()
    plain, counted = runs.alternate(training.timed_step(False), training.timed_step(True), rounds)
    return {
        "benchmark": "memory_bench", "table": "counting_cost", "configuration": "pp2 1f1b",
        "plain_ms": plain * 1e3, "counting_ms": counted * 1e3, "ratio": counted / plain,
        "rounds": rounds, "passed": True,
    }  # fmt: skip


COUNTING_COLUMNS = (
    runs.Column("configuration", -14, runs.text("configuration")),
    runs.Column("plain ms", 9, runs.fixed("plain_ms", 1)),
    runs.Column("counting ms", 12, runs.fixed("counting_ms", 1)),
    runs.Column("ratio", 6, runs.fixed("ratio", 2)),
)


# ---------------------------------------------------------------------------------- main
def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def printer(args: argparse.Namespace, line: Callable[[dict[str, Any]], str]) -> Any:
    """Rank 0 prints each record as a table row (or a JSON line); other ranks nothing."""

    def emit(record: dict[str, Any]) -> None:
        if dist.get_rank() == 0:
            print(json.dumps(record) if args.json else line(record), flush=True)

    return emit


def title(args: argparse.Namespace, text: str) -> None:
    """A line above or below the rows (rank 0, tables only)."""
    if dist.get_rank() == 0 and not args.json:
        print(text, flush=True)


def main() -> None:
    """The tables asked for, in order; the load average before and after."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tables", default="1,2,3,4", help="comma-separated: 1, 2, 3, 4")
    parser.add_argument("--rounds", type=int, default=8, help="table 2's A B B A rounds")
    parser.add_argument("--json", action="store_true", help="print JSON lines, not tables")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)
    torch.manual_seed(1000 + dist.get_rank())
    tables = {int(t) for t in args.tables.split(",")}
    title(args, f"memory_bench on {dist.get_world_size()} ranks; load average {load_average()}")
    if 1 in tables:
        title(
            args,
            "\n1. predicted against measured peak bytes per rank, every storage allocated "
            "(goal: ratio 0.95-1.05)",
        )
        title(args, runs.header(ACCURACY_COLUMNS))
        accuracy_records(printer(args, accuracy_line))
    if 2 in tables:
        title(
            args, "\n2. recomputation at pp2 x dp2, 1f1b, m 8 (GPT 8 layers, hidden 128, seq 128)"
        )
        recompute_records(args, printer(args, functools.partial(runs.row, RECOMPUTE_COLUMNS)))
    if 3 in tables:
        title(args, "\n3. peak saved activation bytes, ours against torch.distributed.pipelining")
        title(args, runs.header(TORCH_COLUMNS))
        torch_records(printer(args, functools.partial(runs.row, TORCH_COLUMNS)))
    if 4 in tables:
        title(args, "\n4. a step with the probe counting every storage against one without")
        title(args, runs.header(COUNTING_COLUMNS))
        record = counting_record(args.rounds)
        if dist.get_rank() == 0:
            print(json.dumps(record) if args.json else runs.row(COUNTING_COLUMNS, record),
                  flush=True)  # fmt: skip
    title(args, f"\nload average at the end {load_average()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
