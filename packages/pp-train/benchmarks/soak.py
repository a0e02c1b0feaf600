"""The fault-injected soak: the bundled GPT under torchrun with seeded faults ends as if unfaulted.

Trains ``pp-train`` (``python -m pp_train``) at pipeline 2 x data parallel 2 under
``torchrun --standalone --nproc-per-node 4 --max-restarts N``, checkpointing every K steps, and
injects faults at seeded random steps on seeded random ranks, one after the other:

- ``kill``: kill -9 of a rank;
- ``term``: SIGTERM to a rank;
- ``stop``: SIGSTOP to a rank, left stopped past the distributed timeout;
- ``disk``: the checkpoint disk (a small tmpfs in a private user and mount namespace) filled
  just before a save, emptied once the save failed;
- ``corrupt``: the last bytes of the newest checkpoint's file overwritten, then a rank killed
  so the job restarts and loads it: pp-train finds it damaged and loads the one before it.

This process is the injector: it reads the job's output for the step number, finds the worker
pids as children of the torchrun agent (/proc) and signals them. For each fault it records
whether the logs name it (the stop report's cause line, or the checkpoint error's), whether the
job restarted and resumed from the last complete checkpoint, the steps recomputed, and whether
the restart came within ``--hang-seconds``. At the end the final checkpoint's tensors are
compared with those of an uninterrupted run with the same seed, and a table is printed.

Run it with ``python3 -m nox -s soak`` (posargs go to this script) or directly:
``python packages/pp-train/benchmarks/soak.py --seed 1 --faults kill,term,stop,disk,corrupt``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "FAULT_KINDS",
    "Fault",
    "Outcome",
    "SoakConfig",
    "main",
    "parse_args",
    "parse_faults",
    "plan_faults",
]

FAULT_KINDS = ("kill", "term", "stop", "disk", "corrupt")
"""The faults ``--faults`` may list, in any order, any number of times."""

RANKS = 4  # pipeline 2 x data parallel 2
PIPELINE = 2
DATA_PARALLEL = RANKS // PIPELINE
DISK_LEAD = 10
"""Steps between filling the disk and the save it must fail: the job's step lines reach the
injector late on a loaded machine, and a fill two steps ahead missed the save."""
_INSIDE = "PP_SOAK_IN_NAMESPACE"  # set when this script re-ran itself under `unshare -rm`
_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_SAVED = re.compile(r"saved checkpoint at iteration (\d+)")
_LOADED = re.compile(r"loaded checkpoint from \S+ at iteration (\d+)")
_FRESH = "starting from scratch"
# What names each fault in the logs (see docs/failure-modes.md, "Soak").
_NO_SPACE = r"(No space left on device|Errno 28|File too large)"


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """The soak's settings (the command-line flags).

    Attributes:
        seed: Seed of the fault plan and of training (``--seed`` of pp-train).
        faults: The fault kinds to inject, in order.
        steps: Training iterations.
        save_interval: Checkpoint every this many iterations.
        ckpt_format: ``torch`` or ``torch_dist``.
        timeout_minutes: pp-train's ``--distributed-timeout-minutes``.
        hang_seconds: A fault whose restart has not resumed training within this is a hang.
        workdir: Where checkpoints and logs go (a temporary folder when None).
    """

    seed: int
    faults: tuple[str, ...]
    steps: int
    save_interval: int
    ckpt_format: str
    timeout_minutes: float
    hang_seconds: float
    workdir: Path | None


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planned fault.

    Attributes:
        kind: One of `FAULT_KINDS`.
        step: Fires once the job logs this iteration (disk: a few before the save at `save`;
            corrupt: at the first save at or after it).
        rank: The global rank signalled (disk: None, every rank's save fails).
        delay: Seconds after the log line, so the signal lands at a random point of the step.
        save: The save a ``disk`` fault fills the disk for (0 for other kinds).
    """

    kind: str
    step: int
    rank: int | None
    delay: float
    save: int = 0


