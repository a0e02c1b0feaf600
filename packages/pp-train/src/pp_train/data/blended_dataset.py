"""Megatron's blend: samples drawn from several datasets in proportion to their weights."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy
import numpy.typing as npt

from pp_state.numbers import check_int
from pp_train.data.cache import cached_or_built
from pp_train.data.config import normalize
from pp_train.data.gpt_dataset import GPTDataset
from pp_train.data.sampler import Microbatch

__all__ = ["BlendedDataset", "build_blending_indices"]


def build_blending_indices(
    weights: Sequence[float], size: int
) -> tuple[npt.NDArray[numpy.int16], npt.NDArray[numpy.int64]]:
    """Which dataset, and which of its samples, each of `size` blended samples is.

    Sample ``n`` comes from the dataset furthest behind its share: the first ``i`` with the
    largest ``weights[i] * max(n, 1) - taken[i]``; it takes that dataset's next sample.

    Args:
        weights: Normalized weights, one per dataset.
        size: Blended samples.

    Returns:
        The dataset index and the per-dataset sample index, `size` long each.
    """
    taken = [0] * len(weights)
    weight_list = [float(w) for w in weights]
    dataset_index = numpy.zeros(size, dtype=numpy.int16)
    sample_index = numpy.zeros(size, dtype=numpy.int64)
    for n in range(size):
        scale = float(max(n, 1))
        best, best_error = 0, weight_list[0] * scale - taken[0]
        for i in range(1, len(weight_list)):
            error = weight_list[i] * scale - taken[i]
            if error > best_error:
                best, best_error = i, error
        dataset_index[n] = best
        sample_index[n] = taken[best]
        taken[best] += 1
    return dataset_index, sample_index


def _check_blend(datasets: Sequence[GPTDataset], weights: Sequence[float], size: int) -> None:
    """Refuses what would divide by zero or index nothing later, naming the numbers."""
    if not datasets:
        raise ValueError("a blend needs at least one dataset, got none")
    values = [float(w) for w in weights]
    if len(values) != len(datasets):
        raise ValueError(f"a blend needs one weight per dataset: {len(datasets)} datasets, "
                         f"{len(values)} weights {values}")  # fmt: skip
    if not all(0.0 <= w < math.inf for w in values) or not sum(values) > 0.0:
        raise ValueError(f"blend weights must be finite, 0 or more and not all 0, got {values}")
    check_int("size", size, 0)


class BlendedDataset:
    """`size` samples drawn from `datasets` in proportion to `weights`, as Megatron's.

    Args:
        datasets: The datasets (one split of each).
        weights: Their weights (normalized here).
        size: Samples in the blend.
        cache_dir: Where the blending indices are cached (None: not cached).

    Raises:
        ValueError: No datasets, not one weight per dataset, a weight negative or not
            finite, weights adding up to 0, a negative `size`, or a blend that needs more
            samples of a dataset than it has.
    """

    def __init__(
        self,
        datasets: Sequence[GPTDataset],
        weights: Sequence[float],
        size: int,
        *,
        cache_dir: Path | None = None,
    ) -> None:
        _check_blend(datasets, weights, size)
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = size
        key: dict[str, Any] = {
            "class": "BlendedDataset",
            "datasets": [(d.indexed.path_prefix, d.split_name, len(d)) for d in self.datasets],
            "weights": self.weights,
            "size": size,
        }
        split_name = self.datasets[0].split_name

        def build() -> list[Any]:
            return list(build_blending_indices(self.weights, size))

        names = ("dataset_index", "dataset_sample_index")
        self.dataset_index, self.dataset_sample_index = cached_or_built(
            cache_dir, f"BlendedDataset-{split_name}", names, key, build
        )
        self._check_sizes()

    def _check_sizes(self) -> None:
        counts = numpy.bincount(
            numpy.asarray(self.dataset_index, dtype=numpy.int64), minlength=len(self.datasets)
        )
        for number, (dataset, count) in enumerate(zip(self.datasets, counts, strict=True)):
            if count > len(dataset):
                raise ValueError(
                    f"the {dataset.split_name} blend takes {count} samples from dataset "
                    f"{number} ({dataset.indexed.path_prefix}), which has {len(dataset)}; "
                    "raise mid_level_dataset_surplus (--mid-level-dataset-surplus)"
                )

    def __len__(self) -> int:
        """The number of samples."""
        return self.size

    def host_bytes(self) -> int:
        """Host memory its blending indices and its datasets' indices hold."""
        own = int(self.dataset_index.nbytes) + int(self.dataset_sample_index.nbytes)
        return own + sum(dataset.host_bytes() for dataset in self.datasets)

    def __getitem__(self, index: int) -> Microbatch:
        """Blended sample `index`: its dataset's sample (``tokens``, ``labels``, masks)."""
        dataset, sample = self._locate(index)
        return dataset[sample]

    def window(self, index: int) -> npt.NDArray[numpy.int64]:
        """Blended sample `index`'s ``seq_length + 1`` tokens."""
        dataset, sample = self._locate(index)
        return dataset.window(sample)

    def _locate(self, index: int) -> tuple[GPTDataset, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} is out of range for {self.size} samples")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset, int(self.dataset_sample_index[index])
