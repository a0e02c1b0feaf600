"""The run's byte model from measured parts, and --memory-limit-gb's planner."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pp_schedules import Choice, MemoryProbe
from pp_schedules.planning import StageMemory
from pp_tensor import RNGStatesTracker, add_model_parallel_states
from pp_train.app.auto_schedule import model_figures, part_memory
from pp_train.app.gpt import GPTChunk, GPTConfig
from pp_train.arguments import ModelArgs, ParallelArgs, PretrainConfig, TrainingArgs
from pp_train.memory_plan import (
    DEFAULT_MARGIN,
    MemoryLimit,
    ModelFigures,
    PartFigures,
    memory_limit,
    memory_model,
    stage_costs,
    stage_memory,
)
from pp_train.recompute import RecomputeConfig
from pp_train.run_plan import Measurements, Measures, RunPlan, decide_run, measure_run
from pp_train.world import check_world

FIGURES = ModelFigures(
    layer=PartFigures(100, 1000, 1.0, 2.0),
    layer_full=PartFigures(100, 50, 1.0, 3.0),
    layer_selective=PartFigures(100, 600, 1.0, 2.5),
    embedding=PartFigures(30, 10, 0.5, 0.5),
    loss=PartFigures(20, 300, 0.5, 1.0),
)


@pytest.mark.parametrize(
    ("recompute", "kept", "transient"),
    [
        (None, 4 * 1000, 0),
        (RecomputeConfig(granularity="selective"), 4 * 600, 400),
        (RecomputeConfig(granularity="full", method="uniform", num_layers=1), 4 * 50, 1000),
        (RecomputeConfig(granularity="full", method="uniform", num_layers=3), 2 * 50, 3 * 1000),
        (RecomputeConfig(granularity="full", method="block", num_layers=1), 50 + 3 * 1000, 1000),
        (RecomputeConfig(granularity="full", method="block", num_layers=4), 4 * 50, 1000),
    ],
)
def test_a_stage_keeps_what_its_recomputation_leaves(
    recompute: RecomputeConfig | None, kept: int, transient: int
) -> None:
    middle = stage_memory(FIGURES, 4, first=False, last=False, recompute=recompute)
    assert (middle.parameters, middle.activation_bytes) == (400, kept)
    assert middle.recompute_bytes == transient
    first = stage_memory(FIGURES, 4, first=True, last=True, recompute=recompute)
    assert (first.parameters, first.activation_bytes) == (450, kept + 310)


def test_recomputation_is_paid_in_both_halves_of_a_split_backward() -> None:
    plain = stage_costs(FIGURES, 2, first=False, last=False, recompute=None)
    full = RecomputeConfig(granularity="full", method="uniform", num_layers=1)
    costs = stage_costs(FIGURES, 2, first=False, last=False, recompute=full)
    assert (plain.forward, plain.backward) == (2.0, 4.0)
    assert costs.backward == 6.0  # 2 layers x 3 ms (backward and recomputed forward)
    assert costs.of("I") == costs.of("W") == plain.backward / 2 + 2.0


def _config(**parallel: object) -> PretrainConfig:
    return PretrainConfig(
        parallel=ParallelArgs(pipeline_model_parallel_size=2, **parallel),  # type: ignore[arg-type]
        model=ModelArgs(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=64),
        training=TrainingArgs(micro_batch_size=2, global_batch_size=16, train_iters=2),
    )


def test_the_memory_model_takes_the_runs_precision_and_optimizer() -> None:
    config = _config()
    model = memory_model(config, (4, 4), FIGURES, data_parallel_size=1, recompute=None)
    assert (model.params_dtype, model.optimizer) == ("fp32", "adam")
    half = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, bf16=True))
    assert memory_model(
        half, (4, 4), FIGURES, data_parallel_size=1, recompute=None
    ).params_dtype == ("bf16")


def _decide(config: PretrainConfig) -> tuple[RunPlan, Choice | None]:
    """The run's one decision with the warm-up's figures, and the planner's choice."""
    decided = decide_run(config, check_world(config, 2), Measurements(figures=FIGURES))
    return decided, decided.choice if decided.chosen_by == "memory" else None