@dataclasses.dataclass
class Outcome:
    """What one fault did (a row of the table)."""

    fault: Fault
    fired_at: int = -1  # the last iteration logged when it fired
    cause: str = ""  # the first line naming it
    expected: int | None = None  # the last complete checkpoint when it fired
    resumed: int | None = None  # the iteration the restart loaded
    lost: int = 0  # iterations recomputed
    seconds: float = 0.0  # fault to resumed training
    hang: bool = False
    peer_error: str = ""  # a collective's error naming the rank as a lost peer
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def named(self) -> bool:
        """Whether a log line names this fault."""
        return bool(self.cause)

    @property
    def recovered(self) -> bool:
        """Whether the job resumed from the last complete checkpoint."""
        return self.resumed is not None and self.resumed == self.expected


def parse_faults(text: str) -> tuple[str, ...]:
    """``kill,term`` -> ("kill", "term").

    Raises:
        ValueError: Empty, or a name not in `FAULT_KINDS`; the message names the valid ones.
    """
    names = tuple(part.strip() for part in text.split(","))
    valid = ", ".join(FAULT_KINDS)
    if not text.strip() or any(not name for name in names):
        raise ValueError(f"--faults needs a comma-separated list of {valid}; got {text!r}")
    unknown = [name for name in names if name not in FAULT_KINDS]
    if unknown:
        raise ValueError(f"--faults: unknown fault(s) {', '.join(unknown)}; valid: {valid}")
    return names


def _whole(name: str, least: int) -> Any:
    """An argparse type: a whole number `least` or more, else an error naming `name`."""

    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < least:
            raise argparse.ArgumentTypeError(
                f"{name} must be a whole number {least} or more, got {text!r}"
            )
        return int(text)

    return parse


def _positive(name: str) -> Any:
    """An argparse type: a positive finite number, else an error naming `name`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{name} must be a positive number, got {text!r}")
        return value

    return parse


def _fault_list(text: str) -> tuple[str, ...]:
    try:
        return parse_faults(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: Sequence[str] | None = None) -> SoakConfig:
    """The flags as a `SoakConfig`; bad values exit with argparse's usage and one line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seed", type=_whole("--seed", 0), default=1)
    parser.add_argument(
        "--faults",
        type=_fault_list,
        default=FAULT_KINDS,
        help=f"comma-separated, from {', '.join(FAULT_KINDS)} (default: all)",
    )
    parser.add_argument("--steps", type=_whole("--steps", 1), default=1000)
    parser.add_argument("--save-interval", type=_whole("--save-interval", 2), default=50)
    parser.add_argument("--ckpt-format", choices=("torch", "torch_dist"), default="torch")
    parser.add_argument(
        "--timeout-minutes", type=_positive("--timeout-minutes"), default=0.5,
        help="pp-train's --distributed-timeout-minutes (what a stopped rank must outlast)",
    )  # fmt: skip
    parser.add_argument("--hang-seconds", type=_positive("--hang-seconds"), default=None)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    args = parser.parse_args(argv)
    hang = args.hang_seconds or args.timeout_minutes * 60 + 120
    config = SoakConfig(
        args.seed, args.faults, args.steps, args.save_interval, args.ckpt_format,
        args.timeout_minutes, hang, args.workdir,
    )  # fmt: skip
    try:
        plan_faults(config)
    except ValueError as error:
        parser.error(str(error))
    return config


def plan_faults(config: SoakConfig) -> list[Fault]:
    """The faults at seeded random steps and ranks: one in each equal slice of the run.

    Each fault lies in its own slice after the first checkpoint, at least one save interval
    long, so the job has resumed before the next fires.

    Raises:
        ValueError: The run is too short for the faults; the message names the least steps.
    """
    rng = random.Random(config.seed)
    interval, count = config.save_interval, len(config.faults)
    slice_ = (config.steps - interval) // max(count, 1)
    if slice_ < 2 * interval:
        least = interval + 2 * interval * count
        raise ValueError(
            f"--steps {config.steps} is too short for {count} fault(s) with --save-interval "
            f"{interval}: each needs a slice of 2 save intervals after the first save; "
            f"use --steps {least} or more"
        )
    faults = []
    for index, kind in enumerate(config.faults):
        start = interval + index * slice_ + 1
        step = start + rng.randrange(slice_ - interval)
        rank = rng.randrange(RANKS)
        delay = rng.uniform(0.0, 0.03)
        if kind == "disk":
            save = (step // interval + 1) * interval
            faults.append(Fault(kind, save - min(DISK_LEAD, interval - 1), None, 0.0, save))
        else:
            faults.append(Fault(kind, step, rank, delay))
    return faults


def train_command(config: SoakConfig, checkpoints: Path, max_restarts: int) -> list[str]:
    """The torchrun command: the tiny GPT at pipeline 2 x data parallel 2, saving to `checkpoints`.

    Each rank runs pp-train's command; a restarted rank joins a process group of its own
    restart (`pp_train.pretrain.restarted_store`).
    """
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(RANKS), "--max-restarts", str(max_restarts),
        "-m", "pp_train", "--pipeline-model-parallel-size", str(PIPELINE),
        "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", str(config.steps), "--lr-warmup-iters", "5", "--eval-iters", "0",
        "--log-interval", "1", "--seed", str(config.seed),
        "--distributed-timeout-minutes", str(config.timeout_minutes),
        "--save", str(checkpoints), "--load", str(checkpoints),
        "--save-interval", str(config.save_interval), "--ckpt-format", config.ckpt_format,
    ]  # fmt: skip


