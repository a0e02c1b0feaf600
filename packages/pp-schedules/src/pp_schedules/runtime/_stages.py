"""Pipeline chunks of any model, and what crosses each boundary between them.

A `PipelineChunk` runs consecutive parts of a model in order. The first part of the model
takes the microbatch's inputs; each part takes what the one before returned (a tensor as one
argument, a tuple as several, a dict as keywords). Keyword inputs given to the chunk
(``chunk(tokens, position_ids=p)``) reach every part whose forward takes them: per-microbatch
inputs that need no sending (position ids, masks computed from the batch) come from each
stage's own data iterator.

What crosses each boundary (a tensor, a tuple or a dict of tensors, their shapes and dtypes)
is a `Boundary`; the executor sends and receives by it, so no hidden size and no particular
batch dimension is assumed. Gradients travel back for the floating-point tensors of a
boundary. `PipelineModel` builds the chunks and their boundaries.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from pp_state.placement import Placement

__all__ = ["Boundary", "PipelineChunk", "TensorSpec"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a boundary: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def carries_grad(self) -> bool:
        """Whether a gradient travels back for it (floating-point tensors)."""
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclasses.dataclass(frozen=True)
class Boundary:
    """What one virtual stage hands the next: a tensor, or a tuple or dict of tensors.

    Attributes:
        kind: "tensor", "tuple" or "dict".
        keys: The dict's keys in order (empty otherwise).
        specs: One `TensorSpec` per tensor, in sending order.
    """

    kind: Literal["tensor", "tuple", "dict"]
    keys: tuple[str, ...]
    specs: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, value: Any, where: str) -> Boundary:
        """The boundary `value` crosses; `where` names its producer in errors.

        Raises:
            TypeError: `value` is not a tensor, nor a non-empty tuple, list or dict of tensors.
        """
        if isinstance(value, torch.Tensor):
            return cls("tensor", (), (_spec(value),))
        if isinstance(value, Mapping) and value:
            bad = [k for k, v in value.items() if not isinstance(v, torch.Tensor)]
            if not bad and all(isinstance(k, str) for k in value):
                return cls("dict", tuple(value), tuple(_spec(v) for v in value.values()))
            raise TypeError(
                f"{where} returned a dict whose entries {bad} are not tensors (or whose keys "
                "are not strings); only tensors cross a pipeline boundary: compute the others "
                "on every stage from the microbatch (keyword inputs of the chunk)"
            )
        if isinstance(value, (tuple, list)) and value:
            bad_at = [i for i, v in enumerate(value) if not isinstance(v, torch.Tensor)]
            if not bad_at:
                return cls("tuple", (), tuple(_spec(v) for v in value))
            raise TypeError(
                f"{where} returned a {type(value).__name__} whose items {bad_at} are not "
                f"tensors ({', '.join(type(value[i]).__name__ for i in bad_at)}); only tensors "
                "cross a pipeline boundary"
            )
        raise TypeError(
            f"{where} returned {type(value).__name__}; a stage that is not the last must return "
            "a tensor, or a non-empty tuple or dict of tensors, for the next stage"
        )

    @classmethod
    def tensor(cls, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> Boundary:
        """A boundary of one tensor (a declared contract)."""
        return cls("tensor", (), (TensorSpec(tuple(shape), dtype),))

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """Every tensor's shape, in sending order."""
        return [s.shape for s in self.specs]

    @property
    def dtypes(self) -> list[torch.dtype]:
        """Every tensor's dtype, in sending order."""
        return [s.dtype for s in self.specs]

    @property
    def grad_specs(self) -> list[TensorSpec]:
        """The tensors whose gradients travel back, in order."""
        return [s for s in self.specs if s.carries_grad]

    def flatten(self, value: Any, where: str) -> list[torch.Tensor]:
        """`value`'s tensors in sending order, after checking it fits this boundary.

        Raises:
            ValueError: `value` has another structure, keys, count or dtypes; naming both.
        """
        found = Boundary.of(value, where)
        if (found.kind, found.keys, found.dtypes) != (self.kind, self.keys, self.dtypes):
            raise ValueError(
                f"{where} returned {found.describe()}, but its contract is {self.describe()}; "
                "infer the contracts again from a sample of the data it runs on"
            )
        if isinstance(value, torch.Tensor):
            return [value]
        return list(value.values()) if isinstance(value, Mapping) else list(value)

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The tensors as the structure they were sent from."""
        if self.kind == "tensor":
            return tensors[0]
        if self.kind == "dict":
            return dict(zip(self.keys, tensors, strict=True))
        return tuple(tensors)

    def describe(self) -> str:
        """``a dict {hidden: (2, 16, 64) float32, ids: (2, 16) int64}``."""
        parts = [f"{tuple(s.shape)} {str(s.dtype).removeprefix('torch.')}" for s in self.specs]
        if self.kind == "tensor":
            return f"a tensor {parts[0]}"
        if self.kind == "dict":
            inner = ", ".join(f"{k}: {p}" for k, p in zip(self.keys, parts, strict=True))
            return f"a dict {{{inner}}}"
        return f"a tuple ({', '.join(parts)})"


def _spec(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(tensor.shape), tensor.dtype)


def _accepted(module: torch.nn.Module) -> frozenset[str] | None:
    """The keyword inputs `module`'s forward takes; None when it takes any (``**kwargs``)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin forward: no keywords beyond its own
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )


