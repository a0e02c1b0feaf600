"""The flight recorder and the stop report on made-up positions (pure, no processes)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

import pp_schedules.runtime._stop_channel as stop_channel
from pp_schedules.planning import plan, validate
from pp_schedules.planning._lowering import Step
from pp_schedules.runtime._flight_recorder import (
    FlightRecorder,
    NullFlightRecorder,
    check_recorder_size,
)
from pp_schedules.runtime._stop_channel import (
    answer_ask,
    ask_to_publish,
    error_record,
    foreign,
    gather_positions,
    publish_document,
    publish_head,
    read_position,
    report_stop,
)
from pp_schedules.runtime._stop_diagnosis import build_stop_report
from pp_schedules.runtime._stop_report import describe_step
from pp_state import liveness
from pp_state.store_channel import StoreChannel

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


def _document(
    rank: int,
    recorder: FlightRecorder,
    error: dict[str, Any] | None,
    pipeline: tuple[int, ...] = tuple(range(PP)),
    coordinates: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What global rank `rank` publishes (its stage is its place in `pipeline`)."""
    stage = pipeline.index(rank)
    return {
        "rank": stage, "global_rank": rank, "pipeline": list(pipeline), "pp_size": len(pipeline),
        "coordinates": coordinates, "iteration": recorder.iteration,
        "position": recorder.head(), "recent": recorder.recent(), "error": error,
        "run": {"world_size": 4, "plan": "p", "token": None},
        "published_at": 100.0, "clock_offset": 0.0,
    }  # fmt: skip


def _walked(stage: int, steps: list[list[Step]], upto: int, call: int = 1) -> FlightRecorder:
    """A recorder that ran `call` calls, the last up to (and in) step `upto` of `stage`."""
    recorder = FlightRecorder()
    for number in range(1, call + 1):
        recorder.start_call(stage, steps)
        last = upto if number == call else len(steps[stage]) - 1
        for index in range(last + 1):
            recorder.begin(index, steps[stage][index])
            if index < last or number < call:
                recorder.end()
    return recorder


def _waiting_at(
    rank: int,
    kind: str,
    steps: list[list[Step]],
    error: dict[str, Any],
    pipeline: tuple[int, ...] = tuple(range(PP)),
) -> dict[str, Any]:
    """A rank that walked up to its first `kind` step and waits there for its receive."""
    stage = pipeline.index(rank)
    index = _first(steps[stage], kind)
    recorder = _walked(stage, steps, index)
    action = steps[stage][index].compute
    assert action is not None
    channel = "forward" if kind == "F" else "backward"
    recorder.wait(("recv", (channel, action.microbatch, action.chunk)))
    return _document(rank, recorder, error, pipeline)


def _error(peer: int, *, timed_out: bool = False, mismatch: bool = False) -> dict[str, Any]:
    return {
        "type": "P2PTimeoutError" if timed_out else "P2PError", "message": "it failed",
        "peer": peer, "peer_stage": peer, "transfer": True, "timed_out": timed_out,
        "lost": not mismatch, "mismatch": mismatch,
    }  # fmt: skip


def _name(rank: int, pipeline: tuple[int, ...] = tuple(range(PP))) -> str:
    return f"rank {rank} (pipeline stage {pipeline.index(rank)} of {list(pipeline)})"


def test_a_dead_rank_is_named_gone_and_placed_by_the_plan() -> None:
    steps = _steps()
    heads = {
        1: _waiting_at(1, "B", steps, _error(2)),
        0: _waiting_at(0, "B", steps, _error(1, timed_out=True)),
    }
    report = build_stop_report(steps, heads, iteration=1)
    wait_1 = heads[1]["position"]["step"]
    # Rank 2 never sent the gradient of microbatch 0: it was at its B0 by the plan.
    b0 = _first(steps[2], "B")
    assert report.positions[2].inferred
    assert report.positions[2].step == b0
    assert report.cause == (
        f"{_name(2)} is gone; by the plan it was at {describe_step(steps[2][b0])} (step {b0}, "
        f"inferred); rank 1 saw its connection close at step {wait_1} "
        f"({steps[1][wait_1]}) of call 1 (rank 0 behind)"
    )
    text = report.render()
    assert f"{_name(2)} is gone" in text
    assert f"({steps[2][b0]})" in text
    assert f"[{steps[1][wait_1]}]" in text
    assert f"{_name(1)} waits at step {wait_1} ({steps[1][wait_1]}) of call 1 for rank 2" in text
    assert "\nrank 2: " in text  # the grid's rows are named by global rank
    document = json.loads(report.to_json())
    assert document["cause"] == report.cause
    assert set(document["heads"]) == {"0", "1"}
    trace = json.loads(report.chrome_trace())
    tracks = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert tracks == {0, 1}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1", "rank 2"}


