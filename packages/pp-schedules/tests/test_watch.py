"""`watch_pipeline`: a training loop's liveness records, hooks, notes, SIGTERM and refusals.

Single-process tests over a FileStore; the kill of a rank of a real job is in
integration_tests/test_own_trainer_failures.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

import pp_schedules.runtime._watch as watch_module
from pp_schedules import ScheduleConfig, get_forward_backward_func, watch_pipeline
from pp_schedules.runtime import PipelineWatch, run_token
from pp_state import CollectiveError
from pp_state.collectives import set_address_book, set_collective_hook, set_peer_finder
from pp_state.store_channel import StoreChannel


def _channel(tmp_path: Path) -> StoreChannel:
    return StoreChannel(dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)


def _executor(channel: StoreChannel) -> Any:
    executor = get_forward_backward_func(None, config=ScheduleConfig(hidden_size=4))
    executor.channel = channel
    return executor


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("executor", ["1f1b", object(), 3])
def test_anything_but_the_executor_is_refused_naming_what_to_pass(executor: object) -> None:
    with pytest.raises(TypeError, match=r"watches pp-schedules' executor, got \w+; pass what "):
        watch_pipeline(executor)  # type: ignore[arg-type]


@pytest.mark.parametrize("linger", [-1.0, float("nan"), True, "10"])
def test_a_linger_that_is_no_number_of_seconds_is_refused(linger: object) -> None:
    with pytest.raises(ValueError, match=r"linger_s must be a number of seconds of 0 or more, got"):
        watch_pipeline(None, linger_s=linger)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the records
def test_the_watch_publishes_the_records_beats_and_puts_the_hooks_back(tmp_path: Path) -> None:
    channel = _channel(tmp_path)
    executor = _executor(channel)
    before = (set_collective_hook(None), set_peer_finder(None), set_address_book(None))
    state = SimpleNamespace(coordinates=lambda rank=None: f"place of {rank}")
    with watch_pipeline(executor, state, sigterm=False) as watch:
        assert watch.run_token == str(os.getpid())  # one process: no broadcast
        assert executor.run_token == watch.run_token
        assert executor.coordinates(3) == "place of 3"
        assert json.loads(channel.read("alive/0/identity") or b"{}")["pid"] == os.getpid()
        assert channel.read("alive/0/endpoints") is not None
        first = channel.read("alive/0/beat")
        deadline = time.monotonic() + 10
        while channel.read("alive/0/beat") == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert channel.read("alive/0/beat") != first  # it beats, every half second
        hooks = set_collective_hook(None), set_peer_finder(None), set_address_book(None)
        assert all(hook is not None for hook in hooks)
        set_collective_hook(hooks[0]), set_peer_finder(hooks[1]), set_address_book(hooks[2])
    assert (set_collective_hook(None), set_peer_finder(None), set_address_book(None)) == before
    assert channel.read(f"alive/0/finished/{watch.run_token}") is not None


@pytest.mark.parametrize(
    ("error", "note"),
    [
        (CollectiveError(rank=0, operation="exit decision", group_ranks=(0, 1), cause="x"), True),
        (RuntimeError("Connection closed by peer [127.0.0.1]:5"), True),  # a raw lost peer
        (RuntimeError("CUDA out of memory"), False),
    ],
    ids=["a-collective-error", "a-backend-s-lost-peer", "its-own-error"],
)
def test_a_rank_leaves_a_note_only_when_it_stops_on_a_failure_it_saw(
    tmp_path: Path, error: Exception, note: bool
) -> None:
    channel = _channel(tmp_path)
    with pytest.raises(type(error)), watch_pipeline(_executor(channel), sigterm=False):
        raise error
    # Its own error leaves no note: the others then name it gone, as the cause.
    assert (channel.read("alive/0/left") is not None) == note


class _GoneStore:
    """A store whose host has exited: every call fails with torch's C++-trace message."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: object) -> None:
            raise RuntimeError("Failed to recv, got 0 bytes.\nException raised from recvBytes")

        return fail


def test_a_gone_store_costs_one_line_and_no_stack_trace(
    capfd: pytest.CaptureFixture[str],
) -> None:
    executor = _executor(StoreChannel(_GoneStore(), rank=0, world_size=2))  # type: ignore[arg-type]
    with watch_pipeline(executor, sigterm=False):
        time.sleep(0.3)
    err = capfd.readouterr().err
    assert "Exception raised from" not in err
    assert err.splitlines() == [
        "pp-schedules: rank 0 could not publish its liveness record (RuntimeError: the store "
        "did not answer); stop reports may miss this rank"
    ]


