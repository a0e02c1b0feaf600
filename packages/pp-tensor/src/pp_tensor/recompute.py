"""Activation recomputation that replays every RNG state: torch's checkpoint plus the tracker.

Dropout inside a recomputed block must draw in the backward pass exactly what it drew in the
forward pass, from the default generators (CPU, and CUDA where present) and from the
tracker's named states (`pp_tensor.random`). `checkpoint` runs on
``torch.utils.checkpoint.checkpoint`` (non-reentrant) with a context that saves all of them at
the forward and replays them around the recomputation; `CheckpointWithoutOutput` also frees
the block's outputs until a later gradient hook recomputes them into the same storage
(Megatron's selective recompute of layer norms and activations).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from pp_tensor.random import RNGStatesTracker, get_rng_tracker
from pp_tensor.utils import (
    divide,
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
    tp_size,
)

__all__ = [
    "CheckpointWithoutOutput",
    "CheckpointWithoutOutputManager",
    "RNGSnapshot",
    "checkpoint",
    "is_checkpointing",
]

_CHECKPOINTING = [0]  # how many checkpoint blocks are running now (forward or recompute)


def is_checkpointing() -> bool:
    """Whether a `checkpoint` block's forward or recomputation is running now."""
    return _CHECKPOINTING[0] > 0


class RNGSnapshot:
    """The default generators' states and a tracker's named states, taken at construction.

    Args:
        tracker: The tracker whose states to take (None: the process default).
    """

    def __init__(self, tracker: RNGStatesTracker | None = None) -> None:
        self.tracker = get_rng_tracker() if tracker is None else tracker
        self.cpu_state = torch.get_rng_state()
        self.cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
        self.tracker_states = self.tracker.get_states()

    def restore(self) -> None:
        """Puts every state back as it was taken."""
        torch.set_rng_state(self.cpu_state)
        if self.cuda_state is not None:
            torch.cuda.set_rng_state(self.cuda_state)
        self.tracker.set_states(self.tracker_states)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Inside the block the states are as taken; after it, as they were before it."""
        before = RNGSnapshot(self.tracker)
        self.restore()
        try:
            yield
        finally:
            before.restore()


class _Distributed:
    """Keeps only this rank's 1-D part of a tensor between the forward and the backward.

    As Megatron's ``CheckpointFunction``: the part is gathered back when backward reaches the
    block, whether or not backward recomputes it (a block that saves nothing for backward,
    ``a + b``, recomputes nothing, yet its input's gradient has the whole input's shape).
    """

    def __init__(self, tensor: torch.Tensor, tp_group: dist.ProcessGroup | None) -> None:
        self.tensor, self.tp_group, self.shape = tensor, tp_group, tensor.shape
        self.split = False

    def shrink(self) -> None:
        part = split_tensor_into_1d_equal_chunks(
            self.tensor.data.contiguous(), new_buffer=True, tp_group=self.tp_group
        )
        self.tensor.data = part
        self.split = True

    def restore(self) -> None:
        """Gathers the tensor whole again (once: later calls find it whole)."""
        if not self.split:
            return
        whole = gather_split_1d_tensor(self.tensor.data, tp_group=self.tp_group)
        self.tensor.data = whole.view(self.shape)
        self.split = False

    def restore_when_backward_starts(self, outputs: Any) -> None:
        """Restore as soon as backward computes the gradient of any of the block's outputs."""
        tensors = [t for t in _tensors_in(outputs) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _: self.restore(), mode="any"
            )


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a block's output: a tensor, or a tuple, list or dict holding some."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors_in(item)]
    return []


class _ForwardContext:
    def __init__(self, owner: _Contexts) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        self.owner.snapshot = RNGSnapshot(self.owner.tracker)
        _CHECKPOINTING[0] += 1

    def __exit__(self, *exc: object) -> None:
        _CHECKPOINTING[0] -= 1
        if self.owner.distributed is not None and exc[0] is None:
            self.owner.distributed.shrink()


class _RecomputeContext:
    def __init__(self, owner: _Contexts) -> None:
        self.owner = owner
        self.replay: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        if self.owner.distributed is not None:
            self.owner.distributed.restore()
        assert self.owner.snapshot is not None, "recomputed before the forward ran"
        self.replay = self.owner.snapshot.replayed()
        self.replay.__enter__()
        _CHECKPOINTING[0] += 1

    def __exit__(self, *exc: Any) -> None:
        _CHECKPOINTING[0] -= 1
        assert self.replay is not None
        self.replay.__exit__(*exc)


