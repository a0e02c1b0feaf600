"""What travels between stages: tensor specs, and the header that describes them on the wire."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeAlias

import torch

__all__ = [
    "HEADER_LENGTH",
    "MAX_DIMS",
    "MAX_TENSORS",
    "ShapesArg",
    "TensorSpec",
    "decode_header",
    "describe",
    "encode_header",
    "encode_specs",
    "normalize_specs",
    "normalize_specs_cached",
]

MAX_DIMS = 8
"""Most dimensions a tensor may have when its shape travels in a header."""
MAX_TENSORS = 8
"""Most tensors one message may carry when shapes travel in a header."""
_PER_TENSOR = 2 + MAX_DIMS  # dtype code, ndim, dims
HEADER_LENGTH = 1 + MAX_TENSORS * _PER_TENSOR
"""int64 elements of a header: a fixed size, so a disagreement is reported, not mis-sized."""

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor sent between stages.

    Attributes:
        shape: The shape, or None when it is learned from the sender (variable shapes).
        dtype: The element type.
    """

    shape: tuple[int, ...] | None
    dtype: torch.dtype

    def __str__(self) -> str:
        """Like "float32 tensor of shape (4, 2, 8)"."""
        dtype = str(self.dtype).removeprefix("torch.")
        shape = "unknown shape" if self.shape is None else f"shape {self.shape}"
        return f"{dtype} tensor of {shape}"

    @property
    def numel(self) -> int:
        """Number of elements (the shape must be known)."""
        assert self.shape is not None
        count = 1
        for dim in self.shape:
            count *= dim
        return count


ShapesArg: TypeAlias = (
    Sequence[int]
    | torch.Size
    | TensorSpec
    | Sequence[Sequence[int] | torch.Size | TensorSpec | None]
    | None
)
"""One shape, a TensorSpec, or a list of them (one per tensor); None entries mean "unknown"."""


def _is_shape(value: object) -> bool:
    # () is the shape of a scalar; [] is an empty list of shapes.
    if isinstance(value, torch.Size):
        return True
    if isinstance(value, list) and not value:
        return False
    return isinstance(value, (tuple, list)) and all(
        isinstance(d, int) and not isinstance(d, bool) for d in value
    )


def _one_spec(shape: object, dtype: torch.dtype, operation: str) -> TensorSpec:
    if isinstance(shape, TensorSpec):
        return shape
    if shape is None:
        return TensorSpec(None, dtype)
    if not _is_shape(shape):
        raise TypeError(f"{operation}: a tensor shape is a sequence of ints, got {shape!r}")
    dims = tuple(int(d) for d in shape)  # type: ignore[attr-defined]
    if any(d < 0 for d in dims):
        raise ValueError(f"{operation}: shape {dims} has a negative dimension")
    return TensorSpec(dims, dtype)


def normalize_specs(
    tensor_shapes: ShapesArg,
    dtypes: torch.dtype | Sequence[torch.dtype] | None,
    default_dtype: torch.dtype,
    *,
    operation: str,
) -> tuple[list[TensorSpec], bool]:
    """Turn Megatron-style shape arguments into one spec per tensor.

    Args:
        tensor_shapes: One shape (``(seq, batch, hidden)``), a TensorSpec, or a list of them.
            None, alone or in a list, means the shape is not known up front.
        dtypes: One dtype for every tensor, or one per tensor; None takes `default_dtype`.
        default_dtype: The pipeline's dtype.
        operation: Name used in error messages.

    Returns:
        The specs, and whether the caller passed a single tensor (so it gets one back).

    Raises:
        TypeError: A shape is not a sequence of ints.
        ValueError: A negative dimension, an empty list, or as many dtypes as tensors missing.
    """
    single = (
        tensor_shapes is None or isinstance(tensor_shapes, TensorSpec) or _is_shape(tensor_shapes)
    )
    entries: list[object] = [tensor_shapes] if single else list(tensor_shapes)  # type: ignore[arg-type]
    if not entries:
        raise ValueError(f"{operation}: an empty list of shapes describes no tensor")
    if dtypes is None:
        dtype_list = [default_dtype] * len(entries)
    elif isinstance(dtypes, torch.dtype):
        dtype_list = [dtypes] * len(entries)
    else:
        dtype_list = list(dtypes)
        if len(dtype_list) != len(entries):
            raise ValueError(
                f"{operation}: {len(dtype_list)} dtypes for {len(entries)} tensors; give one dtype "
                "or one per tensor"
            )
    return [_one_spec(e, d, operation) for e, d in zip(entries, dtype_list, strict=True)], single