def test_the_planner_takes_recomputation_only_when_the_limit_needs_it() -> None:
    gib = 1024**3
    roomy = _config(pipeline_schedule="auto", memory_limit_gb=1.0)
    layout, choice = _decide(roomy)
    assert layout.recompute is None
    assert choice is not None
    assert layout.memory is not None
    assert layout.memory.transfers is not None  # pp-comm's frames on gloo
    # A limit between the smallest peak with recomputation and the smallest without.
    kept = min(max(c.peak_bytes) for c in choice.candidates if "no recompute" in c.option)
    recomputed = min(max(c.peak_bytes) for c in choice.candidates if "full" in c.option)
    assert recomputed < kept
    tight = _config(pipeline_schedule="auto", memory_limit_gb=(recomputed + kept) / 2 / gib)
    fitted, choice = _decide(tight)
    assert fitted.recompute is not None
    assert fitted.recompute.granularity == "full"
    assert choice is not None
    assert "fits" in choice.table()
    assert max(choice.chosen.peak_bytes) <= (recomputed + kept) / 2
    static = layout.memory.rank_static(layout.placement, 0).total
    too_small = _config(pipeline_schedule="auto", memory_limit_gb=static / 2 / gib)
    with pytest.raises(ValueError, match=r"--memory-limit-gb .*smallest peak is .* on rank"):
        _decide(too_small)


def test_a_margin_keeps_its_share_of_the_limit_free() -> None:
    roomy = _config(pipeline_schedule="1f1b", memory_limit_gb=1.0)
    _, choice = _decide(roomy)
    assert choice is not None
    peak = max(choice.chosen.peak_bytes)
    fits = _config(pipeline_schedule="1f1b", memory_limit_gb=peak * 1.05 / 1024**3)
    assert _decide(fits)[1] is not None
    # 10% of a limit 5% above the peak: nothing fits any more, and the message says why.
    margin = _config(pipeline_schedule="1f1b", memory_limit_gb=peak * 1.05 / 1024**3,
                     memory_limit_margin=0.1)  # fmt: skip
    with pytest.raises(ValueError, match=r"--memory-limit-gb \S+ less a 10% margin: "):
        _decide(margin)
    assert memory_limit(margin, "gloo") == MemoryLimit(peak * 1.05 / 1024**3, 0.1)
    assert memory_limit(fits, "gloo").margin == 0.0  # type: ignore[union-attr]
    assert memory_limit(fits, "nccl").margin == DEFAULT_MARGIN["nccl"] > 0  # type: ignore[union-attr]


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("margin", "limit", "match"),
    [
        (-0.1, 1.0, r"--memory-limit-margin must be a share of --memory-limit-gb from 0 up to"),
        (1.5, 1.0, r"from 0 up to \(not including\) 1, .*got 1.5"),
        (1.0, 1.0, r"got 1.0"),
        (0.1, None, r"--memory-limit-margin 0.1 needs --memory-limit-gb"),
    ],
)
def test_a_margin_outside_zero_to_one_is_refused(
    margin: float, limit: float | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelArgs(memory_limit_margin=margin, memory_limit_gb=limit)


def test_a_named_schedule_keeps_its_chunks_and_is_only_fitted() -> None:
    config = _config(pipeline_schedule="1f1b", memory_limit_gb=1.0)
    layout, choice = _decide(config)
    assert layout.schedule == "1f1b"
    assert layout.resolved.vp_size == 1
    assert choice is not None
    assert {c.name for c in choice.candidates} == {"1f1b"}


@pytest.mark.reliability
def test_a_limit_without_a_way_to_measure_is_refused() -> None:
    config = _config(memory_limit_gb=1.0)
    with pytest.raises(ValueError, match="--memory-limit-gb needs the model's activation bytes"):
        measure_run(config, check_world(config, 2), Measures())


@pytest.mark.reliability
def test_a_part_that_saves_nothing_cannot_be_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8)
    monkeypatch.setattr(MemoryProbe, "saved_by", lambda self, fn: 0)
    with pytest.raises(ValueError, match=r"failed on its layer .*saved nothing for backward"):
        model_figures(shape, micro_batch_size=1, seed=0, rounds=1)