def test_a_rank_that_only_timed_out_its_peers_is_not_answering() -> None:
    steps = _steps()
    heads = {
        1: _waiting_at(1, "B", steps, _error(2, timed_out=True)),
        0: _waiting_at(0, "B", steps, _error(1, timed_out=True)),
    }
    cause = build_stop_report(steps, heads).cause
    assert cause.startswith(f"{_name(2)} is not answering (published nothing); by the plan")
    assert "; rank 1 timed out waiting for it at step " in cause
    assert cause.endswith(" of call 1 (rank 0 behind)")


def test_a_mismatch_is_named_with_both_ranks() -> None:
    steps = _steps()
    heads = {
        rank: _waiting_at(rank, "B", steps, _error(rank + 1, timed_out=True)) for rank in (0, 1)
    }
    heads[2] = _waiting_at(2, "F", steps, _error(1, mismatch=True))
    report = build_stop_report(steps, heads)
    assert report.cause == f"contract mismatch between {_name(1)} and {_name(2)}: it failed"
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
    assert report.cause == (
        f"{_name(2)} failed at step 0 ({steps[2][0]}) of call 1: ValueError: bad batch"
    )
    written = report.write(tmp_path)
    assert [p.name for p in written] == [
        "pipeline-stop.txt", "pipeline-stop.json", "pipeline-stop.trace.json",
    ]  # fmt: skip
    assert json.loads(written[2].read_text())["traceEvents"]


# -------------------------------------------------------------------- global ranks, pp 2 x dp 2
def _pp2_steps() -> list[list[Step]]:
    return validate(plan("1f1b", pp_size=2, num_microbatches=4)).steps


def _coordinates(rank: int, pipeline: tuple[int, ...], dp: int) -> dict[str, Any]:
    return {"rank": rank, "pipeline": list(pipeline), "stage": pipeline.index(rank),
            "data_parallel": dp, "tensor_parallel": 0, "context_parallel": 0}  # fmt: skip


def test_in_a_data_parallel_job_ranks_are_global_ranks_with_their_place() -> None:
    """pp 2 x dp 2: pipeline [1, 3]; global rank 1 (its stage 0) is killed."""
    steps, pipeline = _pp2_steps(), (1, 3)
    head = _waiting_at(3, "F", steps, {**_error(1), "peer_stage": 0}, pipeline)
    head["coordinates"] = _coordinates(3, pipeline, 1)
    described = {1: "rank 1 (pipeline stage 0 of [1, 3], dp 1, tp 0)"}
    report = build_stop_report(
        steps, {3: head}, iteration=5, pipeline=pipeline, describe=described.__getitem__
    )
    assert report.cause.startswith("rank 1 (pipeline stage 0 of [1, 3], dp 1, tp 0) is gone;")
    assert "rank 0" not in report.cause
    text = report.render()
    assert text.startswith("pipeline stopped (call 5) in pipeline [1, 3]: rank 1 (pipeline")
    assert "rank 3 (pipeline stage 1 of [1, 3], dp 1, tp 0) waits at step" in text
    assert "\nrank 1: " in text
    assert "\nrank 3: " in text
    assert report.reporter == 3
    assert json.loads(report.to_json())["pipeline"] == [1, 3]


# --------------------------------------------------------------- collectives and other calls
@dataclasses.dataclass(frozen=True)
class _Live:
    state: str
    evidence: str


def _in_collective(
    rank: int, steps: list[list[Step]], call: int, operation: str, *, group: tuple[int, ...],
    seq: int,
) -> dict[str, Any]:  # fmt: skip
    """A rank that ended call `call` and waits in a collective after it."""
    stage = rank
    recorder = _walked(stage, steps, len(steps[stage]) - 1, call)
    recorder.end()
    for _ in range(seq):  # earlier collectives on the group, ended
        recorder.end_collective(recorder.begin_collective(operation, group))
    recorder.begin_collective(operation, group, iteration=54)
    return _document(rank, recorder, None, tuple(range(4)))


