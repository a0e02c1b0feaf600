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
