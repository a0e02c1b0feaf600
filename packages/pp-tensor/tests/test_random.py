"""The model-parallel RNG tracker: named states swapped in by fork, seeded per tp rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pp_state import parallel_state
from pp_tensor import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    CudaRNGStatesTracker,
    RNGStatesTracker,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
    model_parallel_seeds,
)
from pp_testing import run_distributed


def _draws(seed: int, count: int) -> torch.Tensor:
    return torch.rand(count, generator=torch.Generator().manual_seed(seed))


def test_fork_swaps_and_restores_the_default_generator() -> None:
    tracker = RNGStatesTracker("cpu")
    tracker.add("dropout", 7)
    torch.manual_seed(1)
    with tracker.fork("dropout"):
        first = torch.rand(3)
    outside = torch.rand(3)
    with tracker.fork("dropout"):
        second = torch.rand(3)
    torch.testing.assert_close(outside, _draws(1, 3))  # the fork drew nothing from it
    torch.testing.assert_close(torch.cat([first, second]), _draws(7, 6))  # the named state advanced


def test_nested_forks_draw_as_unnested() -> None:
    """fork(s1) { draw; fork(s2) { draw; fork(s1) { draw }; draw }; draw }, and outside."""
    tracker = RNGStatesTracker("cpu")
    tracker.add("s1", 11)
    tracker.add("s2", 22)
    torch.manual_seed(3)
    drawn: dict[str, list[torch.Tensor]] = {"s1": [], "s2": []}
    with tracker.fork("s1"):
        drawn["s1"].append(torch.rand(2))
        with tracker.fork("s2"):
            drawn["s2"].append(torch.rand(2))
            with tracker.fork("s1"):
                drawn["s1"].append(torch.rand(2))
            drawn["s2"].append(torch.rand(2))
        drawn["s1"].append(torch.rand(2))
    outside = torch.rand(2)
    with tracker.fork("s1"):  # continues after every draw above
        drawn["s1"].append(torch.rand(2))
    torch.testing.assert_close(torch.cat(drawn["s1"]), _draws(11, 8))
    torch.testing.assert_close(torch.cat(drawn["s2"]), _draws(22, 4))
    torch.testing.assert_close(outside, _draws(3, 2))


def test_get_and_set_states_round_trip_and_restore_draws() -> None:
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    saved = tracker.get_states()
    assert sorted(saved) == ["a", "b"]
    with tracker.fork("a"):
        drawn = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork("a"):
        again = torch.rand(4)
    torch.testing.assert_close(again, drawn)
    assert tracker.get_states()["b"] is saved["b"]
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("a", 1)  # the name and seed are free again after reset


def test_model_parallel_seeds_and_manual_seed() -> None:
    assert model_parallel_seeds(1234, 3) == (1234, 1234 + 2718 + 3)
    tracker = model_parallel_manual_seed(10, tp_rank=1, tracker=RNGStatesTracker(), device="cpu")
    torch.testing.assert_close(torch.rand(2), _draws(10, 2))
    with tracker.fork():
        torch.testing.assert_close(torch.rand(2), _draws(10 + 2718 + 1, 2))
    assert list(tracker.get_states()) == [
        DATA_PARALLEL_RNG,
        MODEL_PARALLEL_RNG,
        EXPERT_PARALLEL_RNG,
    ]
    with tracker.fork(get_data_parallel_rng_tracker_name()):
        torch.testing.assert_close(torch.rand(2), _draws(10, 2))
    with tracker.fork(get_expert_parallel_rng_tracker_name()):
        torch.testing.assert_close(torch.rand(2), _draws(10 + 1024, 2))
    tracker = model_parallel_manual_seed(10, tp_rank=0, ep_rank=2, etp_rank=1, tracker=tracker)
    with tracker.fork(EXPERT_PARALLEL_RNG):
        torch.testing.assert_close(torch.rand(2), _draws(10 + 1024 + 200 + 1, 2))


def test_megatron_names_use_the_default_tracker_and_state_rank() -> None:
    assert CudaRNGStatesTracker is RNGStatesTracker
    assert get_cuda_rng_tracker() is get_rng_tracker()
    parallel_state.set_tensor_model_parallel_rank(1)
    torch.manual_seed(99)
    try:
        tracker = model_parallel_cuda_manual_seed(3, ep_rank=0, etp_rank=0)
    finally:
        parallel_state.set_tensor_model_parallel_rank(None)
    assert tracker is get_rng_tracker()
    # Megatron seeds CUDA and the tracker only: the CPU generator goes on from its own seed.
    torch.testing.assert_close(torch.rand(2), _draws(99, 2))
    if tracker.device.type == "cpu":
        with tracker.fork():
            torch.testing.assert_close(torch.rand(2), _draws(3 + 2718 + 1, 2))


def _draws_on_each_rank() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tracker = model_parallel_manual_seed(
        42, tp_rank=dist.get_rank(), tracker=RNGStatesTracker("cpu")
    )
    replicated = torch.nn.functional.dropout(torch.ones(64), p=0.5)
    with tracker.fork():
        split = torch.nn.functional.dropout(torch.ones(64), p=0.5)
    return replicated, split, torch.rand(4)


def test_fork_draws_differ_across_tp_ranks_and_default_draws_match() -> None:
    (replicated0, split0, after0), (replicated1, split1, after1) = run_distributed(
        _draws_on_each_rank, 2
    )
    torch.testing.assert_close(replicated0, replicated1)
    torch.testing.assert_close(after0, after1)  # forks leave the default stream in step
    assert not torch.equal(split0, split1)


@pytest.mark.reliability
def test_repeated_names_and_seeds_and_unknown_forks_are_refused() -> None:
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="RNG state 'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used by another RNG state"):
        tracker.add("b", 1)
    with (
        pytest.raises(KeyError, match=r"RNG state 'c' is not tracked; known states: \['a'\]"),
        tracker.fork("c"),
    ):
        pass
