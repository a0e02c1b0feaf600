"""One real stop report per rule of the cause, at pp 2 x dp 2 and tp 2 x pp 2 x dp 2.

Runs the bundled GPT under torchrun with one fault injected into one rank's forward step (or a
signal sent to it) at a chosen call, and prints the report the reporting rank wrote for the
faulty rank's pipeline. The cases follow the order of evidence in docs/failure-modes.md:

- ``mismatch``: the rank sends an activation one position short (a contract mismatch);
- ``own``: the rank's forward raises an error of its own;
- ``gone``: the rank is killed with SIGKILL (kill -9);
- ``stopped``: the rank is stopped with SIGSTOP;
- ``busy``: the rank sleeps past the transfers' timeout inside its forward, alive.

``python packages/pp-train/benchmarks/stop_cases.py [--tp 1|2] [--cases gone,busy,...]``;
each case is one job (20-60 s on 2 cores). Exit status 0 when every report names the faulty
rank first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

CASES = ("mismatch", "own", "gone", "stopped", "busy")
FAULT_CALL = 6  # the forward step call of the faulty rank that misbehaves
TIMEOUT_MINUTES = 0.25  # transfers and collectives time out after 15 s

# The bundled command with a forward step that misbehaves on one rank at one call.
_WRAPPER = """\
import os, runpy, sys, time

import pp_train.app.command as command

inner = command.gpt_forward_step
calls = [0]
case, victim, at = os.environ["STOP_CASE"], os.environ["STOP_VICTIM"], int(os.environ["STOP_AT"])


def forward_step(data, model):
    calls[0] += 1
    faulty = os.environ["RANK"] == victim and calls[0] == at
    if faulty and case == "own":
        raise RuntimeError("injected: this rank's forward failed on its own")
    if faulty and case == "busy":
        time.sleep(float(os.environ["STOP_BUSY_S"]))
    output, loss = inner(data, model)
    if faulty and case == "mismatch":
        output = output[:-1]  # one position short: the next stage expects the full sequence
    if faulty and case in ("gone", "stopped"):
        print(f"stop-case: ready {os.getpid()}", file=sys.stderr, flush=True)
        time.sleep(30)  # the driver signals this process now
    return output, loss


command.gpt_forward_step = forward_step
sys.argv[0] = "pp-train"
runpy.run_module("pp_train", run_name="__main__")
"""

TINY = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--eval-iters", "2", "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "50",
    "--log-interval", "1", "--eval-interval", "1000",
]  # fmt: skip


def victim_of(tp: int) -> int:
    """The faulty rank: stage 0 of the second data-parallel pipeline.

    Rank 1 at tp 1, rank 2 at tp 2: a rank whose activations the next stage receives.
    """
    return tp


def run_case(case: str, tp: int, workdir: Path) -> tuple[str, str]:
    """Run one job; returns the report the faulty rank's pipeline wrote, and the job's stderr."""
    reports = workdir / f"{case}-tp{tp}"
    script = workdir / "wrapper.py"
    script.write_text(_WRAPPER)
    world = 4 * tp
    env = {
        **os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
        "STOP_CASE": case, "STOP_VICTIM": str(victim_of(tp)), "STOP_AT": str(FAULT_CALL),
        "STOP_BUSY_S": str(TIMEOUT_MINUTES * 60 + 10),
    }  # fmt: skip
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(world), str(script), *TINY, "--pipeline-model-parallel-size", "2",
        "--tensor-model-parallel-size", str(tp), "--stop-report-dir", str(reports),
        "--distributed-timeout-minutes", str(TIMEOUT_MINUTES),
    ]  # fmt: skip
    job = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                           text=True, env=env)  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        assert job.stderr is not None
        for line in job.stderr:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    victim_pid = None
    deadline = time.monotonic() + 300
    while job.poll() is None and time.monotonic() < deadline:
        ready = [re.search(r"stop-case: ready (\d+)", line) for line in lines]
        found = next((m for m in ready if m), None)
        if found and victim_pid is None:
            victim_pid = int(found.group(1))
            os.kill(victim_pid, signal.SIGKILL if case == "gone" else signal.SIGSTOP)
        exits = sum("pp-train: rank" in line or "pp-train: error" in line for line in lines)
        if case == "stopped" and victim_pid is not None and exits >= world - 1:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim_pid, signal.SIGKILL)  # torchrun's agent waits for it
        time.sleep(0.1)
    job.kill()
    job.wait()
    reader.join(5)
    written = sorted(reports.glob("pipeline-stop-*.txt"))
    victim = victim_of(tp)
    mine = [p for p in written if f"in pipeline [{victim}, " in p.read_text().splitlines()[0]]
    chosen = mine or written
    return (chosen[0].read_text() if chosen else "(no report written)"), "".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the cases; prints each report; 0 when each names the faulty rank first."""
    parser = argparse.ArgumentParser(prog="stop_cases.py", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, choices=(1, 2), action="append")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; valid: {', '.join(CASES)}")
    failures = 0
    with tempfile.TemporaryDirectory() as folder:
        for tp in args.tp or [1, 2]:
            for case in cases:
                started = time.monotonic()
                report, _ = run_case(case, tp, Path(folder))
                seconds = time.monotonic() - started
                layout = f"tp {tp} x pp 2 x dp 2" if tp > 1 else "pp 2 x dp 2"
                print(f"=== {case} at {layout} (rank {victim_of(tp)}, {seconds:.0f} s)")
                print(report.rstrip() + "\n")
                first = report.splitlines()[0] if report else ""
                named = re.search(r"\]: (?:contract mismatch between )?rank (\d+) ", first)
                failures += named is None or int(named.group(1)) != victim_of(tp)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