def _pp4_steps() -> list[list[Step]]:
    return validate(plan("1f1b", pp_size=4, num_microbatches=8)).steps


def _scene(steps: list[list[Step]]) -> dict[int, dict[str, Any]]:
    """pp 4: ranks 1 and 3 ended call 54 and wait in the exit decision (over every rank);
    rank 0 left it and waits in call 55 for rank 1's activations; rank 2 published nothing."""
    world = (0, 1, 2, 3)
    heads = {
        rank: _in_collective(rank, steps, 54, "exit decision", group=world, seq=3)
        for rank in (1, 3)
    }
    index = _first(steps[0], "B")
    recorder = _walked(0, steps, index, call=55)
    action = steps[0][index].compute
    assert action is not None
    recorder.wait(("recv", ("backward", action.microbatch, action.chunk)))
    heads[0] = _document(0, recorder, None, world)
    return heads


def test_a_rank_in_a_collective_after_its_call_is_not_busy_in_the_next_call() -> None:
    steps = _pp4_steps()
    report = build_stop_report(steps, _scene(steps), iteration=55, pipeline=(0, 1, 2, 3))
    assert report.cause.startswith(f"{_name(2, (0, 1, 2, 3))} is not answering (published nothing)")
    assert "busy" not in report.cause
    assert report.cause.endswith(
        "; ranks 1 and 3 wait for it in exit decision over ranks [0, 1, 2, 3] (call 54) "
        "(rank 0 behind)"
    )
    waits = {(w.rank, w.peer) for w in report.waits}
    assert {(1, 2), (3, 2)} <= waits
    assert (1, 3) not in waits  # 1 and 3 are both in it
    text = report.render()
    assert "waits in exit decision (after call 54) for rank 2: exit decision over ranks" in text
    assert "after call 54, in exit decision over ranks [0, 1, 2, 3] (waiting)" in text
    order = [
        line.split(":")[0].strip()
        for line in text.split("ranks (by iteration")[1].splitlines()[1:5]
    ]
    assert order.index(_name(1, (0, 1, 2, 3))) < order.index(_name(0, (0, 1, 2, 3)))


@pytest.mark.parametrize(
    ("state", "evidence", "said"),
    [
        ("gone", "its process 4242 on this host has exited", "is gone"),
        ("stopped", "its process 4242 on this host is stopped", "is stopped"),
        ("silent", "no heartbeat for 6.1 s", "is silent"),
    ],
)
def test_liveness_names_the_rank_that_went_before_any_wait(
    state: str, evidence: str, said: str
) -> None:
    steps = _pp4_steps()
    report = build_stop_report(
        steps, _scene(steps), iteration=55, pipeline=(0, 1, 2, 3),
        liveness={2: _Live(state, evidence), 1: _Live("alive", "it beats")},
    )  # fmt: skip
    assert report.cause.startswith(f"{_name(2, (0, 1, 2, 3))} {said} ({evidence})")
    assert f"{state}, published nothing, {evidence}" in report.render()


def test_a_rank_that_left_on_its_own_error_is_not_taken_for_the_lost_one() -> None:
    """Rank 1 exited after its own error (a note in its record); rank 2 went without one."""
    steps = _pp4_steps()
    heads = {r: h for r, h in _scene(steps).items() if r != 1}
    report = build_stop_report(
        steps, heads, iteration=55, pipeline=(0, 1, 2, 3),
        liveness={1: _Live("left", "it left after its own error: ..."),
                  2: _Live("gone", "its process 4242 on this host has exited")},
    )  # fmt: skip
    assert report.cause.startswith(f"{_name(2, (0, 1, 2, 3))} is gone (its process 4242")
    left = next(p for p in report.positions if p.rank == 1)
    assert left.state == "left"


