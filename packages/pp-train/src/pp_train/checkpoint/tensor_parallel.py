"""Tensor-parallel parts of a tensor in a torch_dist checkpoint: where each lies in the whole.

A parameter a tensor-parallel layer splits carries Megatron's attributes
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``): tensor-parallel rank
``r`` of ``t`` holds the ``r``-th of ``t`` contiguous equal parts along ``partition_dim``
(`TensorSplit`). A save writes each part at its offsets in the whole tensor, so the checkpoint
holds every whole tensor once under its global key; a load reads the part of the whole its own
split asks for (`Box`), from whatever parts the saving run wrote. Tensors nobody split are
written whole, as at tensor-parallel size 1.

The word embedding and the output layer have one row per token of the padded vocabulary,
which depends on the tensor-parallel size (Megatron pads to a multiple of
``--make-vocab-size-divisible-by`` times it). When the saved and the loading run pad
differently (`VocabResize`), their rows are trimmed, or padded with zero rows, to this run's
padded size; the rows of real tokens are read unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pp_train.checkpoint.errors import listed
from pp_train.checkpoint.keys import (
    FP32_PARAM_PREFIX,
    MODEL_PREFIX,
    OPTIMIZER_STATE_PREFIX,
    chunk_global_keys,
)
from pp_train.wrappers import unwrap_model

__all__ = [
    "Box",
    "RegionRead",
    "TensorSplit",
    "VocabResize",
    "assemble",
    "coverage_gap",
    "name_of_key",
    "plan_region",
    "save_chunks",
    "tensor_splits",
]


@dataclasses.dataclass(frozen=True)
class Box:
    """A block of a whole tensor: its first index and extent along every dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Its number of elements."""
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The block both hold, or None when they share no element."""
        starts = [max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True)]
        ends = [
            min(a + n, b + m)
            for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        ]
        if any(end <= start for start, end in zip(starts, ends, strict=True)):
            return None
        return Box(tuple(starts), tuple(e - s for s, e in zip(starts, ends, strict=True)))


@dataclasses.dataclass(frozen=True)
class TensorSplit:
    """Where one rank's part of a tensor lies in the whole (Megatron's contiguous split)."""

    dim: int
    """The dimension it is split along; -1 when every rank holds it whole."""
    rank: int
    """This rank's part (its tensor-parallel rank)."""
    size: int
    """The number of parts (the tensor-parallel size)."""
    local_shape: tuple[int, ...]
    """The shape of this rank's part."""

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape."""
        if self.dim < 0:
            return self.local_shape
        shape = list(self.local_shape)
        shape[self.dim] *= self.size
        return tuple(shape)

    @property
    def box(self) -> Box:
        """This rank's part as a block of the whole tensor."""
        offsets = [0] * len(self.local_shape)
        if self.dim >= 0:
            offsets[self.dim] = self.rank * self.local_shape[self.dim]
        return Box(tuple(offsets), self.local_shape)

    @property
    def is_split(self) -> bool:
        """Whether the ranks hold different parts (split, over more than one rank)."""
        return self.dim >= 0 and self.size > 1


def _split_dim(tensor: torch.Tensor, where: str) -> int:
    """The tensor's ``partition_dim`` when a tensor-parallel layer split it, else -1.

    Raises:
        ValueError: A stride other than 1 (interleaved parts), or a dimension it lacks.
    """
    if not getattr(tensor, "tensor_model_parallel", False):
        return -1
    dim, stride = getattr(tensor, "partition_dim", -1), getattr(tensor, "partition_stride", 1)
    if stride != 1:
        raise ValueError(
            f"{where} has partition_stride {stride}; checkpoints take contiguous tensor-parallel "
            "parts only (partition_stride 1)"
        )
    if not isinstance(dim, int) or not 0 <= dim < tensor.dim():
        raise ValueError(
            f"{where} is marked tensor_model_parallel with partition_dim {dim!r}; its shape "
            f"{tuple(tensor.shape)} has dimensions 0 .. {tensor.dim() - 1}"
        )
    return dim


