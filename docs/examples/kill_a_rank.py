"""Kill one rank of the example trainer and time what the survivors say and when they leave.

    python docs/examples/kill_a_rank.py [--model sequential|hf_llama] [--victims 1,2]
        [--launchers plain,torchrun] [--burners 0,2] [--steps 100000] [--seed 0]

Starts `pipeline_trainer.py` with the model file at dp 2 x pp 2 (1F1B), on 4 ranks: as four
plain processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; nobody ends the survivors)
or under torchrun (its agent sends SIGTERM to the survivors of a dead rank). Once every rank
runs its forward steps and a seeded moment more (up to a second), the victim gets kill -9.
Each survivor must leave within 60 s; some survivor must name the victim, by its global rank
and place, as gone; none may call another rank gone. With burners, that many busy processes
run beside the job. One line per case: the seconds from the kill to the first line naming
the victim gone, each survivor's exit (seconds after the kill, status) and what it named.
Exit status 0 when every case holds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORLD = 4
LEAVE_WITHIN_S = 60.0
MODELS = ("sequential", "hf_llama")
LAUNCHERS = ("plain", "torchrun")

# The model file's forward step, counting: a rank says once that it trains.
_WRAPPER = """\
import os, sys
sys.path.insert(0, {examples!r})
import {model} as model
import pipeline_trainer

inner, calls = model.forward_step, [0]


def forward_step(data, chunk):
    calls[0] += 1
    if calls[0] == 8:
        print(f"kill_a_rank: rank {{os.environ['RANK']}} pid {{os.getpid()}} trains",
              file=sys.stderr, flush=True)
    return inner(data, chunk)


model.forward_step = forward_step
pipeline_trainer.main(model)
"""


@dataclasses.dataclass(frozen=True)
class Case:
    """One job: the model, the rank killed, how the job is started, the busy processes."""

    model: str
    victim: int
    launcher: str
    burners: int

    def __str__(self) -> str:
        return f"{self.model} kill rank {self.victim} {self.launcher} burners {self.burners}"


@dataclasses.dataclass
class Outcome:
    """What a case showed: lines with their time after the kill, each survivor's exit."""

    lines: list[tuple[float, int | None, str]]  # seconds after the kill, rank, text
    exits: dict[int, tuple[float | None, int | None]]  # rank -> (seconds after kill, status)
    load: float = 0.0  # the load average (1 minute) at the kill


class _Lines:
    """Lines read from pipes, each with the moment it came and its rank (a thread per pipe).

    A plain process's pipes are its rank's; torchrun's lines carry ``[defaultN]:`` (--tee 3).
    """

    def __init__(self) -> None:
        self.lines: list[tuple[float, int | None, str]] = []
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def read(self, stream: object, rank: int | None = None) -> None:
        def run() -> None:
            for line in stream:  # type: ignore[attr-defined]
                text, who = line.rstrip("\n"), rank
                tagged = re.match(r"\[default(\d+)\]:(.*)", text)
                if tagged:
                    who, text = int(tagged.group(1)), tagged.group(2)
                with self.lock:
                    self.lines.append((time.monotonic(), who, text))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def pids(self) -> dict[int, int]:
        with self.lock:
            found = [
                re.search(r"kill_a_rank: rank (\d+) pid (\d+) trains", t) for *_, t in self.lines
            ]
        return {int(m.group(1)): int(m.group(2)) for m in found if m}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start(case: Case, script: Path, steps: int, lines: _Lines) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    args = [str(script), "1f1b", "--steps", str(steps)]
    if case.launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(WORLD), "--tee", "3", *args]  # fmt: skip
        job = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=env)  # fmt: skip
        lines.read(job.stderr)
        lines.read(job.stdout)
        return [job]
    port = _free_port()
    processes = []
    for rank in range(WORLD):
        mine = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        process = subprocess.Popen([sys.executable, *args], stderr=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=mine)  # fmt: skip
        lines.read(process.stderr, rank)
        lines.read(process.stdout, rank)
        processes.append(process)
    return processes


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@contextlib.contextmanager
def _burning(count: int) -> Iterator[None]:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


def run_case(case: Case, steps: int, seed: int, workdir: Path) -> Outcome:
    """Start the job, kill the victim once every rank trains, follow the survivors."""
    script = workdir / f"train_{case.model}.py"
    script.write_text(_WRAPPER.format(examples=str(HERE), model=case.model))
    lines = _Lines()
    processes = _start(case, script, steps, lines)
    try:
        deadline = time.monotonic() + 600
        while len(lines.pids()) < WORLD:
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                raise RuntimeError(f"{case}: the job did not start: {lines.lines[-20:]}")
            time.sleep(0.05)
        pids = lines.pids()
        time.sleep(random.Random(f"{seed} {case}").uniform(0.0, 1.0))
        os.kill(pids[case.victim], signal.SIGKILL)
        killed, load = time.monotonic(), os.getloadavg()[0]
        exits = _follow(case, pids, processes, killed)
        with contextlib.suppress(subprocess.TimeoutExpired):  # torchrun's summary: the statuses
            processes[0].wait(timeout=15 if case.launcher == "torchrun" else 0.1)
    finally:
        for process in processes:
            process.kill()
            process.wait()
        for thread in lines.threads:
            thread.join(5)
    with lines.lock:
        timed = [(at - killed, who, text) for at, who, text in lines.lines if at >= killed - 0.5]
    return Outcome(timed, _statuses(exits, pids, timed), load)


