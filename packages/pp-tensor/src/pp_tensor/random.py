"""Named RNG states, so dropout differs over tensor parallelism where it must and matches elsewhere.

The rule (Megatron's): dropout on activations split over tensor parallelism (attention
probabilities) draws inside ``tracker.fork()``, from a state seeded differently on each
tensor-parallel rank and equally across data parallelism; dropout on activations every
tensor-parallel rank holds whole draws from the default generator, seeded equally on every
tensor-parallel rank. Under sequence parallelism the transformer layers' activations are split
along the sequence, so all their dropout draws inside ``fork()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from pp_state.numbers import check_int

__all__ = [
    "MODEL_PARALLEL_RNG",
    "TP_SEED_OFFSET",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "model_parallel_seeds",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The name of the tensor-parallel RNG state (Megatron's ``_MODEL_PARALLEL_RNG_TRACKER_NAME``)."""

TP_SEED_OFFSET = 2718
"""Megatron's offset of the tensor-parallel seed from the default seed."""


def _default_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_default_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _seeded_state(device: torch.device, seed: int) -> torch.Tensor:
    """The state of a generator of `device` seeded with `seed`, leaving the default one alone."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator.get_state()


class RNGStatesTracker:
    """Named RNG states of one device type, swapped in for the default generator by `fork`.

    Args:
        device: "cpu" or "cuda" (the current CUDA device at each call): whose default
            generator `fork` swaps.

    Attributes:
        device: That device.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()
        self._active: list[str] = []  # the forks open, innermost last

    def reset(self) -> None:
        """Forgets every state and seed."""
        self._states = {}
        self._seeds = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """The states by name (a new dict; the tensors are replaced, never changed, by forks)."""
        return dict(self._states)

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Replaces the states by `states` (from `get_states`); the seeds in use stay known."""
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Adds a state `name` seeded with `seed`; the default generator is untouched.

        Raises:
            ValueError: `name` or `seed` is in use already (two states from one seed would
                draw the same numbers).
        """
        check_int("seed", seed, 0)
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG state")
        self._seeds.add(seed)
        self._states[name] = _seeded_state(self.device, seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draws from state `name` inside the block; the default generator is restored after.

        The named state keeps what the block drew, so the next fork continues from there.
        Forks nest: entering one saves the progress of the fork it is inside by name first,
        and leaving it resumes that fork where it was, so every state draws the same numbers
        nested as unnested.

        Raises:
            KeyError: No state `name`; the message lists the known names.
        """
        if name not in self._states:
            raise KeyError(
                f"RNG state {name!r} is not tracked; known states: {sorted(self._states)} "
                "(model_parallel_manual_seed adds the tensor-parallel one)"
            )
        current = _default_state(self.device)
        if self._active:  # the enclosing fork's progress, saved before this one draws
            self._states[self._active[-1]] = current
        _set_default_state(self.device, self._states[name])
        self._active.append(name)
        try:
            yield
        finally:
            self._active.pop()
            self._states[name] = _default_state(self.device)
            # Back to the enclosing fork as this one left it, or to the default generator.
            resumed = self._states[self._active[-1]] if self._active else current
            _set_default_state(self.device, resumed)


CudaRNGStatesTracker = RNGStatesTracker
"""Megatron's name of the tracker."""

_TRACKER: RNGStatesTracker | None = None


def get_rng_tracker() -> RNGStatesTracker:
    """The process's default tracker, made on first use (CUDA when available, else CPU)."""
    global _TRACKER  # noqa: PLW0603 - one default tracker per process, made lazily
    if _TRACKER is None:
        _TRACKER = RNGStatesTracker("cuda" if torch.cuda.is_available() else "cpu")
    return _TRACKER


get_cuda_rng_tracker = get_rng_tracker
"""Megatron's name of `get_rng_tracker`."""


def model_parallel_seeds(seed: int, tp_rank: int) -> tuple[int, int]:
    """(default seed, tensor-parallel seed): ``(seed, seed + 2718 + tp_rank)``."""
    return seed, seed + TP_SEED_OFFSET + tp_rank


def model_parallel_manual_seed(
    seed: int,
    *,
    tp_rank: int,
    tracker: RNGStatesTracker | None = None,
    device: torch.device | str | None = None,
) -> RNGStatesTracker:
    """Seeds the default generators with `seed` and the tracker's tensor-parallel state.

    Every tensor-parallel rank then draws the same default numbers and different forked ones.

    Args:
        seed: The run's seed (the same on every rank of a model replica).
        tp_rank: This rank's tensor-parallel rank.
        tracker: The tracker to reset and seed (None: the process default).
        device: Make the tracker swap this device's generator ("cpu" or "cuda"); None keeps
            its device.

    Returns:
        The tracker, holding `MODEL_PARALLEL_RNG` only.
    """
    default_seed, tp_seed = model_parallel_seeds(seed, tp_rank)
    torch.manual_seed(default_seed)  # the CPU generator and, where present, every CUDA one
    tracker = get_rng_tracker() if tracker is None else tracker
    if device is not None:
        tracker.device = torch.device(device)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, tp_seed)
    return tracker


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int | None = None) -> RNGStatesTracker:
    """Megatron's name of `model_parallel_manual_seed` on the default tracker.

    Args:
        seed: The run's seed.
        tp_rank: This rank's tensor-parallel rank; None reads it from pp-state's default state
            (`pp_state.parallel_state.get_tensor_model_parallel_rank`).
    """
    if tp_rank is None:
        from pp_state.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
    return model_parallel_manual_seed(seed, tp_rank=tp_rank)
