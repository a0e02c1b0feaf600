"""Step costs measured in a short warm-up, for the simulator's two picks.

``--pipeline-schedule auto`` and the balanced split of layers that do not divide
(``--pipeline-model-parallel-layout auto``) both simulate with measured costs.

Before the model is built, each rank times one microbatch through a throwaway chunk of the
run's size (its transformer layers, no embedding or head): the forward, the input half and the
weight half of the backward (pp-schedules' split backward), medians of a few rounds. The
slowest rank's times are the costs `choose_schedule` simulates every candidate with.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from pp_schedules import Choice, Costs, choose_schedule
from pp_schedules.split_backward import backward_input
from pp_state.collectives import collective
from pp_train.app.gpt import GPTChunk, GPTConfig

__all__ = ["choose_measured", "layout_costs", "warmup_costs"]


def warmup_costs(
    config: GPTConfig, *, layers: int, micro_batch_size: int, seed: int, rounds: int = 3
) -> Costs:
    """Milliseconds of F, I and W of one microbatch through `layers` layers (max over ranks).

    Args:
        config: The model's shape.
        layers: Transformer layers per chunk.
        micro_batch_size: Sequences per microbatch.
        seed: Seeds the throwaway chunk's weights.
        rounds: Timed rounds after one untimed; the medians count.
    """
    chunk = GPTChunk(config, layers=range(layers), pre_process=False, post_process=False, seed=seed)
    params = [p for p in chunk.parameters() if p.requires_grad]
    activations = torch.randn(config.seq_length, micro_batch_size, config.hidden_size)
    times: list[tuple[float, float, float]] = []
    for _ in range(rounds + 1):
        given = activations.clone().requires_grad_()
        chunk.set_input_tensor([given])
        start = time.perf_counter()
        output = chunk(None)
        forward = time.perf_counter()
        _, weights = backward_input([output], [torch.ones_like(output)], [given], params)
        inputs = time.perf_counter()
        weights.run()
        times.append((forward - start, inputs - forward, time.perf_counter() - inputs))
    seconds = [statistics.median(t[k] for t in times[1:]) for k in range(3)]
    f, i, w = _slowest([value * 1e3 for value in seconds], "schedule cost all-reduce")
    return Costs(forward=f, backward=i + w, backward_input=i, backward_weight=w)


def _slowest(medians: list[float], operation: str) -> list[float]:
    """Each median's largest value over the ranks (at least 1 µs), so every rank agrees."""
    measured = torch.tensor(medians)
    if dist.is_initialized():
        with collective(operation):
            dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return [max(float(value), 1e-3) for value in measured]


def choose_measured(
    config: GPTConfig,
    guess: Choice,
    *,
    sizes: tuple[int, int, int],
    micro_batch_size: int,
    seed: int,
) -> Choice:
    """Choose again among `guess`'s runnable candidates with warm-up costs.

    Args:
        config: The model's shape.
        guess: The choice made with default costs when the flags were checked.
        sizes: Pipeline ranks, microbatches per step, chunks per rank.
        micro_batch_size: Sequences per microbatch.
        seed: Seeds the throwaway chunk.
    """
    pp, m, vp = sizes
    costs = warmup_costs(
        config, layers=config.num_layers // (pp * vp), micro_batch_size=micro_batch_size,
        seed=seed,
    )  # fmt: skip
    runnable = [c.name for c in guess.candidates if c.makespan is not None]
    return choose_schedule(
        pp_size=pp, num_microbatches=m, vp_size=vp, costs=costs,
        memory_limit=float(min(pp, m)), names=runnable,
    )  # fmt: skip


def layout_costs(
    config: GPTConfig, *, micro_batch_size: int, seed: int, rounds: int = 3
) -> tuple[Costs, float, float]:
    """One transformer layer's F and B (ms), and the embedding's and the loss's time in layers.

    Each part (a layer, the embedding, the output layer with the loss) runs a forward and a
    backward of one microbatch; medians of `rounds` timed rounds after one untimed count, and
    the slowest rank's.

    Args:
        config: The model's shape.
        micro_batch_size: Sequences per microbatch.
        seed: Seeds the throwaway chunks' weights.
        rounds: Timed rounds after one untimed; the medians count.
    """
    tokens = torch.randint(config.vocab_size, (micro_batch_size, config.seq_length))
    medians: list[float] = []
    for pre, post, layers in ((False, False, 1), (True, False, 0), (False, True, 0)):
        part = GPTChunk(config, layers=range(layers), pre_process=pre, post_process=post, seed=seed)
        times = [_step(part, tokens, pre=pre, post=post) for _ in range(rounds + 1)][1:]
        medians += [statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)]
    f, b, *ends = _slowest(medians, "layout cost all-reduce")
    return (
        Costs(forward=f, backward=b),
        (ends[0] + ends[1]) / (f + b),
        (ends[2] + ends[3]) / (f + b),
    )


def _step(part: GPTChunk, tokens: torch.Tensor, *, pre: bool, post: bool) -> tuple[float, float]:
    """Milliseconds of one forward and one backward through `part`."""
    config = part.config
    given = torch.randn(config.seq_length, tokens.shape[0], config.hidden_size, requires_grad=True)
    part.set_input_tensor([None if pre else given])
    start = time.perf_counter()
    output = part(tokens if pre else None, tokens if post else None)
    forward = time.perf_counter()
    if post:
        output.float().mean().backward()
    else:
        output.backward(torch.ones_like(output))
    return (forward - start) * 1e3, (time.perf_counter() - forward) * 1e3
