"""Memory as bytes: what each rank holds for its parameters, optimizer and activations.

A `MemoryModel` gives, per virtual stage, the parameter count and the bytes one microbatch's
forward saves for its backward (`StageMemory`), and for the whole model the dtypes and the
optimizer. From it, and the plan's placement, each rank's **static** bytes follow
(`StaticBytes`: parameters, gradients, optimizer state); `simulate(report, costs, memory=...)`
adds the **activations** held over the plan's time (a microbatch's saved tensors from its
forward to its last backward, ``B`` or ``W``) and reports the peak of every rank.

What is counted is what `pp_schedules.MemoryProbe` measures on a real run, so that the two
compare step by step: parameter, gradient and optimizer-state storage, and tensors autograd
saved for backward. Left out of both: p2p buffers, the outputs a stage keeps for its backward
(a stage's output is usually saved by the next op anyway), and temporaries inside one op.

Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TypeVar

from pp_state.placement import Placement

__all__ = [
    "DTYPE_BYTES",
    "OPTIMIZERS",
    "MemoryModel",
    "StageMemory",
    "StaticBytes",
    "TransferBuffers",
    "chain",
    "format_bytes",
    "format_bytes_apart",
    "stage_ends",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the parameter and gradient dtypes the model knows."""

OPTIMIZERS = ("adam", "sgd")
"""Optimizer kinds (pp-optim's ``OptimizerConfig.optimizer``)."""

_GB = 1024**3
_T = TypeVar("_T")


_UNITS = (("GB", _GB), ("MB", 2**20), ("KB", 2**10))


def format_bytes(count: float) -> str:
    """`count` bytes in binary units as torch's allocator reports: ``"1.25 GB"``, ``"3.4 MB"``."""
    for unit, size in _UNITS:
        if count >= size:
            return f"{count / size:.2f} {unit}" if unit == "GB" else f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


def format_bytes_apart(counts: Sequence[float], reference: float) -> tuple[str, list[str]]:
    """`reference` and `counts` in one unit, with digits enough to keep each count apart from it.

    The unit is the one `format_bytes` takes for the largest count; the digits are the fewest (at
    least one) with which every count other than `reference` reads other than it, on the
    same side ("over 7.62 MB: rank 0 needs 7.65 MB", never "over 7.6 MB: ... needs 7.6 MB").

    Returns:
        The reference's text, and each count's, in order.
    """
    largest = max(counts) if counts else reference
    unit, size = next(((u, s) for u, s in _UNITS if largest >= s), ("B", 1))
    if unit == "B":
        return f"{int(reference)} B", [f"{int(c)} B" for c in counts]
    for digits in range(1, 10):
        scaled = [round(c / size, digits) for c in counts]
        mark = round(reference / size, digits)
        if all((v > mark) == (c > reference) and (v < mark) == (c < reference)
               for v, c in zip(scaled, counts, strict=True)):  # fmt: skip
            break
    else:  # apart by less than a byte's share of the unit's ninth digit: in bytes
        return f"{reference:.1f} B", [f"{c:.1f} B" for c in counts]
    return f"{reference / size:.{digits}f} {unit}", [
        f"{c / size:.{digits}f} {unit}" for c in counts
    ]


