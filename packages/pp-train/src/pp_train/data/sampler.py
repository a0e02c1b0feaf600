"""Megatron's pretraining sample order over any dataset of samples.

`microbatches` walks global sample indices from a count of consumed samples the way
Megatron's pretraining sampler does, so the data a run sees depends only on that count: a
run resumed from a checkpoint continues with the microbatches an unbroken run would have
seen, whatever the data-parallel size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from pp_state.numbers import check_int, is_int

__all__ = ["Microbatch", "SampleDataset", "microbatches"]

Microbatch = dict[str, torch.Tensor]


class SampleDataset(Protocol):
    """Samples by global index: ``{"tokens": [seq] int64, "labels": [seq] int64, ...}``.

    Every sample of a dataset holds the same keys (a GPT dataset adds ``loss_mask``,
    ``position_ids`` and maybe ``document_ids``); a microbatch stacks each of them.
    """

    def __getitem__(self, index: int) -> Microbatch:
        """Sample `index` (0 or more)."""


def microbatches(
    dataset: SampleDataset,
    *,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
) -> Iterator[Microbatch]:
    """This data-parallel rank's microbatches, in Megatron's pretraining sampler order.

    Global sample indices are walked from `consumed_samples` in chunks of
    ``micro_batch_size * data_parallel_size``; rank ``r`` takes indices
    ``[r * micro_batch_size, (r + 1) * micro_batch_size)`` of each chunk. The iterator never
    ends (the dataset wraps into later epochs).

    Args:
        dataset: The samples.
        consumed_samples: Samples the whole job has already trained on (0 for a fresh run).
        micro_batch_size: Samples per microbatch on each rank.
        data_parallel_rank: This rank's index in its data-parallel group.
        data_parallel_size: Ranks in the data-parallel group.

    Returns:
        An infinite iterator of ``{"tokens": [mbs, seq], "labels": [mbs, seq]}`` int64, plus
        every other key of the samples, each stacked along a new first dimension.

    Raises:
        TypeError: An argument is not an int.
        ValueError: A size is below 1, `consumed_samples` is negative, or the rank is outside
            ``0 .. data_parallel_size - 1``.
    """
    check_int("consumed_samples", consumed_samples, 0)
    check_int("micro_batch_size", micro_batch_size, 1)
    check_int("data_parallel_size", data_parallel_size, 1)
    if not is_int(data_parallel_rank):
        raise TypeError(f"data_parallel_rank must be an int, got {data_parallel_rank!r}")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(
            f"data_parallel_rank {data_parallel_rank} is out of range for data-parallel size "
            f"{data_parallel_size}; valid: 0 .. {data_parallel_size - 1}"
        )
    # Checked above, iterated lazily below: a generator function would defer the errors.
    return _walk(
        dataset,
        start=consumed_samples + data_parallel_rank * micro_batch_size,
        micro_batch_size=micro_batch_size,
        stride=micro_batch_size * data_parallel_size,
    )


def _walk(
    dataset: SampleDataset, *, start: int, micro_batch_size: int, stride: int
) -> Iterator[Microbatch]:
    while True:
        samples = [dataset[start + i] for i in range(micro_batch_size)]
        yield {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
        start += stride