RECOMPUTES = [
    None,
    RecomputeConfig(granularity="full", method="uniform", num_layers=1),
    RecomputeConfig(granularity="full", method="uniform", num_layers=3),
    RecomputeConfig(granularity="full", method="block", num_layers=2),
    RecomputeConfig(granularity="selective"),
]


@pytest.mark.parametrize(
    "recompute", RECOMPUTES, ids=["none", "full", "uniform-3", "block-2", "selective"]
)
def test_measured_parts_chain_to_the_chunk_measured_whole(
    recompute: RecomputeConfig | None,
) -> None:
    """Every byte figure of a chunk is the chain of its parts' (what the byte model assumes).

    Parts and chunks measured alike (pp-schedules' `measure_stage`, every storage counted);
    the parts' chain is within one activation of the chunk measured whole (where one part's
    gradient dies while the next one's peaks, measured alone it stays), or above it by the
    RNG states recomputed parts copy.
    """
    torch.manual_seed(0)
    shape = GPTConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
        hidden_dropout=0.1, attention_dropout=0.1,
    )  # fmt: skip
    figures = model_figures(shape, micro_batch_size=2, seed=0, rounds=1)
    tokens = torch.randint(shape.vocab_size, (2, shape.seq_length))
    activation = shape.seq_length * 2 * shape.hidden_size * 4
    # The run's three states (data-, tensor-, expert-parallel), as the warm-up's tracker.
    tracker = add_model_parallel_states(RNGStatesTracker("cpu"), 5, tp_rank=0)
    for first, last in ((True, False), (False, False), (False, True)):
        chunk = GPTChunk(
            dataclasses.replace(shape, recompute=recompute), layers=range(3),
            pre_process=first, post_process=last, seed=0, rng_tracker=tracker,
        )  # fmt: skip
        whole = part_memory(chunk, tokens)
        chained = stage_memory(figures, 3, first=first, last=last, recompute=recompute)
        assert chained.parameters == whole.parameters == sum(p.numel() for p in chunk.parameters())
        for field in dataclasses.fields(StageMemory):
            mine, theirs = getattr(chained, field.name), getattr(whole, field.name)
            if isinstance(mine, bool):
                assert mine == theirs, (first, last, field.name)
            else:
                # A recomputed part copies the RNG states (5 KB each) it replays: alone, once
                # per part; whole, once per chunk. The chain errs on the safe side there, by
                # the copies of the two parts after the first.
                states = len(tracker.get_states()) * torch.get_rng_state().numel()
                above = activation + 2 * states if recompute is not None else activation
                assert -activation <= mine - theirs <= above, (
                    first,
                    last,
                    field.name,
                    mine,
                    theirs,
                )


def test_the_parts_are_measured_alike_whatever_the_run_recomputes() -> None:
    """The plain layer, embedding and loss figures do not take the run's recomputation."""
    shape = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8)
    full = RecomputeConfig(granularity="full", method="uniform", num_layers=1)
    plain = model_figures(shape, micro_batch_size=1, seed=0, rounds=1)
    recomputing = model_figures(
        dataclasses.replace(shape, recompute=full), micro_batch_size=1, seed=0, rounds=1
    )
    for part in ("layer", "layer_full", "embedding", "loss"):
        mine, theirs = getattr(plain, part), getattr(recomputing, part)
        assert (mine.parameters, mine.activation_bytes) == (
            theirs.parameters,
            theirs.activation_bytes,
        )
    assert plain.layer.activation_bytes > plain.layer_full.activation_bytes