def stage_ends(counts: Sequence[int], first: _T | None, last: _T | None) -> list[list[_T]]:
    """What each virtual stage holds beside its layers: `first` on stage 0, `last` on the last.

    The layer layouts' rule (see `pp_state.PipelineLayerLayout`), shared by the per-stage
    costs and bytes built from per-layer figures.

    Raises:
        ValueError: No stages, or a negative layer count.
    """
    if not counts or min(counts) < 0:
        raise ValueError(
            f"layer counts must name at least one stage and none below 0, got {tuple(counts)}"
        )
    final = len(counts) - 1
    return [
        [part for part, here in ((first, s == 0), (last, s == final)) if part is not None and here]
        for s in range(len(counts))
    ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageMemory:
    """The memory figures of one virtual stage (one model chunk), or of one part of one.

    Per microbatch. A step's figures are bytes on top of what the rank held when the step
    started; what crosses the stage's edges (its received input, its output, the gradients
    that come back and go out) is followed by the simulator, which knows when each arrives,
    is sent and is freed.

    Attributes:
        parameters: Parameters the chunk holds (a tied copy of the word embedding on the last
            stage counts: it is a parameter of its own there).
        activation_bytes: Bytes its forward keeps until the microbatch's last backward step
            on the chunk (``B``, or ``W`` after a split backward): autograd's saved tensors
            (parameters excluded), dropout masks and every other storage its graph holds,
            but not its input (received, or handed over on the rank) nor its output. With
            recomputation: the checkpointed inputs and whatever is not recomputed.
        recompute_bytes: Held on top during each backward step (``B``, ``I``, ``W``) while a
            checkpointed segment is recomputed (that segment's saved tensors); 0 without
            recomputation, or when the backward transients below include it (measured).
        output_bytes: Its output: the activations the next stage receives, whose gradient
            comes back in the same size. Held from ``F`` until its send completes (the
            executor frees a sent output), or until the backward when it is not freed.
        forward_transient_bytes: The most its forward holds at once on top of what it keeps
            at its end (``activation_bytes + output_bytes``): temporaries inside the forward.
        backward_transient_bytes: The most a whole backward (``B``) holds on top of what was
            held when it started: gradients of activations, weight gradients on their way to
            the gradient buffer, its input's gradient as it is made, recomputed activations.
            It ends holding ``input_grad_bytes`` more and ``activation_bytes`` less.
        input_grad_bytes: The gradient of its input, made by ``B`` or ``I`` and held until
            sent (0 when its input takes no gradient: the first stage's token ids).
        input_transient_bytes: The most the input-gradient step ``I`` of a split backward
            holds on top of what was held when it started. It ends holding
            ``deferred_bytes + input_grad_bytes`` more.
        deferred_bytes: What ``I`` keeps until ``W``: the gradients arriving where the
            weights' branches leave the path to the input. (The graph's saved tensors stay
            too: they are ``activation_bytes``.)
        weight_transient_bytes: The most ``W`` holds on top of what was held when it
            started. It ends holding ``activation_bytes + deferred_bytes`` less.
        weight_kept_bytes: What its part of a ``W`` keeps until the whole ``W`` ends: the
            activations it recomputed, which a ``W``'s calls share (only `chain` reads it;
            ``W`` runs a chunk's parts in forward order).
        holds_input: Its graph keeps its input until its backward (only `chain` reads it: a
            received input is kept by the executor anyway).
        keeps_output_grad: Its ``I`` keeps the gradient of its output until ``W`` (only
            `chain` reads it).

    A chunk whose input takes no gradient (``input_grad_bytes`` 0 on its first part: the
    first stage) computes nothing in ``I``; its ``W`` is a whole backward (`chain` gives it
    ``backward_transient_bytes`` there).
    """

    parameters: int
    activation_bytes: int
    recompute_bytes: int = 0
    output_bytes: int = 0
    forward_transient_bytes: int = 0
    backward_transient_bytes: int = 0
    input_grad_bytes: int = 0
    input_transient_bytes: int = 0
    deferred_bytes: int = 0
    weight_transient_bytes: int = 0
    weight_kept_bytes: int = 0
    holds_input: bool = True
    keeps_output_grad: bool = False

    def __post_init__(self) -> None:
        """Counts are whole numbers, none negative.

        Raises:
            ValueError: A negative or non-integral figure, named with its value.
        """
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{field.name} must be True or False, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"stage memory figures must be whole numbers 0 or more, got "
                    f"{field.name}={value!r} (parameters={self.parameters!r}, "
                    f"activation_bytes={self.activation_bytes!r})"
                )

    @property
    def forward_peak_bytes(self) -> int:
        """The most its forward holds at once on top of what was held before it."""
        return self.activation_bytes + self.output_bytes + self.forward_transient_bytes

    @property
    def first_stage(self) -> bool:
        """Its input takes no gradient, so a split backward's ``I`` computes nothing."""
        return self.input_grad_bytes == 0


