"""Step costs and bytes measured in a short warm-up, for the simulator's picks.

``--pipeline-schedule auto`` and the balanced split of layers that do not divide
(``--pipeline-model-parallel-layout auto``) both simulate with measured costs;
``--memory-limit-gb`` and the memory report's prediction use `model_figures`: each part of
the model (a layer with each kind of recomputation, the embedding, the loss) alone, one
microbatch, its parameters, its bytes saved for backward (pp-schedules' `MemoryProbe`) and
its times. At tensor-parallel size > 1 the parts are measured split over a tensor-parallel
group of the run's (`warmup_tensor_parallel_group`: the warm-up runs before the run's parallel
state), so every figure is one rank's, as the run holds it; under sequence parallelism with
this rank's part of the sequence (`sequence_shards`).

Before the model is built, each rank times one microbatch through a throwaway chunk of the
run's size (its transformer layers, no embedding or head): the forward, the input half and the
weight half of the backward (pp-schedules' split backward), medians of a few rounds. The
slowest rank's times are the costs the run's one decision (`pp_train.run_plan.decide_run`)
simulates every candidate with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import statistics
import time
from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist

from pp_schedules import Costs, MemoryProbe
from pp_schedules.planning import StageMemory
from pp_schedules.runtime import backward_input, measure_stage
from pp_state import rank_layout
from pp_state.collectives import collective
from pp_tensor import RNGStatesTracker, add_model_parallel_states
from pp_train.app.gpt import GPTChunk, GPTConfig
from pp_train.app.transformer import TensorParallelism
from pp_train.memory_plan import MemoryPlanError, ModelFigures, PartFigures
from pp_train.recompute import RecomputeConfig

__all__ = [
    "layout_costs",
    "layout_times",
    "model_figures",
    "part_memory",
    "received_activations",
    "sequence_shards",
    "warmup_context_parallel_group",
    "warmup_costs",
    "warmup_tensor_parallel_group",
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
    given = torch.randn_like(received_activations(part, tokens.shape[0]))
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
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    cp_group: dist.ProcessGroup | None = None,
    cp_comm_type: str = "p2p",
) -> ModelFigures:
    """Each part of the GPT alone, one microbatch: parameters, bytes and times, per rank.

    The parts are built in training mode (dropout masks count, as in a training step) in the
    run's parameter `dtype` (bf16 or fp16 halves what most activations take, as
    `Float16Module` runs them); times are medians of `rounds` rounds after one untimed, the
    slowest rank's.

    With `tp_group` the parts are built split over it, as the run builds them
    (`sequence_parallel` as the run's): every figure is one rank's, as the run holds it (its
    shard of the weights, of the attention heads and the MLP's hidden layer, its part of the
    sequence under sequence parallelism, the collectives' buffers). Every rank of the job
    calls this at once (the parts run the group's collectives). Without `tp_group` and at
    `tensor_model_parallel_size` > 1 the parts are measured whole: only the parameters are
    one rank's share (`_rank_elements`), the bytes and times the whole's (an upper bound).
    `tied`: the output layer is the word embedding's copy, kept once by a stage with both.
    With `cp_group` (`warmup_context_parallel_group`) the parts hold this rank's part of the
    sequence and their attention runs over the group (`cp_comm_type`), so the key and value
    blocks in flight count among their transients.

    Raises:
        ValueError: `tensor_model_parallel_size` is not 1 or the size of `tp_group`.
        MemoryPlanError: A part cannot be built or run, or its forward saves nothing for
            backward; the message says which part (its activation bytes cannot be measured).
    """
    tp = _checked_tensor_parallel(tensor_model_parallel_size, tp_group)
    parallel = TensorParallelism(tp_group, sequence_parallel, None, cp_group, cp_comm_type)
    local = config.seq_length // parallel.cp_size  # this rank's part of the sequence
    tokens = torch.randint(config.vocab_size, (micro_batch_size, local))
    built = {}
    for name, (recompute, pre, post, layers) in _PARTS.items():
        shape = dataclasses.replace(config, recompute=recompute)
        built[name] = _measured_part(
            name, shape, tokens, pre=pre, post=post, layers=layers, seed=seed, dtype=dtype,
            parallel=parallel,
        )  # fmt: skip
    slowest = _timed([part for part, _, _ in built.values()], tokens, rounds)
    fullest = _fullest([measured for _, _, measured in built.values()])
    figures = {}
    for i, (name, (part, saved, _)) in enumerate(built.items()):
        count = sum(_rank_elements(p, 1 if tp_group is not None else tp) for p in part.parameters())
        memory = dataclasses.replace(fullest[i], parameters=count)
        figures[name] = PartFigures(count, saved, slowest[2 * i], slowest[2 * i + 1], memory)
    # A tied output layer is a copy of the word embedding, split by vocabulary rows over
    # tensor parallelism; an untied one is a weight of its own, counted whole on every stage.
    shared = config.vocab_size * config.hidden_size // tp if tied else 0
    return ModelFigures(**figures, shared_parameters=shared)


_PARTS: dict[str, tuple[RecomputeConfig | None, bool, bool, int]] = {
    "layer": (None, False, False, 1),
    "layer_full": (_FULL, False, False, 1),
    "layer_selective": (_SELECTIVE, False, False, 1),
    "embedding": (None, True, False, 0),
    "loss": (None, False, True, 0),
}
"""The parts `model_figures` measures: recomputation, first stage, last stage, layers."""


@contextlib.contextmanager
def warmup_tensor_parallel_group(
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    *,
    context_parallel_size: int = 1,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
) -> Iterator[dist.ProcessGroup | None]:
    """This rank's tensor-parallel group for the warm-up, before the run's parallel state.

    The groups are the run's (`pp_state.rank_layout`, Megatron's order), on gloo (the
    warm-up's parts are on CPU), made by every rank of the job together and destroyed on
    exit. None at size 1 (no group is made).

    Args:
        tensor_model_parallel_size: The run's tensor-parallel size.
        pipeline_model_parallel_size: The run's pipeline size (with the world and the
            context-parallel size, it fixes which ranks share a group).
        context_parallel_size: The run's context-parallel size.
        timeout: How long the groups' collectives may wait.

    Raises:
        ValueError: The sizes do not fit the job's world (`pp_state.rank_layout`'s message),
            or the size is over 1 without an initialised default process group.
    """
    sizes = (tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size)
    with _warmup_group("tp", *sizes, timeout=timeout) as group:
        yield group


@contextlib.contextmanager
def warmup_context_parallel_group(
    tensor_model_parallel_size: int,
    context_parallel_size: int,
    pipeline_model_parallel_size: int,
    *,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
) -> Iterator[dist.ProcessGroup | None]:
    """This rank's context-parallel group for the warm-up, as `warmup_tensor_parallel_group`.

    Parts measured on it run `pp_tensor.context_parallel_attention` over it, so their figures
    hold this rank's part of the sequence and the key and value blocks in flight.
    """
    sizes = (tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size)
    with _warmup_group("cp", *sizes, timeout=timeout) as group:
        yield group


@contextlib.contextmanager
def _warmup_group(
    kind: Literal["tp", "cp"], tp: int, cp: int, pp: int, *, timeout: datetime.timedelta
) -> Iterator[dist.ProcessGroup | None]:
    """This rank's group of `kind` ("tp" or "cp") in the run's layout; None at size 1."""
    size = {"tp": tp, "cp": cp}[kind]
    if size == 1:
        yield None
        return
    if not dist.is_initialized():
        name = {"tp": "tensor", "cp": "context"}[kind]
        raise ValueError(
            f"measuring a {name}-parallel size of {size} needs the job's default process "
            "group; initialise torch.distributed first"
        )
    layout = rank_layout(
        dist.get_world_size(), tensor_model_parallel_size=tp, context_parallel_size=cp,
        pipeline_model_parallel_size=pp,
    )  # fmt: skip
    groups = [dist.new_group(ranks, timeout=timeout, backend="gloo") for ranks in layout[kind]]
    rank = dist.get_rank()
    own = next(g for g, ranks in zip(groups, layout[kind], strict=True) if rank in ranks)
    try:
        yield own
    finally:
        dist.destroy_process_group(own)


def _checked_tensor_parallel(size: int, group: dist.ProcessGroup | None) -> int:
    """The tensor-parallel size the parts are counted at: the group's, or `size` without one.

    Raises:
        ValueError: `size` is neither 1 nor the group's size.
    """
    if group is None:
        return size
    ranks = dist.get_world_size(group)
    if size not in (1, ranks):
        raise ValueError(
            f"tensor_model_parallel_size {size} does not match the tensor-parallel group of "
            f"{ranks} ranks; pass 1 or {ranks}"
        )
    return ranks


def _measured_part(
    name: str,
    shape: GPTConfig,
    tokens: torch.Tensor,
    *,
    pre: bool,
    post: bool,
    layers: int,
    seed: int,
    dtype: torch.dtype,
    parallel: TensorParallelism,
) -> tuple[GPTChunk, int, StageMemory]:
    """One part built as the run builds it on this rank, its saved bytes and its figures.

    Dropout draws under a model-parallel RNG tracker holding the run's states (recomputation
    keeps copies of all of them: the three of pp-tensor 0.2's seeding, 5 KB each).

    Raises:
        MemoryPlanError: The part cannot be built or run; the message names it.
    """
    group = parallel.group
    tp_rank = 0 if group is None else dist.get_rank(group)
    tracker = add_model_parallel_states(RNGStatesTracker("cpu"), seed, tp_rank=tp_rank)
    try:
        part = GPTChunk(
            shape, layers=range(layers), pre_process=pre, post_process=post, seed=seed,
            tp_group=group, sequence_parallel=parallel.sequence_parallel, rng_tracker=tracker,
            cp_group=parallel.cp_group, cp_comm_type=parallel.cp_comm_type,
        ).to(dtype)  # fmt: skip
        tries = 1 if group is None and parallel.cp_group is None else _TRIES
        measured = _least([part_memory(part, tokens) for _ in range(tries)])
        return part, _saved_bytes(part, tokens), measured
    except (RuntimeError, ValueError) as error:
        raise MemoryPlanError(
            f"the warm-up that measures the model's memory failed on its "
            f"{name.replace('_', ' ')} (one microbatch of {tokens.shape[0]} x "
            f"{tokens.shape[1]} tokens): {error}"
        ) from error


_TRIES = 3
"""Times a part split over tensor parallelism is measured; each figure is the least seen."""


def _least(measured: list[StageMemory]) -> StageMemory:
    """Each figure the least of `measured` (one microbatch through a part, measured again).

    gloo's worker thread lets go of a collective's tensors a moment after it completes; an
    output the rank has already used and dropped (an all-reduced sum added to the residual,
    a sequence-parallel gather) is then freed on that thread, and now and then after the
    counter reads a figure: that figure comes out a tensor or two high. The least of a few
    measurements is the part's own.
    """
    names = [f.name for f in dataclasses.fields(StageMemory) if f.type in ("int", int)]
    return _with_counts(measured[0], {n: min(getattr(m, n) for m in measured) for n in names})


def _fullest(measured: list[StageMemory]) -> list[StageMemory]:
    """Each part's figures, every one the largest any rank measured, so every rank agrees.

    A part split over tensor parallelism holds the same shapes on every rank of its group,
    but a collective's tensors are freed a moment late now and then (on gloo's thread), so
    two ranks may count a figure apart by such a tensor; the run's decision must be the
    same on every rank (``--memory-limit-gb``), and the larger is the safer.
    """
    if not dist.is_initialized():
        return measured
    names = [f.name for f in dataclasses.fields(StageMemory) if f.type in ("int", int)]
    values = torch.tensor([[getattr(m, n) for n in names] for m in measured], dtype=torch.int64)
    with collective("memory warm-up all-reduce"):
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    rows: list[list[int]] = values.tolist()
    return [
        _with_counts(m, dict(zip(names, row, strict=True)))
        for m, row in zip(measured, rows, strict=True)
    ]


def _with_counts(memory: StageMemory, counts: dict[str, int]) -> StageMemory:
    """`memory` with the byte counts (and parameters) in `counts` instead of its own."""
    return StageMemory(**{**dataclasses.asdict(memory), **counts})


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


def sequence_shards(part: GPTChunk) -> int:
    """How many ranks split the sequence of the activations `part` takes and hands on.

    The context-parallel size, times the tensor-parallel size under sequence parallelism.
    This is the one place the warm-up learns how the run shards a microbatch's sequence: the
    activations received between stages, and so every figure measured downstream of them,
    are this rank's ``seq_length / sequence_shards`` positions. The key and value blocks
    context-parallel attention holds in flight are allocated inside the part's forward and
    backward, so a part run on its context-parallel group counts them in its transients, as
    the tensor-parallel collectives' buffers are counted (see docs/memory.md).
    """
    parallel = part.parallel
    return (parallel.size if parallel.sequence_parallel else 1) * parallel.cp_size


def received_activations(part: GPTChunk, micro_batch_size: int) -> torch.Tensor:
    """Zeros shaped as the activations `part` receives from the previous stage in the run.

    ``[seq / shards, batch, hidden]`` (`sequence_shards`) in the part's parameter dtype.
    """
    config = part.config
    dtype = next(part.parameters()).dtype
    length = config.seq_length // sequence_shards(part)
    return torch.zeros(length, micro_batch_size, config.hidden_size, dtype=dtype)


def part_memory(part: GPTChunk, tokens: torch.Tensor) -> StageMemory:
    """Every byte one microbatch through `part` holds, step by step, as the executor runs it.

    pp-schedules' `measure_stage` on the part: its ``pre_process`` part takes `tokens`, its
    ``post_process`` part ends in the loss against the next tokens (a scalar, as the
    executor backwards from), any other takes activations of the run's shape and dtype
    (`received_activations`: this rank's part of the sequence under sequence parallelism).
    A part built on a tensor-parallel group runs its collectives: its figures are one
    rank's, as the run holds them.
    The token ids and labels are copied inside the step, as the data iterator makes them.
    """
    pre, post = part.pre_process, part.post_process
    labels = tokens.roll(-1, dims=1) if post else None
    given = None if pre else received_activations(part, tokens.shape[0])

    def forward(received: torch.Tensor | None) -> torch.Tensor:
        # The microbatch's data is read during the step (it counts as device memory, and
        # the graph keeps what it saves of it): fresh copies, as the data iterator gives.
        part.set_input_tensor([received])
        output: torch.Tensor = part(
            tokens.clone() if pre else None, None if labels is None else labels.clone()
        )
        part.set_input_tensor([None])  # as the executor: the chunk keeps no input
        _settled(part.parallel.group)
        _settled(part.parallel.cp_group)
        return output.float().mean() if post else output

    return measure_stage(forward, given, part.parameters(), loss=post)


def _settled(group: dist.ProcessGroup | None) -> None:
    """Waits until `group`'s collectives have let go of their tensors (nothing without one).

    gloo's worker thread drops its reference to a collective's tensors just after the
    collective completes, so an output the rank has already used and dropped (a row-parallel
    layer's all-reduced sum, added to the residual) may be freed a moment later, on that
    thread. In the run the next layer's work covers that moment; a part measured alone ends
    its forward there, and what it keeps would be read with the tensor or without it. A
    barrier on the group settles it: the figures are the same every time.
    """
    if group is not None:
        with collective("memory warm-up barrier", group=group):
            dist.barrier(group=group)


def _saved_bytes(part: GPTChunk, tokens: torch.Tensor) -> int:
    """Bytes one microbatch's forward through `part` saves for backward.

    Raises:
        ValueError: It saved nothing.
    """
    pre, post = part.pre_process, part.post_process
    given = torch.randn_like(received_activations(part, tokens.shape[0]))
    part.set_input_tensor([None if pre else given.requires_grad_()])
    probe = MemoryProbe(static=part.parameters)
    saved = probe.saved_by(lambda: part(tokens if pre else None, tokens if post else None))
    if saved <= 0:
        raise ValueError("its forward saved nothing for backward, so no bytes can be measured")
    return saved
