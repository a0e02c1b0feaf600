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
    "DATA_PARALLEL_RNG",
    "EP_SEED_OFFSET",
    "EXPERT_PARALLEL_RNG",
    "MODEL_PARALLEL_RNG",
    "TP_SEED_OFFSET",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "add_model_parallel_states",
    "convert_cuda_rng_state",
    "expert_parallel_seed",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_rng_tracker",
    "initialize_rng_tracker",
    "is_graph_safe_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "model_parallel_seeds",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The name of the tensor-parallel RNG state (Megatron's ``_MODEL_PARALLEL_RNG_TRACKER_NAME``)."""

EXPERT_PARALLEL_RNG = "expert-parallel-rng"
"""The state MoE expert layers draw from: different over expert-model and expert-tensor
parallelism, equal over expert data parallelism."""

DATA_PARALLEL_RNG = "data-parallel-rng"
"""A state seeded with the run's seed itself: equal on every tensor-parallel rank."""

TP_SEED_OFFSET = 2718
"""Megatron's offset of the tensor-parallel seed from the default seed."""

EP_SEED_OFFSET = 1024
"""Megatron's offset of the expert-parallel seed from the default seed."""


def get_expert_parallel_rng_tracker_name() -> str:
    """`EXPERT_PARALLEL_RNG` (Megatron's getter)."""
    return EXPERT_PARALLEL_RNG


def get_data_parallel_rng_tracker_name() -> str:
    """`DATA_PARALLEL_RNG` (Megatron's getter)."""
    return DATA_PARALLEL_RNG


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

    use_cudagraphable_rng = False
    """Megatron's flag of a CUDA-graph-safe tracker: pp has none (see `initialize_rng_tracker`)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()
        self._active: list[str] = []  # the forks open, innermost last
        self._initialized = False

    def is_initialized(self) -> bool:
        """Whether a state was added or set since the last `reset` (Megatron's test)."""
        return self._initialized

    def reset(self) -> None:
        """Forgets every state and seed."""
        self._states = {}
        self._seeds = set()
        self._initialized = False

    def get_states(self) -> dict[str, torch.Tensor]:
        """The states by name (a new dict; the tensors are replaced, never changed, by forks)."""
        return dict(self._states)

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Replaces the states by `states` (from `get_states`); the seeds in use stay known."""
        self._states = dict(states)
        self._initialized = True

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
        self._initialized = True

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
                "(model_parallel_manual_seed adds the data-, tensor- and expert-parallel ones)"
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


class _InferenceRNGStatesTracker(RNGStatesTracker):
    """Megatron's inference tracker: adding and setting states do nothing.

    A fork draws from the default generator.
    """

    def add(self, name: str, seed: int) -> None:
        """Does nothing (inference draws no dropout)."""

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Does nothing."""

    def fork(self, name: str = MODEL_PARALLEL_RNG) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        """A block that changes nothing."""
        return contextlib.nullcontext()


CudaRNGStatesTracker = RNGStatesTracker
"""Megatron's name of the tracker."""

_TRACKER: RNGStatesTracker | None = None


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Makes the process's default tracker, unless one exists (`force_reset`: anew).

    Args:
        use_te_rng_tracker: Transformer Engine's tracker: pp has none; True is refused.
        inference_rng_tracker: A tracker that adds nothing and forks to nothing (inference).
        use_cudagraphable_rng: CUDA-graph-safe states: pp has none; True is refused.
        force_reset: Replace an existing tracker.

    Raises:
        ValueError: `use_te_rng_tracker` or `use_cudagraphable_rng` asked for.
    """
    global _TRACKER  # noqa: PLW0603 - one default tracker per process, made lazily
    for flag, value in (
        ("use_te_rng_tracker", use_te_rng_tracker),
        ("use_cudagraphable_rng", use_cudagraphable_rng),
    ):
        if value:
            raise ValueError(
                f"{flag}=True: pp has no Transformer Engine or CUDA-graph-safe RNG tracker; "
                "use False (the plain tracker)"
            )
    if force_reset:
        _TRACKER = None
    if _TRACKER is None:
        kind = _InferenceRNGStatesTracker if inference_rng_tracker else RNGStatesTracker
        _TRACKER = kind(_default_device())


def get_rng_tracker() -> RNGStatesTracker:
    """The process's default tracker, made on first use (CUDA when available, else CPU)."""
    initialize_rng_tracker()
    assert _TRACKER is not None
    return _TRACKER


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> RNGStatesTracker:
    """Megatron's name of `get_rng_tracker`.

    The arguments apply when the tracker is made (`initialize_rng_tracker`).
    """
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return get_rng_tracker()


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker: object) -> bool:
    """Whether `cuda_rng_tracker` keeps CUDA-graph-safe states: never for pp's trackers."""
    return bool(getattr(cuda_rng_tracker, "use_cudagraphable_rng", False))


def convert_cuda_rng_state(
    state: torch.Tensor | torch.Generator, to_graphable: bool = False
) -> torch.Tensor | torch.Generator:
    """Megatron's conversion between a state tensor and a graph-safe generator.

    A tensor stays a tensor and a generator becomes its state tensor; converting to the
    graph-safe form needs CUDA graphs, which pp does not capture, and is refused.

    Raises:
        ValueError: `to_graphable` for a tensor, or a state of another type.
    """
    if isinstance(state, torch.Generator):
        return state if to_graphable else state.get_state()
    if not isinstance(state, torch.Tensor):
        raise ValueError(
            f"an RNG state is a tensor or a torch.Generator, got {type(state).__name__}"
        )
    if to_graphable:
        raise ValueError(
            "convert_cuda_rng_state(to_graphable=True): pp keeps no CUDA-graph-safe RNG states"
        )
    return state