def chain(parts: Sequence[StageMemory]) -> StageMemory:
    """The figures of `parts` run one after another in one chunk, as if measured whole.

    Each part takes the previous part's output as its input. The forward holds each part's
    activations and output; an output stays once the next part is done with it only if that
    part holds its input. A backward goes through the parts in reverse and frees each part's
    activations (and its input, when held) as it passes, and each gradient between two parts
    once the earlier part has used it; an ``I`` frees nothing of the graph and keeps each
    part's deferred gradients; a ``W`` runs one part's weights at a time, in forward order,
    keeping what each recomputed until it ends. Parameters add up; the recompute transient is
    the largest part's.

    Args:
        parts: The parts in forward order (an embedding, layers, an output layer and loss);
            none: an empty chunk, all figures 0.

    Returns:
        The chunk's figures.
    """
    if not parts:
        return StageMemory(parameters=0, activation_bytes=0)
    kept, forward_peak = 0, 0
    for index, part in enumerate(parts):
        forward_peak = max(forward_peak, kept + part.forward_peak_bytes)
        kept += part.activation_bytes + part.output_bytes
        if index and not part.holds_input:
            kept -= parts[index - 1].output_bytes  # freed once this part has used it
    last, first = parts[-1], parts[0]
    activation = kept - last.output_bytes
    backward_peak = _backward_peak(parts, frees_graph=True)
    if first.first_stage:  # a whole backward in W, which frees the graph as it goes
        deferred, input_peak, weight_peak, weight_kept = 0, 0, backward_peak, 0
    else:
        weight_kept = sum(part.weight_kept_bytes for part in parts)
        deferred, input_peak = _input_step(parts)
        weight_peak = _weight_peak(parts)
    return StageMemory(
        parameters=sum(part.parameters for part in parts),
        activation_bytes=activation,
        recompute_bytes=max(part.recompute_bytes for part in parts),
        output_bytes=last.output_bytes,
        forward_transient_bytes=forward_peak - kept,
        backward_transient_bytes=backward_peak,
        input_grad_bytes=first.input_grad_bytes,
        input_transient_bytes=input_peak,
        deferred_bytes=deferred,
        weight_transient_bytes=weight_peak,
        weight_kept_bytes=weight_kept,
        holds_input=first.holds_input,
        keeps_output_grad=last.keeps_output_grad,
    )


def _backward_peak(parts: Sequence[StageMemory], *, frees_graph: bool) -> int:
    """The most a backward through `parts` (last first) holds on top of its start."""
    held, peak = 0, 0
    for index in reversed(range(len(parts))):
        part = parts[index]
        peak = max(peak, held + part.backward_transient_bytes)
        held += part.input_grad_bytes
        if frees_graph:
            held -= part.activation_bytes
            if index and part.holds_input:
                held -= parts[index - 1].output_bytes
        if index < len(parts) - 1:
            held -= parts[index + 1].input_grad_bytes  # the gradient this part used up
    return peak


def _weight_peak(parts: Sequence[StageMemory]) -> int:
    """The most a ``W`` through `parts` (in forward order) holds on top of its start."""
    held, peak = 0, 0
    for part in parts:
        peak = max(peak, held + part.weight_transient_bytes)
        held += part.weight_kept_bytes
    return peak


