"""Coordinates that name a rank with its place, and liveness records that name a lost one."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pp_state import (
    CollectiveError,
    RankCoordinates,
    collective,
    coordinates_in,
    liveness,
    rank_layout,
    set_address_book,
    set_collective_hook,
    set_peer_finder,
)
from pp_state.collectives import collective_error
from pp_state.store_channel import StoreChannel
from pp_testing import DistributedTestError, run_distributed


# ------------------------------------------------------------------------------ coordinates
def test_a_rank_is_named_by_its_global_rank_with_its_pipeline_and_data_parallel_place() -> None:
    layout = rank_layout(4, pipeline_model_parallel_size=2)  # pp 2 x dp 2
    one = coordinates_in(layout, 1)
    assert one == RankCoordinates(1, (1, 3), 0, data_parallel=1, tensor_parallel=0,
                                  context_parallel=0)  # fmt: skip
    assert one.describe() == "rank 1 (pipeline stage 0 of [1, 3], dp 1, tp 0)"
    assert coordinates_in(layout, 2).describe() == "rank 2 (pipeline stage 1 of [0, 2], dp 0, tp 0)"


def test_at_tp_2_pp_2_dp_2_every_rank_has_its_own_place() -> None:
    layout = rank_layout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    places = {r: coordinates_in(layout, r) for r in range(8)}
    assert places[5].describe() == "rank 5 (pipeline stage 1 of [1, 5], dp 0, tp 1)"
    assert places[6].describe() == "rank 6 (pipeline stage 1 of [2, 6], dp 1, tp 0)"
    assert len({(p.pipeline, p.stage) for p in places.values()}) == 8
    for place in places.values():  # the JSON a stop document carries reads back equal
        assert RankCoordinates.from_json(json.loads(json.dumps(place.to_json()))) == place


def test_a_rank_outside_the_layout_and_unreadable_coordinates_are_refused() -> None:
    layout = rank_layout(4, pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"rank 9 is in no pipeline group .*ranks 0 to 3"):
        coordinates_in(layout, 9)
    with pytest.raises(ValueError, match=r"rank coordinates .* are not readable"):
        RankCoordinates.from_json({"rank": 1, "stage": 0})


# ------------------------------------------------------------------------------ liveness
def _channel(tmp_path: Path) -> StoreChannel:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    return StoreChannel(store, rank=0, world_size=1, timeout=1.0)


def _child(channel: StoreChannel, rank: int, tmp_path: Path) -> subprocess.Popen[bytes]:
    """A process that publishes its identity as `rank`, then waits to be signalled."""
    code = (
        "import sys, time, torch.distributed as dist\n"
        "from pp_state import liveness\n"
        "from pp_state.store_channel import StoreChannel\n"
        f"store = dist.FileStore({str(tmp_path / 'store')!r}, 1)\n"
        f"channel = StoreChannel(store, rank={rank}, world_size=1, prefix={channel.prefix!r})\n"
        f"liveness.publish_identity(channel, {rank}); liveness.beat(channel, {rank})\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == b"ready"
    return child


def test_a_process_on_this_host_is_alive_then_stopped_then_gone(tmp_path: Path) -> None:
    channel = _channel(tmp_path)
    liveness.leave(channel, 3, "an earlier process's note")  # removed by the new identity
    child = _child(channel, 3, tmp_path)
    try:
        assert liveness.assess(channel, [3])[3].state == "alive"
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while liveness.assess(channel, [3])[3].state != "stopped" and time.monotonic() < deadline:
            time.sleep(0.02)
        stopped = liveness.assess(channel, [3])[3]
        assert stopped.state == "stopped"
        assert stopped.evidence == f"its process {child.pid} on this host is stopped"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        gone = liveness.assess(channel, [3])[3]
        assert (gone.state, gone.evidence) == (
            "gone", f"its process {child.pid} on this host has exited"
        )  # fmt: skip
        lost = liveness.lost_peer(channel, [0, 3])  # 0 left no record: unknown
        assert lost is not None
        assert (lost.rank, lost.state) == (3, "gone")
        assert liveness.peer_finder(channel, wait_s=0.0)((0, 3)) == (3, liveness.describe(gone))
    finally:
        child.kill()
        child.wait()


def test_a_running_process_on_this_host_is_alive_however_old_its_heartbeat(
    tmp_path: Path,
) -> None:
    channel = _channel(tmp_path)
    child = _child(channel, 4, tmp_path)
    try:
        channel.set("alive/4/beat", repr(time.time() - 30.0))  # its beating thread starved
        alive = liveness.assess(channel, [4])[4]
        assert (alive.state, alive.lost) == ("alive", False)
        assert alive.evidence == f"its process {child.pid} on this host runs"
    finally:
        child.kill()
        child.wait()


def test_the_rank_lost_first_is_the_one_whose_heartbeat_stopped_first() -> None:
    here_gone = liveness.Liveness(2, "gone", "its process 7 on this host has exited", 1.0)
    there_silent = liveness.Liveness(1, "silent", "no heartbeat for 10.0 s", 10.0)
    no_beat = liveness.Liveness(3, "gone", "its process 8 on this host has exited")
    ranked = sorted([here_gone, no_beat, there_silent], key=liveness.lost_first)
    assert [live.rank for live in ranked] == [1, 2, 3]


def test_another_hosts_rank_is_silent_once_its_heartbeat_is_stale(tmp_path: Path) -> None:
    channel = _channel(tmp_path)
    elsewhere = liveness.Identity(rank=5, host="other", pid=4242, space="another-boot:1")
    channel.set("alive/5/identity", json.dumps(elsewhere.__dict__))
    liveness.beat(channel, 5)
    assert liveness.assess(channel, [5])[5].state == "alive"  # its pid cannot be seen from here
    channel.set("alive/5/beat", repr(time.time() - 6.1))
    silent = liveness.assess(channel, [5])[5]
    assert silent.state == "silent"
    assert silent.evidence.startswith("no heartbeat for 6.")
    assert "(host other, process 4242)" in silent.evidence
    assert liveness.assess(channel, [6])[6].state == "unknown"  # no record at all
    assert liveness.lost_peer(channel, [6], wait_s=0.2) is None


class _GoneStore:
    """A store whose host has gone: every call fails, with a C++-like trace."""

    def __getattr__(self, name: str) -> object:
        def fail(*args: object) -> None:
            raise RuntimeError("Failed to recv, got 0 bytes\nException raised from recvBytes")

        return fail


def test_a_gone_store_makes_every_rank_unknown_and_raises_nothing() -> None:
    channel = StoreChannel(_GoneStore(), rank=0, world_size=2)  # type: ignore[arg-type]
    assert not liveness.publish_identity(channel, 0)
    assert not liveness.beat(channel, 0)
    found = liveness.assess(channel, [1])[1]
    assert found.state == "unknown"
    assert found.evidence == "the store did not answer (Failed to recv, got 0 bytes)"


# ------------------------------------------------------------------------------ hooks
class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def begin(self, operation: str, group_ranks: tuple[int, ...], iteration: int | None) -> object:
        self.events.append(("begin", (operation, iteration)))
        return len(self.events)

    def end(self, token: object, failed: bool = False) -> None:
        self.events.append(("end", (token, failed)))


def test_the_collective_hook_hears_every_collective_begin_and_end_failed_or_not() -> None:
    hook = _Recorder()
    previous = set_collective_hook(hook)
    try:
        with collective("exit decision", iteration=4):
            pass
        with pytest.raises(CollectiveError), collective("loss averaging"):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1")
    finally:
        assert set_collective_hook(previous) is hook
    assert hook.events == [
        ("begin", ("exit decision", 4)), ("end", (1, False)),
        ("begin", ("loss averaging", None)), ("end", (3, True)),
    ]  # fmt: skip


def _lose_rank_two_named(marks: str) -> tuple[str, str]:
    """4 ranks publish their identity; rank 2 dies; the others' all-reduce names it."""
    rank = dist.get_rank()
    channel = StoreChannel.from_default_group(timeout=5.0)
    liveness.publish_identity(channel, rank)
    previous = set_peer_finder(liveness.peer_finder(channel))
    dist.barrier()
    if rank == 2:
        Path(marks, "killed").write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        with collective("test all-reduce", iteration=5):
            for _ in range(1000):
                dist.all_reduce(torch.ones(4))
                time.sleep(0.01)
    except CollectiveError as error:
        # As pp-train does: a rank that stops on what it saw says so before it exits.
        liveness.leave(channel, rank, f"{type(error).__name__}: {error}")
        return str(error.peer), str(error)
    finally:
        set_peer_finder(previous)
    return "none", ""