class Job:
    """One torchrun launch: its output line by line (also appended to a log), its workers."""

    def __init__(self, command: list[str], log: Path) -> None:
        """Start `command` in its own session, its output read by a thread."""
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        env["PYTHONUNBUFFERED"] = "1"  # step lines must arrive as they are printed
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self._reader.start()

    def _read(self, log: Path) -> None:
        assert self.process.stdout is not None
        with log.open("a") as out:
            for line in self.process.stdout:
                out.write(line)
                out.flush()
                self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def workers(self) -> dict[int, int]:
        """Global rank -> pid of the agent's live worker processes (from /proc)."""
        found: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                if int(fields[1]) != self.process.pid or fields[0] == "Z":
                    continue
                environ = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(entry.name)
        return found

    def end(self) -> None:
        """Kill the launch's whole session (agent and workers) and wait for it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._reader.join(timeout=10)


def _tracked(checkpoints: Path) -> int | None:
    """The iteration the tracker names, or None."""
    try:
        return int((checkpoints / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return None


def _newest_file(directory: Path, ckpt_format: str) -> Path:
    """The file a corrupt fault overwrites: a stage's file, or DCP's ``.metadata``."""
    if ckpt_format == "torch_dist":
        return directory / ".metadata"
    return sorted(directory.glob("*/model_optim_rng.pt"))[0]


class Injector:
    """Fires the planned faults at a running job and records what each did."""

    def __init__(self, config: SoakConfig, checkpoints: Path, faults: list[Fault]) -> None:
        """Arm the first of `faults` against the job saving to `checkpoints`."""
        self.config, self.checkpoints = config, checkpoints
        self.pending = list(faults)
        self.outcomes: list[Outcome] = []
        self.current: Outcome | None = None  # fired, not yet resumed
        self.iteration = 0  # last logged
        self.saved: list[int] = []  # complete checkpoints, oldest first
        self.fired_time = 0.0
        self.filler: Path | None = None
        self.corrupted: int | None = None

    def see(self, line: str, job: Job) -> None:
        """Take one line of the job's output: track steps and saves, fire, judge."""
        if match := _ITERATION.search(line):
            self.iteration = int(match.group(1))
        elif match := _SAVED.search(line):
            self.saved.append(int(match.group(1)))
        if self.current is not None:
            self._after_fault(line, self.current)
        elif self.pending and self._due(self.pending[0], line):
            self._fire(self.pending.pop(0), job)

    def _due(self, fault: Fault, line: str) -> bool:
        if fault.kind == "corrupt":
            match = _SAVED.search(line)
            return match is not None and int(match.group(1)) >= fault.step
        return _ITERATION.search(line) is not None and self.iteration >= fault.step

    def _fire(self, fault: Fault, job: Job) -> None:
        outcome = Outcome(fault, fired_at=self.iteration)
        outcome.expected = self.saved[-1] if self.saved else 0
        time.sleep(fault.delay)
        if fault.kind == "disk":
            self._fill_disk(outcome)
        elif fault.kind == "corrupt":
            self._corrupt_newest(outcome)
        workers = job.workers()
        if fault.rank is not None and fault.rank in workers:
            kind = "kill" if fault.kind == "corrupt" else fault.kind
            sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}[kind]
            os.kill(workers[fault.rank], sig)
        elif fault.rank is not None:
            outcome.notes.append(f"rank {fault.rank} had no live process; nothing sent")
        self.current, self.fired_time = outcome, time.monotonic()
        print(
            f"soak: fired {fault.kind} at iteration {self.iteration} (rank {fault.rank})",
            flush=True,
        )

    def _fill_disk(self, outcome: Outcome) -> None:
        """Leave less free space than one checkpoint needs."""
        free = shutil.disk_usage(self.checkpoints).free
        self.filler = self.checkpoints.parent / "filler"
        try:
            with self.filler.open("wb") as out:
                out.write(b"\0" * max(free - 16 * 1024, 0))
        except OSError as error:  # ENOSPC: tmpfs counts whole pages; the disk is full anyway
            if error.errno != errno.ENOSPC:
                outcome.notes.append(f"filling the disk failed: {error.strerror}")

    def _corrupt_newest(self, outcome: Outcome) -> None:
        """Overwrite the newest checkpoint file's last 64 bytes; the restart must skip it."""
        newest = self.saved[-1]
        target = _newest_file(self.checkpoints / f"iter_{newest:07d}", self.config.ckpt_format)
        with target.open("r+b") as out:
            out.seek(max(target.stat().st_size - 64, 0))
            out.write(b"\xff" * 64)
        self.corrupted = newest
        self.saved.pop()
        outcome.expected = self.saved[-1] if self.saved else 0
        outcome.notes.append(f"corrupted {target.relative_to(self.checkpoints)}")

    def _after_fault(self, line: str, outcome: Outcome) -> None:
        """Between a fault and the resume: note the naming line, undo the disk, judge."""
        if not outcome.cause and _names(outcome.fault, line, self.corrupted):
            outcome.cause = line.strip()[:160]
        outcome.peer_error = outcome.peer_error or _peer_error(outcome.fault, line)
        if self.filler is not None and re.search(_NO_SPACE, line):
            self.filler.unlink()
            self.filler = None
        if _SAVED.search(line) and outcome.fault.kind != "corrupt":
            outcome.expected = self.saved[-1]
            if outcome.fault.kind == "disk" and self.filler is not None:
                self._missed(outcome, "the save did not fail: the disk was not full")
                return
        resumed = _LOADED.search(line)
        if resumed or _FRESH in line:
            self._resumed(outcome, int(resumed.group(1)) if resumed else 0)

    def _missed(self, outcome: Outcome, note: str) -> None:
        """The fault did not stop the job: note why, undo the disk fill, arm the next."""
        if self.filler is not None:
            self.filler.unlink()
            self.filler = None
        outcome.notes.append(note)
        self.outcomes.append(outcome)
        self.current = None

    def _resumed(self, outcome: Outcome, iteration: int) -> None:
        if self.filler is not None:  # the save never failed: the fault did not happen
            self.filler.unlink()
            self.filler = None
            outcome.notes.append("the save did not fail")
        outcome.resumed = iteration
        outcome.lost = max(self.iteration - iteration, 0)
        outcome.seconds = time.monotonic() - self.fired_time
        self.iteration = iteration
        self.saved = [s for s in self.saved if s <= iteration]
        self.outcomes.append(outcome)
        self.current = None

    def overdue(self) -> bool:
        """Whether the current fault's restart is past the hang bound."""
        late = time.monotonic() - self.fired_time > self.config.hang_seconds
        return self.current is not None and late


