"""Record one pipeline step and write its measured and simulated timelines (and a picture).

Each stage sleeps a fixed time in forward and backward (so the picture shows the schedule, not
the machine's load); the executor records every compute step and exchange, and
`write_schedule_trace` writes one Chrome-trace JSON file (open it in ui.perfetto.dev) with the
measured tracks of every rank beside the simulator's tracks for the same plan, then prints the
summary line. With ``--png`` (needs Pillow) rank 0 also draws the two timelines as a picture,
the one in docs/pp-schedules.md.

    torchrun --standalone --nproc-per-node 4 docs/examples/schedule_trace.py
        --schedule 1f1b --trace /tmp/trace.json --png /tmp/trace.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import ScheduleConfig, get_forward_backward_func, write_schedule_trace
from pp_schedules.runtime import check_trace_path, resolve_for


class _Sleep(torch.autograd.Function):
    """Forward sleeps one time, backward another."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepChunk(torch.nn.Module):
    """A model chunk whose forward and backward take fixed times.

    Half of the backward is the input's gradient (on the activations' path), half the
    weight's (a branch of its own), so a zero-bubble schedule splits it into I and W.
    """

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.costs = (forward_s, backward_s / 2)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        """Megatron's hook: the previous stage's activations."""
        self.input_tensor = tensors[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Sleep for the forward cost (and, in backward, half the backward cost per branch)."""
        forward_s, half_s = self.costs
        through = _Sleep.apply(x, forward_s, half_s)  # type: ignore[no-untyped-call]
        weight = _Sleep.apply(self.weight, 0.0, half_s)  # type: ignore[no-untyped-call]
        return through + weight  # type: ignore[no-any-return]


def forward_step(
    data: Iterator[torch.Tensor], model: SleepChunk
) -> tuple[torch.Tensor, Callable[..., Any]]:
    """Megatron's forward_step_func for the sleeping chunks."""
    x = next(data)
    out = model(x if model.input_tensor is None else model.input_tensor)
    return out, lambda o: (o.sum(), {"loss": o.sum().detach()})


COLOURS = {
    "forward": (66, 133, 244),
    "backward": (234, 67, 53),
    "backward input": (234, 67, 53),
    "backward weight": (52, 168, 83),
    "exchange": (170, 170, 170),
    "wait": (251, 188, 5),
}


def draw(trace_path: Path, png_path: Path, *, width: int = 1200) -> None:
    """Draw the measured tracks over the simulated ones, one row per rank, time to the right."""
    from PIL import Image, ImageDraw  # only this picture needs Pillow

    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    ranks = 1 + max(int(e["tid"]) for e in spans)
    end = max(float(e["ts"]) + float(e["dur"]) for e in spans)
    row, gap, left = 22, 30, 130
    height = 2 * ranks * row + 3 * gap
    image = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(image)
    scale = (width - left - 10) / end
    for pid, label in ((0, "measured"), (1, "simulated")):
        top = gap + pid * (ranks * row + gap)
        pen.text((5, top - 18), label, fill="black")
        for rank in range(ranks):
            pen.text((5, top + rank * row + 5), f"rank {rank}", fill="black")
        for span in (e for e in spans if e["pid"] == pid):
            x0 = left + float(span["ts"]) * scale
            x1 = max(x0 + 1, left + (float(span["ts"]) + float(span["dur"])) * scale)
            y0 = top + int(span["tid"]) * row + 2
            pen.rectangle((x0, y0, x1, y0 + row - 4), fill=COLOURS[span["cat"]], outline="white")
            if x1 - x0 > 16 and span["cat"] not in ("exchange", "wait"):
                pen.text((x0 + 2, y0 + 3), str(span["name"]), fill="white")
    pen.text((left, height - 18), f"0 .. {end / 1000:.0f} ms", fill="black")
    image.save(png_path)


def main() -> None:
    """Run two steps, record the second, write the trace (and picture) from rank 0."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--vp-size", type=int, default=1)
    parser.add_argument("--placement", default="looped")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--png", default=None)
    args = parser.parse_args()
    trace = check_trace_path(args.trace)  # before anything starts
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
    torch.set_num_threads(1)
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(minutes=1)))
    vp, m = args.vp_size, args.microbatches
    chunks = [
        SleepChunk(args.forward_ms / 1e3 / vp, args.backward_ms / 1e3 / vp) for _ in range(vp)
    ]
    resolved = resolve_for(
        comm, args.schedule, vp_size=vp, placement=args.placement, microbatch_counts=[m]
    )
    forward_backward = get_forward_backward_func(
        comm, resolved, config=ScheduleConfig(hidden_size=1)
    )
    data = [torch.ones(1, 1, 1) for _ in range(m)]
    for step in range(2):  # the first step validates the plan and connects the ranks
        forward_backward.record_timeline(step == 1)
        dist.barrier()
        forward_backward(
            forward_step_func=forward_step, data_iterator=[iter(data) for _ in range(vp)],
            model=chunks, num_microbatches=m, seq_length=1, micro_batch_size=1,
        )  # fmt: skip
    line = write_schedule_trace(trace, forward_backward, num_microbatches=m)
    if dist.get_rank() == 0:
        print(line, flush=True)
        if args.png:
            draw(trace, Path(args.png))
            print(f"picture written to {args.png}", flush=True)
    comm.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