@pytest.mark.reliability
def test_a_collective_over_four_ranks_names_the_dead_one_by_its_liveness_record(
    tmp_path: Path,
) -> None:
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_lose_rank_two_named, 4, str(tmp_path), pg_timeout=10.0, timeout=60)
    outcomes = caught.value.results
    assert sorted(outcomes) == [0, 1, 3]
    for peer, message in outcomes.values():
        assert peer == "2", message
        assert "peer rank 2 (gone: its process " in message
        assert "on this host has exited)" in message


def test_a_rank_that_left_a_note_is_not_taken_for_the_lost_one(tmp_path: Path) -> None:
    channel = _channel(tmp_path)
    first, second = _child(channel, 1, tmp_path), _child(channel, 2, tmp_path)
    try:
        for child in (first, second):
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        liveness.leave(channel, 1, "CollectiveError: rank 1: exit decision failed")
        left = liveness.assess(channel, [1])[1]
        assert (left.state, left.lost) == ("left", False)
        assert left.evidence == (
            "it left after its own error: CollectiveError: rank 1: exit decision failed"
        )
        found = liveness.lost_peer(channel, [1, 2])
        assert found is not None
        assert found.rank == 2
    finally:
        for child in (first, second):
            child.kill()
            child.wait()


def test_without_evidence_the_peer_stays_unknown() -> None:
    previous = set_peer_finder(lambda ranks: None)
    try:
        error = collective_error(RuntimeError("Connection closed by peer [::1]:5"), "barrier")
    finally:
        set_peer_finder(previous)
    assert error.peer is None
    assert "peer rank unknown (address [::1]:5)" in str(error)


