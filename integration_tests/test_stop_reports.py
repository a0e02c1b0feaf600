"""Under torchrun: a killed rank is named by the stop report; a live dump prints every rank.

A rank killed mid-step makes torchrun's agent SIGTERM the others within a fraction of a second,
long before any p2p timeout (10 minutes here): the report must come from that path.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pp_train.dump import main as dump_main

Torchrun = Callable[..., subprocess.CompletedProcess[str]]

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
    cause = re.search(r"pipeline stopped \(call \d+\): (.*)", done.stderr)
    assert cause is not None, done.stderr[-6000:]
    assert cause.group(1).startswith(f"rank {VICTIM} is gone; by the plan it was at "), cause
    assert "inferred, published nothing" in done.stderr
    written = sorted(p.name for p in reports.glob("pipeline-stop-iter*-rank0.*"))
    assert len(written) == 3, written
    assert f"rank {VICTIM} is gone" in (reports / written[-1]).read_text()
    # The first rank leaves on SIGTERM; the survivors that saw the failure name their error.
    assert "leaves on SIGTERM: its pipeline stopped: rank 2 is gone" in done.stderr
    assert done.stderr.count("Traceback") == 1  # torchrun's own ChildFailedError only
    assert re.search(r"pp-train: rank 1 stopped: P2PError: rank 1 \(stage 1 of 4\)", done.stderr)
    assert elapsed < 120  # not a p2p timeout (10 minutes)


def _reader(stream: object, lines: list[str]) -> threading.Thread:
    def read() -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.append(line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_sigusr2_to_one_worker_prints_every_rank_while_training_goes_on(tmp_path: Path) -> None:
    """A job of 4 ranks (pp 2 x dp 2) long enough to be signalled mid-training (~20-40 s)."""
    flags = [*TINY, "--pipeline-model-parallel-size", "2", "--train-iters", "300"]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        "-m", "pp_train", *flags, "--log-interval", "10", "--eval-interval", "1000",
    ]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    out: list[str] = []
    err: list[str] = []
    readers = [_reader(job.stdout, out), _reader(job.stderr, err)]
    try:
        deadline = time.monotonic() + 180
        while not any("iteration       20/" in line for line in out):
            assert job.poll() is None, "".join(out + err)
            assert time.monotonic() < deadline, "".join(out + err)
            time.sleep(0.1)
        # The command's main, in this process (a new interpreter takes seconds to import
        # torch, by which time the job may have ended; its own test is in pp-train's tests).
        assert dump_main(["--pid", str(job.pid)]) == 0
        assert job.wait(240) == 0, "".join(err[-50:])
    finally:
        job.kill()
        for reader in readers:
            reader.join(5)
    # Each rank's line, wherever it starts: other output shares the pipe.
    dumps = re.findall(
        r"pp-train dump 1: rank (\d+) [^\n]*?, iteration \d+, call \d+", "".join(err)
    )
    print(dumps)
    assert sorted(int(rank) for rank in dumps) == [0, 1, 2, 3], "".join(err[-50:])
    assert any("iteration      300/     300" in line for line in out)