def _names(fault: Fault, line: str, corrupted: int | None) -> bool:
    """Whether `line` names `fault`: the stop report's cause or the checkpoint error."""
    if fault.kind == "disk":
        return re.search(_NO_SPACE, line) is not None
    if fault.kind == "corrupt":
        return corrupted is not None and f"checkpoint iteration {corrupted} is damaged" in line
    assert fault.rank is not None
    # Only a report's cause counts, naming the global rank with its place ("rank 1 (pipeline
    # stage 0 of [1, 3], dp 1, tp 0) is gone"): not a stage index, not a peer in an error.
    cause = {"kill": "is gone", "stop": "is (?:stopped|silent|not answering)", "term": ""}
    report = r"pipeline stopped \(call \d+\) in pipeline \[[\d, ]+\]: "
    pattern = rf"{report}rank {fault.rank} \([^)]*\) {cause[fault.kind]}"
    return re.search(pattern, line) is not None


def _peer_error(fault: Fault, line: str) -> str:
    """A collective's error in `line` naming the signalled rank as a lost peer, shortened; or ''."""
    if fault.rank is None or fault.kind not in ("kill", "stop"):
        return ""
    lost = "closed the connection or died|did not answer in time"
    found = re.search(
        rf"(\w+Error): (rank \d+: .*?) failed: peer rank {fault.rank} .*?({lost})", line
    )
    return f"{found[1]}: {found[2]}: peer rank {fault.rank} {found[3]}" if found else ""