def test_a_rank_gone_in_another_pipeline_is_the_cause_not_a_busy_rank_of_this_one() -> None:
    """tp 2 x pp 2 x dp 2, the report of pipeline [1, 5] after rank 6 (of [2, 6]) died.

    Rank 5 answered the ask at its step 2 (its work held up by the ranks around rank 6),
    rank 1 waits for it: by the plan's waits rank 5 is the head of the chain. No position
    names rank 6, but its liveness record says it is gone: a live rank is never the cause
    then (the report once read "rank 5 (...) is busy at step 2").
    """
    steps, pipeline = _pp2_steps(), (1, 5)
    busy = _walked(1, steps, 2)  # rank 5 (stage 1) runs its step 2
    heads = {
        1: _waiting_at(1, "B", steps, {**_error(5, timed_out=True), "peer_stage": 1}, pipeline),
        5: dict(_document(5, busy, None, pipeline), answers_ask=True),
    }
    heads[1]["coordinates"] = _coordinates(1, pipeline, 0) | {"tensor_parallel": 1}
    heads[5]["coordinates"] = _coordinates(5, pipeline, 0) | {"tensor_parallel": 1}
    described = {6: "rank 6 (pipeline stage 1 of [2, 6], dp 1, tp 0)"}
    before = build_stop_report(steps, heads, iteration=3, pipeline=pipeline)
    assert before.cause.startswith("rank 5 (pipeline stage 1 of [1, 5], dp 0, tp 1) is busy")
    report = build_stop_report(
        steps, heads, iteration=3, pipeline=pipeline, describe=described.__getitem__,
        liveness={6: _Live("gone", "its process 4242 on this host has exited"),
                  5: _Live("alive", "its process 4243 on this host runs")},
    )  # fmt: skip
    assert report.cause.startswith(
        "rank 6 (pipeline stage 1 of [2, 6], dp 1, tp 0) is gone (its process 4242 on this "
        "host has exited); in this pipeline rank 5 (pipeline stage 1 of [1, 5], dp 0, tp 1) "
        "is busy at step 2"
    ), report.cause
    assert "; rank 1 waits for it at step " in report.cause
    gone = next(p for p in report.positions if p.rank == 6)
    assert (gone.stage, gone.state, gone.inferred) == (None, "gone", True)
    assert "rank 6 (pipeline stage 1 of [2, 6], dp 1, tp 0): step unknown, gone" in report.render()


def test_a_failed_collective_is_recorded_as_failed_and_waits_on_who_never_reached_it() -> None:
    recorder = _walked(0, _steps(), 1)
    recorder.end()
    hook = recorder.collective_hook()
    hook.end(hook.begin("exit decision", (0, 1, 2), None), failed=True)
    head = recorder.head()
    assert head is not None
    assert head["collective"]["state"] == "failed"
    document = _document(0, recorder, _error(2), (0, 1, 2))
    other = _document(1, _walked(1, _steps(), 1), None, (0, 1, 2))
    other["collectives"] = [dict(head["collective"], state="failed")]  # rank 1 reached it too
    report = build_stop_report(_steps(), {0: document, 1: other}, pipeline=(0, 1, 2))
    assert {(w.rank, w.peer) for w in report.waits if not w.key} == {(0, 2)}


def test_a_rank_that_ended_its_call_without_a_recorded_collective_is_behind_not_busy() -> None:
    steps = _pp4_steps()
    heads = _scene(steps)
    for rank in (1, 3):
        heads[rank] = _document(rank, _walked(rank, steps, len(steps[rank]) - 1, 54), None,
                                (0, 1, 2, 3))  # fmt: skip
    heads[2] = _document(2, _walked(2, steps, len(steps[2]) - 1, 54), None, (0, 1, 2, 3))
    for rank in (1, 2, 3):
        heads[rank]["position"]["state"] = "ended"
    report = build_stop_report(steps, heads, iteration=55, pipeline=(0, 1, 2, 3))
    assert "busy" not in report.cause
    assert report.cause.startswith(f"{_name(1, (0, 1, 2, 3))} has not reached the others' call")


def test_the_recorder_keeps_collectives_beside_the_steps() -> None:
    steps = _steps()
    recorder = _walked(1, steps, 2)
    inside = recorder.begin_collective("tensor-parallel all-reduce", (1, 5))
    head = recorder.head()
    assert head is not None
    assert head["collective"]["in_step"] == 2  # inside the open plan step
    recorder.end_collective(inside)
    recorder.end()
    recorder.set_training_iteration(7)
    hook = recorder.collective_hook()
    token = hook.begin("loss averaging", (0, 1), None)
    head = recorder.head()
    assert head is not None
    assert head["collective"] == {
        "operation": "loss averaging", "group": [0, 1], "seq": 0, "call": 1,
        "training_iteration": 7, "in_step": None, "start": head["collective"]["start"],
        "end": None, "state": "waiting",
    }  # fmt: skip
    hook.end(token)
    again = hook.begin("loss averaging", (0, 1), None)
    assert recorder.head()["collective"]["seq"] == 1  # type: ignore[index]
    hook.end(again)
    assert [c["operation"] for c in recorder.collectives()] == [
        "tensor-parallel all-reduce", "loss averaging", "loss averaging",
    ]  # fmt: skip
    json.dumps(recorder.head())


