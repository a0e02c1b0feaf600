"""Errors that satisfy both worlds: ours (ValueError) and Megatron's (RuntimeError, assertions).

Code written for pp catches ``ValueError`` for bad sizes; code ported from Megatron-core
expects ``RuntimeError`` (sizes) or ``AssertionError`` (calls made too early). Each error here
inherits from both, so either ``except`` clause holds. No torch.
"""

from __future__ import annotations

__all__ = [
    "AlreadyInitializedError",
    "DistributedNotInitializedError",
    "InvalidArgumentError",
    "LayerLayoutError",
    "ParallelSizeAssertionError",
    "ParallelSizeError",
]


class ParallelSizeError(ValueError, RuntimeError):
    """Parallel sizes that do not fit the world or each other (a RuntimeError in Megatron)."""


class ParallelSizeAssertionError(ParallelSizeError, AssertionError):
    """Parallel sizes that do not fit, where Megatron asserts instead of raising.

    A `ParallelSizeError` (so a ValueError and a RuntimeError) and an AssertionError: the
    distributed-optimizer instances that do not divide a data-parallel size, expert sizes
    that do not fit an order without 'pp' last, expert and context parallel in one
    `RankGenerator`.
    """


class DistributedNotInitializedError(RuntimeError, AssertionError):
    """torch.distributed was used before ``init_process_group`` (Megatron asserts it)."""


class AlreadyInitializedError(RuntimeError, AssertionError):
    """Model parallelism initialised twice without ``destroy_model_parallel`` (Megatron asserts)."""


class InvalidArgumentError(ValueError, AssertionError):
    """Arguments that contradict each other, where Megatron asserts.

    ``partial_data_parallel`` without ``with_context_parallel``, for instance.
    """


class LayerLayoutError(ValueError):
    """A pipeline layer layout that cannot be built.

    The message names the layout text, where in it the problem lies (a character index or a
    stage number, both counted from 0) and the rule it breaks.

    Attributes:
        layout: The layout text as given (or as the counts would write it), None when the
            problem is in arguments that describe no layout yet (first/last counts).
        position: The character index in `layout`, when the problem has one.
        stage: The virtual stage, when the problem is one stage.
        rule: The rule, without the layout text in front.
    """

    def __init__(
        self,
        layout: str | None,
        rule: str,
        *,
        position: int | None = None,
        stage: int | None = None,
    ) -> None:
        self.layout = layout
        self.rule = rule
        self.position = position
        self.stage = stage
        super().__init__(rule if layout is None else f"layout {layout!r}: {rule}")

    def __reduce__(self) -> tuple[object, ...]:
        """Pickles with every attribute (errors cross process boundaries in tests and runs)."""
        return (_layer_layout_error, (self.layout, self.rule, self.position, self.stage))


def _layer_layout_error(
    layout: str | None, rule: str, position: int | None, stage: int | None
) -> LayerLayoutError:
    return LayerLayoutError(layout, rule, position=position, stage=stage)