def _input_step(parts: Sequence[StageMemory]) -> tuple[int, int]:
    """What an ``I`` through `parts` keeps until ``W``, and the most it holds on top."""
    held, peak = 0, 0
    for index in reversed(range(len(parts))):
        part = parts[index]
        peak = max(peak, held + part.input_transient_bytes)
        held += part.deferred_bytes + part.input_grad_bytes
        if index < len(parts) - 1 and not part.keeps_output_grad:
            held -= parts[index + 1].input_grad_bytes
    return held - parts[0].input_grad_bytes, peak


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferBuffers:
    """What the transport holds for transfers beyond the tensors themselves.

    pp-comm's contract frames on gloo (`pp_comm.frame_buffers` says its figures): every
    posted receive holds a frame that any message fits in until the receive is used, and
    a send of at most `inline_bytes` is copied into a frame of its size plus a header. Used
    frames are kept for reuse, up to `spare_frames` received ones and as many sent ones of
    each size (a sent frame is reused once its send is complete). All 0: no frames (NCCL,
    or contracts off).

    Attributes:
        receive_frame_bytes: Bytes of the frame each receive posts.
        send_header_bytes: Header bytes a sent frame adds to its payload.
        inline_bytes: The largest payload copied into a sent frame (larger ones travel as
            they are, with a header from host memory).
        spare_frames: Frames kept for reuse, of each kind and size.
    """

    receive_frame_bytes: int = 0
    send_header_bytes: int = 0
    inline_bytes: int = 0
    spare_frames: int = 0

    def __post_init__(self) -> None:
        """Whole numbers, none negative.

        Raises:
            ValueError: A negative or non-integral figure, named.
        """
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field.name} must be a whole number 0 or more, got {value!r}")

    def send_frame_bytes(self, payload: int) -> int:
        """The frame a send of `payload` bytes is copied into; 0 when it travels as it is."""
        if not self.receive_frame_bytes or payload > self.inline_bytes:
            return 0
        return self.send_header_bytes + payload


def _ends(
    counts: Sequence[int], embedding: StageMemory | None, loss: StageMemory | None
) -> list[tuple[list[StageMemory], list[StageMemory]]]:
    """What each stage holds before its layers (the embedding) and after them (the loss).

    Raises:
        ValueError: No stages, or a negative count (`stage_ends`).
    """
    firsts = stage_ends(counts, embedding, None)
    lasts = stage_ends(counts, None, loss)
    return list(zip(firsts, lasts, strict=True))


