"""Layer layouts: Megatron's layout syntax, first/last counts, and what each (rank, chunk) holds."""

from __future__ import annotations

import itertools
import pickle
import random
import re

import pytest

from pp_state import LayerLayoutError, PipelineLayerLayout, Placement


# ------------------------------------------------------------------------ the examples
def test_two_ranks_three_layers_each() -> None:
    layout = PipelineLayerLayout.parse("Ettt|tttL", 2, num_layers=6)
    assert layout.counts == (3, 3)
    assert (layout.pp_size, layout.vp_size, layout.num_stages, layout.num_layers) == (2, 1, 2, 6)
    assert layout.layers(0) == range(0, 3)
    assert layout.layers(1) == range(3, 6)
    assert layout.holds_embedding(0)
    assert not layout.holds_embedding(1)
    assert layout.holds_loss(1)
    assert not layout.holds_loss(0)


def test_last_stage_holding_only_the_loss() -> None:
    layout = PipelineLayerLayout.parse("Ett|tt|tt|L", 4, num_layers=6)
    assert layout.counts == (2, 2, 2, 0)
    assert layout.layers(3) == range(6, 6)
    assert layout.holds_loss(3)
    assert [layout.layers(r) for r in range(3)] == [range(0, 2), range(2, 4), range(4, 6)]


def test_first_stage_holding_only_the_embedding() -> None:
    layout = PipelineLayerLayout.parse("E|ttt|tttL", 3)
    assert layout.counts == (0, 3, 3)
    assert not layout.layers(0)
    assert layout.holds_embedding(0)


def test_four_stages_on_two_ranks_make_two_chunks_each() -> None:
    layout = PipelineLayerLayout.parse("Et|tt|tt|tL", 2, num_layers=6)
    assert layout.counts == (1, 2, 2, 1)
    assert layout.vp_size == 2
    assert layout.placement == Placement.looped(2, 2)
    # Rank 0 holds stages 0 and 2, rank 1 stages 1 and 3.
    assert [layout.placement.stage(0, c) for c in (0, 1)] == [0, 2]
    assert (layout.layers(0, 0), layout.layers(0, 1)) == (range(0, 1), range(3, 5))
    assert (layout.layers(1, 0), layout.layers(1, 1)) == (range(1, 3), range(5, 6))
    assert layout.holds_embedding(0, 0)
    assert layout.holds_loss(1, 1)
    assert not layout.holds_loss(1, 0)
    assert not layout.holds_embedding(0, 1)


def test_v_placement_puts_the_layout_stages_on_the_v_holders() -> None:
    layout = PipelineLayerLayout.parse("Et|tt|tt|tL", 2, placement="v")
    assert layout.placement == Placement.v_shape(2)
    # Rank 0 holds stages 0 and 3 (embedding and loss), rank 1 stages 1 and 2.
    assert (layout.layers(0, 0), layout.layers(0, 1)) == (range(0, 1), range(5, 6))
    assert (layout.layers(1, 0), layout.layers(1, 1)) == (range(1, 3), range(3, 5))
    assert layout.holds_embedding(0, 0)
    assert layout.holds_loss(0, 1)


def test_megatrons_mtp_layout_is_refused_for_the_m_only() -> None:
    with pytest.raises(LayerLayoutError) as caught:
        PipelineLayerLayout.parse("Et*3|(tt|)*29,m|L", 16)
    assert caught.value.position == 14
    assert "'m' at character 14" in str(caught.value)
    assert "multi-token-prediction" in str(caught.value)
    assert "'Et*3|(tt|)*29,m|L'" in str(caught.value)
    # Dropping the 'm' leaves its stage empty, which is refused with the stage named.
    with pytest.raises(LayerLayoutError, match="stage 30 of 32 holds nothing"):
        PipelineLayerLayout.parse("Et*3|(tt|)*29,|L", 16)
    # A transformer layer in its place, or no stage for it, is a layout pp builds.
    layout = PipelineLayerLayout.parse("Et*3|(tt|)*29,t|L", 16, num_layers=62)
    assert layout.counts == (3,) + (2,) * 29 + (1, 0)
    assert layout.vp_size == 2
    assert PipelineLayerLayout.parse("Et*3|(tt|)*29,L", 31, num_layers=61).counts[-1] == 0


