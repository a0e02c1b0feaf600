"""Placement: which virtual stage each (rank, chunk) holds, and the stage predicates that ask it."""

from __future__ import annotations

import pytest

from pp_state import Placement
from pp_state.stages import first_stage, last_stage


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("vp", [1, 2, 3])
def test_looped_is_megatrons_chunk_times_pp_plus_rank(pp: int, vp: int) -> None:
    placement = Placement.looped(pp, vp)
    for rank in range(pp):
        for chunk in range(vp):
            stage = placement.stage(rank, chunk)
            assert stage == chunk * pp + rank
            assert placement.holder(stage) == (rank, chunk)
    assert str(placement) == "looped"


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_v_shape_puts_stages_r_and_2p_minus_1_minus_r_on_rank_r(pp: int) -> None:
    placement = Placement.v_shape(pp)
    assert placement.stages == tuple((r, 2 * pp - 1 - r) for r in range(pp))
    # The first and last stages share rank 0; the turn of the V stays on the last rank.
    assert placement.is_first(0, 0)
    assert placement.is_last(0, 1)
    assert placement.neighbour(pp - 1, 0, +1) == (pp - 1, 1)
    assert placement.neighbour(0, 1, +1) is None
    assert placement.neighbour(0, 0, -1) is None


def test_v_shape_with_four_chunks_zigzags() -> None:
    assert Placement.v_shape(2, 4).stages == ((0, 3, 4, 7), (1, 2, 5, 6))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ([[0, 1], [1, 2]], "stage 1 is held twice: by rank 0 chunk 1 and by rank 1 chunk 0"),
        ([[0, 4], [1, 2]], "rank 0 chunk 1 holds stage 4, outside the 4 virtual stages 0 .. 3"),
        ([[0], [1, 2]], "rank 1 holds 2 chunks but rank 0 holds 1"),
        ([], "at least one rank"),
    ],
)
def test_tables_that_leave_a_stage_unheld_are_refused(table: list[list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Placement.from_table(table)


def test_tables_are_recognised_and_parsed() -> None:
    assert Placement.from_table([[0, 3], [1, 2]]).name == "v"
    assert Placement.from_table([[0, 2], [1, 3]]).name == "looped"
    odd = Placement.parse("1 2 | 0 3", 2, 2)
    assert odd.name == "table"
    assert str(odd) == "1 2 | 0 3"
    assert odd.chunk_of(1, 3) == 1
    with pytest.raises(ValueError, match="not on rank 0"):
        odd.chunk_of(0, 3)
    with pytest.raises(ValueError, match="neither a name"):
        Placement.parse("zigzag", 2, 2)
    with pytest.raises(ValueError, match="has 2 ranks x 2 chunks, but the pipeline has 4 x 1"):
        Placement.parse("0 3 | 1 2", 4, 1)
    with pytest.raises(ValueError, match="vp_size must be even"):
        Placement.named("v", 4, 3)
    with pytest.raises(ValueError, match="unknown placement 'w'; valid: looped, v"):
        Placement.named("w", 4, 2)


def test_layers_follow_the_stage() -> None:
    assert Placement.v_shape(2).layers(1, 1, 8) == range(4, 6)
    assert Placement.looped(2, 2).layers(1, 1, 8) == range(6, 8)
    with pytest.raises(ValueError, match="7 layers do not split evenly over 4 virtual stages"):
        Placement.looped(2, 2).layers(0, 0, 7)


def test_stage_predicates_ask_the_placement() -> None:
    v = Placement.v_shape(4)
    # Looped by default: the last rank's last chunk is last.
    assert last_stage(3, 4, 2, ignore_virtual=False, vp_stage=1)
    assert not last_stage(0, 4, 2, ignore_virtual=False, vp_stage=1)
    # The V puts the last stage on rank 0.
    assert last_stage(0, 4, 2, ignore_virtual=False, vp_stage=1, placement=v)
    assert last_stage(0, 4, 2, ignore_virtual=True, vp_stage=None, placement=v)
    assert not last_stage(3, 4, 2, ignore_virtual=True, vp_stage=None, placement=v)
    assert first_stage(0, 2, ignore_virtual=False, vp_stage=0, pp_size=4, placement=v)
    assert not first_stage(0, 2, ignore_virtual=False, vp_stage=1, pp_size=4, placement=v)
    with pytest.raises(ValueError, match="covers 4 ranks x 2 chunks, but the pipeline has 2 x 2"):
        last_stage(0, 2, 2, ignore_virtual=True, vp_stage=None, placement=v)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="pp_size must be 1 or more, got 0"):
        Placement.looped(0)
    with pytest.raises(TypeError, match="vp_size must be an int"):
        Placement.looped(2, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank 2 chunk 0 is outside a pipeline of 2 ranks x 1"):
        Placement.looped(2).stage(2, 0)