class _Contexts:
    """torch's ``context_fn``: a forward context and a recompute context.

    The first takes the RNG states, the second replays them (and gathers a distributed
    first input back).
    """

    def __init__(self, tracker: RNGStatesTracker | None, distributed: _Distributed | None) -> None:
        self.tracker, self.distributed = tracker, distributed
        self.snapshot: RNGSnapshot | None = None

    def __call__(self) -> tuple[_ForwardContext, _RecomputeContext]:
        return _ForwardContext(self), _RecomputeContext(self)


def checkpoint(
    function: Callable[..., Any],
    distribute_saved_activations: bool,
    *args: Any,
    tp_group: dist.ProcessGroup | None = None,
    tracker: RNGStatesTracker | None = None,
) -> Any:
    """``function(*args)`` without keeping its activations: they are recomputed in backward.

    The recomputation draws the same random numbers as the forward did, from the default
    generators and from every state of the tracker.

    Args:
        function: The block to run.
        distribute_saved_activations: Keep only this tensor-parallel rank's 1-D part of
            ``args[0]`` until backward reaches the block (it is all-gathered back then, as
            Megatron does, whether or not anything is recomputed); the caller must not read
            ``args[0]`` between the call and the backward. Needs `tp_group`.
        *args: The block's inputs.
        tp_group: The tensor-parallel group ``args[0]`` is distributed over.
        tracker: The tracker whose states are replayed (None: the process default).

    Raises:
        ValueError: `distribute_saved_activations` without a tensor first argument, or with
            one whose size does not divide by the tensor-parallel size.
    """
    distributed = None
    if distribute_saved_activations:
        if not args or not isinstance(args[0], torch.Tensor):
            raise ValueError("distribute_saved_activations=True needs a tensor as first input")
        divide(args[0].numel(), tp_size(tp_group), "number of elements")  # before the forward
        distributed = _Distributed(args[0], tp_group)
    outputs = torch_checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=False,  # the contexts replay every state, the tracker's included
        context_fn=_Contexts(tracker, distributed),
    )
    if distributed is not None:
        distributed.restore_when_backward_starts(outputs)
    return outputs


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().requires_grad_(tensor.requires_grad)


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, run_function: Callable[..., Any], owner: CheckpointWithoutOutput, *args: Any
    ) -> Any:
        with torch.no_grad():
            outputs = run_function(*args)
        tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.layout = [None if isinstance(arg, torch.Tensor) else arg for arg in args]
        ctx.is_tensor = [isinstance(arg, torch.Tensor) for arg in args]
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if getattr(ctx, "outputs", None) is None:
            ctx.owner_recompute()  # no hook ran the recomputation first: run it now
        pairs = [
            (output, grad)
            for output, grad in zip(ctx.outputs, grads, strict=True)
            if output.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        inputs, ctx.outputs, ctx.inputs = ctx.inputs, None, None
        return (
            None,
            None,
            *(arg.grad if isinstance(arg, torch.Tensor) else None for arg in inputs),
        )


class CheckpointWithoutOutput:
    """Runs a block without keeping its activations or, once discarded, its outputs.

    ``checkpoint(run_function, *args)`` runs the block under ``no_grad``;
    ``discard_output_and_register_recompute(hook_tensor)`` frees the outputs' storage and
    recomputes them (with the forward's RNG states) when `hook_tensor`'s gradient is computed,
    into the same storage, so whatever saved them for its backward finds them again.

    Args:
        fp8: Megatron's FP8 recipe: pp has no FP8; only False or None is accepted.
        ckpt_manager: A `CheckpointWithoutOutputManager` to register with; it then discards
            and recomputes all its blocks at once.
        retain_input_tensors: Keep outputs that share storage with an input.
        tracker: The tracker whose states are replayed (None: the process default).

    Raises:
        ValueError: `fp8` set.
    """

    def __init__(
        self,
        fp8: object = False,
        ckpt_manager: CheckpointWithoutOutputManager | None = None,
        retain_input_tensors: bool = False,
        *,
        tracker: RNGStatesTracker | None = None,
    ) -> None:
        if fp8 not in (False, None):
            raise ValueError(f"CheckpointWithoutOutput(fp8={fp8!r}): pp has no FP8; use False")
        self.fp8 = False
        self.ckpt_manager = ckpt_manager
        self.retain_input_tensors = retain_input_tensors
        self.tracker = tracker
        self.run_function: Callable[..., Any] | None = None
        self.rng_states: RNGSnapshot | None = None
        self.ctx: Any = None
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self._input_storages: set[int] = set()

    def checkpoint(self, run_function: Callable[..., Any], *args: Any) -> Any:
        """Runs ``run_function(*args)`` keeping only its inputs; returns its outputs."""
        self.run_function = run_function
        self.rng_states = RNGSnapshot(self.tracker)
        self._input_storages = {
            arg.untyped_storage().data_ptr() for arg in args if isinstance(arg, torch.Tensor)
        }
        outputs = _CheckpointWithoutOutputFunction.apply(  # type: ignore[no-untyped-call]
            run_function, self, *args
        )
        self.ctx.owner_recompute = lambda: self._recompute(None)
        self.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        if self.ckpt_manager is not None:
            self.ckpt_manager.add_checkpoint(self)
        return outputs

    def _recompute(self, _: object) -> None:
        """Recomputes the outputs into their storage (once; a gradient hook)."""
        if self.ctx is None:
            return
        assert self.rng_states is not None
        assert self.run_function is not None
        saved = iter(self.ctx.saved_tensors)
        inputs = [
            _detached(next(saved)) if is_tensor else arg
            for is_tensor, arg in zip(self.ctx.is_tensor, self.ctx.layout, strict=True)
        ]
        with self.rng_states.replayed(), torch.enable_grad():
            outputs = self.run_function(*inputs)
        recomputed = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        assert self.outputs is not None
        with torch.no_grad():
            for output, again in zip(self.outputs, recomputed, strict=True):
                storage = output.untyped_storage()
                if storage.data_ptr() != again.untyped_storage().data_ptr():
                    storage.resize_(again.untyped_storage().nbytes())
                    storage.copy_(again.untyped_storage())
        self.ctx.outputs, self.ctx.inputs = recomputed, inputs
        self.run_function, self.rng_states, self.outputs, self.ctx = None, None, None, None

    def _discard_outputs(self) -> None:
        assert self.outputs is not None, "discarded before checkpoint() ran"
        for output in self.outputs:
            kept = output.untyped_storage().data_ptr() in self._input_storages
            if not (self.retain_input_tensors and kept):
                output.untyped_storage().resize_(0)

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Frees the outputs' storage; `hook_tensor`'s gradient hook recomputes them.

        With a manager, the manager discards and recomputes instead (this does nothing).
        """
        if self.ckpt_manager is not None:
            return
        self._discard_outputs()
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)  # type: ignore[no-untyped-call]


class CheckpointWithoutOutputManager:
    """Discards the outputs of several `CheckpointWithoutOutput` blocks at once.

    One gradient hook recomputes them all, in forward order (blocks feeding each other).
    """

    def __init__(self) -> None:
        self.checkpoints: list[CheckpointWithoutOutput] = []
        self.is_last_layer_in_recompute_block = False

    def add_checkpoint(self, ckpt: CheckpointWithoutOutput) -> None:
        """Registers a block that ran `checkpoint`.

        Raises:
            TypeError: Not a `CheckpointWithoutOutput`.
            ValueError: Its `checkpoint` has not run.
        """
        if not isinstance(ckpt, CheckpointWithoutOutput):
            raise TypeError(f"expected a CheckpointWithoutOutput, got {type(ckpt).__name__}")
        if ckpt.outputs is None:
            raise ValueError("a CheckpointWithoutOutput is added after its checkpoint() ran")
        self.checkpoints.append(ckpt)

    def discard_all_outputs_and_register_unified_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Frees every block's outputs; `hook_tensor`'s gradient recomputes them all."""
        for ckpt in self.checkpoints:
            ckpt._discard_outputs()
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute_all)  # type: ignore[no-untyped-call]

    def _recompute_all(self, _: object) -> None:
        for ckpt in self.checkpoints:
            ckpt._recompute(None)