def test_documents_of_another_run_are_set_aside() -> None:
    steps = _steps()
    own = _waiting_at(1, "B", steps, _error(2))
    other = dict(own, run={"world_size": 4, "plan": "q", "token": None})
    assert (
        foreign(other, own) == "published for another plan (another schedule or microbatch count)"
    )
    assert foreign(dict(own, run={"world_size": 8, "plan": "p", "token": None}), own) == (
        "published for world size 8, not 4"
    )
    assert foreign(dict(own, run={"world_size": 4, "plan": "p", "token": "x"}), own) == (
        "published by another run (another run token)"
    )
    assert foreign(dict(own), own) is None
    now = dict(own, position=dict(own["position"], training_iteration=9))
    earlier = dict(own, position=dict(own["position"], training_iteration=7))
    assert foreign(earlier, now) == "published at iteration 7, long before this stop (iteration 9)"
    assert foreign(dict(earlier, position=dict(own["position"], training_iteration=8)), now) is None
    report = build_stop_report(steps, {1: own}, ignored=["rank 0: published by another run"])
    assert "ignored (not of this run):\n  rank 0: published by another run" in report.render()


# ------------------------------------------------------------------ asking a rank where it is
def _host(tmp_path: Path) -> Any:
    """Stage 0 of the pipeline [0, 1], one call run, publishing into a FileStore."""
    comm = SimpleNamespace(rank=0, pipeline_ranks=[0, 1], prev_rank=1, next_rank=1)
    channel = StoreChannel(dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    return SimpleNamespace(
        communicator=comm, rank=0, pp_size=2, recorder=_walked(0, _steps2(), 1), channel=channel,
        report_wait=1.0, coordinates=None, run_token="t",
    )  # fmt: skip


def _steps2() -> list[list[Step]]:
    return validate(plan("1f1b", pp_size=2, num_microbatches=2)).steps


def test_an_asked_rank_publishes_its_position_marked_as_an_answer(tmp_path: Path) -> None:
    host = _host(tmp_path)
    assert answer_ask(host, None) is None  # nobody asked
    ask_to_publish(host.channel, [0], asker=1)
    answered = answer_ask(host, None)
    assert answered is not None
    document = read_position(host.channel, 0)
    assert document is not None
    assert document["answers_ask"] is True
    assert answer_ask(host, answered) == answered  # the same ask is answered once


def test_an_answer_never_overwrites_the_failure_this_rank_published(tmp_path: Path) -> None:
    host = _host(tmp_path)
    assert publish_head(host, RuntimeError("its own failure")) is not None
    ask_to_publish(host.channel, [0], asker=1)
    answer_ask(host, None)
    document = read_position(host.channel, 0)
    assert document is not None
    assert document["error"]["message"] == "its own failure"
    assert document["answers_ask"] is False


def test_a_position_published_before_this_stop_is_used_only_if_no_newer_comes(
    tmp_path: Path,
) -> None:
    host = _host(tmp_path)
    own = publish_head(host, RuntimeError("stopped"))
    assert own is not None
    channel, document = own
    snapshot = dict(document, global_rank=1, rank=1, error=None)
    snapshot["published_at"] = document["published_at"] - 30.0  # an earlier SIGTERM's
    publish_document(channel, snapshot)
    heads, _ = gather_positions(channel, document, wait_s=0.3)
    assert heads[1]["published_at"] == snapshot["published_at"]  # nothing newer: kept
    newer = dict(snapshot, published_at=document["published_at"] + 0.1)
    timer = threading.Timer(0.1, publish_document, (channel, newer))
    timer.start()
    heads, _ = gather_positions(channel, document, wait_s=3.0)
    timer.join()
    assert heads[1]["published_at"] == newer["published_at"]


# ------------------------------------------------------------------ gathering and the store
def _host_running(tmp_path: Path) -> Any:
    """Stage 0 of the pipeline [0, 1] in its first step, publishing into a FileStore."""
    comm = SimpleNamespace(rank=0, pipeline_ranks=[0, 1], prev_rank=1, next_rank=1)
    recorder = FlightRecorder()
    recorder.start_call(0, _steps2())
    recorder.begin(0, _steps2()[0][0])
    return SimpleNamespace(
        communicator=comm, rank=0, pp_size=2, recorder=recorder,
        channel=StoreChannel(dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1),
        report_wait=10.0, coordinates=None, run_token="t",
    )  # fmt: skip


def _gone_identity(channel: StoreChannel, rank: int) -> None:
    """Rank `rank`'s identity, of a process of this host that has exited."""
    done = subprocess.Popen(["true"])
    done.wait()
    identity = dataclasses.replace(liveness.own_identity(rank), pid=done.pid)
    channel.set(f"alive/{rank}/identity", json.dumps(dataclasses.asdict(identity)))


def test_a_gather_does_not_wait_for_a_rank_whose_process_is_gone(tmp_path: Path) -> None:
    host = _host_running(tmp_path)
    _gone_identity(host.channel, 1)
    published = publish_head(host, RuntimeError("Connection closed by peer [127.0.0.1]:5"))
    assert published is not None
    started = time.monotonic()
    heads, _ = gather_positions(host.channel, published[1], wait_s=10.0)
    assert set(heads) == {0}
    assert time.monotonic() - started < 5.0  # not the 10 s it could wait for rank 1


def test_a_rank_lost_elsewhere_in_the_job_is_the_cause_not_a_live_one_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """World of 4, pipeline [0, 1]: rank 1 answers, busy; rank 3 of another pipeline is gone."""
    world = SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: 4)
    monkeypatch.setattr(stop_channel, "dist", world)
    host = _host_running(tmp_path)
    busy = FlightRecorder()
    busy.start_call(1, _steps2())
    busy.begin(0, _steps2()[1][0])
    answer = SimpleNamespace(**{**vars(host), "rank": 1, "recorder": busy,
                                "communicator": SimpleNamespace(**{**vars(host.communicator),
                                                                   "rank": 1})})  # fmt: skip
    document = stop_channel.position_document(answer, None, answers_ask=True)
    document["published_at"] += 5.0  # an answer to the ask, after this rank's own position
    publish_document(host.channel, document)
    for rank in (2,):
        liveness.publish_identity(host.channel, rank)  # this process: alive
    _gone_identity(host.channel, 3)
    report = report_stop(host, RuntimeError("timed out waiting for rank 1"))
    assert report is not None
    assert report.cause.startswith("rank 3 is gone (its process "), report.cause
    assert "; in this pipeline " in report.cause


