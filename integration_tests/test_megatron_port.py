"""A Megatron model ported by its imports (docs/examples/megatron_mlp.py) trains at tp x pp as
at tp 1 x pp 1: column- and row-parallel MLP blocks with sequence parallelism, pipelined."""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "docs" / "examples" / "megatron_mlp.py"
PAGE = ROOT / "docs" / "porting.md"
Torchrun = Callable[..., subprocess.CompletedProcess[str]]


def _losses(torchrun: Torchrun, ranks: int, tp: int, pp: int) -> list[float]:
    done = torchrun(SCRIPT, ranks, "--tp", str(tp), "--pp", str(pp), timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = re.findall(r"^\[.*\]$", done.stdout, flags=re.MULTILINE)
    assert len(printed) == 1, done.stdout
    losses = ast.literal_eval(printed[0])
    assert isinstance(losses, list)
    return [float(loss) for loss in losses]


@pytest.mark.parametrize(("tp", "pp"), [(2, 2), (4, 1)], ids=["tp2-pp2", "tp4-pp1"])
def test_the_ported_model_gives_the_losses_of_one_process(
    torchrun: Torchrun, tp: int, pp: int
) -> None:
    one = _losses(torchrun, 1, 1, 1)
    many = _losses(torchrun, tp * pp, tp, pp)
    assert len(one) == len(many) == 4
    assert one[-1] < one[0] / 2  # it trains
    worst = max(abs(a - b) / abs(b) for a, b in zip(many, one, strict=True))
    assert worst <= 1e-5, (many, one)


def test_the_porting_page_shows_the_ported_model_as_it_runs() -> None:
    source = SCRIPT.read_text(encoding="utf-8")
    ported = source.split("# --- ported ---\n", 1)[1].split("# --- end ported ---", 1)[0]
    assert ported.strip() in PAGE.read_text(encoding="utf-8")
    # Porting it back is replacing the two import prefixes: no other pp name is used.
    assert "pp_" not in re.sub(
        r"from pp_tensor\.megatron(\.model_parallel_config)? import", "", ported
    )