@pytest.mark.parametrize(
    ("text", "expanded"),
    [
        ("Et*3|t*3L", "Ettt|tttL"),
        ("E(t)*2|(t|)*2,tL", "Ett|t|t|tL"),
        ("E((tt)*2|)*2,L", "Etttt|tttt|L"),
        ("E t t | t, t L", "Ett|ttL"),
        ("Et|*3tL", "Et|||tL"),
        ("(Et|)*1tL", "Et|tL"),
        ("Et*12|L", "E" + "t" * 12 + "|L"),
    ],
)
def test_repetition_parentheses_and_cosmetics(text: str, expanded: str) -> None:
    if "||" in expanded:
        with pytest.raises(LayerLayoutError, match="holds nothing"):
            PipelineLayerLayout.parse(text, 1)
        return
    stages = expanded.count("|") + 1
    assert str(PipelineLayerLayout.parse(text, stages)) == expanded


def test_str_is_the_canonical_text_and_parses_back() -> None:
    layout = PipelineLayerLayout.from_counts((2, 3, 0), 3)
    assert str(layout) == "Ett|ttt|L"
    assert PipelineLayerLayout.parse(str(layout), 3) == layout
    assert str(PipelineLayerLayout.from_counts((0,), 1)) == "EL"


# ------------------------------------------------------------------ every layout partitions
def _count_tuples(rng: random.Random, stages: int) -> list[tuple[int, ...]]:
    tuples = [(1,) * stages, (3,) + (1,) * (stages - 1)]
    for _ in range(12):
        middle = tuple(rng.randint(1, 4) for _ in range(max(stages - 2, 0)))
        ends = (rng.randint(0, 3), rng.randint(0, 3))
        tuples.append(((ends[0], *middle, ends[1])) if stages > 1 else (ends[0],))
    return tuples


@pytest.mark.parametrize(("pp", "vp"), list(itertools.product(range(1, 5), range(1, 4))))
def test_the_chunks_of_all_ranks_partition_the_layers_in_order(pp: int, vp: int) -> None:
    rng = random.Random(pp * 10 + vp)
    placements = ["looped", "v"] if vp % 2 == 0 else ["looped"]
    for counts, name in itertools.product(_count_tuples(rng, pp * vp), placements):
        layout = PipelineLayerLayout.from_counts(counts, pp, placement=name)
        by_stage = {
            layout.placement.stage(r, c): layout.layers(r, c) for r in range(pp) for c in range(vp)
        }
        walked = [layer for stage in range(pp * vp) for layer in by_stage[stage]]
        assert walked == list(range(sum(counts))), (counts, name)
        assert [len(by_stage[s]) for s in range(pp * vp)] == list(counts)
        holders = [(r, c) for r in range(pp) for c in range(vp) if layout.holds_embedding(r, c)]
        assert holders == [layout.placement.holder(0)]
        losses = [(r, c) for r in range(pp) for c in range(vp) if layout.holds_loss(r, c)]
        assert losses == [layout.placement.holder(pp * vp - 1)]
        assert PipelineLayerLayout.parse(str(layout), pp, placement=name) == layout


@pytest.mark.parametrize(("pp", "vp"), list(itertools.product(range(1, 5), range(1, 4))))
def test_looped_offsets_match_megatrons_formula(pp: int, vp: int) -> None:
    """Megatron's offset of (rank r, chunk c) sums the layers of all earlier virtual stages."""
    counts = tuple(1 + (s * 7) % 3 for s in range(pp * vp))
    layout = PipelineLayerLayout.from_counts(counts, pp)
    for rank, chunk in itertools.product(range(pp), range(vp)):
        offset = sum(
            counts[c * pp + r] for c in range(chunk + 1) for r in range(pp if c < chunk else rank)
        )
        assert layout.layers(rank, chunk) == range(offset, offset + counts[chunk * pp + rank])


def test_even_is_todays_split() -> None:
    layout = PipelineLayerLayout.even(8, 2, 2)
    assert layout.counts == (2, 2, 2, 2)
    for rank, chunk in itertools.product(range(2), range(2)):
        assert layout.layers(rank, chunk) == layout.placement.layers(rank, chunk, 8)
    with pytest.raises(LayerLayoutError, match="7 layers do not split evenly over 2 virtual"):
        PipelineLayerLayout.even(7, 2)


