"""Layout-independent names for a model's and its optimizer's state (the torch_dist keys).

A chunk says which name each entry of its ``state_dict()`` has in the whole, unpipelined
model (`ShardedStateKeys`); every key of a torch_dist checkpoint is built from those names,
so what a checkpoint holds does not depend on how many stages or chunks wrote it:

- ``model.<global name>``: the model's parameters and buffers, in the model's dtype;
- ``optimizer.state.<global name>.<entry>``: the inner torch optimizer's per-parameter state
  (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``);
- ``optimizer.fp32_param.<global name>``: the fp32 main copy of an fp16/bf16 parameter.

Several local entries may share one global name (the output layer tied to the word
embedding): the checkpoint holds one copy, and loading fills every local entry from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from pp_optim import MegatronOptimizer
from pp_train.wrappers import unwrap_model

__all__ = [
    "FP32_PARAM_PREFIX",
    "MODEL_PREFIX",
    "OPTIMIZER_STATE_PREFIX",
    "MainParam",
    "ShardedStateKeys",
    "chunk_global_keys",
    "main_params",
    "model_targets",
    "optimizer_tensors",
]

MODEL_PREFIX = "model."
OPTIMIZER_STATE_PREFIX = "optimizer.state."
FP32_PARAM_PREFIX = "optimizer.fp32_param."


@runtime_checkable
class ShardedStateKeys(Protocol):
    """A model chunk that names its state by global keys (needed by the torch_dist format).

    Megatron's modules answer the same question with ``sharded_state_dict`` and layer
    offsets; here a chunk returns only the names, and the checkpoint code does the rest.
    """

    def sharded_state_keys(self) -> Mapping[str, str]:
        """Each key of ``state_dict()`` mapped to its name in the unpipelined model.

        Names must not depend on the pipeline layout (a layer's global index, not its
        index in the chunk). Two local keys may map to one name when they hold copies of one
        tensor (a tied embedding); their values must then be equal when saved.
        """


def chunk_global_keys(chunk: torch.nn.Module, index: int) -> dict[str, str]:
    """The global name of every ``state_dict`` key of chunk `index` (wrappers unwrapped).

    Raises:
        TypeError: The chunk has no ``sharded_state_keys`` method.
        ValueError: Its answer does not cover exactly the chunk's ``state_dict`` keys.
    """
    inner = unwrap_model(chunk)
    method = getattr(inner, "sharded_state_keys", None)
    if not callable(method):
        raise TypeError(
            f"model chunk {index} ({type(inner).__name__}) has no sharded_state_keys() method; "
            "the torch_dist format names every tensor by its global name and needs it (see "
            "pp_train.checkpoint.ShardedStateKeys), or save with ckpt_format='torch'"
        )
    keys = {str(local): str(name) for local, name in dict(method()).items()}
    expected = list(inner.state_dict())
    missing = [key for key in expected if key not in keys]
    unexpected = [key for key in keys if key not in expected]
    if missing or unexpected:
        raise ValueError(
            f"model chunk {index} ({type(inner).__name__}): sharded_state_keys() must name "
            f"every state_dict key; missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return keys


def model_targets(model: Sequence[torch.nn.Module]) -> dict[str, list[torch.Tensor]]:
    """Each ``model.<global name>`` key with the local tensors holding it (tied: several)."""
    targets: dict[str, list[torch.Tensor]] = {}
    for index, chunk in enumerate(model):
        state = unwrap_model(chunk).state_dict(keep_vars=True)
        for local, name in chunk_global_keys(chunk, index).items():
            targets.setdefault(MODEL_PREFIX + name, []).append(state[local])
    return targets


@dataclasses.dataclass(frozen=True)
class MainParam:
    """One parameter the inner optimizer updates: its global name and position."""

    name: str
    """Its global name."""
    group: int
    """Its parameter group."""
    param: torch.Tensor
    """The tensor the inner optimizer updates (an fp32 main copy or the model's own)."""
    is_copy: bool
    """Whether `param` is an fp32 copy of an fp16/bf16 model parameter."""


def main_params(model: Sequence[torch.nn.Module], optimizer: MegatronOptimizer) -> list[MainParam]:
    """The inner optimizer's parameters in its order (torch's state-dict indices), named.

    Raises:
        ValueError: A parameter of the optimizer belongs to none of the chunks.
    """
    names: dict[int, tuple[str, bool]] = {}
    for index, chunk in enumerate(model):
        keys = chunk_global_keys(chunk, index)
        for local, param in unwrap_model(chunk).named_parameters():
            main = getattr(param, "main_param", None)
            names[id(param if main is None else main)] = (keys[local], main is not None)
    found = []
    for group_index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    f"optimizer parameter of shape {tuple(param.shape)} in group {group_index} "
                    "belongs to no model chunk"
                )
            name, is_copy = names[id(param)]
            found.append(MainParam(name, group_index, param, is_copy))
    return found


def optimizer_tensors(
    model: Sequence[torch.nn.Module], optimizer: MegatronOptimizer
) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state and fp32 main copies under their global keys.

    A name held twice (tied copies) is taken from its first holder; the copies have equal
    gradients and so equal state.
    """
    tensors: dict[str, torch.Tensor] = {}
    for main in main_params(model, optimizer):
        for entry, value in optimizer.optimizer.state.get(main.param, {}).items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(f"{OPTIMIZER_STATE_PREFIX}{main.name}.{entry}", value)
        if main.is_copy:
            tensors.setdefault(FP32_PARAM_PREFIX + main.name, main.param.detach())
    return tensors
