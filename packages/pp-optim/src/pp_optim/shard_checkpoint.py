"""Which parameter parts a data-parallel rank owns, and the sharded state gathered to rank 0.

`ShardRange` describes one owned part. `gather_state` and `load_gathered_state` implement
Megatron's ``get_parameter_state_dp_zero`` / ``load_parameter_state_from_dp_zero`` for
`pp_optim.DistributedOptimizer` (the legacy ``distrib_optim.pt``): whole fp32 parameters and
optimizer state per parameter name on data-parallel rank 0, taken apart again at any
data-parallel size, one bucket at a time so no rank holds more than a bucket extra.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pp_optim.grad_buffer import DistributedDataParallel, GradBucket
from pp_optim.loss_scaling import GradScaler
from pp_state.collectives import collective

__all__ = [
    "ShardRange",
    "ShardedOptimizer",
    "gather_state",
    "load_gathered_state",
    "param_names",
    "param_sizes",
    "state_keys",
]


@dataclasses.dataclass(frozen=True)
class ShardRange:
    """The part of one model parameter this data-parallel rank owns."""

    name: str
    """``"{chunk index}.{parameter name in the chunk}"``: the same on every rank and dp size."""
    param: torch.nn.Parameter
    """The model parameter."""
    start: int
    """First owned element of the flattened parameter."""
    end: int
    """One past the last owned element."""
    main_param: torch.Tensor
    """The fp32 main shard the inner optimizer updates (a view into the parameter for an
    fp32 parameter, as in Megatron; a copy for fp16/bf16)."""
    bucket: GradBucket
    """The bucket holding the parameter."""
    bucket_start: int
    """Where the owned elements start inside the bucket."""


class ShardedOptimizer(Protocol):
    """What the gather and the load read from a `pp_optim.DistributedOptimizer`."""

    optimizer: torch.optim.Optimizer
    grad_scaler: GradScaler | None
    model_chunks: list[DistributedDataParallel]
    data_parallel_group: dist.ProcessGroup | None
    data_parallel_rank: int
    data_parallel_size: int

    def shard_ranges(self) -> list[ShardRange]:
        """This rank's parts."""
        ...


def param_names(chunks: Sequence[DistributedDataParallel]) -> dict[int, str]:
    """``"{chunk index}.{name}"`` of every parameter of the chunks, by parameter id."""
    return {
        id(param): f"{index}.{name}"
        for index, chunk in enumerate(chunks)
        for name, param in chunk.module.named_parameters()
    }


def param_sizes(chunks: Sequence[DistributedDataParallel]) -> dict[str, int]:
    """The elements of every parameter the chunks' grad buffers hold, by `param_names` name.

    What a gathered optimizer state must cover.
    """
    names = param_names(chunks)
    return {
        names[id(param)]: param.numel()
        for chunk in chunks
        for bucket in chunk.buckets
        for param, _, _ in bucket.param_ranges
    }


def state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """The per-element state tensors Adam/AdamW or SGD keep.

    Read from the hyperparameters: the same on every rank, whether it owns anything or not.
    """
    groups = optimizer.param_groups
    if isinstance(optimizer, torch.optim.SGD):
        return ["momentum_buffer"] if any(g.get("momentum", 0) for g in groups) else []
    keys = ["exp_avg", "exp_avg_sq"]
    return [*keys, "max_exp_avg_sq"] if any(g.get("amsgrad") for g in groups) else keys


def _all_max(value: float, opt: ShardedOptimizer) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    group = opt.data_parallel_group
    if group is not None and opt.data_parallel_size > 1:
        tensor = tensor.to(opt.model_chunks[0].buckets[0].data.device)
        with collective("optimizer state layout all-reduce", group=group):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())


def _saved_keys(opt: ShardedOptimizer) -> tuple[list[str], float | None]:
    """["param", state keys...] and Adam's step, agreed over data parallel."""
    mains = [shard.main_param for shard in opt.shard_ranges()]
    has_state = _all_max(float(any(main in opt.optimizer.state for main in mains)), opt)
    if not has_state:
        return ["param"], None
    steps = [
        float(opt.optimizer.state[m].get("step", -1.0)) for m in mains if m in opt.optimizer.state
    ]
    step = _all_max(max(steps, default=-1.0), opt)
    return ["param", *state_keys(opt.optimizer)], None if step < 0 else step


def _value(opt: ShardedOptimizer, shard: ShardRange, key: str) -> torch.Tensor:
    if key == "param":
        return shard.main_param
    state = opt.optimizer.state.get(shard.main_param, {})
    return state[key] if key in state else torch.zeros_like(shard.main_param)


def _local_shard(opt: ShardedOptimizer, bucket: GradBucket, key: str) -> torch.Tensor:
    """This rank's shard of `bucket` for `key`, in fp32, padding zero."""
    local = torch.zeros(bucket.shard_size, dtype=torch.float32, device=bucket.data.device)
    shard_start = bucket.shard(opt.data_parallel_rank)[0]
    for shard in opt.shard_ranges():
        if shard.bucket is bucket:
            offset = shard.bucket_start - shard_start
            local[offset : offset + shard.end - shard.start] = _value(opt, shard, key).detach()
    return local


