"""Activation recomputation, as Megatron-LM's ``--recompute-*`` flags configure it.

Full granularity checkpoints whole transformer layers: their inputs are kept and everything
inside is recomputed during backward. Method ``uniform`` checkpoints consecutive groups of
``num_layers`` layers (only each group's input is kept); ``block`` checkpoints each of the first
``num_layers`` layers of a chunk on its own and runs the rest normally. Selective granularity
recomputes only the core attention (softmax, dropout and the attention-weighted sum), the part
whose activations grow with the square of the sequence length.

Everything runs through non-reentrant `torch.utils.checkpoint.checkpoint` with the random state
preserved, so the recomputed dropout masks are the original ones and a recomputed run gives the
gradients of a plain one bit for bit. Torch preserves only the default generators; dropout
drawn under a model-parallel RNG tracker (`pp_tensor.RNGStatesTracker`: attention dropout at
tensor-parallel size > 1, every dropout under sequence parallelism) is replayed too: each
recomputation starts from the tracker states of the original forward and leaves the tracker
where the original forward left it. Under a split backward (zero-bubble schedules) a
recomputed chunk runs its forward twice, once in the input-gradient and once in the
weight-gradient step (see `pp_schedules.split_backward`).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
from torch.utils.checkpoint import checkpoint

from pp_state.numbers import is_int

__all__ = ["RNGStates", "RecomputeConfig", "checkpoint_core_attention", "run_layers"]

# A ModuleList indexes and has a length, but is no Sequence to a type checker.
Layers = Sequence[torch.nn.Module] | torch.nn.ModuleList


class RNGStates(Protocol):
    """What recomputation needs of an RNG tracker (`pp_tensor.RNGStatesTracker` has it)."""

    def get_states(self) -> dict[str, torch.Tensor]:
        """The named states (a dict the tracker does not change afterwards)."""
        ...

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replaces the named states."""
        ...


_GRANULARITIES = ("full", "selective")
_METHODS = ("uniform", "block")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecomputeConfig:
    """Which activations are recomputed during backward instead of kept (Megatron's flags)."""

    granularity: Literal["full", "selective"] | None = None
    """``full``: checkpoint whole transformer layers (needs `method` and `num_layers`);
    ``selective``: recompute only the core attention; None: recompute nothing
    (``--recompute-granularity``)."""

    method: Literal["uniform", "block"] | None = None
    """With full granularity: ``uniform`` checkpoints groups of `num_layers` consecutive layers;
    ``block`` checkpoints the first `num_layers` layers of each chunk one by one
    (``--recompute-method``)."""

    num_layers: int | None = None
    """With full granularity: layers per checkpointed group (uniform) or checkpointed layers per
    chunk (block) (``--recompute-num-layers``)."""

    def __post_init__(self) -> None:
        """Checks the settings against each other, in Megatron's terms.

        Raises:
            ValueError: An unknown granularity or method; full granularity without a method
                or a layer count of 1 or more; a method or layer count without full
                granularity. The message names the flags, the values and the choices.
        """
        if self.granularity not in (None, *_GRANULARITIES):
            raise ValueError(
                f"--recompute-granularity {self.granularity!r} is not a granularity; use "
                "full or selective"
            )
        if self.method not in (None, *_METHODS):
            raise ValueError(
                f"--recompute-method {self.method!r} is not a method; use uniform or block"
            )
        if self.granularity == "full":
            self._check_full()
            return
        given = [
            f"{flag} {value}"
            for flag, value in (
                ("--recompute-method", self.method),
                ("--recompute-num-layers", self.num_layers),
            )
            if value is not None
        ]
        if given:
            now = (
                "--recompute-granularity selective recomputes the core attention only"
                if self.granularity == "selective"
                else "no --recompute-granularity is set"
            )
            verb = "needs" if len(given) == 1 else "need"
            raise ValueError(
                f"{' and '.join(given)} {verb} --recompute-granularity full; {now}. Use "
                "--recompute-granularity full with --recompute-method uniform or block and "
                "--recompute-num-layers N, or drop them"
            )

    def _check_full(self) -> None:
        """Full granularity names a method and a layer count of 1 or more."""
        if self.method is None:
            raise ValueError(
                "--recompute-granularity full needs --recompute-method: uniform (groups of "
                "--recompute-num-layers layers) or block (the first --recompute-num-layers "
                "layers of each chunk)"
            )
        if self.num_layers is None:
            raise ValueError(
                f"--recompute-granularity full with --recompute-method {self.method} needs "
                "--recompute-num-layers N (1 or more)"
            )
        if not is_int(self.num_layers):
            raise TypeError(
                f"--recompute-num-layers must be an int, got {type(self.num_layers).__name__} "
                f"{self.num_layers!r}"
            )
        if self.num_layers < 1:
            raise ValueError(
                f"--recompute-num-layers must be 1 or more (up to the layers of a chunk), got "
                f"{self.num_layers}"
            )

    @property
    def enabled(self) -> bool:
        """Whether anything is recomputed."""
        return self.granularity is not None

    def for_chunk(self, layers: int) -> RecomputeConfig:
        """This configuration for a chunk of `layers` transformer layers.

        ``--recompute-num-layers`` is one number for every chunk of the run; a chunk holding
        fewer layers (uneven stages) recomputes all of its layers, as Megatron's loop over a
        shorter chunk does: `num_layers` is capped at `layers`. A chunk without layers gets
        this configuration unchanged (`run_layers` has nothing to run).
        """
        if self.num_layers is None or layers < 1 or self.num_layers <= layers:
            return self
        return dataclasses.replace(self, num_layers=layers)