# ---------------------------------------------------------------- Megatron's first/last counts
@pytest.mark.parametrize(
    ("num_layers", "pp", "vp", "first", "last", "counts"),
    [
        (10, 4, 1, 4, 2, (4, 2, 2, 2)),
        (10, 4, 1, None, 1, (3, 3, 3, 1)),
        (10, 4, 1, 1, None, (1, 3, 3, 3)),
        (6, 4, 1, 0, 0, (0, 3, 3, 0)),
        # With chunks, first and last count the whole rank (Megatron): each chunk gets a share.
        (8, 2, 2, 2, 6, (1, 3, 1, 3)),
        (16, 3, 2, 2, 2, (1, 6, 1, 1, 6, 1)),
    ],
)
def test_first_last_counts(  # noqa: PLR0917 (one argument per parameter column)
    num_layers: int,
    pp: int,
    vp: int,
    first: int | None,
    last: int | None,
    counts: tuple[int, ...],
) -> None:
    layout = PipelineLayerLayout.from_first_last(num_layers, pp, first=first, last=last, vp_size=vp)
    assert layout.counts == counts
    assert sum(len(layout.layers(0, c)) for c in range(vp)) == (
        first if first is not None else counts[0] * vp
    )


def test_first_last_without_either_is_the_even_split() -> None:
    assert PipelineLayerLayout.from_first_last(8, 4) == PipelineLayerLayout.even(8, 4)


_FIRST_LAST_ERRORS = [
    (
        (8, 2, 1, 5, 4),
        "first=5 and last=4 take more than the 8 layers, leaving -1 for the middle; "
        "valid: first one of 4 or last one of 3",
    ),
    (
        (30, 4, 1, 5, 4),
        "first=5 and last=4 leave 21 of 30 layers for 2 middle ranks x 1 chunks, which "
        "does not divide into stages of one layer or more; valid: first one of 0, 2, 4, 6",
    ),
    (
        (8, 2, 1, 2, 4),
        "first=2 and last=4 hold 6 of 8 layers, and no middle rank is left for the other 2",
    ),
    (
        (8, 4, 2, 3, None),
        "first=3 does not split over the 2 chunks of a rank; valid: first one of 2",
    ),
    ((8, 1, 1, 4, 4), "with one pipeline rank the first rank is the last; give only one"),
]


@pytest.mark.parametrize(("sizes", "message"), _FIRST_LAST_ERRORS)
def test_first_last_errors_name_the_numbers_and_valid_choices(
    sizes: tuple[int, int, int, int | None, int | None], message: str
) -> None:
    num_layers, pp, vp, first, last = sizes
    with pytest.raises(LayerLayoutError) as caught:
        PipelineLayerLayout.from_first_last(num_layers, pp, first=first, last=last, vp_size=vp)
    assert message in str(caught.value)
    assert caught.value.layout is None


