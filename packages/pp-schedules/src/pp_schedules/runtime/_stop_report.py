"""The report of a stopped pipeline, and its renderings: text, JSON and a Chrome trace.

A `StopReport` holds where every rank was (`RankPosition`), who waits for whom (`Wait`), the
plan's grid and the cause in one sentence; `build_stop_report` (the stop diagnosis) makes
one. `StopReport.render` writes it as text, `to_json` as one document, `chrome_trace` as the
recorded steps of every rank that published, and `write` all three under a directory.

Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pp_schedules.planning import Step
from pp_schedules.runtime._timeline import recorded_trace

__all__ = ["RankPosition", "StopReport", "Wait", "describe_step", "paired_step"]

_MARGIN = 3  # grid columns shown around the marked steps


@dataclasses.dataclass(frozen=True)
class Wait:
    """One rank waiting for another.

    Attributes:
        rank: The waiting global rank.
        step: Its plan step (index in its lowered plan); None in a collective outside a step.
        action: That step's string form, or the collective's operation.
        peer: The global rank it waits for.
        what: What it waits for, in words ("activations of mb 6 chunk 1 (recv)", "exit
            decision over ranks [0, 1, 2, 3]").
        key: The tensor's key of a transfer (channel, microbatch, sender chunk, receiver
            chunk); empty for a collective.
        call: The executor call the waiting rank is in (or last ran).
    """

    rank: int
    step: int | None
    action: str
    peer: int
    what: str
    key: tuple[Any, ...]
    call: int = 0


@dataclasses.dataclass(frozen=True)
class RankPosition:
    """Where one rank was.

    Attributes:
        rank: Global rank.
        stage: Its pipeline stage in the reported pipeline; None for a rank of another
            pipeline (a data-parallel peer in a collective).
        name: The rank with its place ("rank 3 (pipeline stage 1 of [1, 3], dp 1, tp 0)").
        step: Index in its lowered plan; None when unknown or outside the plan.
        action: The step's string form ("" when unknown).
        state: "running", "posting", "waiting" or "ended" for a rank that published (or "in
            a collective"); "gone", "stopped", "silent", "left" (it exited after an error of
            its own seeing), "not answering" or "quiet" (nobody waits for it) for one that
            did not.
        inferred: Whether the step comes from the plan rather than the rank.
        error: The error it stopped with ("Type: first line"), if it published one.
        call: The executor call it is in or last ran; None when unknown.
        collective: The collective it is in (or ran last, after its last step), in words.
        liveness: What its liveness record says, when it was read ("gone: its process 4242
            on this host has exited").
        iteration: The training iteration it said it was in, when known.
    """

    rank: int
    stage: int | None
    name: str
    step: int | None
    action: str
    state: str
    inferred: bool
    error: str | None = None
    call: int | None = None
    collective: str | None = None
    liveness: str | None = None
    iteration: int | None = None

    @property
    def order(self) -> tuple[int, int, int, int]:
        """(training iteration, call, phase, step): how far the rank got (unknown: first)."""
        iteration = -1 if self.iteration is None else self.iteration
        call = -1 if self.call is None else self.call
        step = -1 if self.step is None else self.step
        outside = 1 if self.collective is not None and self.state == "in a collective" else 0
        return iteration, call, outside, step


@dataclasses.dataclass(frozen=True)
class StopReport:
    """One report of a stopped pipeline (see `build_stop_report`).

    Attributes:
        cause: One sentence naming the rank that stopped the pipeline and why.
        positions: Every rank's position: the pipeline's stages in order, then the other
            ranks that take part (data-parallel peers of a collective).
        waits: Who waits for whom, at which step or collective, for what.
        plan: The plan's lowered steps as grid cells, by stage.
        heads: What each rank published, by global rank (plain data).
        iteration: The executor call the reporting rank was in.
        pipeline: The reported pipeline's global ranks, in stage order.
        ignored: Documents set aside, with why ("rank 5: published for another plan").
        store_traces: The stack traces torch printed for the store while this rank gathered
            (kept out of the console, written beside the report).
    """

    cause: str
    positions: list[RankPosition]
    waits: list[Wait]
    plan: list[list[str]]
    heads: dict[int, dict[str, Any]]
    iteration: int = 0
    pipeline: tuple[int, ...] = ()
    ignored: list[str] = dataclasses.field(default_factory=list)
    store_traces: list[str] = dataclasses.field(default_factory=list)

    @property
    def answered(self) -> list[int]:
        """The pipeline's global ranks that published, in stage order."""
        return [rank for rank in self.pipeline if rank in self.heads]

    @property
    def reporter(self) -> int | None:
        """The global rank that prints the report: the lowest stage that stopped and built one.

        Not a rank that only answered an ask for its position.
        """
        reporting = [r for r in self.answered if not self.heads[r].get("answers_ask")]
        return reporting[0] if reporting else None

    def grid(self) -> str:
        """The stage x step grid around the marked steps, rows named by global rank.

        ``[x]``: the step the rank published; ``(x)``: the step inferred from the plan.
        """
        in_pipeline = [p for p in self.positions if p.stage is not None]
        known = [p.step for p in in_pipeline if p.step is not None]
        longest = max((len(row) for row in self.plan), default=0)
        low = max(min(known, default=0) - _MARGIN, 0)
        high = min(max(known, default=longest) + _MARGIN, longest - 1)
        rows = [list(row[low : high + 1]) for row in self.plan]
        for position in in_pipeline:
            if position.step is not None and low <= position.step <= high:
                assert position.stage is not None
                cell = rows[position.stage][position.step - low]
                rows[position.stage][position.step - low] = (
                    f"({cell})" if position.inferred else f"[{cell}]"
                )
        width = max((len(c) for row in rows for c in row), default=1) + 2
        labels = [f"rank {rank}: " for rank in self.pipeline] or [""] * len(rows)
        label = max((len(text) for text in labels), default=0)
        header = "step".ljust(label) + "".join(str(i).ljust(width) for i in range(low, high + 1))
        lines = [header.rstrip()]
        for text, row in zip(labels, rows, strict=False):
            lines.append((text.ljust(label) + "".join(c.ljust(width) for c in row)).rstrip())
        return "\n".join(lines)

    def render(self) -> str:
        """The report as text: cause, grid, waits, every rank's position, what was ignored."""
        pipeline = f" in pipeline {list(self.pipeline)}" if self.pipeline else ""
        lines = [f"pipeline stopped (call {self.iteration}){pipeline}: {self.cause}", ""]
        lines += ["where every rank is ([x] as it said, (x) inferred from the plan):", self.grid()]
        names = {p.rank: p.name for p in self.positions}
        if self.waits:
            lines += ["", "waits:"]
            for w in self.waits:
                where = (
                    f"at step {w.step} ({w.action}) of call {w.call}"
                    if w.step is not None
                    else f"in {w.action} (after call {w.call})"
                )
                lines.append(
                    f"  {names.get(w.rank, f'rank {w.rank}')} waits {where} for rank "
                    f"{w.peer}: {w.what}"
                )
        lines += ["", "ranks (by iteration, call and step):"]
        for p in sorted(self.positions, key=lambda p: (p.order, p.rank)):
            lines.append(f"  {p.name}: {_where(p)}")
        if self.ignored:
            lines += ["", "ignored (not of this run):", *[f"  {text}" for text in self.ignored]]
        return "\n".join(lines)

    def to_json(self) -> str:
        """The report as one JSON document (cause, positions, waits, grid text, heads)."""
        return json.dumps(
            {
                "iteration": self.iteration,
                "pipeline": list(self.pipeline),
                "cause": self.cause,
                "positions": [dataclasses.asdict(p) for p in self.positions],
                "waits": [dataclasses.asdict(w) for w in self.waits],
                "grid": self.grid(),
                "heads": {str(rank): head for rank, head in self.heads.items()},
                "ignored": self.ignored,
                "store_traces": self.store_traces,
            },
            indent=1,
        )

    def chrome_trace(self) -> str:
        """A Chrome trace of the recorded steps of every rank that published, a track each.

        Tracks are named by global rank. Times are wall-clock (each rank's monotonic clock
        moved by the offset it published); a step still open when the rank published ends
        at that moment.
        """
        return recorded_trace([p.rank for p in self.positions], self.heads)

    def write(self, directory: str | Path, stem: str = "pipeline-stop") -> list[Path]:
        """Write ``<stem>.txt``, ``<stem>.json`` and ``<stem>.trace.json`` under `directory`.

        With `store_traces`, ``<stem>.store-traces.txt`` too.
        """
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        paths = [root / f"{stem}.txt", root / f"{stem}.json", root / f"{stem}.trace.json"]
        texts = [self.render(), self.to_json(), self.chrome_trace()]
        if self.store_traces:
            paths.append(root / f"{stem}.store-traces.txt")
            texts.append("\n".join(trace.rstrip() for trace in self.store_traces))
        for path, text in zip(paths, texts, strict=True):
            path.write_text(text + ("\n" if not text.endswith("\n") else ""))
        return paths


def _where(p: RankPosition) -> str:
    """One rank's line after its name: where it was, its state, its error or evidence."""
    if p.state == "in a collective":
        place = f"after call {p.call}" if p.step is None else f"call {p.call} step {p.step}"
        where = f"{place}, in {p.collective}"
        return f"{where}, {', '.join(x for x in (p.liveness or '', p.error or '') if x) or 'alive'}"
    elif p.step is None:
        where = "step unknown"
    else:
        where = (
            f"call {p.call} step {p.step} ({p.action})" if p.call else f"step {p.step} ({p.action})"
        )
    said = "inferred, published nothing" if p.inferred or p.call is None else ""
    if p.inferred and p.step is None:
        said = "published nothing"
    live = p.liveness or ""
    if live.startswith(f"{p.state}: "):  # "gone, ..., gone: its process ..." says it twice
        live = live[len(p.state) + 2 :]
    detail = ", ".join(x for x in (p.state, said, live, p.error or "") if x)
    return f"{where}, {detail}"


def describe_step(step: Step | None, text: str = "", paired: Step | None = None) -> str:
    """A step in words: ``F mb 6 chunk 1``, ``exchange SEND_F6.1+RECV_B2.1``.

    An F&B step (`paired`: its backward): ``F&B: F mb 6 chunk 0 with B mb 2 chunk 1``.
    """
    if step is None:
        return text or "an unknown step"
    if step.compute is not None:
        action = step.compute
        said = f"{action.kind} mb {action.microbatch} chunk {action.chunk}"
        if paired is not None and paired.compute is not None:
            other = paired.compute
            said = f"F&B: {said} with {other.kind} mb {other.microbatch} chunk {other.chunk}"
        return said
    return f"exchange {step}"


def paired_step(steps: Sequence[Step], index: int) -> Step | None:
    """The backward run with step `index` as one F&B step, or None."""
    following = index + 1
    return steps[following] if following < len(steps) and steps[following].overlap else None
