"""Under torchrun: a killed rank is named by the stop report; a live dump prints every rank.

A rank killed mid-step makes torchrun's agent SIGTERM the others within a fraction of a second,
long before any p2p timeout (10 minutes here): the report must come from that path.
"""

from __future__ import annotations

import random
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pp_train.dump import main as dump_main

Torchrun = Callable[..., subprocess.CompletedProcess[str]]
StartJob = Callable[..., Any]  # conftest's `torchrun_job`: (script, ranks, *args) -> Job

pytestmark = pytest.mark.reliability

TINY = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--eval-iters", "2", "--lr", "3e-3", "--lr-warmup-iters", "2",
]  # fmt: skip

# The bundled command with a forward step that kills one rank at one call (os._exit: no word,
# no clean-up, as kill -9).
_KILLING = """\
import os
import runpy
import sys

import pp_train.app.command as command

inner = command.gpt_forward_step
calls = [0]


def forward_step(data, model):
    calls[0] += 1
    if os.environ["RANK"] == "{victim}" and calls[0] == {call}:
        os._exit(9)
    return inner(data, model)


command.gpt_forward_step = forward_step
sys.argv[0] = "pp-train"
runpy.run_module("pp_train", run_name="__main__")
"""

VICTIM = 2


def test_a_killed_rank_is_named_by_the_report_after_torchrun_s_sigterm(
    torchrun: Torchrun, tmp_path: Path
) -> None:
    # 4 microbatches a step on rank 2 (pp 4, gbs 8, mbs 2): a forward of iteration 3 or 4.
    call = random.Random(28).randrange(9, 17)
    script = tmp_path / "killing.py"
    script.write_text(_KILLING.format(victim=VICTIM, call=call))
    reports = tmp_path / "reports"
    started = time.monotonic()
    done = torchrun(
        script, 4, *TINY, "--pipeline-model-parallel-size", "4", "--train-iters", "10",
        "--log-interval", "1", "--stop-report-dir", str(reports), timeout=240,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    print(done.stderr[-6000:])  # the report, for the docs (pytest -s)
    assert done.returncode != 0
    cause = re.search(
        r"pipeline stopped \(call \d+\) in pipeline \[0, 1, 2, 3\]: (.*)", done.stderr
    )
    assert cause is not None, done.stderr[-6000:]
    victim = f"rank {VICTIM} (pipeline stage {VICTIM} of [0, 1, 2, 3], dp 0, tp 0)"
    assert cause.group(1).startswith(f"{victim} is gone (its process "), cause
    assert "by the plan it was at " in cause.group(1)
    assert "inferred, published nothing" in done.stderr
    written = sorted(p.name for p in reports.glob("pipeline-stop-iter*-rank0.*"))
    assert len(written) == 3, written
    assert f"{victim} is gone" in (reports / written[-1]).read_text()
    # Each survivor leaves with one line naming the dead rank: on SIGTERM (torchrun's agent
    # ends it) or, having seen the failure first, with the cause and its own error. Which
    # survivors see the failure before the agent's SIGTERM is a race the load decides.
    assert f"leaves on SIGTERM: its pipeline stopped: {victim} is gone" in done.stderr
    assert done.stderr.count("Traceback") == 1  # torchrun's own ChildFailedError only
    for survivor in (0, 1, 3):
        lines = re.findall(
            rf"pp-train: rank {survivor} \(pipeline stage {survivor} of \[0, 1, 2, 3\], dp 0, "
            rf"tp 0\) (leaves on SIGTERM: its pipeline stopped|stopped: cause): "
            rf"{re.escape(victim)} is gone (.*)",
            done.stderr,
        )
        assert len(lines) == 1, (survivor, done.stderr[-6000:])
        how, rest = lines[0]
        if how == "stopped: cause":
            assert re.search(rf"; its own error: P2PError: rank {survivor} \(stage", rest), rest
    assert elapsed < 120  # not a p2p timeout (10 minutes)


def test_sigusr2_to_one_worker_prints_every_rank_while_training_goes_on(
    torchrun_job: StartJob,
) -> None:
    """A job of 4 ranks (pp 2 x dp 2) long enough to be signalled mid-training (~20-40 s)."""
    flags = [*TINY, "--pipeline-model-parallel-size", "2", "--train-iters", "300"]
    job = torchrun_job("-m pp_train", 4, *flags, "--log-interval", "10", "--eval-interval", "1000")
    job.wait_for_output("iteration       20/", timeout=180)
    # The command's main, in this process (a new interpreter takes seconds to import
    # torch, by which time the job may have ended; its own test is in pp-train's tests).
    assert dump_main(["--pid", str(job.process.pid)]) == 0
    assert job.process.wait(240) == 0, job.stderr[-5000:]
    job.end()
    # Each rank's line, wherever it starts: other output shares the pipe.
    text = job.stderr
    print("\n".join(re.findall(r"pp-train dump 1: [^\n]*", text)))  # for the docs (pytest -s)
    dumps = re.findall(r"pp-train dump 1: rank (\d+) \(pipeline stage [^\n]*?, iteration \d+, "
                       r"(?:after )?call \d+", text)  # fmt: skip
    assert sorted(int(rank) for rank in dumps) == [0, 1, 2, 3], text[-5000:]
    # A peer a rank waits for is named by its global rank and place, never by its stage alone
    # (when a dump lands in a wait: the moment is the job's).
    for rank, stage, first, second in re.findall(
        r"waiting for rank (\d+) \(pipeline stage (\d) of \[(\d), (\d)\]", text
    ):
        assert int(rank) == (int(first), int(second))[int(stage)], text
    assert "waiting for pipeline rank" not in text
    assert any("iteration      300/     300" in line for line in job.out)