def test_first_last_type_errors() -> None:
    with pytest.raises(TypeError, match="first must be an int"):
        PipelineLayerLayout.from_first_last(8, 2, first=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="last must be 0 or more, got -1"):
        PipelineLayerLayout.from_first_last(8, 2, last=-1)


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("text", "pp", "message", "position"),
    [
        (
            "Ett|tt|L",
            2,
            "3 stages (split by '|') are not a multiple of the pipeline size 2: write 2 or 4 "
            "stages, or use a pipeline size dividing 3 (1 or 3)",
            None,
        ),
        ("Ett|t||tL", 1, "stage 2 of 4 holds nothing: a stage needs a layer, E or L", 5),
        (
            "tEt|L",
            2,
            "E at character 1 is in stage 0 of 2, item 1: the embedding must open stage 0",
            1,
        ),
        ("Et|EtL", 2, "E appears 2 times (characters 0 and 3): the embedding is built once", 3),
        ("E*3tL", 1, "E appears 3 times (characters 0): the embedding is built once", 0),
        ("ttL", 1, "no E: the embedding must open stage 0", None),
        (
            "Et|L|",
            3,
            "L at character 3 is in stage 1 of 3, item 0: the loss must close the last",
            3,
        ),
        ("Ett", 1, "no L: the loss must close the last stage (0)", None),
        ("Et*0t|L", 1, "'*0' at character 2 repeats nothing: a count must be 1 or more", 2),
        ("Et*|L", 1, "'*' at character 2 needs a count, such as '*2'", 2),
        ("*EtL", 1, "'*' at character 0 repeats nothing", 0),
        ("Et(t|L", 1, "'(' at character 2 is never closed", 2),
        ("Ett)|L", 1, "')' at character 3 closes no '('", 3),
        ("E()tL", 1, "the parentheses at character 1 hold nothing", 1),
        ("EtxL", 1, "'x' at character 2 is not part of a layout", 2),
        ("Et3L", 1, "'3' at character 2 is not part of a layout", 2),
        ("", 1, "the layout is empty", 0),
        ("E(t*1000)*1001L", 1, "expands past 1000000 items", 1),
    ],
)
def test_bad_layouts_name_the_position_and_the_rule(
    text: str, pp: int, message: str, position: int | None
) -> None:
    with pytest.raises(LayerLayoutError) as caught:
        PipelineLayerLayout.parse(text, pp)
    assert message in str(caught.value)
    assert str(caught.value).startswith(f"layout {text!r}: ")
    assert caught.value.layout == text
    assert caught.value.position == position


def test_a_wrong_layer_count_names_both_counts() -> None:
    with pytest.raises(
        LayerLayoutError, match=re.escape("holds 5 transformer layers (t) but num_layers is 6")
    ):
        PipelineLayerLayout.parse("Ettt|ttL", 2, num_layers=6)


def test_an_odd_chunk_count_cannot_be_a_v() -> None:
    with pytest.raises(LayerLayoutError, match="vp_size must be even, got 3"):
        PipelineLayerLayout.parse("Et|t|tL", 1, placement="v")


def test_counts_are_checked_like_text() -> None:
    with pytest.raises(
        LayerLayoutError, match=re.escape("layout 'Et||tL': stage 1 of 3 holds nothing")
    ):
        PipelineLayerLayout.from_counts((1, 0, 1), 1)
    with pytest.raises(LayerLayoutError, match="stage 1 has -1 layers"):
        PipelineLayerLayout.from_counts((1, -1), 2)
    with pytest.raises(
        LayerLayoutError, match=r"3 stages .* not a multiple of the pipeline size 2"
    ):
        PipelineLayerLayout.from_counts((1, 1, 1), 2)
    with pytest.raises(LayerLayoutError, match="placement has 2 ranks x 1 chunks"):
        PipelineLayerLayout.from_counts((1, 1, 1, 1), 2, placement=Placement.looped(2))
    with pytest.raises(LayerLayoutError, match="counts is empty"):
        PipelineLayerLayout.from_counts((), 1)
    with pytest.raises(TypeError, match="counts must be a tuple of ints"):
        PipelineLayerLayout((1.0, 2), Placement.looped(2))  # type: ignore[arg-type]


def test_errors_keep_their_fields_through_pickling() -> None:
    with pytest.raises(LayerLayoutError) as caught:
        PipelineLayerLayout.parse("Ett|t||tL", 1)
    copy = pickle.loads(pickle.dumps(caught.value))
    assert (copy.layout, copy.position, copy.stage, str(copy)) == (
        "Ett|t||tL",
        5,
        2,
        str(caught.value),
    )
    assert isinstance(copy, ValueError)


def test_queries_outside_the_layout_are_refused() -> None:
    layout = PipelineLayerLayout.parse("Ett|ttL", 2)
    with pytest.raises(ValueError, match="stage 2 is outside the 2 virtual stages"):
        layout.stage_layers(2)
    with pytest.raises(ValueError, match="rank 2 chunk 0 is outside a pipeline of 2 ranks"):
        layout.layers(2)


def test_table_draws_what_each_rank_holds() -> None:
    layout = PipelineLayerLayout.parse("Et|tt|tt|tL", 2)
    assert layout.table().splitlines() == [
        "         chunk 0    chunk 1",
        "rank 0   s0: E t0   s2: t3-4",
        "rank 1   s1: t1-2   s3: t5 L",
    ]