def run_job(config: SoakConfig, checkpoints: Path, log: Path, injector: Injector | None) -> int:
    """Launch torchrun until training completes; returns the launches it took.

    A launch that ends before the last iteration (torchrun out of restarts, or every rank
    stopped cleanly on SIGTERM, as a scheduler would requeue it) is launched again; a fault
    past the hang bound kills the launch.
    """
    faults = len(injector.pending) if injector else 0
    command = train_command(config, checkpoints, max_restarts=2 * faults + 1)
    launches = 0
    while True:
        launches += 1
        job = Job(command, log)
        finished = _follow(job, injector, config.steps)
        if finished:
            return launches
        if launches > 2 * faults + 2:
            raise RuntimeError(f"training did not finish after {launches} launches")
        if injector is not None and injector.current is not None:
            injector.current.notes.append(f"torchrun exited: relaunch {launches + 1}")


def _follow(job: Job, injector: Injector | None, steps: int) -> bool:
    """Feed `job`'s lines to `injector` until it exits; whether it trained to `steps`."""
    last = 0
    while True:
        try:
            line = job.lines.get(timeout=1.0)
        except queue.Empty:
            line = ""
        if line is None:
            job.end()
            return job.process.returncode == 0 and last >= steps
        if match := _ITERATION.search(line):
            last = int(match.group(1))
        if injector is not None:
            injector.see(line, job)
            if injector.overdue() and injector.current is not None:
                injector.current.hang = True
                injector.current.notes.append("hang: killed the launch")
                injector.fired_time = time.monotonic()  # the relaunch gets its own bound
                job.end()


def _tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, tensor) for every tensor in a nested checkpoint dict."""
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _tensors(value[key], f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}/{index}")


def final_state(checkpoints: Path, steps: int, ckpt_format: str) -> dict[str, Any]:
    """Every model and optimizer tensor of iteration `steps`'s checkpoint, by path."""
    import torch

    directory = checkpoints / f"iter_{steps:07d}"
    if ckpt_format == "torch_dist":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        target = checkpoints.parent / "final.pt"
        dcp_to_torch_save(directory, target)
        loaded = torch.load(target, weights_only=True)
        return {k: v for k, v in _tensors(loaded) if "rng" not in k}
    state: dict[str, Any] = {}
    for path in sorted(directory.glob("*/model_optim_rng.pt")):
        saved = torch.load(path, weights_only=True)
        for part in ("model", "optimizer"):
            state.update(_tensors(saved[part], f"{path.parent.name}/{part}"))
    return state


