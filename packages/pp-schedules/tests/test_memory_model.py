"""The byte model: static bytes per rank, activations over the plan's time, and the planner."""

from __future__ import annotations

import pytest

from pp_schedules import Costs, MemoryLimitError
from pp_schedules.planning import (
    MemoryModel,
    PlanOption,
    StageMemory,
    choose_fitting,
    choose_schedule,
    format_bytes,
    plan,
    simulate,
    validate,
)
from pp_state import Placement

ACT = 1000
PARAMS = 100


def _model(stages: int, **options: object) -> MemoryModel:
    return MemoryModel(
        stages=tuple(StageMemory(parameters=PARAMS, activation_bytes=ACT) for _ in range(stages)),
        **options,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("options", "per_parameter"),
    [
        ({}, 4 + 4 + 8),  # fp32 Adam: parameter, gradient, two moments
        ({"params_dtype": "bf16", "grad_dtype": "fp32"}, 2 + 4 + 8 + 4),  # + fp32 master copy
        # The master copy's fp32 gradient lives only through the optimizer step: not counted.
        ({"params_dtype": "bf16"}, 2 + 2 + 8 + 4),
        ({"params_dtype": "fp16", "optimizer": "sgd"}, 2 + 2 + 4 + 4),
        ({"optimizer": "sgd", "sgd_momentum": False}, 4 + 4),
    ],
)
def test_static_bytes_per_parameter(options: dict[str, object], per_parameter: int) -> None:
    assert _model(1, **options).static_bytes(PARAMS).total == PARAMS * per_parameter


def test_the_distributed_optimizer_splits_only_the_optimizer_state() -> None:
    plain = _model(1, data_parallel_size=4).static_bytes(PARAMS)
    sharded = _model(1, data_parallel_size=4, distributed_optimizer=True).static_bytes(PARAMS)
    assert (sharded.parameters, sharded.gradients) == (plain.parameters, plain.gradients)
    assert sharded.optimizer == plain.optimizer // 4


def test_a_rank_holds_the_parameters_of_its_chunks_through_the_placement() -> None:
    stages = tuple(StageMemory(parameters=10**s, activation_bytes=0) for s in range(4))
    model = MemoryModel(stages=stages, optimizer="sgd", sgd_momentum=False)
    # On the V placement rank 0 holds the first and the last stage.
    assert model.rank_static(Placement.v_shape(2), 0).parameters == (1 + 1000) * 4
    assert model.rank_static(Placement.looped(2, 2), 0).parameters == (1 + 100) * 4


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_rank_r_holds_pp_minus_r_microbatches(pp: int) -> None:
    report = validate(plan("1f1b", pp_size=pp, num_microbatches=2 * pp))
    simulation = simulate(report, memory=_model(pp))
    assert simulation.memory is not None
    static = _model(pp).static_bytes(PARAMS).total
    assert simulation.peak_memory == [static + (pp - r) * ACT for r in range(pp)]
    for rank, track in enumerate(simulation.memory):
        assert len(track.after) == len(simulation.spans[rank])
        assert track.after[-1] == static  # everything released at the end of the step
        assert track.peak_activations == (pp - rank) * ACT
        assert track.peak_step is not None
        assert simulation.spans[rank][track.peak_step].action.kind == "F"


def test_a_split_backward_holds_activations_until_w() -> None:
    report = validate(plan("zb_h1", pp_size=2, num_microbatches=4))
    simulation = simulate(report, memory=_model(2))
    assert simulation.memory is not None
    track, spans = simulation.memory[0], simulation.spans[0]
    static = track.static.total
    for index, span in enumerate(spans):
        before = track.after[index - 1] if index else static
        change = {"F": ACT, "I": 0, "W": -ACT}[span.action.kind]
        assert track.after[index] - before == change, span.action


def test_recompute_transient_counts_during_the_backward_only() -> None:
    stages = tuple(
        StageMemory(parameters=0, activation_bytes=10, recompute_bytes=500) for _ in "ab"
    )
    report = validate(plan("1f1b", pp_size=2, num_microbatches=4))
    simulation = simulate(report, memory=MemoryModel(stages=stages))
    assert simulation.memory is not None
    track, spans = simulation.memory[1], simulation.spans[1]
    for index, span in enumerate(spans):
        extra = track.during[index] - track.after[index]
        # A backward releases its own 10 bytes only after recomputing.
        assert extra == (0 if span.action.kind == "F" else 500 + 10)
    # Rank 1 holds one microbatch (10) and recomputes on top of it: 510.
    assert track.peak == 510


