"""Errors that satisfy both worlds: ours (ValueError) and Megatron's (RuntimeError, assertions).

Code written for pp catches ``ValueError`` for bad sizes; code ported from Megatron-core
expects ``RuntimeError`` (sizes) or ``AssertionError`` (calls made too early). Each error here
inherits from both, so either ``except`` clause holds. No torch.
"""

from __future__ import annotations

__all__ = ["AlreadyInitializedError", "DistributedNotInitializedError", "ParallelSizeError"]


class ParallelSizeError(ValueError, RuntimeError):
    """Parallel sizes that do not fit the world or each other (a RuntimeError in Megatron)."""


class DistributedNotInitializedError(RuntimeError, AssertionError):
    """torch.distributed was used before ``init_process_group`` (Megatron asserts it)."""


class AlreadyInitializedError(RuntimeError, AssertionError):
    """Model parallelism initialised twice without ``destroy_model_parallel`` (Megatron asserts)."""
