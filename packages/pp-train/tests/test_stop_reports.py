"""The trainer's side of a stopped pipeline: the report's directory, exit line, handlers, dumps."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import PipelineExecutor, ScheduleConfig, get_forward_backward_func
from pp_schedules.runtime import RankPosition, StopReport, report_stop
from pp_state import Placement, coordinates_in, rank_layout
from pp_state.collectives import CollectiveError
from pp_state.store_channel import StoreChannel
from pp_testing import (
    run_distributed,
    stage_chunks,
    tiny_forward_step,
    tiny_layers,
    tiny_microbatches,
)
from pp_train.arguments import CheckpointArgs, LoggingArgs, PretrainConfig
from pp_train.dump import main as dump_main
from pp_train.dump import worker_ranks
from pp_train.exits import SigtermFlag
from pp_train.live_dump import SignalWatcher, dump_line
from pp_train.stop_reports import (
    exit_line,
    keep_report,
    report_collective,
    report_directory,
    report_non_finite,
    report_stem,
    stop_evidence,
)
from pp_train.training import NonFiniteError

WIDTH, SEQ, BATCH, M = 4, 2, 2, 2


def _config(**logging: Any) -> PretrainConfig:
    save = logging.pop("save", None)
    return PretrainConfig(logging=LoggingArgs(**logging), checkpoint=CheckpointArgs(save=save))


def test_the_report_goes_to_the_flag_then_tensorboard_then_save_then_here(tmp_path: Path) -> None:
    a, b, c = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")
    assert report_directory(_config(stop_report_dir=a, tensorboard_dir=b, save=c)) == Path(a)
    assert report_directory(_config(tensorboard_dir=b, save=c)) == Path(b)
    assert report_directory(_config(save=c)) == Path(c)
    assert report_directory(_config()) == Path.cwd()
    assert report_stem(7, 3) == "pipeline-stop-iter7-rank3"


CAUSE = "rank 2 (pipeline stage 1 of [0, 2], dp 0) is gone; by the plan it was at F mb 3 chunk 0"


def _report(cause: str = CAUSE) -> StopReport:
    """A report built in the pipeline [1, 3] (pp 2 x dp 2), both stages answering."""
    heads = {1: {"position": None}, 3: {"position": None}}
    named = [(r, s, f"rank {r} (pipeline stage {s} of [1, 3], dp 1)") for s, r in enumerate((1, 3))]
    positions = [RankPosition(r, s, name, None, "", "ended", False) for r, s, name in named]
    return StopReport(
        cause=cause, positions=positions, waits=[], plan=[["F0"]] * 2, heads=heads,
        pipeline=(1, 3),
    )  # fmt: skip


@dataclasses.dataclass
class _Host:
    """What the trainer's side reads of an executor: its communicator's global rank."""

    rank: int

    @property
    def communicator(self) -> SimpleNamespace:
        return SimpleNamespace(rank=self.rank)


def test_the_reporting_rank_writes_and_names_the_cause_others_their_error(
    tmp_path: Path,
) -> None:
    report, host = _report(), _Host(rank=1)
    error = RuntimeError("rank 1 (stage 1 of 4) failed in recv\nmore")
    paths = keep_report(error, report, host, tmp_path, 5)  # type: ignore[arg-type]
    assert [p.name for p in paths] == [
        "pipeline-stop-iter5-rank1.txt",
        "pipeline-stop-iter5-rank1.json",
        "pipeline-stop-iter5-rank1.trace.json",
    ]
    assert json.loads(paths[1].read_text())["cause"] == report.cause
    assert exit_line(error, 1) == (
        f"pp-train: error: the pipeline stopped (call 0) in pipeline [1, 3]: {report.cause} "
        f"(report: {paths[0]})"
    )
    # The other rank names the cause too, and its own error after it.
    other = RuntimeError("rank 3 (stage 1 of 2) failed in recv. Cause: gloo\nmore")
    assert keep_report(other, report, _Host(rank=3), tmp_path / "x", 5) == []  # type: ignore[arg-type]
    assert exit_line(other, 3) == (
        f"pp-train: rank 3 (pipeline stage 1 of [1, 3], dp 1) stopped: cause: {CAUSE}; its "
        "own error: RuntimeError: rank 3 (stage 1 of 2) failed in recv."
    )
    assert not (tmp_path / "x").exists()
    assert exit_line(RuntimeError("no report"), 0) is None


def test_a_dump_line_says_where_the_rank_is() -> None:
    line = dump_line(None, 2, 9, 1)
    assert line == (
        "pp-train dump 1: rank 2, iteration 9: no pipeline executor (its forward-backward "
        "function records no steps)"
    )
    executor = get_forward_backward_func(None, config=ScheduleConfig(hidden_size=WIDTH))
    assert dump_line(executor, 0, 1, 2) == (
        "pp-train dump 2: rank 0 (pipeline stage 0 of [0]), iteration 1, before its first plan step"
    )


def test_a_dump_line_names_the_peers_it_waits_for_by_global_rank() -> None:
    """pp 2 x dp 2: rank 3 is stage 1 of the pipeline [1, 3]; it waits for stage 0, rank 1."""
    layout = rank_layout(4, pipeline_model_parallel_size=2)
    executor = get_forward_backward_func(None, config=ScheduleConfig(hidden_size=WIDTH))
    executor.coordinates = lambda rank: coordinates_in(layout, rank)
    head = {
        "iteration": 7, "step": 4, "action": "F1", "state": "waiting",
        "waiting_for": [{"peer": 0, "what": "activations of mb 1 chunk 0", "direction": "recv"}],
        "collective": None,
    }  # fmt: skip
    executor.recorder.head = lambda: head  # type: ignore[method-assign]
    assert dump_line(executor, 3, 4, 1) == (
        "pp-train dump 1: rank 3 (pipeline stage 1 of [1, 3], dp 1, tp 0), iteration 4, call 7, "
        "step 4 (F1), waiting; waiting for rank 1 (pipeline stage 0 of [1, 3], dp 1, tp 0): "
        "activations of mb 1 chunk 0 (recv)"
    )


def test_sigusr2_prints_the_dump_line_from_the_watcher_thread(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    before = signal.getsignal(signal.SIGUSR2)
    with SignalWatcher(None, iteration=lambda: 4, directory=tmp_path, poll_s=0.05) as watcher:
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while watcher.dumps == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert watcher.dumps == 1
    assert "pp-train dump 1: rank 0, iteration 4: no pipeline executor" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGUSR2) == before


class _GoneStore:
    """A store whose host has exited: every call fails with torch's C++-trace message."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: object) -> None:
            raise RuntimeError(
                "Failed to recv, got 0 bytes. Connection was likely closed.\n"
                "Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/"
                "Utils.hpp:670 (most recent call first):\nframe #0: c10::Error::Error(...)"
            )

        return fail