def test_memory_tracks_are_drawn() -> None:
    simulation = simulate(validate(plan("gpipe", pp_size=2, num_microbatches=4)), memory=_model(2))
    drawn = simulation.timeline(40, memory=True).splitlines()
    assert len(drawn) == 4
    assert drawn[1].startswith("  mem  |")
    assert "peak" in drawn[1]
    assert "@" in drawn[1]  # the highest level is reached
    trace = simulation.chrome_trace()
    assert '"ph": "C"' in trace
    assert "memory rank 1 (MB)" in trace


def test_a_memory_model_for_another_pipeline_is_refused() -> None:
    report = validate(plan("1f1b", pp_size=2, num_microbatches=4))
    with pytest.raises(
        ValueError, match="memory model covers 3 virtual stages, but the plan has 2"
    ):
        simulate(report, memory=_model(3))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: StageMemory(parameters=-1, activation_bytes=0), "whole numbers 0 or more"),
        (lambda: StageMemory(parameters=1, activation_bytes=1.5), "whole numbers"),  # type: ignore[arg-type]
        (lambda: _model(1, params_dtype="fp8"), "params_dtype 'fp8' is unknown; valid: fp32"),
        (lambda: _model(1, optimizer="lion"), "optimizer 'lion' is unknown; valid: adam, sgd"),
        (lambda: MemoryModel(stages=()), "one StageMemory per virtual stage"),
        (lambda: _model(1, data_parallel_size=0), "data_parallel_size must be an int 1"),
    ],
)
@pytest.mark.reliability
def test_bad_memory_figures_are_refused(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()  # type: ignore[operator]


def test_a_byte_limit_leaves_out_what_does_not_fit() -> None:
    static = _model(2).static_bytes(PARAMS).total
    # 1F1B's first rank holds 2 microbatches, GPipe's all 8.
    choice = choose_schedule(
        pp_size=2, num_microbatches=8, memory=_model(2), memory_limit_bytes=static + 2 * ACT,
        names=["gpipe", "1f1b"],
    )  # fmt: skip
    assert choice.chosen.name == "1f1b"
    gpipe = next(c for c in choice.candidates if c.name == "gpipe")
    assert not gpipe.fits
    assert "rank 0 needs" in gpipe.note
    assert gpipe.peak_bytes == (static + 8 * ACT,) * 2
    table = choice.table()
    assert "peak per rank" in table
    assert "fits" in table
    assert format_bytes(static + 8 * ACT) in table


@pytest.mark.reliability
def test_nothing_fitting_names_the_smallest_peak_and_what_would_fit() -> None:
    static = _model(2).static_bytes(PARAMS).total
    with pytest.raises(MemoryLimitError) as caught:
        choose_schedule(
            pp_size=2, num_microbatches=8, memory=_model(2), memory_limit_bytes=static + ACT,
            names=["gpipe", "1f1b"],
        )  # fmt: skip
    message = str(caught.value)
    assert f"smallest peak is {format_bytes(static + 2 * ACT)} on rank 0, with 1f1b" in message
    assert "recompute" in message
    assert "smaller microbatch" in message
    assert not caught.value.static_too_large
    with pytest.raises(MemoryLimitError, match="optimizer state alone need") as alone:
        choose_fitting(
            [PlanOption("vp 1", 1, Costs(), _model(2))],
            pp_size=2, num_microbatches=8, memory_limit_bytes=static // 2,
        )  # fmt: skip
    assert alone.value.static_too_large


def test_choose_fitting_takes_the_fastest_option_that_fits() -> None:
    slow = Costs(forward=1.0, backward=3.0)  # recomputation: backward + forward
    small = MemoryModel(
        stages=tuple(StageMemory(parameters=PARAMS, activation_bytes=ACT // 10) for _ in "ab")
    )
    options = [
        PlanOption("no recompute", 1, Costs(), _model(2)),
        PlanOption("recompute", 1, slow, small),
    ]
    static = _model(2).static_bytes(PARAMS).total
    roomy = choose_fitting(options, pp_size=2, num_microbatches=8, memory_limit_bytes=None)
    assert roomy.option is not None
    assert roomy.option.label == "no recompute"
    tight = choose_fitting(options, pp_size=2, num_microbatches=8, memory_limit_bytes=static + ACT)
    assert tight.option is not None
    assert tight.option.label == "recompute"
    assert tight.chosen.name in {"1f1b", "zb_h1", "gpipe"}
    assert "recompute" in tight.table()
    assert "no recompute" in tight.table()