def test_a_rank_that_left_a_note_and_still_runs_is_leaving_not_alive(tmp_path: Path) -> None:
    channel = _channel(tmp_path)
    child = _child(channel, 1, tmp_path)
    try:
        liveness.leave(channel, 1, "P2PError: rank 1 lost rank 3")
        leaving = liveness.assess(channel, [1])[1]
        assert (leaving.state, leaving.lost) == ("left", False)
        assert leaving.evidence == "it is leaving after its own error: P2PError: rank 1 lost rank 3"
    finally:
        child.kill()
        child.wait()


def test_the_store_s_host_waits_until_every_other_rank_finished_or_is_lost(
    tmp_path: Path,
) -> None:
    channel = _channel(tmp_path)
    running, killed = _child(channel, 1, tmp_path), _child(channel, 2, tmp_path)
    try:
        killed.kill()
        killed.wait()
        started = time.monotonic()
        assert liveness.wait_until_finished(channel, [1, 2], timeout=0.3) == [1]
        assert time.monotonic() - started >= 0.3  # rank 1 runs and has not finished
        assert liveness.finish(channel, 1, run="a")
        started = time.monotonic()
        assert liveness.wait_until_finished(channel, [1, 2], timeout=30, run="a") == []
        assert time.monotonic() - started < 5
        # a mark of run "a" is not one of run "b": the ranks share a run token per watch
        assert liveness.wait_until_finished(channel, [1], timeout=0.1, run="b") == [1]
    finally:
        for child in (running, killed):
            child.kill()
            child.wait()