def test_a_backend_s_own_lost_peer_error_is_a_lost_transfer_not_the_rank_s_own_failure() -> None:
    """A collective outside `collective(...)` raises gloo's bare error: still a lost peer."""
    comm: Any = SimpleNamespace(rank=0, pipeline_ranks=[0, 1])
    record = error_record(RuntimeError("Connection closed by peer [127.0.0.1]:5"), comm)
    assert record is not None
    assert (record["transfer"], record["lost"], record["peer"]) == (True, True, None)
    own = error_record(RuntimeError("CUDA out of memory"), comm)
    assert own is not None
    assert (own["transfer"], own["lost"]) == (False, False)


def test_torch_s_store_traces_go_to_a_file_beside_the_report(tmp_path: Path) -> None:
    steps = _steps()
    report = build_stop_report(steps, {1: _waiting_at(1, "B", steps, _error(2))})
    trace = (
        "[W1206 TCPStore.cpp:106] sendBytes failed\nException raised from sendBytes\nframe #0: x"
    )
    written = dataclasses.replace(report, store_traces=[trace]).write(tmp_path)
    assert [p.name for p in written][3:] == ["pipeline-stop.store-traces.txt"]
    assert written[3].read_text() == trace + "\n"
    assert "Exception raised" not in written[0].read_text()
    assert json.loads(written[1].read_text())["store_traces"] == [trace]
    assert len(report.write(tmp_path / "none")) == 3  # no traces, no fourth file
