"""`param_is_not_tensor_parallel_duplicate`: megatron-core 0.20's rule, with groups or ranks.

A split parameter always counts; a whole one counts on rank 0 of its tensor-parallel group,
or of its expert tensor-parallel group for an expert parameter (``allreduce = False``) when
that group is given; with no group the default state's tensor-parallel rank decides.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pp_state import (
    NotInitializedError,
    param_is_not_tensor_parallel_duplicate,
    reset_default_state,
)
from pp_state import parallel_state as mpu
from pp_testing import run_distributed


@pytest.fixture(autouse=True)
def _fresh_default_state() -> Iterator[None]:
    reset_default_state()
    yield
    reset_default_state()


def _params() -> dict[str, torch.nn.Parameter]:
    """A split weight, a whole bias, and a whole expert bias."""
    split, whole, expert = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    split.tensor_model_parallel = True  # type: ignore[attr-defined]
    expert.allreduce = False  # type: ignore[attr-defined]
    return {"split": split, "whole": whole, "expert": expert}


def test_int_form_counts_split_params_everywhere_and_whole_ones_on_rank_0() -> None:
    params = _params()
    for rank in (0, 1, 3):
        assert param_is_not_tensor_parallel_duplicate(params["split"], rank)
        assert param_is_not_tensor_parallel_duplicate(params["whole"], rank) == (rank == 0)
        assert param_is_not_tensor_parallel_duplicate(params["whole"], tp_group=rank) == (rank == 0)


def test_expert_params_use_the_expert_group_when_given() -> None:
    params = _params()
    # Expert tensor parallel 1 beside tensor parallel 2: tp rank 1 is expert tp rank 0.
    assert param_is_not_tensor_parallel_duplicate(params["expert"], 1, expert_tp_group=0)
    assert not param_is_not_tensor_parallel_duplicate(params["expert"], 0, expert_tp_group=1)
    # A dense parameter ignores the expert group; without one, an expert one uses tp_group.
    assert not param_is_not_tensor_parallel_duplicate(params["whole"], 1, expert_tp_group=0)
    assert not param_is_not_tensor_parallel_duplicate(params["expert"], 1)
    # A split expert parameter counts everywhere.
    params["expert"].tensor_model_parallel = True  # type: ignore[attr-defined]
    assert param_is_not_tensor_parallel_duplicate(params["expert"], 1, expert_tp_group=1)


@pytest.mark.reliability
def test_without_a_group_or_a_default_state_the_error_says_what_to_do() -> None:
    params = _params()
    # A split parameter needs no rank, so it needs no state.
    assert param_is_not_tensor_parallel_duplicate(params["split"])
    with pytest.raises(NotInitializedError, match=r"pass tp_group=.*initialize_model_parallel"):
        param_is_not_tensor_parallel_duplicate(params["whole"])
    with pytest.raises(AssertionError, match="tp_group="):  # Megatron's error type too
        param_is_not_tensor_parallel_duplicate(params["expert"], expert_tp_group=None)


def test_without_a_group_megatrons_rank_override_answers() -> None:
    params = _params()
    mpu.set_tensor_model_parallel_rank(1)
    assert not param_is_not_tensor_parallel_duplicate(params["whole"])
    mpu.set_tensor_model_parallel_rank(0)
    assert param_is_not_tensor_parallel_duplicate(params["whole"])


class _Group:
    """Anything with ``rank()``, which megatron-core 0.20 accepts as a group (it calls only
    that): a process-group collection's entry, a stand-in in a ported test."""

    def __init__(self, rank: Any) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank  # type: ignore[no-any-return]  # whatever it was given


def test_any_object_with_a_rank_method_is_taken_as_a_group() -> None:
    params = _params()
    for rank in (0, 1, 3):
        group = _Group(rank)
        assert param_is_not_tensor_parallel_duplicate(params["split"], group)
        assert param_is_not_tensor_parallel_duplicate(params["whole"], group) == (rank == 0)
        assert param_is_not_tensor_parallel_duplicate(params["whole"], tp_group=group) == (
            rank == 0
        )
    # The expert group too: tp rank 1 is expert tp rank 0.
    assert param_is_not_tensor_parallel_duplicate(params["expert"], _Group(1), _Group(0))


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("rank", "error", "words"),
    [
        (-1, ValueError, r"tp_group\.rank\(\) returned -1: .* 0 or more"),
        ("0", TypeError, r"tp_group\.rank\(\) returned '0' \(str\); .* an int"),
    ],
)
def test_a_rank_method_that_gives_no_position_is_refused(
    rank: object, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        param_is_not_tensor_parallel_duplicate(_params()["whole"], _Group(rank))


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("group", "error", "words"),
    [
        (-1, ValueError, "tp_group as an int .* 0 or more, got -1"),
        (-100, ValueError, "got -100"),  # torch's "not a member" marker
        (1.0, TypeError, r"ProcessGroup, .* or None, got 1.0 \(float\)"),
        (True, TypeError, r"got True \(bool\)"),
        ("tp", TypeError, r"got 'tp' \(str\)"),
    ],
)
def test_bad_groups_are_refused_whatever_the_parameter(
    group: object, error: type[Exception], words: str
) -> None:
    split = _params()["split"]
    with pytest.raises(error, match=words):
        param_is_not_tensor_parallel_duplicate(split, group)  # type: ignore[arg-type]
    with pytest.raises(error, match=words.replace("tp_group", "expert_tp_group")):
        param_is_not_tensor_parallel_duplicate(split, 0, expert_tp_group=group)  # type: ignore[arg-type]


def _on_two_ranks() -> dict[str, list[bool]]:
    """Tensor parallel 2, expert parallel 2 with expert tensor parallel 1, on 2 ranks."""
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=0.5,
    )
    tp, etp = mpu.get_tensor_model_parallel_group(), mpu.get_expert_tensor_parallel_group()
    params = _params()
    names = ("split", "whole", "expert")
    seen = {
        "groups": [param_is_not_tensor_parallel_duplicate(params[n], tp, etp) for n in names],
        "tp_only": [param_is_not_tensor_parallel_duplicate(params[n], tp) for n in names],
        "default": [param_is_not_tensor_parallel_duplicate(params[n]) for n in names],
        "default_tp_and_etp": [
            param_is_not_tensor_parallel_duplicate(params[n], expert_tp_group=etp) for n in names
        ],
    }
    mpu.destroy_model_parallel()
    return seen


def test_groups_and_the_default_state_on_two_ranks() -> None:
    for rank, seen in enumerate(run_distributed(_on_two_ranks, 2, timeout=60)):
        # Each rank is expert tp rank 0 of its own group: expert parameters count on both.
        assert seen["groups"] == [True, rank == 0, True]
        assert seen["default_tp_and_etp"] == [True, rank == 0, True]
        # Without the expert group every whole parameter counts on tp rank 0 only.
        assert seen["tp_only"] == [True, rank == 0, rank == 0]
        assert seen["default"] == [True, rank == 0, rank == 0]
