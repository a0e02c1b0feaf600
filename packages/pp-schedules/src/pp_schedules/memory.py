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
    "format_bytes",
    "stage_ends",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the parameter and gradient dtypes the model knows."""

OPTIMIZERS = ("adam", "sgd")
"""Optimizer kinds (pp-optim's ``OptimizerConfig.optimizer``)."""

_GB = 1024**3
_T = TypeVar("_T")


def format_bytes(count: float) -> str:
    """`count` bytes in binary units as torch's allocator reports: ``"1.25 GB"``, ``"3.4 MB"``."""
    for unit, size in (("GB", _GB), ("MB", 2**20), ("KB", 2**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}" if unit == "GB" else f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


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
    """The memory figures of one virtual stage (one model chunk).

    Attributes:
        parameters: Parameters the chunk holds (a tied copy of the word embedding on the last
            stage counts: it is a parameter of its own there).
        activation_bytes: Bytes one microbatch's forward saves for backward (parameters
            excluded), held until that microbatch's last backward step on the chunk. With
            recomputation these are the checkpointed inputs and whatever is not recomputed.
        recompute_bytes: The most bytes a backward step holds on top while it recomputes a
            checkpointed segment (that segment's saved tensors); 0 without recomputation.
            Transient: it counts toward the peak during the step only.
    """

    parameters: int
    activation_bytes: int
    recompute_bytes: int = 0

    def __post_init__(self) -> None:
        """Counts are whole numbers, none negative.

        Raises:
            ValueError: A negative or non-integral figure.
        """
        figures = (self.parameters, self.activation_bytes, self.recompute_bytes)
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in figures):
            raise ValueError(
                "stage memory figures must be whole numbers 0 or more, got "
                f"parameters={self.parameters!r}, activation_bytes={self.activation_bytes!r}, "
                f"recompute_bytes={self.recompute_bytes!r}"
            )


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
    """

    stages: tuple[StageMemory, ...]
    params_dtype: str = "fp32"
    grad_dtype: str | None = None
    optimizer: str = "adam"
    sgd_momentum: bool = True
    data_parallel_size: int = 1
    distributed_optimizer: bool = False

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
        output layer and loss; each stage's figures are the sums of what it holds (a chunk's
        saved tensors are the union of its parts', which do not share storage). The largest
        recompute transient of a stage's parts is its `recompute_bytes`.

        Args:
            counts: Transformer layers of each virtual stage, in pipeline order.
            layer: One transformer layer's figures.
            embedding: The embedding's figures; none by default.
            loss: The output layer's and loss's figures; none by default.
            **options: The other `MemoryModel` fields (dtypes, optimizer, ...).

        Raises:
            ValueError: No stages, or a negative count.
        """
        stages = []
        for n, ends in zip(counts, stage_ends(counts, embedding, loss), strict=True):
            parts = [(layer, n)] + [(part, 1) for part in ends]
            stages.append(
                StageMemory(
                    parameters=sum(p.parameters * k for p, k in parts),
                    activation_bytes=sum(p.activation_bytes * k for p, k in parts),
                    recompute_bytes=max((p.recompute_bytes for p, k in parts if k), default=0),
                )
            )
        return cls(stages=tuple(stages), **options)  # type: ignore[arg-type]
