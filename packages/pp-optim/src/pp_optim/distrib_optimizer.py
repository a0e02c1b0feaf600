"""Megatron's distributed optimizer (ZeRO-1): fp32 parameters and optimizer state sharded over dp.

`DistributedDataParallel` with ``use_distributed_optimizer`` pads every bucket to a multiple of
the data-parallel size and gives rank r the contiguous shard r of each bucket. This optimizer
keeps, for the parts of parameters inside this rank's shards only, fp32 main parameters and the
inner optimizer's state: 1/dp of the non-distributed optimizer's bytes. A step reads the reduced
gradient shards from the grad buffer, unscales and checks them (found-inf reduced over data
parallel and model parallel, so every shard agrees), clips with the norm over all shards, runs
the inner optimizer on the shards, writes them back into the parameter buffer and all-gathers it
bucket by bucket (asynchronously with ``overlap_param_gather``: the next forward waits per
module). Only elementwise updates give the same result sharded: Adam, AdamW and SGD.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pp_optim.grad_buffer import DistributedDataParallel, GradBucket
from pp_optim.loss_scaling import GradScaler
from pp_optim.optimizer import (
    MegatronOptimizer,
    OptimizerConfig,
    copy_layout_attributes,
    zero_grads,
)
from pp_optim.shard_checkpoint import ShardRange, gather_state, load_gathered_state, param_names

__all__ = ["ELEMENTWISE_OPTIMIZERS", "DistributedOptimizer", "ShardRange"]

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
)
"""Inner optimizers whose update of an element depends on that element alone, so a shard
stepped on its own equals the same elements of a whole step."""


def _check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(f"torch.optim.{kind.__name__}" for kind in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(
            f"DistributedOptimizer shards the optimizer state over data-parallel ranks, which is"
            f" exact only for elementwise updates; got {type(optimizer).__qualname__}"
            f" ({type(optimizer).__module__}); use one of {names}"
        )


def _check_chunks(chunks: Sequence[torch.nn.Module]) -> list[DistributedDataParallel]:
    checked = []
    for index, chunk in enumerate(chunks):
        if not (
            isinstance(chunk, DistributedDataParallel) and chunk.config.use_distributed_optimizer
        ):
            raise ValueError(
                f"model chunk {index} is a {type(chunk).__name__}; DistributedOptimizer needs"
                " every chunk wrapped in DistributedDataParallel with"
                " DDPConfig(use_distributed_optimizer=True) (--use-distributed-optimizer)"
            )
        checked.append(chunk)
    if not checked:
        raise ValueError("DistributedOptimizer needs at least one model chunk")
    return checked


class DistributedOptimizer(MegatronOptimizer):
    """`MegatronOptimizer` over this rank's data-parallel shards only (Megatron's name).

    Build the inner optimizer over the model's parameters (as for the other wrappers); at
    construction each parameter is replaced in its group by the fp32 main shard of the part
    this rank owns (a parameter with nothing here leaves its group).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: GradScaler | None = None,
        *,
        model_chunks: Sequence[torch.nn.Module],
        grad_stats_group: dist.ProcessGroup | None,
        tensor_parallel_rank: int = 0,
    ) -> None:
        """Shards `optimizer`'s parameters.

        Args:
            optimizer: Adam, AdamW or SGD over the chunks' parameters, with no state yet.
            config: Clipping and zero counting.
            grad_scaler: The loss scale (needed for fp16), or None.
            model_chunks: This rank's chunks, each a `DistributedDataParallel` with
                ``use_distributed_optimizer``; their data-parallel group is the sharding's.
            grad_stats_group: The model-parallel group (see `MegatronOptimizer`).
            tensor_parallel_rank: This rank's position in its tensor-parallel group.

        Raises:
            ValueError: The optimizer is not elementwise, a chunk is not set up for it, the
                chunks disagree on the data-parallel group, or fp16 without a scaler.
            TypeError: A parameter is neither fp16, bf16 nor fp32, or is in no chunk.
        """
        _check_elementwise(optimizer)
        self.model_chunks = _check_chunks(model_chunks)
        groups = {id(chunk.data_parallel_group) for chunk in self.model_chunks}
        if len(groups) != 1:
            raise ValueError("the model chunks reduce over different data-parallel groups")
        self.data_parallel_group = self.model_chunks[0].data_parallel_group
        self.data_parallel_rank = self.model_chunks[0].data_parallel_rank
        self.data_parallel_size = self.model_chunks[0].data_parallel_size
        super().__init__(
            optimizer,
            config,
            grad_scaler,
            grad_stats_group=grad_stats_group,
            tensor_parallel_rank=tensor_parallel_rank,
        )

    def _adopt_params(self) -> None:
        """Replaces each parameter in the inner optimizer's groups by its owned fp32 shard."""
        if self.optimizer.state:
            raise ValueError("build DistributedOptimizer before the inner optimizer's first step")
        located = self._locate_params()
        self._ranges: list[ShardRange] = []
        for group_index, group in enumerate(self.optimizer.param_groups):
            shards = []
            for index, param in enumerate(group["params"]):
                if id(param) not in located:
                    raise TypeError(
                        f"parameter {index} of group {group_index} ({tuple(param.shape)}) is in"
                        " none of the model chunks given to DistributedOptimizer"
                    )
                shard = self._shard_of(param, *located[id(param)])
                if shard is not None:
                    self._ranges.append(shard)
                    shards.append(shard.main_param)
            group["params"] = shards

    def _locate_params(self) -> dict[int, tuple[str, GradBucket, int]]:
        """Each chunk parameter's name, bucket and start inside the bucket, by id."""
        names = param_names(self.model_chunks)
        return {
            id(param): (names[id(param)], bucket, start)
            for chunk in self.model_chunks
            for bucket in chunk.buckets
            for param, start, _ in bucket.param_ranges
        }

    def _shard_of(
        self, param: torch.nn.Parameter, name: str, bucket: GradBucket, start: int
    ) -> ShardRange | None:
        shard_start, shard_end = bucket.shard(self.data_parallel_rank)
        first = max(start, shard_start)
        last = min(start + param.numel(), shard_end)
        if first >= last:
            return None
        flat = param.detach().view(-1)[first - start : last - start]
        if param.dtype == torch.float32:
            main = flat  # the model's own elements, updated in place (Megatron)
        elif param.dtype in (torch.float16, torch.bfloat16):
            if param.dtype == torch.float16 and self.grad_scaler is None:
                raise ValueError(
                    "fp16 parameters need a grad scaler (DynamicGradScaler or"
                    " ConstantGradScaler); bf16 may run without one"
                )
            main = flat.clone().float()
        else:
            raise TypeError(f"parameter {name} is {param.dtype}; expected fp16, bf16 or fp32")
        copy_layout_attributes(param, main)
        return ShardRange(name, param, first - start, last - start, main, bucket, first)

    def shard_ranges(self) -> list[ShardRange]:
        """Every parameter part this rank owns, in optimizer order.

        Each `ShardRange` holds the flat range [start, end) inside the whole parameter, the
        parameter, its name and its fp32 main shard.

        A checkpoint stores each shard under the parameter's name and offsets; a loader at
        another data-parallel size takes whichever ranges it owns.
        """
        return list(self._ranges)

    def stats_groups(self) -> list[dist.ProcessGroup]:
        """Data parallel first (each rank holds a shard), then the model-parallel group."""
        groups = super().stats_groups()
        if self.data_parallel_group is not None and self.data_parallel_size > 1:
            groups.insert(0, self.data_parallel_group)
        return groups

    def _copy_model_grads_to_main_grads(self) -> None:
        for shard in self._ranges:
            grad = shard.param.main_grad.view(-1)[shard.start : shard.end]  # type: ignore[attr-defined]
            shard.main_param.grad = grad.float()

    def _copy_main_params_to_model_params(self) -> None:
        """Writes the updated shards into the parameter buffer and all-gathers it."""
        for shard in self._ranges:
            if shard.param.dtype != torch.float32:
                shard.param.data.view(-1)[shard.start : shard.end].copy_(shard.main_param)
        for chunk in self.model_chunks:
            chunk.start_param_sync()

    def finish_param_sync(self) -> None:
        """Waits for parameter all-gathers still in flight (``overlap_param_gather``).

        Call it before reading the parameters outside a forward (a checkpoint, the params
        norm); the forward itself waits per module.
        """
        for chunk in self.model_chunks:
            chunk.finish_param_sync()

    def reload_model_params(self) -> None:
        """Sets the main shards from the model's parameters (after loading the model)."""
        with torch.no_grad():
            for shard in self._ranges:
                shard.main_param.copy_(shard.param.detach().view(-1)[shard.start : shard.end])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the main shards' and the model parameters' ``grad``."""
        zero_grads(self.main_params(), set_to_none)
        zero_grads([shard.param for shard in self._ranges], set_to_none)

    def state_tensors(self) -> list[torch.Tensor]:
        """This rank's shard state only: 1/dp of the non-distributed optimizer's bytes.

        The inner optimizer's state, the fp32 copies of half parameters' shards and their
        gradients where those are storages of their own (not views of an fp32 grad buffer).
        """
        copies = [s for s in self._ranges if s.param.dtype != torch.float32]
        grads = [
            shard.main_param.grad
            for shard in copies
            if shard.main_param.grad is not None
            and not _same_storage(shard.main_param.grad, shard.param.main_grad)  # type: ignore[attr-defined]
        ]
        return [*super().state_tensors(), *(s.main_param for s in copies), *grads]

    def _layout(self) -> dict[str, Any]:
        return {
            "data_parallel_rank": self.data_parallel_rank,
            "data_parallel_size": self.data_parallel_size,
            "ranges": [(s.name, s.start, s.end) for s in self._ranges],
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state.

        Returns:
            The inner optimizer's state, the scaler's, ``shard_params`` (the fp32 main
            shards) and ``shard_layout`` (data-parallel rank, size and each range).
        """
        state = super().state_dict()
        state["shard_params"] = [s.main_param.detach().clone() for s in self._ranges]
        state["shard_layout"] = self._layout()
        return state

    def check_state_dict(self, state_dict: object) -> None:
        """Raises unless `state_dict` is this rank's shard at this layout; changes nothing.

        Raises:
            ValueError: Another rank's or data-parallel size's shard, other ranges, or shapes
                that differ; the message names them.
        """
        super().check_state_dict(state_dict)
        assert isinstance(state_dict, dict)
        layout = state_dict.get("shard_layout")
        if layout != self._layout():
            mine = self._layout()
            saved = layout if isinstance(layout, dict) else {}
            raise ValueError(
                f"optimizer shard was saved by data-parallel rank"
                f" {saved.get('data_parallel_rank')} of {saved.get('data_parallel_size')}"
                f" with ranges {saved.get('ranges')}; this is rank {mine['data_parallel_rank']}"
                f" of {mine['data_parallel_size']} with ranges {mine['ranges']} (load a"
                " resharding checkpoint through load_state_from_dp_zero or the shard ranges)"
            )
        saved_params = state_dict.get("shard_params")
        shapes = [tuple(s.main_param.shape) for s in self._ranges]
        saved_shapes = [
            tuple(p.shape) if isinstance(p, torch.Tensor) else None for p in saved_params or []
        ]
        if saved_shapes != shapes:
            raise ValueError(
                f"saved main shards have shapes {saved_shapes}; this rank has {shapes}"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores this rank's shard exactly; a refused state changes nothing.

        Raises:
            ValueError: See `check_state_dict`.
        """
        self.check_state_dict(state_dict)
        self._load_checked(state_dict)
        with torch.no_grad():
            for shard, value in zip(self._ranges, state_dict["shard_params"], strict=True):
                shard.main_param.copy_(value)
        self._write_main_params_to_model()

    def _write_main_params_to_model(self) -> None:
        with torch.no_grad():
            self._copy_main_params_to_model_params()
            self.finish_param_sync()

    def gather_state_to_dp_zero(self) -> dict[str, Any] | None:
        """Whole fp32 parameters and optimizer state, gathered to data-parallel rank 0.

        Megatron's ``get_parameter_state_dp_zero`` (its ``distrib_optim.pt``), keyed by
        parameter name (see `ShardRange.name`), so it loads at any data-parallel size.

        Every rank of the data-parallel group must call it.

        Returns:
            On data-parallel rank 0, ``{"params": {name: {"param": flat fp32, state key:
            flat fp32, ...}}, "step": Adam's step or None, "grad_scaler": ...,
            "param_groups": hyperparameters}``; None on the other ranks.
        """
        return gather_state(self)

    def load_state_from_dp_zero(self, state: dict[str, Any] | None) -> None:
        """Takes this rank's shards of a state gathered to data-parallel rank 0.

        Megatron's ``load_parameter_state_from_dp_zero``: data-parallel rank 0 passes what
        `gather_state_to_dp_zero` returned (at any data-parallel size), the others None.
        Every rank of the data-parallel group must call it.

        Args:
            state: The gathered state on data-parallel rank 0; ignored elsewhere.

        Raises:
            ValueError: On rank 0, a parameter is missing or has another size (checked
                before anything is changed; the other ranks then fail too).
        """
        load_gathered_state(self, state)
        self._write_main_params_to_model()


def _same_storage(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