def _call(part: torch.nn.Module, value: Any, side: Mapping[str, Any], takes: Any) -> Any:
    """Run `part` on what the part before it returned, with the keyword inputs it takes."""
    keywords = dict(side) if takes is None else {k: v for k, v in side.items() if k in takes}
    if isinstance(value, Mapping):
        return part(**value, **keywords)
    if isinstance(value, tuple):
        return part(*value, **keywords)
    return part(value, **keywords)


class PipelineChunk(torch.nn.Module):
    """Consecutive parts of a model: the virtual stage `stage` of `placement`.

    Its parameters are those of its parts; `model_state_dict` and `load_model_state_dict`
    use the whole model's names (``model.layers.3.mlp.up_proj.weight``).
    """

    def __init__(
        self,
        parts: Sequence[tuple[str, torch.nn.Module]],
        *,
        stage: int,
        placement: Placement,
    ) -> None:
        """Holds `parts` (name, module) in order, as virtual stage `stage` of `placement`."""
        super().__init__()
        self.part_names: tuple[str, ...] = tuple(name for name, _ in parts)
        """Each part's name in the whole model, in order."""
        self.parts = torch.nn.ModuleList(module for _, module in parts)
        self.stage = stage
        """The virtual stage this chunk is."""
        self.pipeline_placement = placement
        """The placement the chunk was built for (the executor refuses another)."""
        self.input_boundary: Boundary | None = None
        """What the chunk receives (None on the first stage, or before contracts are set)."""
        self.output_boundary: Boundary | None = None
        """What the chunk sends (None on the last stage, or before contracts are set)."""
        self._takes = [_accepted(module) for module in self.parts]
        self._input: list[torch.Tensor] | None = None

    @property
    def is_first(self) -> bool:
        """Whether this chunk is the model's first stage (it reads the microbatch)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this chunk is the model's last stage (its output goes to the loss)."""
        return self.stage == self.pipeline_placement.num_stages - 1

    def set_input_tensor(self, input_tensor: Sequence[torch.Tensor | None] | None) -> None:
        """The executor's hook: the tensors the previous stage sent ([None] on the first)."""
        tensors = [t for t in input_tensor or () if t is not None]
        self._input = tensors or None

    def forward(self, *inputs: Any, **side: Any) -> Any:
        """Run the parts in order.

        Args:
            inputs: The microbatch's inputs to the model's first part (read on the first stage
                only; the others start from what they received).
            side: Keyword inputs given to every part whose forward takes them.

        Returns:
            What the last part returns: the next stage's input, or the model's output.
        """
        value: Any
        if self.is_first:
            value = inputs[0] if len(inputs) == 1 else tuple(inputs)
        else:
            if self._input is None or self.input_boundary is None:
                raise RuntimeError(
                    f"virtual stage {self.stage} has no input: the executor sets it from the "
                    "stage before, by the contracts (PipelineModel.infer_contracts or "
                    "declare_contracts, called before the first step)"
                )
            value = self.input_boundary.unflatten(self._input)
        for part, takes in zip(self.parts, self._takes, strict=True):
            value = _call(part, value, side, takes)
        return value

    def flatten_output(self, output: Any) -> list[torch.Tensor]:
        """The executor's hook: the output's tensors in sending order, checked by contract."""
        if self.output_boundary is None:
            return [output] if isinstance(output, torch.Tensor) else list(output)
        return self.output_boundary.flatten(output, f"virtual stage {self.stage}")

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The chunk's state under the whole model's names."""
        return {
            f"{name}.{key}": value
            for name, part in zip(self.part_names, self.parts, strict=True)
            for key, value in part.state_dict().items()
        }

    def load_model_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load this chunk's entries of a whole model's state dict (others are ignored).

        Raises:
            KeyError: With `strict`, an entry of this chunk is missing; naming it.
        """
        for name, part in zip(self.part_names, self.parts, strict=True):
            prefix = f"{name}."
            mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
            missing = [k for k in part.state_dict() if k not in mine]
            if strict and missing:
                raise KeyError(
                    f"the state dict has no {', '.join(prefix + k for k in missing[:3])}"
                    f"{' ...' if len(missing) > 3 else ''} for part {name!r} of virtual stage "
                    f"{self.stage}"
                )
            part.load_state_dict(mine, strict=strict)
