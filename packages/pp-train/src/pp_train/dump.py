"""``python -m pp_train.dump --pid PID``: every rank of a running job prints where it is now.

`PID` is torchrun's (its agent's) process id, or any worker's. The command sends SIGUSR2 to one
worker (the agent's child with the lowest ``RANK``, or `PID` itself when it is a worker); that
rank's `pp_train.live_dump.SignalWatcher` counts a request in the job's store and every rank
prints one line on its stderr within about half a second, without stopping training::

    pp-train dump 1: rank 3 (pipeline rank 1 of 2), iteration 41, call 41, step 9 (B2), running

Linux only (it reads ``/proc``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "worker_ranks"]


def _children(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue  # a thread that ended meanwhile
    return children


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"RANK="):
            text = entry[len(b"RANK=") :].decode(errors="replace")
            return int(text) if text.isdigit() else None
    return None


def worker_ranks(pid: int) -> dict[int, int]:
    """The workers a torchrun agent started: process id by ``RANK`` (its direct children)."""
    ranks = {}
    for child in _children(pid):
        rank = _rank_of(child)
        if rank is not None:
            ranks[rank] = child
    return ranks


def main(argv: Sequence[str] | None = None) -> int:
    """Signals one worker of the job at ``--pid``; returns the exit status (2: no such process)."""
    parser = argparse.ArgumentParser(
        prog="python -m pp_train.dump",
        description="Every rank of a running pp-train job prints where it is now (stderr).",
    )
    parser.add_argument("--pid", type=int, required=True, help="torchrun's process id, or a rank's")
    args = parser.parse_args(argv)
    workers = worker_ranks(args.pid)
    rank, target = min(workers.items()) if workers else (_rank_of(args.pid), args.pid)
    if rank is None:
        # SIGUSR2 ends a process that has no handler for it: signal pp-train's ranks only.
        print(
            f"pp_train.dump: error: process {args.pid} is neither a torchrun agent with "
            "workers nor a worker (no RANK in its environment)",
            file=sys.stderr,
        )
        return 2
    try:
        os.kill(target, signal.SIGUSR2)
    except (ProcessLookupError, PermissionError) as error:
        print(f"pp_train.dump: error: cannot signal process {target}: {error}", file=sys.stderr)
        return 2
    print(f"asked rank {rank} (pid {target}) for a dump: every rank prints one line on stderr")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
