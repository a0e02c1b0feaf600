"""`broadcast_data`: one rank of a tensor-parallel group reads a batch, every rank gets it.

Only tensor-parallel rank 0 needs the data (the others pass anything, even None); it sends
the sizes first, then every tensor packed into one flat buffer, so a batch costs two
broadcasts whatever its number of keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from pp_state.collectives import collective, collective_device
from pp_tensor.utils import tp_rank

__all__ = ["MAX_DATA_DIM", "broadcast_data"]

MAX_DATA_DIM = 5
"""Megatron's bound: a broadcast tensor has fewer dimensions than this."""


def _sizes_of(
    keys: Sequence[str], data: Mapping[str, torch.Tensor] | None, datatype: torch.dtype
) -> list[int]:
    """Rank 0's tensors' shapes, each padded with zeros to `MAX_DATA_DIM` numbers."""
    if data is None:
        raise ValueError("broadcast_data: tensor-parallel rank 0 needs the data, got None")
    sizes: list[int] = []
    for key in keys:
        if key not in data:
            raise ValueError(f"broadcast_data: key {key!r} is not in the data ({sorted(data)})")
        tensor = data[key]
        if tensor.dtype != datatype:
            raise ValueError(
                f"broadcast_data: {key!r} has dtype {tensor.dtype}, the call says {datatype}"
            )
        if tensor.dim() >= MAX_DATA_DIM:
            raise ValueError(
                f"broadcast_data: {key!r} has {tensor.dim()} dimensions; at most {MAX_DATA_DIM - 1}"
            )
        sizes += [*tensor.shape, *[0] * (MAX_DATA_DIM - tensor.dim())]
    return sizes


def _src(tp_group: dist.ProcessGroup) -> int:
    return dist.get_global_rank(tp_group, 0)


def broadcast_data(
    keys: Sequence[str],
    data: Mapping[str, torch.Tensor] | None,
    datatype: torch.dtype,
    *,
    tp_group: dist.ProcessGroup | None,
) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank 0's ``data[key]`` for each key, on every rank of `tp_group`.

    Args:
        keys: The keys to send, in the same order on every rank.
        data: Rank 0's tensors by key (ignored elsewhere), all of dtype `datatype`.
        datatype: Their dtype.
        tp_group: The tensor-parallel group (None: `data`'s tensors, checked, as they are).

    Returns:
        The tensors by key, on the group's device (CPU for gloo, the current GPU for NCCL).

    Raises:
        ValueError: On rank 0: a key missing, a dtype other than `datatype`, `MAX_DATA_DIM`
            dimensions or more.
    """
    if tp_group is None:  # nothing to send: rank 0's tensors, checked
        _sizes_of(keys, data, datatype)
        assert data is not None
        return {key: data[key] for key in keys}
    device = collective_device(tp_group)
    first = tp_rank(tp_group) == 0
    sizes = torch.tensor(
        _sizes_of(keys, data, datatype) if first else [0] * (MAX_DATA_DIM * len(keys)),
        dtype=torch.int64,
        device=device,
    )
    with collective("broadcast_data sizes", group=tp_group):
        dist.broadcast(sizes, _src(tp_group), group=tp_group)
    shapes = [
        [int(n) for n in sizes[i * MAX_DATA_DIM : (i + 1) * MAX_DATA_DIM] if n > 0]
        for i in range(len(keys))
    ]
    if first and keys:
        assert data is not None
        flat = torch.cat([data[key].to(device).reshape(-1) for key in keys])
    else:
        total = sum(int(torch.Size(shape).numel()) for shape in shapes)
        flat = torch.empty(total, dtype=datatype, device=device)
    with collective("broadcast_data", group=tp_group):
        dist.broadcast(flat, _src(tp_group), group=tp_group)
    out, offset = {}, 0
    for key, shape in zip(keys, shapes, strict=True):
        numel = int(torch.Size(shape).numel())
        out[key] = flat.narrow(0, offset, numel).view(shape)
        offset += numel
    return out