def _statuses(
    exits: dict[int, tuple[float | None, int | None]],
    pids: dict[int, int],
    lines: list[tuple[float, int | None, str]],
) -> dict[int, tuple[float | None, int | None]]:
    """The exits, with the statuses torchrun's summary gives its workers' (not our children)."""
    said = [re.search(r"exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)", text) for *_, text in lines]
    status = {int(m.group(2)): int(m.group(1)) for m in said if m}
    return {
        rank: (at, code if code is not None else status.get(pids[rank]))
        for rank, (at, code) in exits.items()
    }


def _follow(
    case: Case, pids: dict[int, int], processes: list[subprocess.Popen[str]], killed: float
) -> dict[int, tuple[float | None, int | None]]:
    """Each survivor's exit: seconds after the kill and status (None: still running)."""
    survivors = {rank: pid for rank, pid in pids.items() if rank != case.victim}
    exits: dict[int, tuple[float | None, int | None]] = {r: (None, None) for r in survivors}
    by_pid = {p.pid: p for p in processes}
    while time.monotonic() - killed < LEAVE_WITHIN_S + 30:
        for rank, pid in survivors.items():
            if exits[rank][0] is None and not _alive(pid):
                process = by_pid.get(pid)
                status = process.wait() if process is not None else None
                exits[rank] = (time.monotonic() - killed, status)
        if all(at is not None for at, _ in exits.values()):
            break
        time.sleep(0.05)
    return exits


_GONE = re.compile(r"\brank (\d+) \([^()]*\) is gone\b|\bpeer rank (\d+) \(gone: ")


def judge(case: Case, outcome: Outcome) -> tuple[bool, float | None, list[int]]:
    """Whether the case holds; the first line naming the victim gone; others called gone.

    Returns:
        (holds, seconds from the kill to that line or None, the other ranks called gone).
    """
    first = None
    others: set[int] = set()
    for at, _, text in outcome.lines:
        for match in _GONE.finditer(text):
            named = int(match.group(1) or match.group(2))
            if named == case.victim and first is None:
                first = at
            elif named != case.victim:
                others.add(named)
    left = all(at is not None and at <= LEAVE_WITHIN_S for at, _ in outcome.exits.values())
    return left and first is not None and not others, first, sorted(others)


def _named(rank: int, outcome: Outcome) -> str:
    """What rank `rank`'s lines say of the cause: the report it printed, or its own line."""
    said = []
    for _, who, text in outcome.lines:
        if who != rank:
            continue
        report = re.match(r"pipeline stopped \(call \d+\) in pipeline \[[\d, ]+\]: (rank \d+ "
                          r"\([^)]*\) is \w+)", text)  # fmt: skip
        own = re.match(r"pp-schedules: rank \d+ \([^)]*\) (stopped: cause|leaves on SIGTERM: "
                       r"its pipeline stopped): (rank \d+ \([^)]*\) is \w+)", text)  # fmt: skip
        if report:
            said.append(f"report: {report.group(1)}")
        elif own:
            said.append(f"{own.group(1).split(':')[0]}: {own.group(2)}")
    return "; ".join(said) or "nothing"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs every case asked for; prints one line each; 0 when all hold."""
    parser = argparse.ArgumentParser(prog="kill_a_rank.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, action="append")
    parser.add_argument("--victims", default="1,2")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--burners", default="0,2")
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", action="store_true", help="print every line after the kill")
    args = parser.parse_args(argv)
    victims = _numbers(parser, "--victims", args.victims, range(WORLD))
    burners = _numbers(parser, "--burners", args.burners, range(65))
    launchers = [x for x in args.launchers.split(",") if x]
    if not launchers or set(launchers) - set(LAUNCHERS):
        parser.error(
            f"--launchers {args.launchers!r}: use {', '.join(LAUNCHERS)} (comma-separated)"
        )
    failures = 0
    with tempfile.TemporaryDirectory() as folder:
        for model in args.model or ["sequential"]:
            for case in (Case(model, v, launcher, b) for b in burners for launcher in launchers
                         for v in victims):  # fmt: skip
                with _burning(case.burners):
                    outcome = run_case(case, args.steps, args.seed, Path(folder))
                ok, first, others = judge(case, outcome)
                failures += not ok
                print(_summary(case, outcome, ok, first, others), flush=True)
                for at, who, text in outcome.lines if args.show else ():
                    print(f"  {at:6.2f} s rank {who}: {text[:400]}")
    return 1 if failures else 0


def _numbers(parser: argparse.ArgumentParser, flag: str, text: str, valid: range) -> list[int]:
    try:
        numbers = [int(x) for x in text.split(",") if x]
    except ValueError:
        numbers = []
    if not numbers or any(n not in valid for n in numbers):
        parser.error(f"{flag} {text!r}: give whole numbers from {valid.start} to "
                     f"{valid.stop - 1}, comma-separated, e.g. {flag} 1,2")  # fmt: skip
    return numbers


def _summary(case: Case, outcome: Outcome, ok: bool, first: float | None, others: list[int]) -> str:
    exits = ", ".join(
        f"rank {rank} left after {'-' if at is None else f'{at:.1f} s'} (status {status}), "
        f"said {_named(rank, outcome)}"
        for rank, (at, status) in sorted(outcome.exits.items())
    )
    named = "never" if first is None else f"{first:.1f} s"
    wrong = f"; others called gone: {others}" if others else ""
    return (
        f"{'ok  ' if ok else 'FAIL'} {case} (load {outcome.load:.1f}): named gone after "
        f"{named}; {exits}{wrong}"
    )


if __name__ == "__main__":
    sys.exit(main())