def tensor_splits(model: Sequence[torch.nn.Module], rank: int, size: int) -> dict[str, TensorSplit]:
    """Each global name of the chunks' ``state_dict`` with this rank's split of it.

    Read from the tensors' own attributes, so any model whose tensor-parallel layers mark
    their parameters (pp-tensor's do) is covered.

    Args:
        model: This rank's chunks (wrappers unwrapped).
        rank: This rank's tensor-parallel rank.
        size: The tensor-parallel size.

    Raises:
        ValueError: A tensor's marks are not a contiguous split along one of its dimensions.
    """
    splits: dict[str, TensorSplit] = {}
    for index, chunk in enumerate(model):
        state = unwrap_model(chunk).state_dict(keep_vars=True)
        for local, name in chunk_global_keys(chunk, index).items():
            tensor = state[local]
            dim = _split_dim(tensor, f"{name} (chunk {index}'s {local})")
            splits.setdefault(name, TensorSplit(dim, rank, size, tuple(tensor.shape)))
    return splits


def name_of_key(key: str) -> str | None:
    """The global name a model or (whole) optimizer key belongs to; None for other keys."""
    if key.startswith(MODEL_PREFIX):
        return key[len(MODEL_PREFIX) :]
    if key.startswith(FP32_PARAM_PREFIX):
        return key[len(FP32_PARAM_PREFIX) :]
    if key.startswith(OPTIMIZER_STATE_PREFIX):
        return key[len(OPTIMIZER_STATE_PREFIX) :].rpartition(".")[0]
    return None


def save_chunks(
    tensors: Mapping[str, Any], splits: Mapping[str, TensorSplit]
) -> dict[str, tuple[Box, tuple[int, ...]]]:
    """The keys of `tensors` that are one rank's part: their block and the whole's shape.

    A model tensor, and the optimizer state and fp32 copy of a split parameter (shaped like
    it), are parts; scalars and tensors of other shapes are whole.
    """
    chunks: dict[str, tuple[Box, tuple[int, ...]]] = {}
    for key, value in tensors.items():
        name = name_of_key(key)
        split = None if name is None else splits.get(name)
        if split is None or not split.is_split or not isinstance(value, torch.Tensor):
            continue
        if tuple(value.shape) == split.local_shape:
            chunks[key] = (split.box, split.full_shape)
    return chunks


@dataclasses.dataclass(frozen=True)
class VocabResize:
    """The padded vocabulary of the saving and of the loading run, when they differ."""

    saved: int
    """Rows of the saved word embedding and output layer."""
    current: int
    """Rows this run's have."""
    vocab_size: int
    """Rows of real tokens (the tokenizer's vocabulary): read unchanged."""

    @staticmethod
    def between(saved_args: Mapping[str, Any], args: Mapping[str, Any]) -> VocabResize | None:
        """From the runs' ``padded_vocab_size`` (``vocab_size`` when absent); None if equal."""
        vocab = saved_args.get("vocab_size")
        saved = saved_args.get("padded_vocab_size", vocab)
        current = args.get("padded_vocab_size", args.get("vocab_size"))
        if not (isinstance(vocab, int) and isinstance(saved, int) and isinstance(current, int)):
            return None
        if saved == current or vocab > min(saved, current):
            return None
        return VocabResize(saved, current, vocab)

    def applies(self, saved_shape: tuple[int, ...], full_shape: tuple[int, ...]) -> bool:
        """Whether a tensor of `saved_shape` becomes `full_shape` by its rows alone."""
        return (
            len(saved_shape) == len(full_shape) >= 1
            and saved_shape[1:] == full_shape[1:]
            and (saved_shape[0], full_shape[0]) == (self.saved, self.current)
        )

    def note(self) -> str:
        """The line a load reports once."""
        how = "rows trimmed" if self.current < self.saved else "rows padded with zeros"
        return (
            f"padded vocabulary {self.saved} -> {self.current}: {how} (the {self.vocab_size} "
            "rows of real tokens unchanged)"
        )