def _checkpointed(
    function: Callable[..., Any], *args: Any, rng_tracker: RNGStates | None = None, **kwargs: Any
) -> Any:
    """`function` run under non-reentrant checkpoint, with the random state preserved.

    Torch preserves the default generators; the states of `rng_tracker` (when given) are
    replayed by `_replaying`.
    """
    if not torch.is_grad_enabled():  # forward only (evaluation): nothing to recompute
        return function(*args, **kwargs)
    if rng_tracker is not None:
        function = _replaying(function, rng_tracker)
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _states_copy(tracker: RNGStates) -> dict[str, torch.Tensor]:
    return {name: state.clone() for name, state in tracker.get_states().items()}


def _replaying(function: Callable[..., Any], tracker: RNGStates) -> Callable[..., Any]:
    """`function`, whose later runs (the recomputations) see the tracker as the first run did.

    A split backward recomputes twice, so every later run starts from the first run's states;
    after each, the tracker gets back the states it had before it (the original forward's
    advance, which the next forwards continue from).
    """
    first: list[dict[str, torch.Tensor]] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        if not first:
            first.append(_states_copy(tracker))
            return function(*args, **kwargs)
        advanced = _states_copy(tracker)
        tracker.set_states(dict(first[0]))
        try:
            return function(*args, **kwargs)
        finally:
            tracker.set_states(advanced)

    return run


def _run_plain(layers: Layers, hidden: torch.Tensor, **layer_kwargs: Any) -> torch.Tensor:
    for layer in layers:
        hidden = layer(hidden, **layer_kwargs)
    return hidden


def _groups(config: RecomputeConfig, count: int) -> list[tuple[range, bool]]:
    """Runs of layer indices and whether each is checkpointed, in order."""
    assert config.num_layers is not None
    if config.method == "uniform":
        size = config.num_layers
        return [(range(s, min(s + size, count)), True) for s in range(0, count, size)]
    return [(range(i, i + 1), i < config.num_layers) for i in range(count)]


def run_layers(
    layers: Layers,
    hidden: torch.Tensor,
    config: RecomputeConfig | None,
    *,
    rng_tracker: RNGStates | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Runs `layers` on `hidden` in order, checkpointing them as `config` says.

    With full granularity, method ``uniform`` checkpoints consecutive groups of
    ``config.num_layers`` layers (the last group may be shorter) and ``block`` checkpoints each
    of the first ``config.num_layers`` layers alone and runs the rest normally (Megatron's
    ``TransformerBlock._checkpointed_forward``). Otherwise (None, no granularity, or selective,
    which `checkpoint_core_attention` applies) the layers run normally. Without layers,
    `hidden` is returned as it is.

    Args:
        layers: The chunk's transformer layers, each taking and returning one tensor.
        hidden: The chunk's input activations.
        config: What to recompute; None: nothing.
        rng_tracker: The model-parallel RNG tracker the layers' dropout may draw under;
            recomputation replays its states. None: only the default generators are used.
        document_ids: Packed documents' ids, handed to every layer as ``document_ids=``
            (and kept for its recomputation); None: layers get `hidden` alone.

    Returns:
        The last layer's output.

    Raises:
        ValueError: ``config.num_layers`` exceeds the layers given (see
            `RecomputeConfig.for_chunk` for a run whose chunks differ).
    """
    extra = {} if document_ids is None else {"document_ids": document_ids}
    if config is None or config.granularity != "full" or not layers:
        return _run_plain(layers, hidden, **extra)
    assert config.num_layers is not None
    if config.num_layers > len(layers):
        raise ValueError(
            f"--recompute-num-layers {config.num_layers} exceeds the {len(layers)} layers of "
            f"this chunk; use 1 .. {len(layers)}"
        )
    for indices, recomputed in _groups(config, len(layers)):
        group = [layers[i] for i in indices]
        if recomputed:
            hidden = _checkpointed(_run_plain, group, hidden, rng_tracker=rng_tracker, **extra)
        else:
            hidden = _run_plain(group, hidden, **extra)
    return hidden


def _checkpointed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's class forward, under checkpoint (bound to one instance)."""
    tracker = getattr(self, "rng_tracker", None)
    return _checkpointed(type(self).forward, self, *args, rng_tracker=tracker, **kwargs)


def checkpoint_core_attention(module: torch.nn.Module) -> int:
    """Selective recompute: checkpoints every submodule named ``core_attention``.

    Each such submodule (Megatron's attribute name for the attention's softmax, dropout and
    weighted sum) gets an instance ``forward`` that runs its class's forward under
    non-reentrant checkpoint. Names of parameters and ``state_dict`` keys do not change, so
    checkpoints stay loadable; calling this again changes nothing. A submodule whose dropout
    draws under a model-parallel RNG tracker exposes it as ``rng_tracker`` (an attribute or
    property; None or absent: none), and its recomputation replays the tracker's states. A
    ``copy.deepcopy`` of the module keeps the checkpointing (the forward is re-bound to the
    copy).

    Args:
        module: The model or chunk to search.

    Returns:
        How many ``core_attention`` submodules are checkpointed.

    Raises:
        ValueError: No submodule is named ``core_attention``.
    """
    found = [
        sub for name, sub in module.named_modules() if name.rpartition(".")[2] == "core_attention"
    ]
    if not found:
        raise ValueError(
            f"selective recompute needs attention marked as core_attention; "
            f"{type(module).__name__} has no submodule named core_attention (Megatron's name "
            "for the softmax, dropout and weighted sum of attention); name it so, or use "
            "--recompute-granularity full"
        )
    for sub in found:
        bound = sub.__dict__.get("forward")
        if not (isinstance(bound, types.MethodType) and bound.__func__ is _checkpointed_forward):
            sub.forward = types.MethodType(_checkpointed_forward, sub)
    return len(found)
