"""docs/own-trainer.md shows the Llama example whole, and it stays at most 100 lines of code."""

from __future__ import annotations

import ast
import importlib
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "own-trainer.md"
TRAINER = [ROOT / "docs" / "examples" / name for name in ("hf_llama.py", "pipeline_trainer.py")]
GOAL = 100
"""Lines of code of the Llama trainer, every schedule (DualPipeV overlapped too), data parallelism
and the story of a rank that dies (`watch_pipeline`, short timeouts, --steps) included (90
before that story)."""


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring.

    A docstring is any string standing alone as a statement (module, class, function and
    attribute docstrings).
    """
    strings = {
        line
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    }
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
               tokenize.DEDENT, tokenize.ENDMARKER}  # fmt: skip
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - strings)


def test_counting_leaves_out_blank_lines_comments_and_docstrings() -> None:
    source = '"""Module."""\n\nimport os  # why\n\n\ndef f() -> int:\n    """Doc\n    more."""\n    # a note\n    return (1 +\n            2)\n'
    assert code_lines(source) == 4  # import, def, and the return's two lines


@pytest.mark.parametrize("path", TRAINER, ids=lambda p: p.name)
def test_the_page_shows_each_file_whole(path: Path) -> None:
    assert f"```python\n{path.read_text()}```" in PAGE.read_text()


def test_the_llama_trainer_is_at_most_100_lines_of_code() -> None:
    counted = sum(code_lines(path.read_text()) for path in TRAINER)
    assert counted <= GOAL, f"{counted} lines of code; the goal is {GOAL}"
    assert f"are {counted} lines of code" in PAGE.read_text()


def test_the_optimizer_is_called_what_it_is() -> None:
    """OptimizerConfig's adam is Megatron's: AdamW with weight decay 0.01, not plain Adam."""
    sys.path.insert(0, str(TRAINER[1].parent))
    try:
        config = importlib.import_module("pipeline_trainer").OPTIMIZER
    finally:
        sys.path.remove(str(TRAINER[1].parent))
    assert (config.optimizer, config.weight_decay) == ("adam", 0.01)
    for text in (TRAINER[1].read_text(), PAGE.read_text()):
        assert "AdamW" in text
        assert "weight decay 0.01" in text
        assert not re.search(r"\bAdam\b(?!W)", text.replace("plain Adam", "")), (
            "the optimizer is AdamW (decoupled weight decay), not Adam"
        )


COLLECTIVES = {"all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter",
               "reduce_scatter", "all_to_all", "barrier", "all_gather_object",
               "broadcast_object_list", "gather_object"}  # fmt: skip


def test_the_trainer_makes_no_collective_on_the_default_group() -> None:
    """The page's last warning: a collective just before exit on the default group can abort
    the process at shutdown; the state's groups, which state.destroy() frees, are safe."""
    tree = ast.parse(TRAINER[1].read_text())
    calls = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"
        and node.func.attr in COLLECTIVES
    ]  # fmt: skip
    assert calls, "the trainer reduces the losses somewhere"
    for call in calls:
        assert any(k.arg == "group" for k in call.keywords), (
            f"line {call.lineno}: dist.{call.func.attr} on the default group"  # type: ignore[attr-defined]
        )
