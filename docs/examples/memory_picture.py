"""Predicted against measured memory over one training step, per rank, drawn as an SVG picture.

    torchrun --standalone --nproc-per-node 2 docs/examples/memory_picture.py --out docs/images

The bundled GPT (8 layers, hidden 64, sequence 64, dropout 0.1, Adam in fp32) on two pipeline
stages, 8 microbatches of 2 sequences, under each schedule asked for (one chunk per rank:
1F1B and ZB-H1 by default, or GPipe). Measured: pp-train's own training step (`train_step`
with pp-schedules' executor) under a `MemoryProbe`, which counts every storage the step
allocates and samples the rank's bytes after every compute step; the second step is drawn
(Adam's moments and pp-comm's frames are made in the first). Predicted: each part of the model
measured alone on one microbatch (`model_figures`), composed into the run's byte model
(`memory_model`, with pp-comm's frames) and followed over the executor's own plan by the
simulator. Rank 0 prints each rank's peaks and writes ``memory-<schedule>-pp2.svg`` (docs/images
holds the ones in docs/memory.md); the bytes do not depend on timing, so the pictures come out
the same each run. Exits with an error when the two differ by more than 5% after any step.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pp_comm import CommConfig, frame_buffers
from pp_optim import DDPConfig, LRScheduleConfig, OptimizerConfig
from pp_schedules import MemoryProbe
from pp_schedules.planning import (
    MemoryTrack,
    PlanReport,
    TransferBuffers,
    resolve_on_demand,
    simulate,
)
from pp_state import ParallelConfig, ParallelState
from pp_train import (
    PretrainConfig,
    build_forward_backward_func,
    microbatches,
    setup_model_and_optimizer,
    train_step,
    training_state_tensors,
)
from pp_train.app import CorpusDataset, GPTChunk, GPTConfig, chunk_layers, gpt_forward_step
from pp_train.app.auto_schedule import model_figures
from pp_train.memory_plan import ModelFigures, memory_model

GPT = GPTConfig(
    num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=64,
    hidden_dropout=0.1, attention_dropout=0.1,
)  # fmt: skip
PP, MICROBATCHES, MICRO_BATCH_SIZE, SEED = 2, 8, 2, 7
CONFIG = PretrainConfig(optimizer=OptimizerConfig(lr=1e-3), ddp=DDPConfig())
"""What the byte model reads: fp32 parameters and gradients, Adam."""
TITLES = {"1f1b": "1F1B", "zb_h1": "ZB-H1", "gpipe": "GPipe"}
MB = 2**20


@dataclasses.dataclass(frozen=True)
class Series:
    """One rank's bytes after each compute step of one training step."""

    labels: list[str]
    measured: list[int]
    predicted: list[int]
    static: int
    measured_peak: int
    predicted_peak: int


def measure(state: ParallelState, schedule: str) -> Series:
    """This rank's measured and predicted bytes over one step of `schedule`."""
    rank = state.pipeline_model_parallel_rank

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        layers = chunk_layers(GPT.num_layers, PP, 1, rank, vp_stage)
        return GPTChunk(GPT, layers=layers, pre_process=pre_process, post_process=post_process,
                        seed=SEED)  # fmt: skip

    model, optimizer, scheduler, _ = setup_model_and_optimizer(
        provider, state, optimizer_config=CONFIG.optimizer, ddp_config=CONFIG.ddp,
        lr_schedule=LRScheduleConfig(max_lr=1e-3, lr_decay_steps=100, lr_decay_style="constant"),
    )  # fmt: skip
    resolved = resolve_on_demand(schedule, pp_size=PP)
    executor = build_forward_backward_func(
        state, model, optimizer, hidden_size=GPT.hidden_size, resolved=resolved
    )
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, GPT.vocab_size, (1 << 14,), generator=generator)
    data = microbatches(
        CorpusDataset(tokens, GPT.seq_length, seed=3), consumed_samples=0,
        micro_batch_size=MICRO_BATCH_SIZE, data_parallel_rank=0, data_parallel_size=1,
    )  # fmt: skip
    step = functools.partial(
        train_step, gpt_forward_step, data, model, optimizer, scheduler,
        forward_backward_func=executor, state=state, num_microbatches=MICROBATCHES,
        micro_batch_size=MICRO_BATCH_SIZE, seq_length=GPT.seq_length,
    )  # fmt: skip
    probe = MemoryProbe(lambda: training_state_tensors(model, optimizer))
    executor.record_memory(probe)
    step()  # Adam's moments and pp-comm's frames are made in the first step
    step()
    executor.record_memory(None)
    samples = executor.memory_samples
    track = predicted(executor.plan_for(MICROBATCHES, False)[1], rank)
    return Series(
        labels=[s.label for s in samples],
        measured=[s.live_bytes or 0 for s in samples],
        predicted=list(track.after),
        static=track.static.total,
        measured_peak=max(s.peak_live_bytes or 0 for s in samples),
        predicted_peak=track.peak,
    )