_SPEC_CACHE: dict[object, tuple[tuple[TensorSpec, ...], bool]] = {}
_SPEC_CACHE_LIMIT = 1024


def _freeze(value: object) -> object:
    """A hashable stand-in for a shapes or dtypes argument; TypeError when there is none."""
    if isinstance(value, (list, tuple, torch.Size)):
        return (type(value), tuple(_freeze(v) for v in value))
    hash(value)
    return value


def normalize_specs_cached(
    tensor_shapes: ShapesArg,
    dtypes: torch.dtype | Sequence[torch.dtype] | None,
    default_dtype: torch.dtype,
    *,
    operation: str,
) -> tuple[Sequence[TensorSpec], bool]:
    """`normalize_specs`, remembered for arguments seen before.

    A schedule repeats the same shapes every microbatch, and this sits on every transfer's path.
    Errors are not remembered: a bad argument raises every time.
    """
    try:
        if type(tensor_shapes) is tuple and (dtypes is None or type(dtypes) is torch.dtype):
            # The usual call (one shape as a tuple, one dtype): a tuple is immutable, so the
            # argument is its own key; no frozen form of it can look like a shape.
            key: object = (tensor_shapes, dtypes, default_dtype)
        else:
            key = (_freeze(tensor_shapes), _freeze(dtypes), default_dtype)
        found = _SPEC_CACHE.get(key)
    except TypeError:  # something unhashable inside
        return normalize_specs(tensor_shapes, dtypes, default_dtype, operation=operation)
    if found is None:
        specs, single = normalize_specs(tensor_shapes, dtypes, default_dtype, operation=operation)
        if len(_SPEC_CACHE) >= _SPEC_CACHE_LIMIT:
            _SPEC_CACHE.clear()
        found = _SPEC_CACHE[key] = (tuple(specs), single)
    return found


def encode_header(tensors: Sequence[torch.Tensor], operation: str) -> torch.Tensor:
    """A fixed-size int64 header describing `tensors` (count, then dtype and shape of each).

    Raises:
        ValueError: Too many tensors or dimensions, or a dtype that cannot travel.
    """
    return encode_specs([TensorSpec(tuple(t.shape), t.dtype) for t in tensors], operation)


def encode_specs(specs: Sequence[TensorSpec], operation: str) -> torch.Tensor:
    """A header describing `specs`; an unknown shape travels as ndim -1.

    Raises:
        ValueError: Too many tensors or dimensions, or a dtype that cannot travel.
    """
    if len(specs) > MAX_TENSORS:
        raise ValueError(f"{operation}: {len(specs)} tensors in one message; at most {MAX_TENSORS}")
    header = [0] * HEADER_LENGTH
    header[0] = len(specs)
    for index, spec in enumerate(specs):
        ndim = -1 if spec.shape is None else len(spec.shape)
        if ndim > MAX_DIMS:
            raise ValueError(
                f"{operation}: a {ndim}-d tensor; at most {MAX_DIMS} dimensions travel"
            )
        if spec.dtype not in _CODE:
            names = ", ".join(str(d).removeprefix("torch.") for d in _DTYPES)
            raise ValueError(f"{operation}: dtype {spec.dtype} cannot travel; use one of {names}")
        base = 1 + index * _PER_TENSOR
        header[base] = _CODE[spec.dtype]
        header[base + 1] = ndim
        if spec.shape is not None:
            header[base + 2 : base + 2 + ndim] = list(spec.shape)
    return torch.tensor(header, dtype=torch.int64)


def decode_header(header: torch.Tensor) -> list[TensorSpec]:
    """The specs a header describes (ndim -1: an unknown shape)."""
    values = header.tolist()
    specs = []
    for index in range(int(values[0])):
        base = 1 + index * _PER_TENSOR
        ndim = int(values[base + 1])
        shape = None if ndim < 0 else tuple(int(d) for d in values[base + 2 : base + 2 + ndim])
        specs.append(TensorSpec(shape, _DTYPES[int(values[base])]))
    return specs


def describe(specs: Sequence[TensorSpec]) -> str:
    """Specs in words, for error messages."""
    if len(specs) == 1:
        text = str(specs[0])
        return f"{'an' if text[0] in 'aeiou' else 'a'} {text}"
    return "[" + ", ".join(str(spec) for spec in specs) + "]"