def test_a_gone_store_costs_the_watcher_one_line_per_thing_and_no_stack_trace(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = StoreChannel(_GoneStore(), rank=0, world_size=2)  # type: ignore[arg-type]
    monkeypatch.setattr(SignalWatcher, "_dump_channel", lambda self: gone)
    executor = get_forward_backward_func(None, config=ScheduleConfig(hidden_size=WIDTH))
    executor.channel = gone  # the liveness record goes there (pp-schedules' watch_pipeline)
    with (
        stop_evidence(executor, None),  # type: ignore[arg-type]
        SignalWatcher(None, iteration=lambda: 1, directory=tmp_path, poll_s=0.02) as watcher,
    ):
        time.sleep(0.3)  # several polls, each failing
    assert watcher.dumps == 0
    err = capfd.readouterr().err
    assert "Exception raised from" not in err
    assert "frame #0" not in err
    lines = [line for line in err.splitlines() if line]
    assert lines == [
        "pp-train: rank 0 could not publish its liveness record (RuntimeError: the store did "
        "not answer); live dumps and stop reports may miss this rank",
        "pp-train: rank 0 could not read the dump requests (RuntimeError: Failed to recv, got 0 "
        "bytes. Connection was likely closed.); live dumps and stop reports may miss this rank",
    ], lines


@pytest.mark.parametrize("seen", [True, False], ids=["a-lost-peer-it-saw", "its-own-error"])
def test_a_rank_leaves_a_note_only_when_it_stops_on_a_failure_it_saw(
    tmp_path: Path, seen: bool
) -> None:
    executor = get_forward_backward_func(None, config=ScheduleConfig(hidden_size=WIDTH))
    channel = StoreChannel(dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    executor.channel = channel
    error: Exception = (
        CollectiveError(rank=0, operation="exit decision", group_ranks=(0, 1), cause="closed")
        if seen
        else RuntimeError("CUDA out of memory")
    )
    with pytest.raises(type(error)), stop_evidence(executor, None):  # type: ignore[arg-type]
        raise error
    # Its own error leaves no note: the others then name it gone, as the cause.
    assert channel.store.check([channel.prefix + "alive/0/left"]) == seen


# --- on 2 ranks --------------------------------------------------------------------------------


def _executor(report_wait: float) -> PipelineExecutor:
    config = CommConfig(timeout=datetime.timedelta(seconds=30))
    comm = P2PCommunicator(None, config=config)
    placement = Placement.looped(2, 1)
    chunks = stage_chunks(tiny_layers(2, WIDTH), stages=placement.stages[comm.stage], num_stages=2)
    executor = get_forward_backward_func(comm, config=ScheduleConfig(hidden_size=WIDTH))
    executor.report_wait = report_wait
    executor(
        forward_step_func=tiny_forward_step(), model=chunks, num_microbatches=M,
        data_iterator=iter(tiny_microbatches(M, seq=SEQ, batch=BATCH, width=WIDTH)),
        seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    return executor


def _blocked_rank_publishes(directory: str) -> dict[str, Any]:
    executor = _executor(report_wait=1.0)
    pids: list[Any] = [None, None]
    dist.all_gather_object(pids, os.getpid())
    store = StoreChannel.from_default_group().store  # where the executor publishes ("pp/")
    if dist.get_rank() == 1:
        time.sleep(1.0)  # rank 0 is in its receive by now
        os.kill(pids[0], signal.SIGTERM)
        sent = time.monotonic()
        while not store.check(["pp/where/0"]) and time.monotonic() - sent < 10:
            time.sleep(0.02)
        seen = time.monotonic() - sent
        dist.send(torch.ones(1), dst=0)  # only now is rank 0's receive released
        return {"seen_after": seen}
    left: list[int] = []
    with (
        SigtermFlag(True) as flag,
        SignalWatcher(executor, iteration=lambda: 3, directory=Path(directory), leave=left.append),
    ):
        dist.recv(torch.zeros(1), src=1)  # blocked in gloo's C++ wait: no Python handler runs
        time.sleep(1.5)  # the watcher's gather waits report_wait for rank 1, which never answers
    return {"received": flag.received, "left": left}


@pytest.mark.reliability
def test_sigterm_publishes_the_position_while_the_main_thread_waits_in_a_receive(
    tmp_path: Path,
) -> None:
    """SIGTERM reaches a rank blocked in gloo's wait: its watcher thread publishes at once."""
    results = run_distributed(_blocked_rank_publishes, 2, str(tmp_path), timeout=90)
    assert results[1]["seen_after"] < 3.0
    assert results[0] == {"received": True, "left": []}
    # Rank 1 never published: the pipeline looked broken, so rank 0 (lowest) wrote the report.
    text = (tmp_path / "pipeline-stop-iter3-rank0.txt").read_text()
    assert "rank 1 (pipeline stage 1 of [0, 1]): step" in text
    assert "published nothing" in text


def _busy_rank_answers(directory: str, busy: int) -> dict[str, Any]:
    executor = _executor(report_wait=5.0)
    with stop_evidence(executor, None):  # type: ignore[arg-type]
        if dist.get_rank() == busy:
            with SignalWatcher(executor, iteration=lambda: 2, directory=Path(directory)):
                time.sleep(4.0)  # busy: neither lost nor in a transfer; its watch answers
            return {}
        report = report_stop(executor, None)
    assert report is not None
    return {
        "answered": report.answered,
        "inferred": [p.inferred for p in report.positions],
        "reporter": report.reporter,
    }


@pytest.mark.reliability
@pytest.mark.parametrize("busy", [1, 0], ids=["stage-1-busy", "stage-0-busy"])
def test_a_busy_rank_asked_for_its_position_publishes_it_from_its_watcher(
    tmp_path: Path, busy: int
) -> None:
    """One rank stops and asks; the other, busy in its main thread, answers from a thread of
    its watch (pp-schedules' `watch_pipeline`, entered by `stop_evidence`).

    The rank that stopped prints the report even when the busy one is the lower stage."""
    stopped = 1 - busy
    result = run_distributed(_busy_rank_answers, 2, str(tmp_path), busy, timeout=90)[stopped]
    assert result == {"answered": [0, 1], "inferred": [False, False], "reporter": stopped}


def _non_finite(directory: str) -> dict[str, Any]:
    executor = _executor(report_wait=5.0)
    error = NonFiniteError("iteration 3: non-finite loss on rank(s) [1]; the gradient norm is nan")
    report = report_non_finite(error, executor, Path(directory), 3)
    assert report is not None
    return {
        "cause": report.cause,
        "answered": sorted(report.heads),
        "inferred": [p.inferred for p in report.positions],
        "files": [str(p) for p in getattr(error, "stop_report_files", [])],
    }


@pytest.mark.reliability
def test_a_non_finite_stop_prints_every_rank_s_position_with_the_value_as_cause(
    tmp_path: Path,
) -> None:
    results = run_distributed(_non_finite, 2, str(tmp_path), timeout=90)
    for result in results:
        assert result["cause"] == (
            "a non-finite value stopped training, no rank is lost: iteration 3: non-finite "
            "loss on rank(s) [1]; the gradient norm is nan"
        )
        assert result["answered"] == [0, 1]
        assert result["inferred"] == [False, False]
    assert Path(results[0]["files"][0]).name == "pipeline-stop-iter3-rank0.txt"
    assert results[1]["files"] == []


def _collective_lost(directory: str, both: bool) -> dict[str, Any]:
    executor = _executor(report_wait=5.0 if both else 1.0)
    rank = dist.get_rank()
    error = CollectiveError(
        rank=rank, operation="gradient all-reduce over data parallel", group_ranks=(rank, 7),
        cause="Connection closed by peer", peer=7, iteration=3,
    )  # fmt: skip
    if rank == 1 and not both:
        time.sleep(2.0)  # blocked elsewhere: it publishes nothing within report_wait
        return {}
    report = report_collective(error, executor, Path(directory), 3)
    assert report is not None
    return {"cause": report.cause, "answered": sorted(report.heads), "line": str(error)}


@pytest.mark.reliability
@pytest.mark.parametrize("both", [True, False], ids=["both-stages", "one-silent"])
def test_a_lost_data_parallel_peer_prints_the_pipeline_s_report_naming_it(
    tmp_path: Path, both: bool
) -> None:
    results = run_distributed(_collective_lost, 2, str(tmp_path), both, timeout=90)
    first_line = results[0]["line"].splitlines()[0]
    assert "peer rank 7" in first_line
    closed = "saw its connection close in gradient all-reduce over data parallel"
    seen = f"ranks 0 and 1 {closed}" if both else f"rank 0 {closed}"
    assert results[0]["cause"] == f"rank 7 is gone; {seen}"
    assert results[0]["answered"] == ([0, 1] if both else [0])
    text = (tmp_path / "pipeline-stop-iter3-rank0.txt").read_text()
    assert text.startswith(f"pipeline stopped (call 1) in pipeline [0, 1]: rank 7 is gone; {seen}")
    assert first_line in text  # each rank's own error, in its line


# --- the command -------------------------------------------------------------------------------

_WORKER = """\
import signal, sys, time
signal.signal(signal.SIGUSR2, lambda *a: (print("dump asked", flush=True), sys.exit(0)))
print("ready", flush=True)
time.sleep(30)
"""


def test_the_dump_command_signals_the_lowest_rank_worker_only(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER], env={**env, "RANK": "0"}, stdout=subprocess.PIPE, text=True
    )
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "ready"
        assert worker_ranks(os.getpid()) == {0: worker.pid}
        assert dump_main(["--pid", str(other.pid)]) == 2  # no RANK: not signalled
        assert dump_main(["--pid", str(worker.pid)]) == 0
        assert worker.stdout.readline().strip() == "dump asked"
        assert worker.wait(10) == 0
        assert other.poll() is None
    finally:
        for process in (worker, other):
            process.kill()
            process.wait()
