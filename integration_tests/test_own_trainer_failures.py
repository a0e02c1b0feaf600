"""docs/examples' trainer when a rank dies: the survivors name it, by its global rank, and leave.

The example (pipeline_trainer.py with the sequential model, dp 2 x pp 2, 1F1B) is started as
four plain processes (nobody ends the survivors) and under torchrun (its agent sends SIGTERM);
docs/examples/kill_a_rank.py kill -9s one rank once every rank trains. Every survivor must
leave within 60 s, some survivor must name the dead rank as gone, and none may call another
rank gone. Each case is one job of 20-45 s on 2 cores; `python docs/examples/kill_a_rank.py`
runs every case (both victims, both launchers, quiet and loaded, and the Llama model).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"


@pytest.mark.parametrize(
    ("victim", "launcher"), [(1, "plain"), (2, "torchrun")], ids=["rank1-plain", "rank2-torchrun"]
)
def test_a_killed_rank_is_named_gone_and_every_survivor_leaves(
    script_module: Callable[[Path], ModuleType], tmp_path: Path, victim: int, launcher: str
) -> None:
    """One job each (20-45 s): started, trained a moment, one rank killed, survivors followed."""
    kill = script_module(EXAMPLES / "kill_a_rank.py")
    case = kill.Case("sequential", victim, launcher, 0)
    outcome = kill.run_case(case, steps=100000, seed=0, workdir=tmp_path)
    holds, first, others = kill.judge(case, outcome)
    print(kill._summary(case, outcome, holds, first, others))
    text = "\n".join(f"{at:6.2f} rank {who}: {line}" for at, who, line in outcome.lines)
    assert first is not None, text[-6000:]
    assert not others, (others, text[-6000:])
    for rank, (left, _) in outcome.exits.items():
        assert left is not None, (rank, text[-6000:])
        assert left <= kill.LEAVE_WITHIN_S, (rank, left, text[-6000:])
    assert holds
    # The cause is said in global ranks with their place, never as a stage index.
    assert f"rank {victim} (pipeline stage " in text


def test_a_bad_step_count_is_refused_before_any_process_group() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "sequential.py"), "1f1b", "--steps", "0"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "--steps must be a whole number of 1 or more, got '0'; e.g. --steps 200"
    )
