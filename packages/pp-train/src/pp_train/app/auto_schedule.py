"""Step costs and bytes measured in a short warm-up, for the simulator's picks.

``--pipeline-schedule auto`` and the balanced split of layers that do not divide
(``--pipeline-model-parallel-layout auto``) both simulate with measured costs;
``--memory-limit-gb`` and the memory report's prediction use `model_figures`: each part of
the model (a layer with each kind of recomputation, the embedding, the loss) alone, one
microbatch, its parameters, its bytes saved for backward (pp-schedules' `MemoryProbe`) and
its times. At tensor-parallel size > 1 the parts are still measured whole (the warm-up runs
before the process groups); the parameters are then counted per rank (see `model_figures`).

Before the model is built, each rank times one microbatch through a throwaway chunk of the
run's size (its transformer layers, no embedding or head): the forward, the input half and the
weight half of the backward (pp-schedules' split backward), medians of a few rounds. The
slowest rank's times are the costs the run's one decision (`pp_train.run_plan.decide_run`)
simulates every candidate with.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from pp_schedules import Costs, MemoryProbe
from pp_schedules.planning import StageMemory
from pp_schedules.runtime import backward_input, measure_stage
from pp_state.collectives import collective
from pp_tensor import RNGStatesTracker, add_model_parallel_states
from pp_train.app.gpt import GPTChunk, GPTConfig
from pp_train.memory_plan import MemoryPlanError, ModelFigures, PartFigures
from pp_train.recompute import RecomputeConfig

__all__ = [
    "layout_costs",
    "layout_times",
    "model_figures",
    "part_memory",
    "warmup_costs",
]


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


def layout_costs(
    config: GPTConfig, *, micro_batch_size: int, seed: int, rounds: int = 3
) -> tuple[Costs, float, float]:
    """One transformer layer's F and B (ms), and the embedding's and the loss's time in layers.

    Each part (a layer, the embedding, the output layer with the loss) runs a forward and a
    backward of one microbatch; medians of `rounds` timed rounds after one untimed count, and
    the slowest rank's (`model_figures`, read by `layout_times`).

    Args:
        config: The model's shape (and recomputation, which the layer's time includes).
        micro_batch_size: Sequences per microbatch.
        seed: Seeds the throwaway chunks' weights.
        rounds: Timed rounds after one untimed; the medians count.
    """
    figures = model_figures(config, micro_batch_size=micro_batch_size, seed=seed, rounds=rounds)
    return layout_times(figures, config.recompute)


def layout_times(
    figures: ModelFigures, recompute: RecomputeConfig | None
) -> tuple[Costs, float, float]:
    """`layout_costs` from measured parts, the ends' times in layers.

    The layer is timed as `recompute` runs it (a chunk of one layer recomputes it whole under
    full granularity, either method).
    """
    layer = {
        None: figures.layer,
        "full": figures.layer_full,
        "selective": figures.layer_selective or figures.layer,
    }[None if recompute is None else recompute.granularity]
    f, b = layer.forward_ms, layer.backward_ms
    embedding, loss = figures.embedding, figures.loss
    return (
        Costs(forward=f, backward=b),
        (embedding.forward_ms + embedding.backward_ms) / (f + b),
        (loss.forward_ms + loss.backward_ms) / (f + b),
    )


def _step(part: GPTChunk, tokens: torch.Tensor, *, pre: bool, post: bool) -> tuple[float, float]:
    """Milliseconds of one forward and one backward through `part`."""
    config, dtype = part.config, next(part.parameters()).dtype
    given = torch.randn(config.seq_length, tokens.shape[0], config.hidden_size, dtype=dtype)
    part.set_input_tensor([None if pre else given.requires_grad_()])
    start = time.perf_counter()
    output = part(tokens if pre else None, tokens if post else None)
    forward = time.perf_counter()
    if post:
        output.float().mean().backward()
    else:
        output.backward(torch.ones_like(output))
    return (forward - start) * 1e3, (time.perf_counter() - forward) * 1e3


_FULL = RecomputeConfig(granularity="full", method="uniform", num_layers=1)
_SELECTIVE = RecomputeConfig(granularity="selective")


def model_figures(
    config: GPTConfig,
    *,
    micro_batch_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    rounds: int = 5,
    tensor_model_parallel_size: int = 1,
    tied: bool = True,
) -> ModelFigures:
    """Each part of the GPT alone, one microbatch: parameters, saved bytes and times.

    The parts are built in training mode (dropout masks count, as in a training step) in the
    run's parameter `dtype` (bf16 or fp16 halves what most activations take, as
    `Float16Module` runs them); times are medians of `rounds` rounds after one untimed, the
    slowest rank's.

    Built whole (before the process groups exist); at `tensor_model_parallel_size` > 1 the
    parameters are one rank's share (`_rank_elements`), the bytes and times the whole's.
    `tied`: the output layer is the word embedding's copy, kept once by a stage with both.

    Raises:
        MemoryPlanError: A part cannot be built or run, or its forward saves nothing for
            backward; the message says which part (its activation bytes cannot be measured).
    """
    tokens = torch.randint(config.vocab_size, (micro_batch_size, config.seq_length))
    parts = {
        "layer": (dataclasses.replace(config, recompute=None), False, False, 1),
        "layer_full": (dataclasses.replace(config, recompute=_FULL), False, False, 1),
        "layer_selective": (dataclasses.replace(config, recompute=_SELECTIVE), False, False, 1),
        "embedding": (dataclasses.replace(config, recompute=None), True, False, 0),
        "loss": (dataclasses.replace(config, recompute=None), False, True, 0),
    }
    # Dropout draws under a model-parallel RNG tracker holding the run's states (recomputation
    # keeps copies of all of them: the three of pp-tensor 0.2's seeding, 5 KB each).
    tracker = add_model_parallel_states(RNGStatesTracker("cpu"), seed, tp_rank=0)
    built, figures = {}, {}
    for name, (shape, pre, post, layers) in parts.items():
        try:
            part = GPTChunk(shape, layers=range(layers), pre_process=pre, post_process=post,
                            seed=seed, rng_tracker=tracker).to(dtype)  # fmt: skip
            built[name] = (part, _saved_bytes(part, tokens), part_memory(part, tokens))
        except (RuntimeError, ValueError) as error:
            raise MemoryPlanError(
                f"the warm-up that measures the model's memory failed on its "
                f"{name.replace('_', ' ')} (one microbatch of {micro_batch_size} x "
                f"{config.seq_length} tokens): {error}"
            ) from error
    slowest = _timed([part for part, _, _ in built.values()], tokens, rounds)
    tp = tensor_model_parallel_size
    for i, (name, (part, saved, measured)) in enumerate(built.items()):
        count = sum(_rank_elements(p, tp) for p in part.parameters())
        memory = dataclasses.replace(measured, parameters=count)
        figures[name] = PartFigures(count, saved, slowest[2 * i], slowest[2 * i + 1], memory)
    # A tied output layer is a copy of the word embedding, split by vocabulary rows over
    # tensor parallelism; an untied one is a weight of its own, counted whole on every stage.
    shared = config.vocab_size * config.hidden_size // tp if tied else 0
    return ModelFigures(**figures, shared_parameters=shared)


def _timed(parts: list[GPTChunk], tokens: torch.Tensor, rounds: int) -> list[float]:
    """Each part's forward and backward milliseconds: medians, the slowest rank's."""
    # Round by round over every part, so that a slow start or a busy moment of the machine
    # does not fall on one part alone; the first round is not timed.
    times: list[list[tuple[float, float]]] = [[] for _ in parts]
    for _ in range(rounds + 1):
        for part, measured in zip(parts, times, strict=True):
            measured.append(_step(part, tokens, pre=part.pre_process, post=part.post_process))
    medians = [statistics.median(t[k] for t in measured[1:]) for measured in times for k in (0, 1)]
    return _slowest(medians, "memory warm-up all-reduce")


def _rank_elements(param: torch.Tensor, tp: int) -> int:
    """The elements one of `tp` tensor-parallel ranks holds of `param`, built whole.

    A weight tensor parallelism splits (marked ``tensor_model_parallel``) counts ``1 / tp``
    of its elements, a replicated one (layer norms, row-parallel biases) all of them. The
    warm-up's activation bytes and times are not scaled: they are the whole layer's, an
    upper bound for one rank (the attention scores and the MLP's hidden layer are ``1 / tp``
    per rank, under sequence parallelism the rest too; the times leave out the
    tensor-parallel collectives).
    """
    split = bool(getattr(param, "tensor_model_parallel", False))
    return param.numel() // tp if split else param.numel()


def part_memory(part: GPTChunk, tokens: torch.Tensor) -> StageMemory:
    """Every byte one microbatch through `part` holds, step by step, as the executor runs it.

    pp-schedules' `measure_stage` on the part: its ``pre_process`` part takes `tokens`, its
    ``post_process`` part ends in the loss against the next tokens (a scalar, as the
    executor backwards from), any other takes activations of the run's shape and dtype.
    The token ids and labels are copied inside the step, as the data iterator makes them.
    """
    pre, post = part.pre_process, part.post_process
    config = part.config
    dtype = next(part.parameters()).dtype
    labels = tokens.roll(-1, dims=1) if post else None
    given = (
        None
        if pre
        else torch.zeros(config.seq_length, tokens.shape[0], config.hidden_size, dtype=dtype)
    )

    def forward(received: torch.Tensor | None) -> torch.Tensor:
        # The microbatch's data is read during the step (it counts as device memory, and
        # the graph keeps what it saves of it): fresh copies, as the data iterator gives.
        part.set_input_tensor([received])
        output: torch.Tensor = part(
            tokens.clone() if pre else None, None if labels is None else labels.clone()
        )
        part.set_input_tensor([None])  # as the executor: the chunk keeps no input
        return output.float().mean() if post else output

    return measure_stage(forward, given, part.parameters(), loss=post)


def _saved_bytes(part: GPTChunk, tokens: torch.Tensor) -> int:
    """Bytes one microbatch's forward through `part` saves for backward.

    Raises:
        ValueError: It saved nothing.
    """
    config, pre, post = part.config, part.pre_process, part.post_process
    dtype = next(part.parameters()).dtype
    given = torch.randn(config.seq_length, tokens.shape[0], config.hidden_size, dtype=dtype)
    part.set_input_tensor([None if pre else given.requires_grad_()])
    probe = MemoryProbe(static=part.parameters)
    saved = probe.saved_by(lambda: part(tokens if pre else None, tokens if post else None))
    if saved <= 0:
        raise ValueError("its forward saved nothing for backward, so no bytes can be measured")
    return saved
