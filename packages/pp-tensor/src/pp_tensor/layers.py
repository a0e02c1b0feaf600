"""Megatron's tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Every layer builds the full (unsplit) weight on the CPU in fp32, fills it with `init_method`
and keeps this rank's contiguous slice, so the same `init_method` (and default-generator
state) gives the same full weight at any tensor-parallel size: a layer at tp N computes what
the unsplit layer with that full weight computes. Biases start at zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's own convention

from pp_tensor.linear import linear_with_grad_accumulation_and_async_allreduce
from pp_tensor.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from pp_tensor.utils import (
    VocabUtility,
    divide,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    strided_shard_of,
    tp_rank,
    tp_size,
)

__all__ = [
    "ColumnParallelLinear",
    "InitMethod",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "split_parameter",
    "split_parameter_and_master",
    "zero_parameter",
]

InitMethod = Callable[[torch.Tensor], object]
"""Fills the full (unsplit, fp32, CPU) weight in place, e.g. ``torch.nn.init.xavier_normal_``.

What it returns is ignored (torch's initialisers return the tensor they filled).
"""

Device = torch.device | str | None


def split_parameter_and_master(
    full_shape: tuple[int, ...],
    init_method: InitMethod,
    *,
    partition_dim: int,
    tp_group: dist.ProcessGroup | None,
    device: Device,
    params_dtype: torch.dtype,
    stride: int = 1,
    perform_initialization: bool = True,
) -> tuple[torch.nn.Parameter, torch.Tensor | None]:
    """This rank's slice of a full weight filled by `init_method`, and that full weight.

    Args:
        full_shape: The unsplit weight's shape.
        init_method: Fills the full weight (fp32, CPU).
        partition_dim: The dimension split over tensor parallelism.
        tp_group: The tensor-parallel group (None: the whole weight).
        device: Where the parameter lives.
        params_dtype: Its dtype.
        stride: Megatron's strided split (`strided_shard_of`): a fused weight of `stride`
            parts gives every rank its slice of each part.
        perform_initialization: False leaves the parameter uninitialised (``torch.empty``;
            a checkpoint fills it): no full weight is built and None is returned for it.

    Returns:
        The parameter (``tensor_model_parallel=True``, its `partition_dim` and `stride`) and
        the full weight in `params_dtype` on the CPU (None without initialisation).
    """
    size = tp_size(tp_group)
    if not perform_initialization:
        shape = list(full_shape)
        shape[partition_dim] = divide(shape[partition_dim], size, "weight dimension")
        param = torch.nn.Parameter(torch.empty(shape, device=device, dtype=params_dtype))
        set_tensor_model_parallel_attributes(param, True, partition_dim, stride)
        return param, None
    full = torch.empty(full_shape, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        init_method(full)
    shard = strided_shard_of(full, partition_dim, tp_rank(tp_group), size, stride)
    param = torch.nn.Parameter(shard.to(device=device, dtype=params_dtype))
    set_tensor_model_parallel_attributes(param, True, partition_dim, stride)
    return param, full.to(params_dtype)


def split_parameter(
    full_shape: tuple[int, ...],
    init_method: InitMethod,
    *,
    partition_dim: int,
    tp_group: dist.ProcessGroup | None,
    device: Device,
    params_dtype: torch.dtype,
) -> torch.nn.Parameter:
    """This rank's contiguous slice of a full weight filled by `init_method`.

    `split_parameter_and_master` without its options.
    """
    param, _ = split_parameter_and_master(
        full_shape,
        init_method,
        partition_dim=partition_dim,
        tp_group=tp_group,
        device=device,
        params_dtype=params_dtype,
    )
    return param


def zero_parameter(
    shape: tuple[int, ...], *, partition_dim: int | None, device: Device, params_dtype: torch.dtype
) -> torch.nn.Parameter:
    """A zero parameter (a bias): split along `partition_dim`, or replicated when None."""
    param = torch.nn.Parameter(torch.zeros(shape, device=device, dtype=params_dtype))
    if partition_dim is None:
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    else:
        set_tensor_model_parallel_attributes(param, True, partition_dim, 1)
    return param


class _ParallelLinear(torch.nn.Module):
    """What the column- and row-parallel layers share: the weight, its master, the product."""

    weight: torch.nn.Parameter | None
    bias: torch.nn.Parameter | None
    master_weight: torch.Tensor | None
    input_size: int
    output_size: int
    tp_group: dist.ProcessGroup | None
    device: Device
    params_dtype: torch.dtype
    gradient_accumulation_fusion: bool

    def _build_weight(
        self, init_method: InitMethod, partition_dim: int, options: dict[str, object]
    ) -> None:
        stride = options.get("stride", 1)
        keep_master = options.get("keep_master_weight_for_test", False)
        perform = options.get("perform_initialization", True)
        assert isinstance(stride, int)
        assert isinstance(perform, bool)
        self.weight, master = split_parameter_and_master(
            (self.output_size, self.input_size),
            init_method,
            partition_dim=partition_dim,
            tp_group=self.tp_group,
            device=self.device,
            params_dtype=self.params_dtype,
            stride=stride,
            perform_initialization=perform,
        )
        self.master_weight = master if keep_master else None

    def _linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
    ) -> torch.Tensor:
        """The product and its communication.

        With `gradient_accumulation_fusion` it is
        `linear_with_grad_accumulation_and_async_allreduce` (Megatron's fused function, the
        input gradient's reduction overlapped with the weight gradient). Otherwise it is the
        mappings around ``F.linear``, the same numbers with every use of the weight visible
        to autograd, which the zero-bubble schedules need to split the backward.
        """
        if self.gradient_accumulation_fusion and weight.requires_grad:
            return linear_with_grad_accumulation_and_async_allreduce(
                x,
                weight,
                bias,
                True,
                allreduce_dgrad,
                sequence_parallel,
                tp_group=self.tp_group,
            )
        if sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tp_group=self.tp_group)
        elif allreduce_dgrad:
            x = copy_to_tensor_model_parallel_region(x, tp_group=self.tp_group)
        return F.linear(x, weight, bias)


_OPTIONS_DOC = """
        stride: Megatron's strided split of a fused weight (`strided_shard_of`).
        keep_master_weight_for_test: Keep the full initial weight as ``master_weight``.
        perform_initialization: False leaves the weight uninitialised (a checkpoint fills it).
        gradient_accumulation_fusion: Add the weight gradient into ``weight.main_grad``
            (`linear_with_grad_accumulation_and_async_allreduce`; its custom autograd
            function hides the weight's use, so the zero-bubble schedules refuse such a
            layer).
        explicit_expert_comm: The caller communicates (a mixture-of-experts dispatcher):
            the layer runs its product alone, with no collective."""


class ColumnParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with `A` split along its output rows: each rank computes columns of Y.

    Args:
        input_size: Input features (the last dimension of the input).
        output_size: Output features of the unsplit layer; divisible by the tensor-parallel size.
        tp_group: The tensor-parallel group (None: no tensor parallelism).
        init_method: Fills the full ``[output_size, input_size]`` weight.
        bias: Whether to have a bias (split like the output, zero at start).
        gather_output: All-gather the output's last dimension (each rank gets the full Y).
        skip_bias_add: Return the bias instead of adding it (for a later fused add).
        sequence_parallel: The input is this rank's part of the sequence (first dimension);
            it is all-gathered along the sequence before the product.
        skip_weight_param_allocation: Build no weight; `forward` then needs `weight` (an output
            layer sharing the word embedding's weight).
        device: Where the parameters live.
        params_dtype: The parameters' dtype.
        disable_grad_reduce: Leave the input gradient partial (no all-reduce over the group;
            the caller reduces it later, as LoRA adapters do).{options}

    Raises:
        ValueError: `output_size` does not divide by the tensor-parallel size.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: dist.ProcessGroup | None,
        init_method: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        skip_weight_param_allocation: bool = False,
        device: Device = None,
        params_dtype: torch.dtype = torch.float32,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        perform_initialization: bool = True,
        gradient_accumulation_fusion: bool = False,
        disable_grad_reduce: bool = False,
        explicit_expert_comm: bool = False,
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_group, self.device, self.params_dtype = tp_group, device, params_dtype
        self.output_size_per_partition = divide(
            output_size, tp_size(tp_group), "ColumnParallelLinear output size"
        )
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.disable_grad_reduce, self.explicit_expert_comm = (
            disable_grad_reduce,
            explicit_expert_comm,
        )
        self.master_weight = None
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self._build_weight(init_method, 0, {
                "stride": stride,
                "keep_master_weight_for_test": keep_master_weight_for_test,
                "perform_initialization": perform_initialization,
            })  # fmt: skip
        if bias:
            self.bias = zero_parameter(
                (self.output_size_per_partition,),
                partition_dim=0,
                device=device,
                params_dtype=params_dtype,
            )
            self.bias.partition_stride = stride  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Applies the layer.

        Args:
            x: ``[sequence, batch, input_size]`` (any leading dimensions); under sequence
                parallelism this rank's part of the sequence.
            weight: Use this ``[output_size / tp, input_size]`` weight instead of `self.weight`.
            runtime_gather_output: Overrides `gather_output` for this call (None: keep it).

        Returns:
            The output (this rank's column block, or all of it when gathered), and the bias
            when `skip_bias_add` (else None): this rank's slice of it, as in Megatron, even
            when the output is gathered.

        Raises:
            ValueError: No weight was built and none was given, or `weight` has the wrong shape.
        """
        weight = self._weight_for(weight)
        parallel = tp_size(self.tp_group) > 1 and not self.explicit_expert_comm
        output = self._linear(
            x,
            weight,
            None if self.skip_bias_add else self.bias,
            allreduce_dgrad=parallel
            and not self.sequence_parallel
            and not self.disable_grad_reduce,
            sequence_parallel=parallel and self.sequence_parallel,
        )
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = gather_from_tensor_model_parallel_region(output, tp_group=self.tp_group)
        return output, self.bias if self.skip_bias_add else None

    def _weight_for(self, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            if self.weight is None:
                raise ValueError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True: "
                    "forward needs weight="
                )
            return self.weight
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"ColumnParallelLinear: the weight given has shape {tuple(weight.shape)}, "
                f"expected {expected}"
            )
        return weight


class RowParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with `A` split along its input columns: each rank sums a partial Y.

    Args:
        input_size: Input features of the unsplit layer; divisible by the tensor-parallel size.
        output_size: Output features.
        tp_group: The tensor-parallel group (None: no tensor parallelism).
        init_method: Fills the full ``[output_size, input_size]`` weight.
        bias: Whether to have a bias (replicated, zero at start, added after the reduction).
        input_is_parallel: The input is already split along its last dimension (the output of
            a column-parallel layer); else this rank's part is taken.
        skip_bias_add: Return the bias instead of adding it.
        sequence_parallel: Reduce-scatter the output along the sequence (first dimension)
            instead of all-reducing it; the bias is marked ``sequence_parallel``.
        device: Where the parameters live.
        params_dtype: The parameters' dtype.{options}

    Raises:
        ValueError: `input_size` does not divide by the tensor-parallel size, or
            `sequence_parallel` without `input_is_parallel`.
    """

    weight: torch.nn.Parameter

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: dist.ProcessGroup | None,
        init_method: InitMethod,
        bias: bool = True,
        input_is_parallel: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        device: Device = None,
        params_dtype: torch.dtype = torch.float32,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        perform_initialization: bool = True,
        gradient_accumulation_fusion: bool = False,
        explicit_expert_comm: bool = False,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True (the "
                "input must be the hidden-split output of a column-parallel layer)"
            )
        if explicit_expert_comm and bias and not skip_bias_add:
            raise ValueError(
                "RowParallelLinear: explicit_expert_comm=True returns a partial sum, to which "
                "the bias cannot be added: use skip_bias_add=True (as Megatron asserts)"
            )
        self.input_size, self.output_size = input_size, output_size
        self.tp_group, self.device, self.params_dtype = tp_group, device, params_dtype
        self.input_size_per_partition = divide(
            input_size, tp_size(tp_group), "RowParallelLinear input size"
        )
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.explicit_expert_comm = explicit_expert_comm
        self._build_weight(init_method, 1, {
            "stride": stride,
            "keep_master_weight_for_test": keep_master_weight_for_test,
            "perform_initialization": perform_initialization,
        })  # fmt: skip
        if bias:
            self.bias = zero_parameter(
                (output_size,), partition_dim=None, device=device, params_dtype=params_dtype
            )
            self.bias.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Applies the layer.

        Args:
            x: ``[sequence, batch, input_size / tp]`` when `input_is_parallel`, else the full
                ``[..., input_size]``.

        Returns:
            The output (the full sum, or this rank's part of the sequence under sequence
            parallelism; the partial sum with `explicit_expert_comm`), and the bias when
            `skip_bias_add` (else None).
        """
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, tp_group=self.tp_group)
        assert self.weight is not None
        partial = self._linear(x, self.weight, None, allreduce_dgrad=False, sequence_parallel=False)
        if self.explicit_expert_comm:
            output = partial
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, tp_group=self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, tp_group=self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return output, self.bias
        return output + self.bias, None


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose rows (the vocabulary) are split over tensor parallelism.

    Each rank looks up the ids in its own vocabulary range, zeroes the others' rows, and the
    ranks' outputs are summed.

    Args:
        num_embeddings: The (padded) vocabulary size; divisible by the tensor-parallel size.
        embedding_dim: The hidden size.
        tp_group: The tensor-parallel group (None: no tensor parallelism).
        init_method: Fills the full ``[num_embeddings, embedding_dim]`` weight.
        reduce_scatter_embeddings: Return ``[sequence / tp, batch, hidden]`` (the input
            ``[batch, sequence]`` transposed, reduce-scattered along the sequence) for sequence
            parallelism, instead of the all-reduced ``[batch, sequence, hidden]``.
        device: Where the weight lives.
        params_dtype: The weight's dtype.
        perform_initialization: False leaves the weight uninitialised (a checkpoint fills it).

    Raises:
        ValueError: `num_embeddings` does not divide by the tensor-parallel size.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: dist.ProcessGroup | None,
        init_method: InitMethod,
        reduce_scatter_embeddings: bool = False,
        device: Device = None,
        params_dtype: torch.dtype = torch.float32,
        perform_initialization: bool = True,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group = tp_group
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        size = tp_size(tp_group)
        try:
            self.num_embeddings_per_partition = divide(num_embeddings, size, "vocabulary size")
        except ValueError as error:
            raise ValueError(
                f"VocabParallelEmbedding: {error}; pad the vocabulary with "
                "--make-vocab-size-divisible-by (pad_vocab_size)"
            ) from None
        self.vocab_start_index, self.vocab_end_index = (
            VocabUtility.vocab_range_from_per_partition_vocab_size(
                self.num_embeddings_per_partition, tp_rank(tp_group), size
            )
        )
        self.weight, _ = split_parameter_and_master(
            (num_embeddings, embedding_dim),
            init_method,
            partition_dim=0,
            tp_group=tp_group,
            device=device,
            params_dtype=params_dtype,
            perform_initialization=perform_initialization,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeds `ids` (``[batch, sequence]`` global token ids, not range-checked)."""
        if tp_size(self.tp_group) > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
            output = F.embedding(local_ids, self.weight)
            output.masked_fill_(outside.unsqueeze(-1), 0.0)
        else:
            output = F.embedding(ids, self.weight)
        if self.reduce_scatter_embeddings:
            output = output.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output, tp_group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, tp_group=self.tp_group)


ColumnParallelLinear.__doc__ = (ColumnParallelLinear.__doc__ or "").format(options=_OPTIONS_DOC)
RowParallelLinear.__doc__ = (RowParallelLinear.__doc__ or "").format(options=_OPTIONS_DOC)
