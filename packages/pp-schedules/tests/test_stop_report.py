"""The flight recorder and the stop report on made-up positions (pure, no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pp_schedules import plan, validate
from pp_schedules.flight_recorder import FlightRecorder, NullFlightRecorder, check_recorder_size
from pp_schedules.lowering import Step
from pp_schedules.stop_report import build_stop_report, describe_step

PP, M = 3, 4


def _steps() -> list[list[Step]]:
    return validate(plan("1f1b", pp_size=PP, num_microbatches=M)).steps


def _first(steps: list[Step], kind: str) -> int:
    return next(i for i, s in enumerate(steps) if s.compute is not None and s.compute.kind == kind)


def test_the_ring_keeps_the_last_steps_and_the_head_is_the_open_one() -> None:
    steps = _steps()
    recorder = FlightRecorder(4)
    assert recorder.head() is None
    recorder.start_call(1, steps)
    for index, step in enumerate(steps[1][:6]):
        recorder.begin(index, step)
        recorder.end()
    recorder.begin(6, steps[1][6])
    kept = recorder.recent()
    assert [r["step"] for r in kept] == [3, 4, 5, 6]  # wrapped: the oldest are gone
    assert recorder.recorded == 7
    head = recorder.head()
    assert head is not None
    assert head["step"] == 6
    assert head["end"] is None
    assert head["iteration"] == 1
    assert head["state"] == ("running" if steps[1][6].compute else "posting")
    json.dumps(head)  # plain data
    recorder.end()
    ended = recorder.head()
    assert ended is not None
    assert ended["state"] == "ended"
    assert ended["end"] >= ended["start"]


def test_a_waiting_head_names_the_receive_and_its_peer() -> None:
    steps = _steps()
    recorder = FlightRecorder()
    recorder.start_call(1, steps)
    index = _first(steps[1], "F")
    recorder.begin(index, steps[1][index])
    recorder.wait(("recv", ("forward", 0, 0)))
    head = recorder.head()
    assert head is not None
    assert head["state"] == "waiting"
    (wait,) = head["waiting_for"]
    assert (wait["peer"], wait["direction"], wait["what"]) == (
        0,
        "recv",
        "activations of mb 0 chunk 0",
    )
    recorder.waited()
    again = recorder.head()
    assert again is not None
    assert again["state"] == "running"


@pytest.mark.parametrize("size", [0, -3, 2.5, True, "8"])
def test_a_recorder_size_below_one_is_refused_naming_the_range(size: Any) -> None:
    with pytest.raises(ValueError, match="whole number of steps, 1 or more"):
        check_recorder_size(size)
    with pytest.raises(ValueError, match="1 or more"):
        FlightRecorder(size)


def test_the_null_recorder_records_nothing() -> None:
    recorder = NullFlightRecorder(2)
    recorder.start_call(0, _steps())
    recorder.begin(0, _steps()[0][0])
    recorder.end()
    assert recorder.head() is None
    assert recorder.recent() == []


def _document(rank: int, recorder: FlightRecorder, error: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "rank": rank, "global_rank": rank, "prev_rank": (rank - 1) % PP,
        "next_rank": (rank + 1) % PP, "pp_size": PP, "iteration": recorder.iteration,
        "position": recorder.head(), "recent": recorder.recent(), "error": error,
        "published_at": 100.0, "clock_offset": 0.0,
    }  # fmt: skip


def _waiting_at(
    rank: int, kind: str, steps: list[list[Step]], error: dict[str, Any]
) -> dict[str, Any]:
    """A rank that walked up to its first `kind` step and waits there for its receive."""
    recorder = FlightRecorder()
    recorder.start_call(rank, steps)
    index = _first(steps[rank], kind)
    for earlier, step in enumerate(steps[rank][:index]):
        recorder.begin(earlier, step)
        recorder.end()
    action = steps[rank][index].compute
    assert action is not None
    recorder.begin(index, steps[rank][index])
    channel = "forward" if kind == "F" else "backward"
    recorder.wait(("recv", (channel, action.microbatch, action.chunk)))
    return _document(rank, recorder, error)


def _error(peer: int, *, timed_out: bool = False, mismatch: bool = False) -> dict[str, Any]:
    return {
        "type": "P2PTimeoutError" if timed_out else "P2PError", "message": "it failed",
        "peer": peer, "transfer": True, "timed_out": timed_out, "lost": not mismatch,
        "mismatch": mismatch,
    }  # fmt: skip


def test_a_dead_rank_is_named_gone_and_placed_by_the_plan() -> None:
    steps = _steps()
    heads = {
        1: _waiting_at(1, "B", steps, _error(2)),
        0: _waiting_at(0, "B", steps, _error(1, timed_out=True)),
    }
    report = build_stop_report(steps, heads, iteration=1)
    wait_1 = heads[1]["position"]["step"]
    wait_0 = heads[0]["position"]["step"]
    # Rank 2 never sent the gradient of microbatch 0: it was at its B0 by the plan.
    b0 = _first(steps[2], "B")
    assert report.positions[2].inferred
    assert report.positions[2].step == b0
    assert report.cause == (
        f"rank 2 is gone; by the plan it was at {describe_step(steps[2][b0])} (step {b0}, "
        f"inferred); ranks 1 and 0 wait for it at steps {wait_1} and {wait_0}"
    )
    text = report.render()
    assert "rank 2 is gone" in text
    assert f"({steps[2][b0]})" in text
    assert f"[{steps[1][wait_1]}]" in text
    assert f"rank 1 waits at step {wait_1}" in text
    document = json.loads(report.to_json())
    assert document["cause"] == report.cause
    assert set(document["heads"]) == {"0", "1"}
    trace = json.loads(report.chrome_trace())
    tracks = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert tracks == {0, 1}


def test_a_rank_that_only_timed_out_its_peers_is_not_answering() -> None:
    steps = _steps()
    heads = {
        1: _waiting_at(1, "B", steps, _error(2, timed_out=True)),
        0: _waiting_at(0, "B", steps, _error(1, timed_out=True)),
    }
    assert build_stop_report(steps, heads).cause.startswith("rank 2 is not answering; by the plan")


def test_a_mismatch_is_named_with_both_ranks() -> None:
    steps = _steps()
    heads = {
        rank: _waiting_at(rank, "B", steps, _error(rank + 1, timed_out=True)) for rank in (0, 1)
    }
    heads[2] = _waiting_at(2, "F", steps, _error(1, mismatch=True))
    report = build_stop_report(steps, heads)
    assert report.cause == "contract mismatch between rank 1 and rank 2: it failed"
    assert not any(p.inferred for p in report.positions)


def test_an_own_failure_is_named_with_its_step(tmp_path: Path) -> None:
    steps = _steps()
    recorder = FlightRecorder()
    recorder.start_call(2, steps)
    recorder.begin(0, steps[2][0])
    own = {"type": "ValueError", "message": "bad batch", "peer": None, "transfer": False,
           "timed_out": False, "lost": False, "mismatch": False}  # fmt: skip
    heads = {
        2: _document(2, recorder, own),
        1: _waiting_at(1, "B", steps, _error(2, timed_out=True)),
    }
    report = build_stop_report(steps, heads)
    assert report.cause == f"rank 2 failed at step 0 ({steps[2][0]}): ValueError: bad batch"
    written = report.write(tmp_path)
    assert [p.name for p in written] == [
        "pipeline-stop.txt", "pipeline-stop.json", "pipeline-stop.trace.json",
    ]  # fmt: skip
    assert json.loads(written[2].read_text())["traceEvents"]