@dataclasses.dataclass(frozen=True)
class RegionRead:
    """What a load reads of one saved tensor, and the shape of the part it fills."""

    key: str
    box: Box | None
    """The block of the saved tensor read; None when nothing is (rows of padding only)."""
    local_shape: tuple[int, ...]
    """The part it fills: the block from its first row, zeros after."""
    dtype: torch.dtype
    resized: bool
    """Whether the rows were trimmed or padded (`VocabResize`)."""

    def buffer(self) -> torch.Tensor | None:
        """An empty tensor for DCP to read the block into (None: nothing to read)."""
        return None if self.box is None else torch.empty(self.box.sizes, dtype=self.dtype)


def plan_region(
    key: str,
    entry: TensorStorageMetadata,
    split: TensorSplit,
    resize: VocabResize | None,
) -> RegionRead:
    """The block of saved tensor `key` that fills this rank's part `split`.

    Raises:
        ValueError: The saved tensor has another shape (and is no resized vocabulary), or
            its saved chunks do not cover the block (the message names both ranges).
    """
    saved, full = tuple(entry.size), split.full_shape
    resized = saved != full and resize is not None and resize.applies(saved, full)
    if saved != full and not resized:
        raise ValueError(f"{key}: expected shape {full}, found {saved}")
    box: Box | None = split.box
    if resized:
        assert box is not None
        box = box.intersect(Box((0,) * len(saved), saved))
    if box is not None:
        gap = coverage_gap(key, entry, box)
        if gap is not None:
            raise ValueError(gap)
    return RegionRead(key, box, split.local_shape, entry.properties.dtype, resized)


def assemble(read: RegionRead, buffer: torch.Tensor | None) -> torch.Tensor:
    """This rank's part: the block read, and zero rows where the saved vocabulary ended."""
    if buffer is not None and tuple(buffer.shape) == read.local_shape:
        return buffer
    local = torch.zeros(read.local_shape, dtype=read.dtype)
    if buffer is not None:
        local[: buffer.shape[0]] = buffer
    return local


def _intervals(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`spans` merged where they touch or overlap, in order."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _missing(want: tuple[int, int], have: list[tuple[int, int]]) -> list[tuple[int, int]]:
    gaps, reached = [], want[0]
    for start, end in have:
        if start > reached:
            gaps.append((reached, min(start, want[1])))
        reached = max(reached, end)
    if reached < want[1]:
        gaps.append((reached, want[1]))
    return [gap for gap in gaps if gap[0] < gap[1]]


def _spans(spans: list[tuple[int, int]]) -> str:
    if not spans:
        return "nothing"
    return listed([f"[{start}, {end})" for start, end in spans])[1:-1]


def coverage_gap(
    key: str,
    entry: TensorStorageMetadata,
    box: Box,
    absent: Sequence[tuple[int, ...]] = (),
) -> str | None:
    """What of `box` no saved chunk of `key` holds, in words; None when it is all there.

    Args:
        key: The saved tensor's key.
        entry: Its ``.metadata`` entry (the whole shape and the saved chunks).
        box: The block wanted.
        absent: Offsets of chunks whose file is missing (they count as not saved).
    """
    lost = set(absent)
    chunks = [c for c in entry.chunks if tuple(c.offsets) not in lost]
    pieces = [
        piece
        for chunk in chunks
        if (piece := Box(tuple(chunk.offsets), tuple(chunk.sizes)).intersect(box)) is not None
    ]
    if sum(piece.numel for piece in pieces) >= box.numel:
        return None
    shape = tuple(entry.size)
    split = [d for d in range(len(shape)) if any(c.sizes[d] != shape[d] for c in entry.chunks)]
    if len(split) != 1:
        covered = sum(piece.numel for piece in pieces)
        return (
            f"{key} (shape {shape}): its saved chunks hold {covered} of the {box.numel} "
            "elements needed; a shard file is missing or the save wrote only some parts"
        )
    d = split[0]
    have = _intervals([(p.offsets[d], p.offsets[d] + p.sizes[d]) for p in pieces])
    want = (box.offsets[d], box.offsets[d] + box.sizes[d])
    return (
        f"{key} (shape {shape}, split along dimension {d}): [{want[0]}, {want[1]}) of "
        f"dimension {d} is needed, its saved chunks cover {_spans(have)}, missing "
        f"{_spans(_missing(want, have))} (a shard file is missing or the save wrote only some "
        "tensor-parallel parts)"
    )