@dataclasses.dataclass(frozen=True)
class StaticBytes:
    """A rank's bytes that do not change during a step."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        """Parameters, gradients and optimizer state together."""
        return self.parameters + self.gradients + self.optimizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """The bytes of a model's stages, with its precision and optimizer.

    Per parameter (Megatron's mixed-precision layout, as pp-optim builds it):

    * parameters: the parameter dtype (`params_dtype`);
    * gradients: one contiguous buffer in `grad_dtype` (fp32 when gradients are accumulated in
      fp32, else the parameter dtype);
    * optimizer state: Adam's two fp32 moments (8 bytes) or SGD's fp32 momentum (4, none
      without momentum); under fp16/bf16 also the fp32 master copy (4). The master copy's
      fp32 gradient (when the gradient buffer is not fp32) lives only from the optimizer step
      to the next ``zero_grad``, outside forward and backward, and is not counted.

    With the distributed optimizer the optimizer state is split over the data-parallel ranks.

    Attributes:
        stages: One `StageMemory` per virtual stage, in pipeline order.
        params_dtype: "fp32", "bf16" or "fp16".
        grad_dtype: The gradient buffer's dtype; the parameters' when None.
        optimizer: "adam" or "sgd".
        sgd_momentum: SGD keeps a momentum buffer (momentum above 0).
        data_parallel_size: Data-parallel replicas (the distributed optimizer's split).
        distributed_optimizer: Optimizer state sharded over the data-parallel ranks.
        transfers: What the transport holds per transfer (pp-comm's frames on gloo); None:
            nothing beyond the tensors.
        deallocates_outputs: A sent output is freed once its send completes (the executor's
            ``deallocate_pipeline_outputs``, on by default); False: kept until its backward.
    """

    stages: tuple[StageMemory, ...]
    params_dtype: str = "fp32"
    grad_dtype: str | None = None
    optimizer: str = "adam"
    sgd_momentum: bool = True
    data_parallel_size: int = 1
    distributed_optimizer: bool = False
    transfers: TransferBuffers | None = None
    deallocates_outputs: bool = True

    def __post_init__(self) -> None:
        """Known dtypes and optimizer, at least one stage.

        Raises:
            ValueError: No stages, an unknown dtype or optimizer, or a data-parallel size
                below 1; the message lists the valid values.
        """
        if not self.stages:
            raise ValueError("a memory model needs one StageMemory per virtual stage, got none")
        for name in ("params_dtype", "grad_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPE_BYTES:
                raise ValueError(f"{name} {value!r} is unknown; valid: {', '.join(DTYPE_BYTES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer {self.optimizer!r} is unknown; valid: {', '.join(OPTIMIZERS)}"
            )
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be an int 1 or more, got {self.data_parallel_size!r}"
            )

    @property
    def num_stages(self) -> int:
        """Virtual stages described."""
        return len(self.stages)

    def optimizer_bytes_per_parameter(self) -> int:
        """Optimizer state bytes per parameter before any sharding (see the class docstring)."""
        state = 8 if self.optimizer == "adam" else (4 if self.sgd_momentum else 0)
        return state if self.params_dtype == "fp32" else state + 4

    def static_bytes(self, parameters: int) -> StaticBytes:
        """The static bytes of a rank holding `parameters` parameters."""
        grad = DTYPE_BYTES[self.grad_dtype or self.params_dtype]
        optimizer = parameters * self.optimizer_bytes_per_parameter()
        if self.distributed_optimizer:
            optimizer = math.ceil(optimizer / self.data_parallel_size)
        return StaticBytes(
            parameters=parameters * DTYPE_BYTES[self.params_dtype],
            gradients=parameters * grad,
            optimizer=optimizer,
        )

    def rank_static(self, placement: Placement, rank: int) -> StaticBytes:
        """The static bytes of pipeline `rank`: the parameters of every chunk it holds.

        Raises:
            ValueError: The placement has another number of virtual stages.
        """
        self.check_placement(placement)
        stages = [placement.stage(rank, chunk) for chunk in range(placement.vp_size)]
        return self.static_bytes(sum(self.stages[s].parameters for s in stages))

    def check_placement(self, placement: Placement) -> None:
        """The model describes exactly the placement's virtual stages.

        Raises:
            ValueError: Another number of stages; the message names both counts.
        """
        if placement.num_stages != self.num_stages:
            raise ValueError(
                f"the memory model describes {self.num_stages} virtual stages, but the plan "
                f"has {placement.num_stages} ({placement.pp_size} ranks x "
                f"{placement.vp_size} chunks)"
            )

    @classmethod
    def from_layers(
        cls,
        counts: Sequence[int],
        *,
        layer: StageMemory,
        embedding: StageMemory | None = None,
        loss: StageMemory | None = None,
        **options: object,
    ) -> MemoryModel:
        """The model of a layout: `counts[s]` transformer layers on virtual stage ``s``.

        As `StageCosts.from_layers`: stage 0 also holds the embedding, the last stage the
        output layer and loss; each stage's figures are the `chain` of what it holds (its
        parameters and activations add up; the largest recompute transient of its parts is
        its `recompute_bytes`).

        Args:
            counts: Transformer layers of each virtual stage, in pipeline order.
            layer: One transformer layer's figures.
            embedding: The embedding's figures; none by default.
            loss: The output layer's and loss's figures; none by default.
            **options: The other `MemoryModel` fields (dtypes, optimizer, ...).

        Raises:
            ValueError: No stages, or a negative count.
        """
        stages = [
            chain([*head, *[layer] * n, *tail])
            for n, (head, tail) in zip(counts, _ends(counts, embedding, loss), strict=True)
        ]
        return cls(stages=tuple(stages), **options)  # type: ignore[arg-type]