def _gather_bucket(opt: ShardedOptimizer, local: torch.Tensor) -> torch.Tensor | None:
    """The whole bucket on data-parallel rank 0 (None elsewhere)."""
    group = opt.data_parallel_group
    if group is None or opt.data_parallel_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(opt.data_parallel_size)]
    with collective("optimizer state gather to data-parallel rank 0", group=group):
        dist.gather(
            local,
            parts if opt.data_parallel_rank == 0 else None,
            dst=dist.get_global_rank(group, 0),
            group=group,
        )
    return torch.cat(parts) if opt.data_parallel_rank == 0 else None


def gather_state(opt: ShardedOptimizer) -> dict[str, Any] | None:
    """See `pp_optim.DistributedOptimizer.gather_state_to_dp_zero`."""
    keys, step = _saved_keys(opt)
    names = param_names(opt.model_chunks)
    params: dict[str, dict[str, torch.Tensor]] = {}
    for chunk in opt.model_chunks:
        for bucket in chunk.buckets:
            for key in keys:
                whole = _gather_bucket(opt, _local_shard(opt, bucket, key))
                if whole is None:
                    continue
                for param, start, end in bucket.param_ranges:
                    params.setdefault(names[id(param)], {})[key] = whole[start:end].clone()
    if opt.data_parallel_rank != 0:
        return None
    return {
        "params": params,
        "step": step,
        "grad_scaler": None if opt.grad_scaler is None else opt.grad_scaler.state_dict(),
        "param_groups": _hyperparameters(opt.optimizer),
    }


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _problem(opt: ShardedOptimizer, state: object) -> str | None:
    """Why rank 0 refuses `state`, or None."""
    if not isinstance(state, dict) or not isinstance(state.get("params"), dict):
        return "the gathered optimizer state is not a dict with 'params'"
    sizes = param_sizes(opt.model_chunks)
    missing = sorted(set(sizes) - set(state["params"]))
    if missing:
        return f"the gathered optimizer state lacks parameters {missing}"
    for name, size in sizes.items():
        entry = state["params"][name]
        if not isinstance(entry, dict) or "param" not in entry:
            return f"the gathered optimizer state has no 'param' for {name}"
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or value.numel() != size:
                got = value.numel() if isinstance(value, torch.Tensor) else type(value).__name__
                return f"{key!r} of {name} has {got} elements; the parameter has {size}"
    if len(state.get("param_groups", [])) != len(opt.optimizer.param_groups):
        return "the gathered optimizer state is for another number of parameter groups"
    return None


def _header(opt: ShardedOptimizer, state: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's verdict, keys, step, scaler and hyperparameters, broadcast over dp."""
    header: dict[str, Any] = {}
    if opt.data_parallel_rank == 0:
        problem = _problem(opt, state)
        header = {"problem": problem}
        if problem is None and state is not None:
            first: dict[str, Any] = next(iter(state["params"].values()), {})
            header.update(
                keys=sorted(first),
                step=state.get("step"),
                grad_scaler=state.get("grad_scaler"),
                param_groups=state["param_groups"],
            )
    group = opt.data_parallel_group
    if group is not None and opt.data_parallel_size > 1:
        box = [header]
        with collective("optimizer state header broadcast", group=group):
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        header = box[0]
    return header


def _whole_bucket(
    opt: ShardedOptimizer, bucket: GradBucket, state: dict[str, Any] | None, key: str
) -> torch.Tensor:
    """The bucket's `key` values from rank 0's state, broadcast to every rank."""
    whole = torch.zeros(bucket.data.numel(), dtype=torch.float32, device=bucket.data.device)
    if opt.data_parallel_rank == 0 and state is not None:
        names = param_names(opt.model_chunks)
        for param, start, end in bucket.param_ranges:
            whole[start:end] = state["params"][names[id(param)]][key].reshape(-1)
    group = opt.data_parallel_group
    if group is not None and opt.data_parallel_size > 1:
        with collective("optimizer state broadcast from data-parallel rank 0", group=group):
            dist.broadcast(whole, src=dist.get_global_rank(group, 0), group=group)
    return whole


def _store(opt: ShardedOptimizer, shard: ShardRange, key: str, value: torch.Tensor) -> None:
    if key == "param":
        shard.main_param.copy_(value)
        return
    state = opt.optimizer.state[shard.main_param]
    if key not in state:
        state[key] = torch.zeros_like(shard.main_param)
    state[key].copy_(value)


def load_gathered_state(opt: ShardedOptimizer, state: dict[str, Any] | None) -> None:
    """See `pp_optim.DistributedOptimizer.load_state_from_dp_zero`."""
    header = _header(opt, state)
    if header["problem"] is not None:
        raise ValueError(f"data-parallel rank 0 refused the optimizer state: {header['problem']}")
    with torch.no_grad():
        for chunk in opt.model_chunks:
            for bucket in chunk.buckets:
                for key in header["keys"]:
                    whole = _whole_bucket(opt, bucket, state, key)
                    for shard in opt.shard_ranges():
                        if shard.bucket is bucket:
                            begin = shard.bucket_start
                            _store(opt, shard, key, whole[begin : begin + shard.end - shard.start])
        if header["step"] is not None:
            for shard in opt.shard_ranges():
                opt.optimizer.state[shard.main_param]["step"] = torch.tensor(
                    header["step"], dtype=torch.float32
                )
    for group, saved in zip(opt.optimizer.param_groups, header["param_groups"], strict=True):
        group.update(saved)
    if opt.grad_scaler is not None and header["grad_scaler"] is not None:
        opt.grad_scaler.load_state_dict(header["grad_scaler"])
