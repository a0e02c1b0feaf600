"""One launch of the command resolves its run once, on every rank.

Each rank runs the command's `main` (the harness made the process group, as torchrun's
environment would) while counting: the opens of the ``--pipeline-schedule-file``, the
configuration checks (`check_world`), ``auto``'s choices with default and with measured costs,
and every plan validation made after the configuration check returned.
"""

from __future__ import annotations

import builtins
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import pp_schedules.planning._auto
import pp_schedules.planning._validation
import pp_train.world
from pp_testing import run_distributed
from pp_train.app import build_parser, main, validate_args
from pp_train.pretrain import pretrain

FLAGS = [
    "--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2",
    "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "1",
    "--train-iters", "2", "--pipeline-model-parallel-size", "2",
]  # fmt: skip

GPIPE = "rank 0: F0 F1 F2 F3 B0 B1 B2 B3\nrank 1: F0 F1 F2 F3 B0 B1 B2 B3\n"


def _replace_everywhere(original: object, replacement: object) -> list[tuple[Any, str]]:
    """Points every pp module's name bound to `original` at `replacement`; returns the spots."""
    spots = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("pp_"):
            continue
        for attribute, value in list(vars(module).items()):
            if value is original:
                setattr(module, attribute, replacement)
                spots.append((module, attribute))
    return spots


def _counted_launch(argv: list[str], plan_path: str | None) -> dict[str, int]:
    """The command's `main(argv)` on this rank, with what it did counted."""
    counts: Counter[str] = Counter()
    checked = False
    real_open, real_check = builtins.open, pp_train.world.check_world
    real_choose, real_validate = (
        pp_schedules.planning._auto.choose_schedule,
        pp_schedules.planning._validation.validate,
    )

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if plan_path is not None and isinstance(file, (str, Path)) and str(file) == plan_path:
            counts["plan file read"] += 1
        return real_open(file, *args, **kwargs)

    def check(*args: Any, **kwargs: Any) -> Any:
        nonlocal checked
        counts["configuration check"] += 1
        layout = real_check(*args, **kwargs)
        checked = True
        return layout

    def choose(*args: Any, **kwargs: Any) -> Any:
        measured = kwargs.get("costs") is not None
        counts["auto, measured costs" if measured else "auto, default costs"] += 1
        return real_choose(*args, **kwargs)

    def validate(*args: Any, **kwargs: Any) -> Any:
        if checked:
            counts["validations after the check"] += 1
        return real_validate(*args, **kwargs)

    fakes: list[tuple[object, Callable[..., Any]]] = [
        (real_check, check), (real_choose, choose), (real_validate, validate),
    ]  # fmt: skip
    spots = [(spot, real) for real, fake in fakes for spot in _replace_everywhere(real, fake)]
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    builtins.open = counting_open
    try:
        assert main(argv) == 0
    finally:
        builtins.open = real_open
        for (module, attribute), real in spots:
            setattr(module, attribute, real)
    return dict(counts)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param(
            [],
            {"configuration check": 1},
            id="default schedule",
        ),
        pytest.param(
            ["--pipeline-schedule", "zb_h1"],
            {"configuration check": 1},
            id="named zb_h1",
        ),
        pytest.param(
            ["--pipeline-schedule", "auto"],
            {"configuration check": 1, "auto, default costs": 1, "auto, measured costs": 1},
            id="auto",
        ),
    ],
)
def test_one_launch_checks_and_resolves_once_per_rank(
    flags: list[str], expected: dict[str, int]
) -> None:
    counts = run_distributed(_counted_launch, 2, [*FLAGS, *flags], None, timeout=120)
    for rank, seen in enumerate(counts):
        # The measured re-choice simulates its candidates (validating each); nothing else may.
        if "auto, measured costs" in expected:
            seen.pop("validations after the check", None)
        assert seen == expected, f"rank {rank}"


def test_one_launch_reads_its_plan_file_once_per_rank(tmp_path: Path) -> None:
    plan = tmp_path / "gpipe.txt"
    plan.write_text(GPIPE)
    argv = [*FLAGS, "--pipeline-schedule-file", str(plan)]
    counts = run_distributed(_counted_launch, 2, argv, str(plan), timeout=120)
    for rank, seen in enumerate(counts):
        assert seen == {"configuration check": 1, "plan file read": 1}, f"rank {rank}"


@pytest.mark.reliability
def test_a_layout_checked_for_another_run_is_refused_before_any_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = build_parser()
    args = validate_args(parser, parser.parse_args(FLAGS), 2)  # checked for 2 processes
    monkeypatch.setenv("WORLD_SIZE", "4")

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("nothing may be built")

    with pytest.raises(
        ValueError,
        match=r"checked for 2 processes on gloo with pipeline size 2, but this run has 4 on gloo",
    ):
        pretrain(never, never, never, config=args.config, layout=args.layout)
    with pytest.raises(ValueError, match="layer_counts and layout were both given"):
        pretrain(never, never, never, config=args.config, layout=args.layout, layer_counts=(2, 2))
    assert not dist.is_initialized()
