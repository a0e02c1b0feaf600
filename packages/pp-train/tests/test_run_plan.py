"""The run decided once: `decide_run`'s record, what it measures, and who reads the flags."""

from __future__ import annotations

import ast
import dataclasses
from collections import Counter
from pathlib import Path

import pytest

import pp_train
from pp_schedules import Costs
from pp_schedules.planning import choose_schedule
from pp_train.arguments import ModelArgs, ParallelArgs, PretrainConfig, TrainingArgs
from pp_train.memory_plan import ModelFigures, PartFigures
from pp_train.run_plan import Measurements, Measures, RunPlan, decide_run, measure_run
from pp_train.world import check_world

FIGURES = ModelFigures(
    layer=PartFigures(100, 1000, 1.0, 2.0),
    layer_full=PartFigures(100, 50, 1.0, 3.0),
    layer_selective=PartFigures(100, 600, 1.0, 2.5),
    embedding=PartFigures(30, 10, 0.5, 0.5),
    loss=PartFigures(20, 300, 0.5, 1.0),
)
# One chunk's measured times: weight gradients almost free, so zero bubble gains nothing.
MEASURED = Costs(forward=3.0, backward=6.0, backward_input=5.9, backward_weight=0.1)


def _config(layers: int = 8, **parallel: object) -> PretrainConfig:
    return PretrainConfig(
        parallel=ParallelArgs(pipeline_model_parallel_size=2, **parallel),  # type: ignore[arg-type]
        model=ModelArgs(num_layers=layers, hidden_size=64, num_attention_heads=4, seq_length=64),
        training=TrainingArgs(micro_batch_size=2, global_batch_size=16, train_iters=2),
    )


def test_a_named_schedule_is_the_flags_and_nothing_is_chosen() -> None:
    config = _config(pipeline_schedule="zb_h1")
    layout = check_world(config, 2)
    decided = decide_run(config, layout)
    assert (decided.schedule, decided.chosen_by, decided.choice) == ("zb_h1", "flags", None)
    assert decided.resolved is layout.resolved  # nothing planned again
    assert (decided.prefetch, decided.microbatch_counts, decided.memory) == (1, (8,), None)
    assert decided.chosen_line is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        decided.recompute = None  # type: ignore[misc]


def test_auto_is_chosen_once_with_the_measured_costs_when_measured() -> None:
    config = _config(pipeline_schedule="auto")
    layout = check_world(config, 2)
    guessed = decide_run(config, layout)
    assert guessed.chosen_by == "simulation"
    assert guessed.choice is layout.resolved.choice
    decided = decide_run(config, layout, Measurements(chunk_costs=MEASURED))
    assert decided.chosen_by == "measured"
    assert decided.choice is not None
    assert decided.choice.costs == MEASURED
    runnable = [c.name for c in layout.resolved.choice.candidates if c.makespan is not None]  # type: ignore[union-attr]
    expected = choose_schedule(
        pp_size=2, num_microbatches=8, vp_size=1, costs=MEASURED, memory_limit=2.0,
        names=runnable,
    )  # fmt: skip
    assert decided.schedule == expected.chosen.name
    assert decided.resolved.microbatch_counts == (8,)
    assert decided.chosen_line is not None
    assert decided.chosen_line.startswith(
        "pipeline schedule chosen by simulation with step costs measured in a warm-up "
        "(ms per chunk: F 3.00, I 5.90, W 0.10):"
    )


def test_a_memory_limit_decides_schedule_chunks_and_recomputation_and_predicts_bytes() -> None:
    config = _config(pipeline_schedule="auto", memory_limit_gb=1.0)
    decided = decide_run(config, check_world(config, 2), Measurements(figures=FIGURES))
    assert decided.chosen_by == "memory"
    assert decided.limit is not None
    assert decided.memory is not None
    peaks = decided.predicted_peaks()
    assert peaks is not None
    assert len(peaks) == 2
    assert max(peaks) <= decided.limit.bytes
    assert decided.chosen_line is not None
    assert "within --memory-limit-gb 1" in decided.chosen_line


def test_measuring_asks_only_for_what_the_decision_uses() -> None:
    asked: Counter[str] = Counter()

    def chunk(layers: int) -> Costs:
        asked[f"chunk of {layers} layers"] += 1
        return MEASURED

    def layout_costs() -> tuple[Costs, float, float]:
        asked["layout"] += 1
        return Costs(forward=1.0, backward=2.0), 1.0, 1.0

    def memory() -> ModelFigures:
        asked["memory"] += 1
        return FIGURES

    measures = Measures(chunk=chunk, layout=layout_costs, memory=memory)
    named = _config(pipeline_schedule="1f1b")
    measure_run(named, check_world(named, 2), measures)
    assert asked == {"memory": 1}
    asked.clear()
    auto = _config(pipeline_schedule="auto")
    measure_run(auto, check_world(auto, 2), measures)
    assert asked == {"chunk of 4 layers": 1, "memory": 1}
    asked.clear()
    uneven = _config(layers=7, pipeline_schedule="auto", memory_limit_gb=1.0)
    measured = measure_run(uneven, check_world(uneven, 2), measures)
    assert asked == {"layout": 1, "memory": 1}  # a memory limit chooses by bytes, not by F/I/W
    decided = decide_run(uneven, check_world(uneven, 2), measured)
    assert decided.layer_split.measured
    assert isinstance(decided, RunPlan)


# Modules that may read --pipeline-schedule: where it is defined, the check before any group
# (`world`), the one decision (`run_plan`), and the command's Megatron-style args namespace,
# set when the flags are checked.
READERS = {"arguments.py", "world.py", "run_plan.py", "app/command.py"}


def test_nothing_after_the_decision_reads_the_schedule_flag_or_asks_for_auto() -> None:
    root = Path(pp_train.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name in READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "pipeline_schedule":
                offenders.append(f"{name}:{node.lineno} reads pipeline_schedule")
            if isinstance(node, ast.Compare) and _names_auto(node):
                offenders.append(f"{name}:{node.lineno} compares with 'auto'")
    assert offenders == []


def _names_auto(compare: ast.Compare) -> bool:
    """Whether `compare` asks if something is "auto" (not the layout flag's text, whose
    ``--pipeline-model-parallel-layout auto`` is another flag, read lower-cased)."""
    operands = [compare.left, *compare.comparators]
    if ".lower()" in ast.unparse(compare.left):
        return False
    return any(isinstance(o, ast.Constant) and o.value == "auto" for o in operands)
