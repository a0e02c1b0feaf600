"""The examples in docs/examples run under torchrun and check themselves."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The `torchrun` fixture from conftest.py: (script, ranks, *args) -> finished process.
Torchrun = Callable[..., subprocess.CompletedProcess[str]]

EXAMPLES = ROOT / "docs" / "examples"


@pytest.mark.parametrize(
    "sizes",
    [
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-split-rank", "2"],
    ],
    ids=["tp2-pp2", "pp4-split2"],
)
def test_parallel_state_tour_under_torchrun(torchrun: Torchrun, sizes: list[str]) -> None:
    done = torchrun(EXAMPLES / "parallel_state_tour.py", 4, *sizes, "--timeout-seconds", "30")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every group reached exactly its ranks" in done.stdout
    assert "layout of 4 ranks" in done.stdout


def test_parallel_state_tour_refuses_a_world_that_does_not_fit(torchrun: Torchrun) -> None:
    done = torchrun(EXAMPLES / "parallel_state_tour.py", 2, "--pipeline-model-parallel-size", "4")
    assert done.returncode != 0
    assert "world size 2 is not divisible by tensor (1) x pipeline (4)" in done.stdout + done.stderr


@pytest.mark.parametrize("ranks", [2, 4])
def test_p2p_pipeline_example_matches_a_single_process(torchrun: Torchrun, ranks: int) -> None:
    done = torchrun(EXAMPLES / "p2p_pipeline.py", ranks)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{ranks} stages: gradients equal the single-process run: True" in done.stdout


def test_schedule_trace_example_writes_measured_and_simulated_tracks(
    torchrun: Torchrun, tmp_path: Path
) -> None:
    trace, png = tmp_path / "trace.json", tmp_path / "trace.png"
    done = torchrun(
        EXAMPLES / "schedule_trace.py", 2, "--microbatches", "4", "--forward-ms", "2",
        "--backward-ms", "4", "--trace", str(trace), "--png", str(png),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "measured/simulated" in done.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    # Measured (pid 0) and simulated (pid 1) tracks for both ranks; 4 F and 4 B per rank each.
    for pid in (0, 1):
        for rank in (0, 1):
            kinds = [e["cat"] for e in spans if (e["pid"], e["tid"]) == (pid, rank)]
            assert kinds.count("forward") == 4
            assert kinds.count("backward") == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_trace_example_refuses_an_unwritable_path_before_starting(
    torchrun: Torchrun, tmp_path: Path
) -> None:
    done = torchrun(EXAMPLES / "schedule_trace.py", 2, "--trace", str(tmp_path / "no" / "t.json"))
    assert done.returncode != 0
    assert "does not exist" in done.stdout + done.stderr


def test_pretrain_example_trains_an_mlp_regressor_on_two_stages(torchrun: Torchrun) -> None:
    done = torchrun(EXAMPLES / "pretrain_mlp.py", 2, "--pipeline-model-parallel-size", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pipeline 2, data parallel 1, 1F1B" in done.stdout
    losses = [float(x) for x in re.findall(r" mse: (\S+) \|", done.stdout)]
    assert len(losses) == 3
    assert losses[-1] < 0.6 * losses[0]


def test_pretrain_example_is_short() -> None:
    """The user code of the example (no blank lines, comments or docstrings) is under 40 lines."""
    source = (EXAMPLES / "pretrain_mlp.py").read_text()
    tree = ast.parse(source)
    docstrings = {
        line
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and ast.get_docstring(node) is not None
        for line in range(node.body[0].lineno, node.body[0].end_lineno + 1)  # type: ignore[operator]
    }
    code = [
        text
        for number, text in enumerate(source.splitlines(), start=1)
        if text.strip() and not text.strip().startswith("#") and number not in docstrings
    ]
    assert len(code) < 40, len(code)


def test_memory_picture_example_draws_what_the_docs_show(
    torchrun: Torchrun, tmp_path: Path
) -> None:
    """The pictures in docs/memory.md are this script's output, and still agree with it.

    Word for word, and number for number within 0.5%: how many frames pp-comm keeps for reuse
    depends on when gloo completes a send (earlier than it is waited for, at times), a few
    tens of KB either way.
    """
    done = torchrun(EXAMPLES / "memory_picture.py", 2, "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("within 5% after every step: True") == 4, done.stdout
    number = re.compile(r"\d+\.\d+")
    for name in ("memory-1f1b-pp2.svg", "memory-zb-h1-pp2.svg"):
        drawn = (tmp_path / name).read_text()
        shown = (ROOT / "docs" / "images" / name).read_text()
        assert number.sub("#", drawn) == number.sub("#", shown)
        # Coordinates within 0.5% or half a pixel; the written figures (MB) within 0.5%.
        pairs = zip(number.findall(drawn), number.findall(shown), strict=True)
        assert all(float(a) == pytest.approx(float(b), rel=5e-3, abs=0.5) for a, b in pairs)
        texts = [number.findall(" ".join(re.findall(">([^<]*)<", svg))) for svg in (drawn, shown)]
        assert all(
            float(a) == pytest.approx(float(b), rel=5e-3) for a, b in zip(*texts, strict=True)
        ), texts