# ------------------------------------------------------------------------------ endpoints
def test_an_address_is_mapped_to_the_rank_whose_endpoints_hold_it(tmp_path: Path) -> None:
    channel = _channel(tmp_path)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        port = listener.getsockname()[1]
        assert ("127.0.0.1", port) in liveness.own_endpoints()
        assert ("127.0.0.1", port) in liveness.own_endpoints(listening=True)
        with socket.create_connection(("127.0.0.1", port)) as client:
            mine = client.getsockname()[1]
            assert ("127.0.0.1", mine) in liveness.own_endpoints()
            assert ("127.0.0.1", mine) not in liveness.own_endpoints(listening=True)
        assert liveness.publish_endpoints(channel, 3)
        channel.set("alive/5/endpoints", json.dumps([["127.0.0.1", 1]]))
        assert liveness.ranks_at(channel, f"[127.0.0.1]:{port}", [3, 5]) == [3]
        # gloo prints the port with its two bytes swapped: that reading is matched too
        swapped = ((port & 0xFF) << 8) | (port >> 8)
        assert liveness.ranks_at(channel, f"[127.0.0.1]:{swapped}", [3, 5]) == [3]
        assert liveness.ranks_at(channel, f"[::ffff:127.0.0.1]:{port}", [3, 5]) == [3]
        assert liveness.ranks_at(channel, f"[10.0.0.9]:{port}", [3, 5]) == []  # another host
        assert liveness.ranks_at(channel, f"[127.0.0.1]:{port}", [5, 6]) == []  # not a member
        # rank 5 holds the port of the other reading: the address names both
        channel.set("alive/5/endpoints", json.dumps([["127.0.0.1", swapped]]))
        assert liveness.ranks_at(channel, f"[127.0.0.1]:{port}", [3, 5]) == [3, 5]
        book = liveness.address_book(channel, wait_s=0.0)
        assert book(f"[127.0.0.1]:{port}", (3, 5)) == ((3, 5), None)
        liveness.publish_identity(channel, 3)  # this process: alive, so nothing more is said
        assert book(f"[127.0.0.1]:{port}", (3,)) == ((3,), None)
        liveness.leave(channel, 3, "CollectiveError: rank 3: it saw rank 0 go")
        assert book(f"[127.0.0.1]:{port}", (3,)) == (
            (3,), "left: it is leaving after its own error: CollectiveError: rank 3: it saw rank 0 go"
        )  # fmt: skip
    finally:
        listener.close()


def _lose_rank_two_by_address(marks: str) -> tuple[str, str]:
    """4 ranks publish their endpoints; rank 2 dies; the others' errors map its address."""
    rank = dist.get_rank()
    channel = StoreChannel.from_default_group(timeout=5.0)
    dist.barrier()  # every pair connected before the endpoints are read
    liveness.publish_identity(channel, rank)
    liveness.publish_endpoints(channel, rank)
    previous = set_address_book(liveness.address_book(channel))
    dist.barrier()
    if rank == 2:
        Path(marks, "killed").write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        with collective("test all-reduce"):
            for _ in range(1000):
                dist.all_reduce(torch.ones(4))
                time.sleep(0.01)
    except CollectiveError as error:
        # As a watched rank does: one that stops on what it saw says so before it exits.
        liveness.leave(channel, rank, f"{type(error).__name__}: {error}")
        return str(error.peer_address), str(error)
    finally:
        set_address_book(previous)
    return "none", ""


@pytest.mark.reliability
def test_a_peer_named_only_by_its_address_is_mapped_to_its_global_rank(tmp_path: Path) -> None:
    """No peer finder: what names a peer is the address in each survivor's error.

    The first survivor to fail saw rank 2's connection close; a later one may see the
    connection of a survivor that left before it, named as such (never unknown, never gone).
    """
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_lose_rank_two_by_address, 4, str(tmp_path), pg_timeout=10.0, timeout=60)
    outcomes = caught.value.results
    assert sorted(outcomes) == [0, 1, 3]
    addressed = [message for address, message in outcomes.values() if address != "None"]
    assert any("peer rank 2 (gone: its process " in m for m in addressed), outcomes
    for message in addressed:
        named = re.search(r"peer rank (\d+) \((gone|left): ", message)
        assert named is not None, message
        assert (named.group(1) == "2") == (named.group(2) == "gone"), message


def test_a_process_read_while_the_store_was_there_is_told_without_the_store(
    tmp_path: Path,
) -> None:
    channel = _channel(tmp_path)
    child = _child(channel, 0, tmp_path)
    try:
        identity = liveness.read_identity(channel, 0)
        assert identity is not None
        assert identity.pid == child.pid
        seen = liveness.by_process(identity)
        assert seen is not None
        assert seen.state == "alive"
        child.kill()
        child.wait()
        gone = liveness.by_process(identity)
        assert gone is not None
        assert (gone.state, gone.evidence) == (
            "gone",
            f"its process {child.pid} on this host has exited",
        )
        elsewhere = liveness.Identity(rank=0, host="other", pid=1, space="another-boot:1")
        assert liveness.by_process(elsewhere) is None  # another host: only the store could say
        assert liveness.read_identity(channel, 9) is None
    finally:
        child.kill()
        child.wait()