def model_parallel_seeds(seed: int, tp_rank: int) -> tuple[int, int]:
    """(default seed, tensor-parallel seed): ``(seed, seed + 2718 + tp_rank)``."""
    return seed, seed + TP_SEED_OFFSET + tp_rank


def expert_parallel_seed(seed: int, ep_rank: int, etp_rank: int) -> int:
    """The expert-parallel state's seed: ``seed + 1024 + 100 * ep_rank + etp_rank``."""
    return seed + EP_SEED_OFFSET + 100 * ep_rank + etp_rank


def add_model_parallel_states(
    tracker: RNGStatesTracker, seed: int, *, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0
) -> RNGStatesTracker:
    """Resets `tracker` to Megatron's three states: data-, tensor- and expert-parallel.

    The default generators are left alone. A tracker built for a measurement (a memory
    warm-up) then holds what the run's holds.
    """
    for name, value in (("tp_rank", tp_rank), ("ep_rank", ep_rank), ("etp_rank", etp_rank)):
        check_int(name, value, 0)
    tracker.reset()
    tracker.add(DATA_PARALLEL_RNG, seed)
    tracker.add(MODEL_PARALLEL_RNG, model_parallel_seeds(seed, tp_rank)[1])
    tracker.add(EXPERT_PARALLEL_RNG, expert_parallel_seed(seed, ep_rank, etp_rank))
    return tracker


def model_parallel_manual_seed(
    seed: int,
    *,
    tp_rank: int,
    ep_rank: int = 0,
    etp_rank: int = 0,
    tracker: RNGStatesTracker | None = None,
    device: torch.device | str | None = None,
) -> RNGStatesTracker:
    """Seeds the default generators with `seed` and the tracker's three states.

    Every tensor-parallel rank then draws the same default numbers and different forked ones.
    Unlike Megatron's `model_parallel_cuda_manual_seed`, this seeds every default generator
    (``torch.manual_seed``: the CPU one too), so a model built on the CPU after it is the
    same at every call.

    Args:
        seed: The run's seed (the same on every rank of a model replica).
        tp_rank: This rank's tensor-parallel rank.
        ep_rank: This rank's expert-model-parallel rank.
        etp_rank: This rank's expert-tensor-parallel rank.
        tracker: The tracker to reset and seed (None: the process default).
        device: Make the tracker swap this device's generator ("cpu" or "cuda"); None keeps
            its device.

    Returns:
        The tracker, holding `DATA_PARALLEL_RNG` (seed), `MODEL_PARALLEL_RNG` (seed + 2718 +
        tp_rank) and `EXPERT_PARALLEL_RNG` (seed + 1024 + 100 ep_rank + etp_rank).
    """
    check_int("seed", seed, 0)
    torch.manual_seed(seed)  # the CPU generator and, where present, every CUDA one
    tracker = get_rng_tracker() if tracker is None else tracker
    if device is not None:
        tracker.device = torch.device(device)
    return add_model_parallel_states(
        tracker, seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank
    )


def _default_rank(value: int | None, getter: str) -> int:
    if value is not None:
        return value
    from pp_state import parallel_state

    rank: int = getattr(parallel_state, getter)()
    return rank


def model_parallel_cuda_manual_seed(  # noqa: PLR0917 - Megatron's signature
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    gtp_remat_rank: int | None = None,
    egtp_remat_rank: int | None = None,
    force_reset_rng: bool = False,
    gtp_remat_world_size: int | None = None,
    egtp_remat_world_size: int | None = None,
) -> RNGStatesTracker:
    """Megatron's seeding: the CUDA default generator and the default tracker's three states.

    The CPU generator is left alone, as Megatron leaves it (seed it with ``torch.manual_seed``
    first, as Megatron's training setup does). Without CUDA only the tracker is seeded.

    Args:
        seed: The run's seed.
        te_rng_tracker: Refused when True (`initialize_rng_tracker`).
        inference_rng_tracker: Make the tracker an inference one (when it is made).
        use_cudagraphable_rng: Refused when True.
        tp_rank: This rank's tensor-parallel rank; None reads pp-state's default state
            (`pp_state.parallel_state`), as do `ep_rank` and `etp_rank`.
        ep_rank: This rank's expert-model-parallel rank.
        etp_rank: This rank's expert-tensor-parallel rank.
        gtp_remat_rank: 0.20's generalized tensor-parallel rank (experts: `egtp_remat_rank`):
            ignored, the world sizes below being 1 (pp has no such parallelism).
        egtp_remat_rank: See `gtp_remat_rank`.
        force_reset_rng: Make the tracker anew (with the arguments above).
        gtp_remat_world_size: None or 1 (so is `egtp_remat_world_size`); more is refused.
        egtp_remat_world_size: See `gtp_remat_world_size`.

    Returns:
        The default tracker.

    Raises:
        ValueError: A generalized tensor-parallel world size above 1.
    """
    del gtp_remat_rank, egtp_remat_rank  # no state of theirs at world size 1 (Megatron's rule)
    for name, size in (
        ("gtp_remat_world_size", gtp_remat_world_size),
        ("egtp_remat_world_size", egtp_remat_world_size),
    ):
        if size not in (None, 1):
            raise ValueError(f"{name}={size}: pp has no generalized tensor parallelism; use 1")
    check_int("seed", seed, 0)
    tp_rank = _default_rank(tp_rank, "get_tensor_model_parallel_rank")
    ep_rank = _default_rank(ep_rank, "get_expert_model_parallel_rank")
    etp_rank = _default_rank(etp_rank, "get_expert_tensor_parallel_rank")
    initialize_rng_tracker(
        te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng
    )
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    return add_model_parallel_states(
        get_rng_tracker(), seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank
    )
