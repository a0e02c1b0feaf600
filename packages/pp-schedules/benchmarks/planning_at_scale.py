"""What planning costs at scale: plan, validate, simulate and resolve at pp 8 to 64, m = 8 pp.

Every rank resolves its schedule before training: plans it, validates it under the
transport's rules, and for ``auto`` simulates every candidate. This times each part on one
core for every built-in pipelined schedule, with m = 8 x pp microbatches, in CPU seconds of
this process (so another job on the machine slows the table less than it would wall time;
the fastest of up to five runs where they are short), and prints the
growth per doubling of pp and m (the plan's steps grow 4x; goal: plan + NCCL validation at
most 5x). `resolve_schedule` (NCCL rules, forward-only plans too) is timed for each schedule
and for ``auto`` with one and two chunks per rank. Generators' caches are cleared before
each timing, so each plan is made anew.

    python packages/pp-schedules/benchmarks/planning_at_scale.py [--sizes 8 16 32 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pp_schedules import Costs, resolve_schedule
from pp_schedules.planning import plan, simulate, validate
from pp_schedules.planning._zero_bubble import _zb_h1, _zbv

SCHEDULES = [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("gpipe", 1)]
AUTO = [("auto", 1), ("auto", 2)]
GOAL_GROWTH = 5.0
Record = dict[str, Any]
PARTS = ("plan", "validate_gloo", "validate_nccl", "simulate", "resolve_nccl")


def _timed(work: Callable[[], Any]) -> tuple[float, Any]:
    """The fastest of a few runs (as many as fit in half a second, at most 5), and its result."""
    best, spent, result = float("inf"), 0.0, None
    for _ in range(5):
        _zb_h1.cache_clear()
        _zbv.cache_clear()
        start = time.process_time()
        result = work()
        took = time.process_time() - start
        best, spent = min(best, took), spent + took
        if spent > 0.5:
            break
    return best, result


def measure(name: str, vp: int, pp: int) -> Record:
    """One row: the seconds of each part for `name` at `pp` ranks and 8 pp microbatches."""
    m = 8 * pp
    resolve_s, resolved = _timed(
        lambda: resolve_schedule(
            name, pp_size=pp, vp_size=vp, microbatch_counts=[m], transport="nccl"
        )
    )
    record: Record = {"schedule": name, "vp": vp, "pp": pp, "m": m}
    if name != "auto":
        plan_s, made = _timed(lambda: plan(name, pp_size=pp, num_microbatches=m, vp_size=vp))
        gloo_s, report = _timed(lambda: validate(made, num_microbatches=m))
        nccl_s, _ = _timed(lambda: validate(made, num_microbatches=m, transport="nccl"))
        simulate_s, _ = _timed(lambda: simulate(report, Costs()))
        steps = sum(len(rank) for rank in made)
        record.update(steps=steps, plan=plan_s, validate_gloo=gloo_s, validate_nccl=nccl_s)
        record["simulate"] = simulate_s
    else:
        record["chosen"] = resolved.name
    record["resolve_nccl"] = resolve_s
    return record


def with_growth(records: list[Record]) -> list[Record]:
    """Each record with the growth of its parts since the same schedule at half the size."""
    by_size = {(r["schedule"], r["vp"], r["pp"]): r for r in records}
    for record in records:
        before = by_size.get((record["schedule"], record["vp"], int(record["pp"]) // 2))
        for part in (*PARTS, "plan_validate_nccl"):
            if part == "plan_validate_nccl" and "plan" in record:
                record[part] = float(record["plan"]) + float(record["validate_nccl"])
            if before is not None and part in record and part in before:
                growth = float(record[part]) / max(float(before[part]), 1e-9)
                record[f"{part}_growth"] = round(growth, 2)
        if "plan_validate_nccl_growth" in record:
            record["passed"] = float(record["plan_validate_nccl_growth"]) <= GOAL_GROWTH
    return records


HEADER = (
    f"{'schedule':<18}{'pp':>4}{'m':>5}{'steps':>9}{'plan':>8}{'val gloo':>9}{'val nccl':>9}"
    f"{'simulate':>9}{'resolve':>9}  growth (plan+val nccl, resolve)"
)


def render(record: Record) -> str:
    """One row of the table: seconds per part, and the growth since half the size."""
    cells = [f"{record['schedule']!s:<18}{record['pp']:>4}{record['m']:>5}"]
    cells.append(f"{record.get('steps', '')!s:>9}")
    for part in PARTS:
        value = record.get(part)
        cells.append(f"{value:>8.2f}s" if isinstance(value, float) else f"{'-':>9}")
    grown = [record.get("plan_validate_nccl_growth"), record.get("resolve_nccl_growth")]
    growth = ", ".join("-" if g is None else f"{g}x" for g in grown)
    verdict = "" if "passed" not in record else " yes" if record["passed"] else " NO"
    chosen = f" (chose {record['chosen']}, vp {record['vp']})" if "chosen" in record else ""
    return "".join(cells) + f"  {growth}{verdict}{chosen}"


def main(argv: Sequence[str] | None = None) -> list[Record]:
    """Measure every schedule at every size; print a table (or JSON lines)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--json", action="store_true", help="one JSON record per line")
    args = parser.parse_args(argv)
    if int(os.environ.get("RANK", "0")):
        return []  # under torchrun (nox -s bench), one process measures
    records = [measure(n, vp, pp) for n, vp in SCHEDULES + AUTO for pp in args.sizes]
    records = with_growth(records)
    if args.json:
        for record in records:
            print(json.dumps(record))
        return records
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    print(f"planning at scale, CPU seconds, m = 8 x pp; load average {' '.join(load) or 'n/a'}")
    print(f"goal: plan + NCCL validation grows at most {GOAL_GROWTH:g}x per doubling of pp and m")
    print(HEADER)
    for record in records:
        print(render(record))
    return records


if __name__ == "__main__":
    main()
