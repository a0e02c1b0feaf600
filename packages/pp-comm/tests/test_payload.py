"""Shape arguments and the header that carries shapes on the wire (no processes)."""

from __future__ import annotations

import datetime

import pytest
import torch

from pp_comm import CommConfig, TensorSpec
from pp_comm.payload import (
    HEADER_LENGTH,
    MAX_DIMS,
    MAX_TENSORS,
    decode_header,
    encode_header,
    normalize_specs,
)


def test_one_shape_gives_one_spec_and_asks_for_one_tensor_back() -> None:
    specs, single = normalize_specs((4, 2, 8), None, torch.bfloat16, operation="op")
    assert specs == [TensorSpec((4, 2, 8), torch.bfloat16)]
    assert single
    specs, single = normalize_specs(torch.Size([3]), torch.int64, torch.float32, operation="op")
    assert specs == [TensorSpec((3,), torch.int64)]
    assert single


def test_a_list_of_shapes_gives_a_list_with_a_dtype_each() -> None:
    specs, single = normalize_specs(
        [(4, 2), [5]], [torch.float16, torch.int32], torch.float32, operation="op"
    )
    assert specs == [TensorSpec((4, 2), torch.float16), TensorSpec((5,), torch.int32)]
    assert not single
    specs, single = normalize_specs([None, (1,)], None, torch.float32, operation="op")
    assert specs == [TensorSpec(None, torch.float32), TensorSpec((1,), torch.float32)]
    assert not single


def test_none_is_one_tensor_of_unknown_shape() -> None:
    assert normalize_specs(None, None, torch.float32, operation="op") == (
        [TensorSpec(None, torch.float32)],
        True,
    )


def test_scalar_shape_is_a_shape() -> None:
    assert normalize_specs((), None, torch.float32, operation="op") == (
        [TensorSpec((), torch.float32)],
        True,
    )


@pytest.mark.parametrize(
    ("shapes", "dtypes", "error", "message"),
    [
        ([], None, ValueError, "recv_forward: an empty list of shapes describes no tensor"),
        ([(1,), (2,)], [torch.float32], ValueError, "recv_forward: 1 dtypes for 2 tensors"),
        ((4, -1), None, ValueError, r"recv_forward: shape \(4, -1\) has a negative dimension"),
        ([(1,), "x"], None, TypeError, "a tensor shape is a sequence of ints, got 'x'"),
    ],
)
def test_bad_shape_arguments(
    shapes: object, dtypes: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        normalize_specs(shapes, dtypes, torch.float32, operation="recv_forward")  # type: ignore[arg-type]


def test_header_round_trips_shapes_and_dtypes() -> None:
    tensors = [
        torch.zeros(3, 1, 4),
        torch.zeros(7, dtype=torch.bfloat16),
        torch.zeros((), dtype=torch.int64),
    ]
    header = encode_header(tensors, "op")
    assert header.shape == (HEADER_LENGTH,)
    assert header.dtype == torch.int64
    assert decode_header(header) == [
        TensorSpec((3, 1, 4), torch.float32),
        TensorSpec((7,), torch.bfloat16),
        TensorSpec((), torch.int64),
    ]


def test_header_limits_are_errors_not_truncation() -> None:
    with pytest.raises(ValueError, match=f"9 tensors in one message; at most {MAX_TENSORS}"):
        encode_header([torch.zeros(1)] * 9, "op")
    with pytest.raises(ValueError, match=f"a 9-d tensor; at most {MAX_DIMS} dimensions"):
        encode_header([torch.zeros([1] * 9)], "op")
    with pytest.raises(
        ValueError, match=r"dtype torch\.complex64 cannot travel; use one of float32"
    ):
        encode_header([torch.zeros(2, dtype=torch.complex64)], "op")


def test_spec_reads_well_in_messages() -> None:
    assert str(TensorSpec((4, 2), torch.bfloat16)) == "bfloat16 tensor of shape (4, 2)"
    assert str(TensorSpec(None, torch.float32)) == "float32 tensor of unknown shape"


def test_config_validates_up_front() -> None:
    with pytest.raises(TypeError, match=r"pipeline_dtype must be a torch\.dtype, got 'float32'"):
        CommConfig(pipeline_dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"timeout must be a datetime\.timedelta, got 5"):
        CommConfig(timeout=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be positive"):
        CommConfig(timeout=datetime.timedelta(0))