@functools.cache
def figures() -> ModelFigures:
    """The GPT's parts alone, one microbatch each (every rank: the times are all-reduced)."""
    return model_figures(GPT, micro_batch_size=MICRO_BATCH_SIZE, seed=SEED, rounds=1)


def predicted(report: PlanReport, rank: int) -> MemoryTrack:
    """The simulator's bytes of `rank` over the plan `report`, with the run's byte model."""
    counts = (GPT.num_layers // PP,) * PP
    frames = TransferBuffers(**dataclasses.asdict(frame_buffers(CommConfig(), "gloo")))
    model = memory_model(CONFIG, counts, figures(), data_parallel_size=1, recompute=None,
                         transfers=frames)  # fmt: skip
    simulation = simulate(report, memory=model)
    assert simulation.memory is not None
    return simulation.memory[rank]


# ---------------------------------------------------------------------------------- the picture
WIDTH, LEFT, RIGHT, TOP, PANEL, GAP = 860, 70, 30, 78, 170, 48
STYLE = """    <style>
      .title { font-weight: bold; font-size: 14px; }
      .note { font-size: 12px; fill: #555; }
      .tick { font-size: 10px; fill: #555; }
      .step { font-family: DejaVu Sans Mono, monospace; font-size: 9px; fill: #334; }
      .axis { stroke: #50607a; stroke-width: 1; }
      .grid { stroke: #e3e7ef; stroke-width: 1; }
      .static { stroke: #b0842a; stroke-width: 1.2; stroke-dasharray: 2 3; }
      .measured { fill: none; stroke: #7fa7d8; stroke-width: 5; stroke-linejoin: round; }
      .predicted { fill: none; stroke: #c0392b; stroke-width: 1.5; stroke-dasharray: 5 3; }
    </style>"""


def y_scale(series: list[Series]) -> tuple[float, float]:
    """The top of the MB axis (a whole number of ticks) and its tick."""
    most = max(max(s.measured + s.predicted) for s in series) / MB
    tick = 2.0 if most > 6 else 1.0
    return tick * (int(most / tick) + 1), tick


def axes(top: float, scale: tuple[float, float], labels: list[str]) -> list[str]:
    """A panel's grid, MB ticks and compute-step labels, `top` pixels down."""
    most, tick = scale
    step = (WIDTH - LEFT - RIGHT) / len(labels)
    out = [f'  <text class="tick" x="{LEFT - 8}" y="{top - 10:.0f}" text-anchor="end">MB</text>']
    for k in range(int(most / tick) + 1):
        level = top + PANEL * (1 - k * tick / most)
        out.append(f'  <line class="grid" x1="{LEFT}" y1="{level:.1f}" x2="{WIDTH - RIGHT}" '
                   f'y2="{level:.1f}"/>')  # fmt: skip
        out.append(f'  <text class="tick" x="{LEFT - 8}" y="{level + 3:.1f}" '
                   f'text-anchor="end">{k * tick:g}</text>')  # fmt: skip
    bottom = top + PANEL
    out.append(f'  <line class="axis" x1="{LEFT}" y1="{top}" x2="{LEFT}" y2="{bottom}"/>')
    out.append(f'  <line class="axis" x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" '
               f'y2="{bottom}"/>')  # fmt: skip
    for i, label in enumerate(labels):
        out.append(f'  <text class="step" x="{LEFT + (i + 1) * step:.1f}" y="{bottom + 13}" '
                   f'text-anchor="middle">{label}</text>')  # fmt: skip
    return out


def panel(rank: int, series: Series, top: float, scale: tuple[float, float]) -> list[str]:
    """One rank's panel: axes, the static level and both lines (the start is the static)."""
    step = (WIDTH - LEFT - RIGHT) / len(series.labels)

    def y(count: float) -> float:
        return top + PANEL * (1 - count / MB / scale[0])

    def line(values: list[int]) -> str:
        points = [(float(LEFT), y(series.static))]
        points += [(LEFT + (i + 1) * step, y(v)) for i, v in enumerate(values)]
        return " ".join(f"{px:.1f},{py:.1f}" for px, py in points)

    level = y(series.static)
    return [
        f'  <text class="title" x="{LEFT}" y="{top - 10:.0f}">rank {rank}</text>',
        f'  <text class="note" x="{LEFT + 70}" y="{top - 10:.0f}">peak (during a step): '
        f"measured {series.measured_peak / MB:.3f} MB, predicted "
        f"{series.predicted_peak / MB:.3f} MB</text>",
        *axes(top, scale, series.labels),
        f'  <line class="static" x1="{LEFT}" y1="{level:.1f}" x2="{WIDTH - RIGHT}" '
        f'y2="{level:.1f}"/>',
        f'  <polyline class="measured" points="{line(series.measured)}"/>',
        f'  <polyline class="predicted" points="{line(series.predicted)}"/>',
    ]


def svg(schedule: str, series: list[Series]) -> str:
    """The picture: a title, a legend and one panel per rank."""
    height = TOP + len(series) * (PANEL + GAP) + 6
    name = TITLES.get(schedule, schedule)
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="DejaVu Sans, Arial, sans-serif" '
        'font-size="13">',
        f"  <title>Bytes per rank after each compute step of one {name} step, pp {PP}: "
        "measured and predicted</title>",
        "  <defs>",
        STYLE,
        "  </defs>",
        f'  <text class="title" x="{LEFT}" y="20">MB held after each compute step of one '
        f"training step: {name}, pp {PP}, {MICROBATCHES} microbatches</text>",
        f'  <text class="note" x="{LEFT}" y="38">bundled GPT: {GPT.num_layers} layers, hidden '
        f"{GPT.hidden_size}, sequence {GPT.seq_length}, {MICRO_BATCH_SIZE} sequences per "
        "microbatch, dropout 0.1, Adam in fp32</text>",
        f'  <line class="measured" x1="{LEFT}" y1="54" x2="{LEFT + 30}" y2="54"/>',
        f'  <text class="note" x="{LEFT + 38}" y="58">measured (every storage allocated)</text>',
        f'  <line class="predicted" x1="{LEFT + 250}" y1="54" x2="{LEFT + 280}" y2="54"/>',
        f'  <text class="note" x="{LEFT + 288}" y="58">predicted (byte model, simulated)</text>',
        f'  <line class="static" x1="{LEFT + 510}" y1="54" x2="{LEFT + 540}" y2="54"/>',
        f'  <text class="note" x="{LEFT + 548}" y="58">parameters, gradients, Adam state</text>',
    ]
    body = []
    scale = y_scale(series)
    for rank, one in enumerate(series):
        body += panel(rank, one, TOP + 18 + rank * (PANEL + GAP), scale)
    return "\n".join([*head, *body, "</svg>", ""])