def test_a_trainer_says_what_it_could_not_do_in_its_own_words() -> None:
    said: list[str] = []
    executor = _executor(StoreChannel(_GoneStore(), rank=0, world_size=2))  # type: ignore[arg-type]
    note = lambda what, error: said.append(f"trainer: {what}")  # noqa: E731
    with watch_pipeline(executor, sigterm=False, note=note, program="trainer"):
        pass
    assert said == ["trainer: publish its liveness record"]


def test_only_the_process_listening_on_the_store_s_port_hosts_it() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    hosted = StoreChannel(server, rank=0, world_size=2)
    assert watch_module._hosts_store(hosted)
    code = textwrap.dedent(f"""
        import torch.distributed as dist
        from pp_schedules.runtime._watch import _hosts_store
        from pp_state.store_channel import StoreChannel
        client = dist.TCPStore("127.0.0.1", {server.port}, is_master=False)
        print(_hosts_store(StoreChannel(client, rank=1, world_size=2)))
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "False", done.stderr
    assert not watch_module._hosts_store(None)


# ------------------------------------------------------------------------------ SIGTERM
_SIGTERMED = """
import os, signal, sys, time
import torch.distributed as dist
from pp_schedules import ScheduleConfig, get_forward_backward_func, watch_pipeline
from pp_state.store_channel import StoreChannel

channel = StoreChannel(dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
executor = get_forward_backward_func(None, config=ScheduleConfig(hidden_size=4))
executor.channel = channel
with watch_pipeline(executor):
    print("watching", flush=True)
    time.sleep(60)  # as a main thread waiting in a transfer
print("not reached", flush=True)
"""


def test_sigterm_ends_the_process_as_before_leaving_a_note(tmp_path: Path) -> None:
    """Its pipeline whole (here: a single stage), SIGTERM still ends the process (status
    143, as its default action), after a note that the rank left on it, not lost."""
    store = tmp_path / "store"
    child = subprocess.Popen([sys.executable, "-c", _SIGTERMED, str(store)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "watching"
        os.kill(child.pid, signal.SIGTERM)
        assert child.wait(timeout=30) == 128 + signal.SIGTERM
        assert "not reached" not in child.stdout.read()
    finally:
        child.kill()
        child.wait()
    channel = StoreChannel(dist.FileStore(str(store), 1), rank=0, world_size=1)
    assert json.loads(channel.read("alive/0/left") or b"{}")["reason"] == (
        "SIGTERM, its pipeline whole"
    )


def test_an_ignored_sigterm_stays_ignored(tmp_path: Path) -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with watch_pipeline(_executor(_channel(tmp_path))) as watch:
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert isinstance(watch, PipelineWatch)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_run_token_without_a_process_group_is_the_process_id() -> None:
    assert run_token() == str(os.getpid())


_STORE_HOST = """
import datetime, sys
import torch.distributed as dist
from pp_state import liveness
from pp_state.store_channel import StoreChannel

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
channel = StoreChannel(store, rank=5, world_size=2, prefix="pp")
liveness.publish_identity(channel, 5)
channel.set("watch/store-host", "5")
print(store.port, flush=True)
sys.stdin.readline()
"""


def test_a_store_host_killed_is_named_gone_when_no_report_can_be_gathered(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Without torchrun rank 0's process hosts the store: killed, it takes every record
    with it, but its identity, read at the start, still names it."""
    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        channel = StoreChannel.connect("127.0.0.1", port, rank=0, world_size=2, prefix="pp")
        state = SimpleNamespace(
            coordinates=lambda rank=None: SimpleNamespace(describe=lambda: f"rank {rank} (here)")
        )
        error = CollectiveError(rank=0, operation="loss all-reduce", group_ranks=(0, 5),
                                cause="Connection closed by peer", peer=5)  # fmt: skip
        watch = watch_pipeline(_executor(channel), state, sigterm=False)
        watch.__enter__()
        host.kill()
        host.wait()
        deadline = time.monotonic() + 10
        while not channel.gone() and time.monotonic() < deadline:
            time.sleep(0.02)
        watch.__exit__(CollectiveError, error, None)  # as a with block the error leaves
    finally:
        host.kill()
        host.wait()
    err = capfd.readouterr().err
    assert (
        f"pp-schedules: rank 0 (here) stopped: cause: rank 5 (here) is gone (its process "
        f"{host.pid} on this host has exited; it hosted the job's store, so no report could "
        "be gathered); its own error: CollectiveError: "
    ) in err
    assert "Exception raised from" not in err
