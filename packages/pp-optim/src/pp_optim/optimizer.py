"""Optimizer wrappers with Megatron's step: unscale, skip on overflow, clip, count zeros, update.

`Float16OptimizerWithFloat16Params` keeps an fp32 main copy of every fp16/bf16 parameter and
hands the copies to the wrapped torch optimizer; `FP32Optimizer` wraps an optimizer of fp32
parameters without copies. Both read gradients from ``main_grad`` when a contiguous grad buffer
(`DistributedDataParallel`) holds them, and both return Megatron's
``(update_successful, grad_norm, num_zeros_in_grad)`` from `step`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

from pp_optim.grad_norm import (
    all_reduce_over,
    clip_grad_norm,
    collective_device,
    count_zeros,
    get_grad_norm,
    grads_for_norm,
)
from pp_optim.loss_scaling import GradScaler
from pp_optim.timing import NullOptimizerTimers, OptimizerTimers, timed
from pp_state.collectives import collective

__all__ = [
    "LAYOUT_ATTRIBUTES",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "MegatronOptimizer",
    "NonFiniteGradError",
    "OptimizerConfig",
    "copy_layout_attributes",
    "zero_grads",
]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Attributes that say how a parameter is laid out over the model-parallel ranks; the fp32 main
# copy carries them so norms and zero counts treat it like the parameter it stands for.
LAYOUT_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared")


def copy_layout_attributes(source: torch.Tensor, target: torch.Tensor) -> None:
    """Gives `target` (an fp32 copy of `source`, or a shard of it) `source`'s layout marks."""
    for name in LAYOUT_ATTRIBUTES:
        if hasattr(source, name):
            setattr(target, name, getattr(source, name))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer, its precision and what the wrapper does around the update.

    The wrappers read `clip_grad` and `log_num_zeros_in_grad`; `get_megatron_optimizer`
    reads the rest to build the inner optimizer and the loss scaler (Megatron's flag names).
    """

    optimizer: Literal["adam", "sgd"] = "adam"
    """``adam`` (AdamW: decoupled weight decay, as Megatron's fused Adam) or ``sgd``."""

    lr: float = 1e-4
    """Initial learning rate; an `OptimizerParamScheduler` overrides it every step."""

    weight_decay: float = 0.01
    """Weight decay of matrices; biases and other 1-D parameters get none."""

    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay."""

    adam_eps: float = 1e-8
    """Adam's denominator term."""

    sgd_momentum: float = 0.9
    """SGD momentum."""

    fp16: bool = False
    """Parameters are fp16: fp32 main copies and a loss scaler."""

    bf16: bool = False
    """Parameters are bf16: fp32 main copies, no loss scaler unless `loss_scale` is set."""

    loss_scale: float | None = None
    """A constant loss scale; None: dynamic scaling for fp16, none otherwise."""

    initial_loss_scale: float = 2.0**32
    """First scale of the dynamic scaler."""

    min_loss_scale: float = 1.0
    """Floor of the dynamic scale."""

    loss_scale_window: int = 1000
    """Clean steps before the dynamic scale grows."""

    hysteresis: int = 2
    """Overflowing steps tolerated before the dynamic scale backs off."""

    clip_grad: float = 1.0
    """Clip the gradient's total (L2) norm to this value; 0 turns clipping and the norm off."""

    grad_norm_skip_threshold: float = math.inf
    """Skip the update of a step whose gradient norm (before clipping, over the model-parallel
    group) exceeds this; ``inf``, the default, never skips and computes no extra norm."""

    log_num_zeros_in_grad: bool = False
    """Count zero gradient elements each step (costs one pass over the gradients)."""

    check_for_nan_in_loss_and_grad: bool = True
    """Without a loss scaler (fp32, bf16), a step whose gradient norm is NaN or inf raises
    `NonFiniteGradError` before anything is applied (a non-finite loss makes the gradients
    non-finite too); with a scaler such a step is skipped and counted instead. Costs the
    gradient norm when clipping is off."""

    def __post_init__(self) -> None:
        """Checks the values.

        Raises:
            ValueError: A value is out of range, or both fp16 and bf16 are set.
        """
        problems = []
        if self.optimizer not in ("adam", "sgd"):
            problems.append(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.fp16 and self.bf16:
            problems.append("set at most one of fp16 and bf16")
        if not 0.0 <= self.clip_grad < math.inf:
            problems.append(f"clip_grad must be >= 0 and finite (0 disables), got {self.clip_grad}")
        if not self.grad_norm_skip_threshold > 0.0:
            problems.append(
                "grad_norm_skip_threshold must be > 0 (inf disables), got "
                f"{self.grad_norm_skip_threshold}"
            )
        if not math.isfinite(self.lr):
            problems.append(f"lr must be a finite number, got {self.lr} (Megatron's --lr)")
        elif self.lr < 0.0:
            problems.append(f"lr must be >= 0, got {self.lr} (Megatron's --lr)")
        for name in ("weight_decay", "sgd_momentum"):
            if not getattr(self, name) >= 0.0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.adam_eps > 0.0:
            problems.append(f"adam_eps must be > 0, got {self.adam_eps}")
        problems.extend(self._loss_scale_problems())
        if problems:
            raise ValueError("invalid OptimizerConfig: " + "; ".join(problems))

    def _loss_scale_problems(self) -> list[str]:
        problems = []
        for name in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
                problems.append(f"{name} must be a finite number > 0, got {value}")
        if self.min_loss_scale > self.initial_loss_scale:
            problems.append(
                f"min_loss_scale {self.min_loss_scale} is above initial_loss_scale "
                f"{self.initial_loss_scale}; the dynamic scale starts at the initial one"
            )
        for name in ("loss_scale_window", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be an integer 1 or more, got {value!r}")
        return problems


class NonFiniteGradError(FloatingPointError):
    """The gradient norm is NaN or inf: the step was refused before anything was applied."""

    def __init__(self, grad_norm: float, ranks: list[int]) -> None:
        """Names the norm and the ranks (global) whose own gradients hold NaN or inf."""
        self.grad_norm = grad_norm
        self.ranks = ranks
        super().__init__(
            f"the gradient norm is {grad_norm} (non-finite gradients on rank(s) {ranks}); the "
            "optimizer step was refused and nothing was applied"
        )


class MegatronOptimizer(abc.ABC):
    """A torch optimizer wrapped with loss scaling, model-parallel clipping and zero counting.

    Subclasses say where the fp32 parameters the inner optimizer updates come from.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: GradScaler | None = None,
        *,
        grad_stats_group: dist.ProcessGroup | None,
        tensor_parallel_rank: int = 0,
    ) -> None:
        """Wraps `optimizer`.

        Args:
            optimizer: Any torch optimizer over the model's parameters.
            config: Clipping and zero counting.
            grad_scaler: The loss scale, or None for none (bf16, fp32). With a scaler a step
                whose gradients hold inf or nan on any rank of `grad_stats_group` is skipped.
            grad_stats_group: The ranks sharing one model (the model-parallel group): overflow,
                norms and zero counts are reduced over it. None: this process alone.
            tensor_parallel_rank: This rank's position in its tensor-parallel group (decides
                which rank counts a duplicated parameter).

        Raises:
            TypeError: `optimizer` is not a torch optimizer, or holds parameters of a dtype
                this wrapper does not take.
            ValueError: fp16 parameters without a grad scaler.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.config = config
        self.grad_scaler = grad_scaler
        self.grad_stats_group = grad_stats_group
        self.tensor_parallel_rank = tensor_parallel_rank
        self.num_skipped_steps = 0
        """Steps skipped so far, for either reason (inf/nan gradients or a large norm)."""
        self.num_grad_norm_skips = 0
        """Of those, the steps skipped for a norm above ``config.grad_norm_skip_threshold``."""
        self._adopt_params()

    @abc.abstractmethod
    def _adopt_params(self) -> None:
        """Checks the inner optimizer's parameters and sets up any copies of them."""

    def stats_groups(self) -> list[dist.ProcessGroup]:
        """The groups overflow, norms and zero counts are reduced over, in turn."""
        return [] if self.grad_stats_group is None else [self.grad_stats_group]

    # What the inner optimizer updates, in its parameter-group order.
    def main_params(self) -> Iterator[torch.Tensor]:
        """The fp32 parameters the inner optimizer updates."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors this optimizer holds besides the model's parameters and gradients.

        The inner optimizer's per-parameter state (Adam's ``exp_avg`` and ``exp_avg_sq``,
        SGD's ``momentum_buffer``; made by the first step), for measuring memory: with the
        parameters and gradient buffers they are a rank's static bytes. Scalar entries
        (Adam's ``step`` count) are bookkeeping and left out.

        Returns:
            The tensors, each once, in parameter-group order.
        """
        return [
            value
            for param in self.main_params()
            for value in self.optimizer.state.get(param, {}).values()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        ]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (the LR scheduler sets lr here)."""
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale (1.0 without a scaler), a one-element float32 tensor."""
        if self.grad_scaler is None:
            return torch.ones(1, dtype=torch.float32)
        return self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the loss scale; the schedules call this as ``grad_scale_func``."""
        return loss * self.get_loss_scale().to(loss.device, loss.dtype)

    @abc.abstractmethod
    def _copy_model_grads_to_main_grads(self) -> None: ...

    @abc.abstractmethod
    def _copy_main_params_to_model_params(self) -> None: ...

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the model's and the main parameters' gradients."""

    def _unscale_main_grads_and_check_for_nan(self, scaler: GradScaler) -> bool:
        grads = [p.grad for p in self.main_params() if p.grad is not None]
        device = collective_device(grads, self.stats_groups())
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        for grad_device, same_device in by_device.items():
            found_here = torch.zeros(1, dtype=torch.float32, device=grad_device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                same_device, found_here, scaler.inv_scale.to(grad_device)
            )
            found_inf = torch.maximum(found_inf, found_here.to(device))
        all_reduce_over(
            found_inf, self.stats_groups(), op=dist.ReduceOp.MAX, operation="found-inf all-reduce"
        )
        return bool(found_inf.item() > 0)

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clips the main gradients to a total norm of `clip_grad`; returns the norm before."""
        return clip_grad_norm(
            self.main_params(),
            clip_grad,
            group=self.stats_groups(),
            tensor_parallel_rank=self.tensor_parallel_rank,
        )

    def get_grad_norm(self) -> float:
        """The L2 norm of the main gradients over the group, duplicates counted once."""
        grads = grads_for_norm(self.main_params(), tensor_parallel_rank=self.tensor_parallel_rank)
        return get_grad_norm(grads, group=self.stats_groups())

    def _norm_and_clip(self) -> float | None:
        """Clips if asked (returning the norm before), else the norm if a check needs it."""
        if self.config.clip_grad:
            return self.clip_grad_norm(self.config.clip_grad)
        if math.isfinite(self.config.grad_norm_skip_threshold) or self._checks_nan():
            return self.get_grad_norm()
        return None

    def _checks_nan(self) -> bool:
        return self.config.check_for_nan_in_loss_and_grad and self.grad_scaler is None

    def _non_finite_ranks(self) -> list[int]:
        """The global ranks of the group whose own main gradients hold NaN or inf."""
        grads = [g for g in (p.grad for p in self.main_params()) if g is not None]
        device = collective_device(grads, self.grad_stats_group)
        bad = any(not bool(torch.isfinite(g).all()) for g in grads)
        flag = torch.tensor([1 if bad else 0], dtype=torch.int32, device=device)
        if self.grad_stats_group is None or not dist.is_initialized():
            return [dist.get_rank() if dist.is_initialized() else 0] if bad else []
        flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size(self.grad_stats_group))]
        with collective("non-finite gradient all-gather", group=self.grad_stats_group):
            dist.all_gather(flags, flag, group=self.grad_stats_group)
        ranks = dist.get_process_group_ranks(self.grad_stats_group)
        return [rank for rank, f in zip(ranks, flags, strict=True) if int(f.item())]

    def count_zeros(self) -> int:
        """Zero elements of the main gradients over the group, duplicates counted once."""
        return count_zeros(
            self.main_params(),
            group=self.stats_groups(),
            tensor_parallel_rank=self.tensor_parallel_rank,
        )

    @torch.no_grad()
    def step(
        self, timers: OptimizerTimers | None = None, *, barrier_with_l1_time: bool = False
    ) -> tuple[bool, float | None, int | None]:
        """One update, as Megatron's mixed-precision step.

        Copies the gradients to the main parameters, unscales them and looks for inf/nan on
        every rank of the group (with a scaler), skips the update on overflow, clips, counts
        zeros, skips the update if the norm exceeds ``config.grad_norm_skip_threshold``, runs
        the inner optimizer and copies the main parameters back to the model. A skipped step
        leaves parameters and optimizer state as they were (the gradients stay until
        `zero_grad`) and adds one to `num_skipped_steps`. Without a scaler and with
        ``config.check_for_nan_in_loss_and_grad``, a NaN or inf norm raises instead.

        Args:
            timers: Time each phase under Megatron's names (`pp_optim.timing.OPTIMIZER_TIMERS`,
                level 1), e.g. pp-train's ``Timers``; None times nothing.
            barrier_with_l1_time: Start each phase's timer after a barrier across ranks.

        Raises:
            NonFiniteGradError: The norm is NaN or inf (no scaler, check on); nothing applied.

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``: the norm is None on
            overflow or when neither clipping nor a skip threshold needs it; the zero count
            None on overflow or when not asked for. A step skipped for its norm returns
            ``(False, grad_norm, num_zeros_in_grad)``.
        """
        clock = timers if timers is not None else NullOptimizerTimers()

        def phase(name: str) -> contextlib.AbstractContextManager[None]:
            return timed(clock, name, barrier=barrier_with_l1_time)

        with phase("optimizer-copy-to-main-grad"):
            self._copy_model_grads_to_main_grads()
        if self.grad_scaler is not None:
            with phase("optimizer-unscale-and-check-inf"):
                found_inf = self._unscale_main_grads_and_check_for_nan(self.grad_scaler)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.num_skipped_steps += 1
                return False, None, None
        with phase("optimizer-clip-main-grad"):
            grad_norm = self._norm_and_clip()
        if grad_norm is not None and not math.isfinite(grad_norm) and self._checks_nan():
            # Every rank of the group sees the same norm, so all of them refuse together.
            raise NonFiniteGradError(grad_norm, self._non_finite_ranks())
        with phase("optimizer-count-zeros"):
            num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        if grad_norm is not None and grad_norm > self.config.grad_norm_skip_threshold:
            self.num_skipped_steps += 1
            self.num_grad_norm_skips += 1
            return False, grad_norm, num_zeros
        with phase("optimizer-inner-step"):
            self.optimizer.step()
        with phase("optimizer-copy-main-to-model-params"):
            self._copy_main_params_to_model_params()
        return True, grad_norm, num_zeros

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state and the loss scaler's."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
        }

    def check_state_dict(self, state_dict: object) -> None:
        """Raises unless `load_state_dict` would accept `state_dict`; changes nothing.

        Checks the keys, the parameter-group sizes, the kind of scaler and the shape of every
        per-parameter state tensor (Adam's moments), so a caller can validate several states
        before loading any.

        Raises:
            ValueError: The state does not fit this optimizer; the message says how.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"optimizer state is a {type(state_dict).__name__}, not a dict")
        missing = {"optimizer", "grad_scaler"} - set(state_dict)
        if missing:
            raise ValueError(f"optimizer state lacks {sorted(missing)}; keys: {sorted(state_dict)}")
        inner = state_dict["optimizer"]
        if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
            raise ValueError("optimizer state has no torch optimizer state with 'param_groups'")
        groups = self.optimizer.param_groups
        sizes = [len(group["params"]) for group in groups]
        saved_sizes = [len(group.get("params", [])) for group in inner["param_groups"]]
        if sizes != saved_sizes:
            raise ValueError(
                f"optimizer state is for parameter groups of sizes {saved_sizes}; this optimizer"
                f" has {sizes}"
            )
        if (state_dict["grad_scaler"] is None) != (self.grad_scaler is None):
            saved = "no loss scaler" if state_dict["grad_scaler"] is None else "a loss scaler"
            mine = "none" if self.grad_scaler is None else type(self.grad_scaler).__name__
            raise ValueError(f"optimizer state was saved with {saved}; this optimizer has {mine}")
        _check_state_shapes(inner, groups)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what `state_dict` returned; a refused state changes nothing.

        Raises:
            ValueError: The state is for other parameter groups or another kind of scaler.
        """
        self.check_state_dict(state_dict)
        self._load_checked(state_dict)

    def _load_checked(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


class FP32Optimizer(MegatronOptimizer):
    """The step of `MegatronOptimizer` for fp32 parameters, updated in place (no copies).

    A grad scaler is optional: `ConstantGradScaler(1.0)` costs one pass over the gradients and
    turns a step with inf or nan gradients into a skipped step.
    """

    def _adopt_params(self) -> None:
        """Checks that every parameter is fp32.

        Raises:
            TypeError: A parameter is not fp32 (use `Float16OptimizerWithFloat16Params`).
        """
        for index, param in enumerate(self.main_params()):
            if param.dtype != torch.float32:
                raise TypeError(
                    f"FP32Optimizer parameter {index} is {param.dtype}; use"
                    " Float16OptimizerWithFloat16Params for fp16/bf16 parameters"
                )

    def _copy_model_grads_to_main_grads(self) -> None:
        for param in self.main_params():
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                param.grad = main_grad

    def _copy_main_params_to_model_params(self) -> None:
        """Nothing to copy: the model's parameters are the ones updated."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' ``grad`` (a grad buffer is zeroed by its own method)."""
        zero_grads(self.main_params(), set_to_none)


def zero_grads(params: Iterator[torch.Tensor] | list[torch.Tensor], set_to_none: bool) -> None:
    """Drops (`set_to_none`) or zeroes the ``grad`` of each of `params`."""
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            param.grad.detach_()
            param.grad.zero_()


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """fp16/bf16 model parameters updated through fp32 main copies.

    At construction every fp16/bf16 parameter in the inner optimizer's groups is replaced by
    an fp32 copy (the model parameter gets a ``main_param`` attribute pointing to it); fp32
    parameters are updated directly. fp16 needs a grad scaler; bf16 usually runs without one.
    """

    def _adopt_params(self) -> None:
        """Replaces each half parameter in the inner optimizer by an fp32 copy.

        Raises:
            TypeError: A parameter is neither fp16, bf16 nor fp32.
            ValueError: fp16 parameters without a grad scaler.
        """
        self._float16_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._fp32_params: list[torch.Tensor] = []
        for group_index, group in enumerate(self.optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                if param.dtype in _HALF_DTYPES:
                    if param.dtype == torch.float16 and self.grad_scaler is None:
                        raise ValueError(
                            "fp16 parameters need a grad scaler (DynamicGradScaler or"
                            " ConstantGradScaler); bf16 may run without one"
                        )
                    group["params"][index] = self._main_copy(param)
                    self._float16_pairs.append((param, group["params"][index]))
                elif param.dtype == torch.float32:
                    self._fp32_params.append(param)
                else:
                    raise TypeError(
                        f"parameter {index} of group {group_index} is {param.dtype}; expected"
                        " float16, bfloat16 or float32"
                    )

    def _main_copy(self, param: torch.Tensor) -> torch.Tensor:
        main = torch.nn.Parameter(param.detach().clone().float())
        copy_layout_attributes(param, main)
        param.main_param = main  # type: ignore[attr-defined]
        if param in self.optimizer.state:
            self.optimizer.state[main] = self.optimizer.state.pop(param)
        return main

    def state_tensors(self) -> list[torch.Tensor]:
        """Adds the fp32 main copies and their gradients where those are storages of their own.

        A main copy's gradient (made by `step`, freed by `zero_grad`) shares the storage of
        an fp32 gradient buffer when the buffer is fp32 (``main_grad.float()`` is the buffer
        itself): that one belongs to the gradients and is left out.
        """
        copies = [main for _, main in self._float16_pairs]
        grads = [
            main.grad
            for model, main in self._float16_pairs
            if main.grad is not None and not _shares_storage(main.grad, _model_grad(model))
        ]
        return [*super().state_tensors(), *copies, *grads]

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_param, main_param in self._float16_pairs:
            source = getattr(model_param, "main_grad", None)
            if source is None:
                source = model_param.grad
            main_param.grad = None if source is None else source.float()
            model_param.grad = None
        for param in self._fp32_params:
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                param.grad = main_grad

    def _copy_main_params_to_model_params(self) -> None:
        if not self._float16_pairs:
            return
        model, main = zip(*self._float16_pairs, strict=True)
        torch._foreach_copy_(list(model), list(main))

    def reload_model_params(self) -> None:
        """Sets the fp32 main copies from the model's parameters (after loading the model)."""
        with torch.no_grad():
            for model_param, main_param in self._float16_pairs:
                main_param.copy_(model_param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of the model's parameters and of the fp32 main copies."""
        zero_grads([model for model, _ in self._float16_pairs], set_to_none)
        zero_grads(self.main_params(), set_to_none)

    def _main_copies_per_group(self) -> list[list[torch.Tensor]]:
        copies = {id(main) for _, main in self._float16_pairs}
        return [
            [param for param in group["params"] if id(param) in copies]
            for group in self.optimizer.param_groups
        ]

    def state_dict(self) -> dict[str, Any]:
        """Adds ``fp32_from_fp16_params``: the fp32 main copies, per parameter group."""
        state = super().state_dict()
        state["fp32_from_fp16_params"] = [
            [param.detach().clone() for param in group] for group in self._main_copies_per_group()
        ]
        return state

    def check_state_dict(self, state_dict: object) -> None:
        """Adds the check of ``fp32_from_fp16_params`` against the fp32 main copies' shapes.

        Raises:
            ValueError: The state does not fit this optimizer; nothing is changed.
        """
        super().check_state_dict(state_dict)
        assert isinstance(state_dict, dict)
        saved = state_dict.get("fp32_from_fp16_params")
        if not isinstance(saved, list) or not all(isinstance(group, list) for group in saved):
            raise ValueError("optimizer state lacks 'fp32_from_fp16_params' (the fp32 copies)")
        shapes = [[tuple(p.shape) for p in group] for group in self._main_copies_per_group()]
        saved_shapes = [[_shape(p) for p in group] for group in saved]
        if shapes != saved_shapes:
            raise ValueError(
                f"saved fp32 copies have shapes {saved_shapes}; this optimizer has {shapes}"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the inner optimizer, the scaler and the fp32 main copies exactly.

        Raises:
            ValueError: The state is for another set of parameters (counts or shapes differ)
                or another kind of scaler; nothing is changed.
        """
        self.check_state_dict(state_dict)
        current = self._main_copies_per_group()
        self._load_checked(state_dict)
        with torch.no_grad():
            for group, saved_group in zip(
                current, state_dict["fp32_from_fp16_params"], strict=True
            ):
                for param, value in zip(group, saved_group, strict=True):
                    param.copy_(value)


def _model_grad(param: torch.Tensor) -> torch.Tensor | None:
    """Where a model parameter's gradient is: its grad buffer view, else ``grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if isinstance(main_grad, torch.Tensor) else param.grad


def _shares_storage(tensor: torch.Tensor, other: torch.Tensor | None) -> bool:
    return other is not None and (
        tensor.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
    )


def _shape(value: object) -> tuple[int, ...] | str:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _check_state_shapes(inner: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    """Every per-parameter state tensor of a torch optimizer state fits its parameter."""
    params = [param for group in groups for param in group["params"]]
    ids = [index for group in inner["param_groups"] for index in group["params"]]
    by_id = dict(zip(ids, params, strict=True))
    state = inner.get("state", {})
    if not isinstance(state, dict):
        raise ValueError("optimizer state's 'state' is not a dict")
    for index, entries in state.items():
        if index not in by_id or not isinstance(entries, dict):
            raise ValueError(f"optimizer state holds an entry for unknown parameter {index!r}")
        param = by_id[index]
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"optimizer state {name!r} of parameter {index} has shape "
                    f"{tuple(value.shape)}; the parameter has {tuple(param.shape)}"
                )