def report(schedule: str, everyone: list[Series], out: str | None) -> bool:
    """Print each rank's peaks and whether the two agree; write the picture into `out`.

    Returns:
        Whether predicted and measured bytes agree within 5% after every step on every rank.
    """
    agreed = True
    for rank, one in enumerate(everyone):
        pairs = zip(one.predicted, one.measured, strict=True)
        agree = all(abs(p - m) <= 0.05 * m for p, m in pairs)
        agreed = agreed and agree
        print(f"{schedule} rank {rank}: peak measured {one.measured_peak / MB:.3f} MB, "
              f"predicted {one.predicted_peak / MB:.3f} MB; within 5% after every step: "
              f"{agree}", flush=True)  # fmt: skip
    if out is not None:
        path = Path(out) / f"memory-{schedule.replace('_', '-')}-pp{PP}.svg"
        path.write_text(svg(schedule, everyone))
        print(f"picture written to {path}", flush=True)
    return agreed


def main() -> None:
    """Measure and predict every schedule on every rank; rank 0 prints and draws."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--schedules", default="1f1b,zb_h1", help="comma-separated: 1f1b, zb_h1, gpipe"
    )
    parser.add_argument("--out", default=None, help="folder for the SVG files (none: no files)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
    torch.set_num_threads(1)
    torch.manual_seed(1000 + dist.get_rank())  # dropout masks differ per rank, as in a run
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=PP))
    agreed = True
    for schedule in args.schedules.split(","):
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, measure(state, schedule))
        if dist.get_rank() == 0:
            agreed = report(schedule, everyone, args.out) and agreed
    dist.destroy_process_group()
    if not agreed:
        raise SystemExit("predicted and measured bytes differ by more than 5% after some step")


if __name__ == "__main__":
    main()