def equal_states(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Same tensor paths, each bit for bit equal."""
    import torch

    return first.keys() == second.keys() and all(
        torch.equal(first[key], second[key]) for key in first
    )


def stale_files(checkpoints: Path) -> list[str]:
    """Temporaries a save leaves when it is interrupted: ``.partial``, ``.replaced``, ``.tmp-``."""
    marks = (".partial", ".replaced", ".tmp-", ".writer")
    return sorted(
        str(path.relative_to(checkpoints))
        for path in checkpoints.rglob("*")
        if any(mark in path.name for mark in marks)
    )


def table(config: SoakConfig, outcomes: list[Outcome], summary: dict[str, Any]) -> str:
    """The per-fault rows and the summary line."""
    rows = [
        f"soak: seed {config.seed}, {config.steps} steps, pp {PIPELINE} x dp {DATA_PARALLEL}, "
        f"{config.ckpt_format} checkpoints every {config.save_interval}, "
        f"faults {','.join(config.faults)}",
        f"{'fault':8}{'step':>6}{'rank':>6}{'named':>7}{'resumed':>9}{'expected':>10}"
        f"{'lost':>6}{'secs':>7}  cause / notes",
    ]
    for o in outcomes:
        rank = "all" if o.fault.rank is None else str(o.fault.rank)
        named_by = [] if o.cause or not o.peer_error else [f"only as a peer: {o.peer_error}"]
        notes = "; ".join([o.cause or "(no report names it)", *named_by, *o.notes])
        rows.append(
            f"{o.fault.kind:8}{o.fired_at:>6}{rank:>6}{'yes' if o.named else 'no':>7}"
            f"{o.resumed if o.resumed is not None else '-':>9}{o.expected:>10}{o.lost:>6}"
            f"{o.seconds:>7.1f}  {notes}"
        )
    rows.append(" | ".join(f"{key.replace('_', ' ')}: {value}" for key, value in summary.items()))
    return "\n".join(rows)


def summarise(
    outcomes: list[Outcome], planned: int, stale: list[str], equal: bool
) -> dict[str, Any]:
    """The table's totals."""
    return {
        "faults_injected": len(outcomes),
        "planned": planned,
        "named": sum(o.named for o in outcomes),
        "recovered": sum(o.recovered for o in outcomes),
        "steps_lost": sum(o.lost for o in outcomes),
        "hangs": sum(o.hang for o in outcomes),
        "stale_files_left": len(stale),
        "params_equal": "yes" if equal else "no",
    }


def soak(config: SoakConfig, root: Path) -> dict[str, Any]:
    """The reference run, the faulted run, the comparison; prints and returns the summary."""
    reference = root / "reference" / "checkpoints"
    reference.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    run_job(config, reference, root / "reference" / "train.log", None)
    print(f"soak: reference run done in {time.monotonic() - started:.0f} s", flush=True)
    disk = root / "faulted" / "disk"  # the disk fault fills it: checkpoints and the filler
    disk.mkdir(parents=True, exist_ok=True)
    mounted = "disk" in config.faults
    if mounted:
        _mount_tmpfs(disk)
    try:
        checkpoints = disk / "checkpoints"
        faults = plan_faults(config)
        injector = Injector(config, checkpoints, faults)
        started = time.monotonic()
        launches = run_job(config, checkpoints, root / "faulted" / "train.log", injector)
        elapsed = time.monotonic() - started
        print(f"soak: faulted run done in {elapsed:.0f} s, {launches} launch(es)")
        stale = stale_files(checkpoints)
        equal = equal_states(
            final_state(reference, config.steps, config.ckpt_format),
            final_state(checkpoints, config.steps, config.ckpt_format),
        )
    finally:
        if mounted:  # a mount point cannot be removed with the work folder
            subprocess.run(["umount", str(disk)], check=False)
    summary = summarise(injector.outcomes, len(faults), stale, equal)
    print(table(config, injector.outcomes, summary))
    if stale:
        print(f"stale files: {', '.join(stale)}")
    print(json.dumps(summary))
    return summary


def _mount_tmpfs(directory: Path) -> None:
    """A 64 MiB tmpfs at `directory` (this process is in its own mount namespace)."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(directory)], check=True)


def _in_namespace(argv: Sequence[str]) -> int:
    """Run this script again under ``unshare -rm`` (a disk fault needs a private tmpfs)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SystemExit("soak: the disk fault needs util-linux's unshare; leave out 'disk'")
    env = {**os.environ, _INSIDE: "1"}
    return subprocess.run(
        [unshare, "-rm", sys.executable, __file__, *argv], env=env, check=False
    ).returncode


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the soak (in a private namespace if it fills a disk); 0 when every goal met.

    The goals: every planned fault injected and recovered, no hang, no stale file, parameters
    equal. How many faults the logs name is reported, not required.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    config = parse_args(args)
    if "disk" in config.faults and os.environ.get(_INSIDE) != "1":
        return _in_namespace(args)
    if config.workdir is not None:
        summary = soak(config, config.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="pp-soak-") as folder:
            summary = soak(config, Path(folder))
    met = (
        summary["faults_injected"] == summary["recovered"] == summary["planned"]
        and summary["hangs"] == 0
        and summary["stale_files_left"] == 0
        and summary["params_equal"] == "yes"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
