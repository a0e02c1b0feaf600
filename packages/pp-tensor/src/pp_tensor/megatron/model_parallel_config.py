"""`ModelParallelConfig`: megatron-core 0.20's configuration of model parallelism, checked.

Every field has Megatron's name and default, and ``__post_init__`` applies Megatron's rules
(sequence parallelism needs tensor parallelism, a pipeline needs ``pipeline_dtype``, the
defaults derived from other fields). Two kinds of input are refused, each naming the field:
a name Megatron's config does not have, and a field pp has no feature for (Transformer
Engine's communication overlap, generalized tensor parallelism, CPU offloading, ...) set to
anything but its default, since the run would silently differ from what was asked.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["UNSUPPORTED_FIELDS", "ModelParallelConfig"]

UNSUPPORTED_FIELDS: dict[str, str] = {
    "tensor_parallel_num_weight_shards": "generalized tensor parallelism (weight shards)",
    "gtp_weight_remat_size": "generalized tensor parallelism",
    "expert_tensor_parallel_num_weight_shards": "generalized expert tensor parallelism",
    "expert_gtp_weight_remat_size": "generalized expert tensor parallelism",
    "hierarchical_context_parallel_sizes": "hierarchical context parallelism",
    "max_seqlen_per_dp_cp_rank": "dynamic context parallelism",
    "hybrid_context_parallel": "hybrid context parallelism",
    "use_te_rng_tracker": "Transformer Engine's RNG tracker",
    "tp_comm_overlap": "Transformer Engine's tensor-parallel communication overlap",
    "cross_entropy_loss_fusion": "a fused cross-entropy kernel",
    "cross_entropy_fusion_impl": "Transformer Engine's cross entropy",
    "overlap_moe_expert_parallel_comm": "overlapped expert-parallel communication",
    "delay_wgrad_compute": "delayed weight gradients in Transformer Engine layers",
    "overlap_dispatch_backward_with_experts_wgrad": "overlapped expert dispatch",
    "ep_overlap_early_attn_memory_release": "overlapped expert-parallel memory release",
    "use_ring_exchange_p2p": "ring-exchange point-to-point communication",
    "defer_embedding_wgrad_compute": "deferred embedding weight gradients in the layers",
    "mtp_standalone": "standalone multi-token prediction",
    "cpu_offloading": "CPU offloading",
    "cpu_offloading_weights": "CPU offloading",
    "cpu_offloading_double_buffering": "CPU offloading",
    "moe_extended_tp": "extended tensor parallelism of experts",
}
"""Fields pp has no feature for -> what they ask for; each must keep its default."""

# Values other than the default that still ask for nothing pp lacks.
_ALSO_ACCEPTED: dict[str, tuple[object, ...]] = {
    "pipeline_model_parallel_comm_backend": ("nccl",),
}


@dataclasses.dataclass
class ModelParallelConfig:
    """megatron-core 0.20's ``ModelParallelConfig``: its fields, defaults and checks.

    The two fields 0.16.1 had and 0.20 dropped are here too (`moe_extended_tp`, refused
    when True; `async_tensor_model_parallel_allreduce`, which changes nothing here).

    Raises:
        TypeError: A field Megatron's config does not have (the message names it and the
            nearest fields).
        ValueError: A field pp has no feature for, set to anything but its default; or one of
            Megatron's own rules broken (sequence parallelism with tensor-parallel size 1, a
            pipeline without ``pipeline_dtype``, ...).
    """

    tensor_model_parallel_size: int = 1
    tensor_parallel_num_weight_shards: int | None = None
    gtp_weight_remat_size: int = 1
    pipeline_model_parallel_comm_backend: str | None = None
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    hierarchical_context_parallel_sizes: list[int] | None = None
    max_seqlen_per_dp_cp_rank: int | None = None
    hybrid_context_parallel: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    expert_tensor_parallel_num_weight_shards: int | None = None
    expert_gtp_weight_remat_size: int = 1
    perform_initialization: bool = True
    use_cpu_initialization: bool = False
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    timers: Callable[..., Any] | None = None
    finalize_model_grads_func: Callable[..., Any] | None = None
    grad_scale_func: Callable[..., Any] | None = None
    moe_grad_scale_func: Callable[..., Any] | None = None
    mtp_grad_scale_func: Callable[..., Any] | None = None
    no_sync_func: Callable[..., Any] | None = None
    grad_sync_func: Callable[..., Any] | None = None
    param_sync_func: Callable[..., Any] | None = None
    deterministic_mode: bool = False
    enable_autocast: bool = False
    autocast_dtype: torch.dtype | None = None
    num_microbatches_with_partial_activation_checkpoints: int | None = None
    gradient_accumulation_fusion: bool = False
    use_te_rng_tracker: bool = False
    tp_comm_overlap: bool = False
    tp_comm_bulk_wgrad: bool = True
    tp_comm_bulk_dgrad: bool = True
    tp_comm_overlap_ag: bool = True
    tp_comm_overlap_rs: bool = True
    tp_comm_overlap_rs_dgrad: bool = False
    tp_comm_split_ag: bool = True
    tp_comm_atomic_ag: bool = False
    tp_comm_split_rs: bool = True
    tp_comm_atomic_rs: bool = False
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"
    tp_comm_overlap_disable_qkv: bool = False
    tp_comm_overlap_disable_fc1: bool = False
    tp_comm_bootstrap_backend: str = "nccl"
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    overlap_dispatch_backward_with_experts_wgrad: bool = False
    ep_overlap_early_attn_memory_release: bool = False
    pipeline_dtype: torch.dtype | None = None
    variable_seq_lengths: bool = False
    overlap_p2p_comm: bool = False
    batch_p2p_comm: bool = True
    batch_p2p_sync: bool = True
    use_ring_exchange_p2p: bool = False
    deallocate_pipeline_outputs: bool = False
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    overlap_p2p_comm_warmup_flush: bool = False
    microbatch_group_size_per_vp_stage: int | None = None
    mtp_standalone: bool = False
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0
    _cpu_offloading_context: AbstractContextManager[Any] | None = None
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False
    cpu_offloading_retain_pinned_cpu_buffers: bool = False
    barrier_with_L1_time: bool = True  # noqa: N815 - Megatron's name
    # megatron-core 0.16.1's fields that 0.20 dropped, kept so 0.16.1 code ports too.
    moe_extended_tp: bool = False
    async_tensor_model_parallel_allreduce: bool = True

    def __post_init__(self) -> None:
        """Refuses what pp cannot do, then applies Megatron's rules and derived defaults."""
        self._refuse_unsupported()
        if self.sequence_parallel and self.tensor_model_parallel_size <= 1:
            raise ValueError(
                "sequence_parallel=True needs tensor_model_parallel_size > 1, got "
                f"{self.tensor_model_parallel_size}"
            )
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise ValueError(
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size} needs "
                "pipeline_dtype (the dtype of the activations between stages)"
            )
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.wgrad_deferral_limit < 0:
            raise ValueError(
                f"wgrad_deferral_limit must be 0 or more, got {self.wgrad_deferral_limit}"
            )
        both = self.expert_model_parallel_size > 1 and self.tensor_model_parallel_size > 1
        if both and not self.sequence_parallel:
            warnings.warn(
                "expert and tensor parallelism together are meant to run with "
                "sequence_parallel=True",
                stacklevel=3,
            )
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size
        if self.overlap_p2p_comm_warmup_flush and (
            not self.overlap_p2p_comm or self.batch_p2p_comm
        ):
            raise ValueError(
                "overlap_p2p_comm_warmup_flush=True needs overlap_p2p_comm=True and "
                "batch_p2p_comm=False"
            )

    def _refuse_unsupported(self) -> None:
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        plain_shards = {  # one weight shard per tensor-parallel rank: plain tensor parallelism
            "tensor_parallel_num_weight_shards": self.tensor_model_parallel_size,
            "expert_tensor_parallel_num_weight_shards": (
                self.expert_tensor_parallel_size or self.tensor_model_parallel_size
            ),
        }
        for name, what in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            if value is not None and value == plain_shards.get(name):
                continue
            if value != defaults[name]:
                raise ValueError(
                    f"ModelParallelConfig.{name}={value!r}: pp has no {what}; leave it at "
                    f"its default {defaults[name]!r}"
                )
        for name, accepted in _ALSO_ACCEPTED.items():
            value = getattr(self, name)
            if value != defaults[name] and value not in accepted:
                raise ValueError(
                    f"ModelParallelConfig.{name}={value!r}: pp supports "
                    f"{[defaults[name], *accepted]}"
                )


_FIELDS = tuple(field.name for field in dataclasses.fields(ModelParallelConfig))
_generated_init = ModelParallelConfig.__init__


@functools.wraps(_generated_init)
def _checked_init(self: ModelParallelConfig, *args: Any, **kwargs: Any) -> None:
    unknown = [name for name in kwargs if name not in _FIELDS]
    if unknown:
        name = unknown[0]
        near = difflib.get_close_matches(name, _FIELDS, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise TypeError(
            f"ModelParallelConfig has no field {name!r} (megatron-core 0.20's fields: "
            f"{', '.join(_FIELDS)}){hint}"
        )
    _generated_init(self, *args, **kwargs)


setattr(ModelParallelConfig, "__init__", _checked_init)  # noqa: B010 - replaces dataclass's
