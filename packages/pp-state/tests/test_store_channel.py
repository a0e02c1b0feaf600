"""`StoreChannel`: keys every rank sets and waits for, over a FileStore or a real TCPStore."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from pp_state import StoreChannel, StoreGoneError, StoreTimeoutError, store_channel
from pp_state.store_channel import store_traces

pytestmark = pytest.mark.reliability

TORCHRUN = {
    "WORLD_SIZE": "2",
    "RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "job7",
    "TORCHELASTIC_RESTART_COUNT": "3",
}


def test_a_file_store_channel_sets_gets_and_waits(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    writer = StoreChannel.from_file(path, rank=0, world_size=2, timeout=5)
    reader = StoreChannel.from_file(path, rank=1, world_size=2, timeout=5)
    writer.set("ready", "yes")
    reader.wait(["ready"])
    assert reader.get("ready") == b"yes"


def test_a_key_never_set_times_out_naming_the_key_rank_and_seconds(tmp_path: Path) -> None:
    channel = StoreChannel.from_file(str(tmp_path / "store"), rank=3, world_size=4, timeout=5)
    with pytest.raises(StoreTimeoutError) as caught:
        channel.wait(["printed"], timeout=0.2)
    assert str(caught.value).startswith(
        "rank 3 waited 0.2 s for store key(s) printed; no rank set it in that time"
    )
    assert isinstance(caught.value, TimeoutError)
    assert (caught.value.keys, caught.value.rank, caught.value.seconds) == (["printed"], 3, 0.2)


def test_prefixes_keep_runs_apart(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    first = StoreChannel.from_file(path, rank=0, world_size=1, prefix="run/0", timeout=5)
    second = StoreChannel.from_file(path, rank=0, world_size=1, prefix="run/1", timeout=5)
    first.set("done", "1")
    with pytest.raises(StoreTimeoutError, match="done"):
        second.wait(["done"], timeout=0.2)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_timeout_must_be_positive(tmp_path: Path, timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        StoreChannel.from_file(str(tmp_path / "store"), rank=0, world_size=1, timeout=timeout)


@pytest.mark.parametrize(
    "environ",
    [{}, {"WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, {"WORLD_SIZE": "2"}],
)
def test_no_channel_without_a_job_of_two_or_more(environ: dict[str, str]) -> None:
    assert StoreChannel.from_torchrun_environment(environ) is None


def test_a_bad_variable_is_named() -> None:
    with pytest.raises(ValueError, match="environment variable MASTER_PORT must be a whole"):
        StoreChannel.from_torchrun_environment({**TORCHRUN, "MASTER_PORT": "x"})


def test_torchrun_keys_carry_the_run_id_and_restart_count() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environ = {**TORCHRUN, "MASTER_PORT": str(server.port)}
    channel = StoreChannel.from_torchrun_environment(environ, namespace="demo", timeout=5)
    assert channel is not None
    assert (channel.rank, channel.world_size, channel.hosts_store) == (1, 2, False)
    channel.set("k", "v")
    assert server.get("demo/job7/3/k") == b"v"


_PEER = """
import sys
from pp_state import StoreChannel
channel = StoreChannel.connect("127.0.0.1", int(sys.argv[1]), rank=1, world_size=2, timeout=30)
channel.wait(["question"])
channel.set("answer", channel.get("question") + b"!")
"""


def test_two_processes_talk_through_a_real_tcp_store() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    channel = StoreChannel.connect("127.0.0.1", server.port, rank=0, world_size=2, timeout=60)
    peer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_PEER), str(server.port)])
    try:
        channel.set("question", "hello")
        assert channel.get("answer", timeout=60) == b"hello!"
        assert peer.wait(timeout=60) == 0
    finally:
        peer.kill()
        peer.wait()


def test_a_hosting_rank_publishes_and_returns_once_every_other_rank_received(
    tmp_path: Path,
) -> None:
    import threading

    path = str(tmp_path / "store")
    store = dist.FileStore(path, 3)
    host = StoreChannel(store, rank=0, world_size=3, timeout=5, hosts_store=True)
    readers = [StoreChannel.from_file(path, rank=rank, world_size=3, timeout=5) for rank in (1, 2)]
    publisher = threading.Thread(target=host.publish, args=("printed", "--lr inf"))
    publisher.start()
    assert readers[0].receive("printed") == "--lr inf"
    publisher.join(timeout=0.3)
    assert publisher.is_alive()  # rank 2 has not received it yet: the host stays
    assert readers[1].receive("printed") == "--lr inf"
    publisher.join(timeout=5)
    assert not publisher.is_alive()


def test_a_hosting_rank_whose_readers_never_come_times_out_naming_them(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 2)
    host = StoreChannel(store, rank=0, world_size=2, timeout=0.3, hosts_store=True)
    with pytest.raises(StoreTimeoutError, match="printed/seen/1"):
        host.publish("printed", "--lr inf")


_HOST = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
print(store.port, flush=True)
sys.stdin.readline()  # until told to leave
"""


def test_a_store_whose_host_exited_is_gone_and_torch_is_not_called(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    host = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HOST)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        channel = StoreChannel.connect("127.0.0.1", port, rank=1, world_size=2, timeout=10)
        assert channel.address == f"127.0.0.1:{port}"
        channel.set("k", "v")
        assert (channel.read("k"), channel.read("missing")) == (b"v", None)
        assert (channel.add("n", 2), channel.add("n", 3)) == (2, 5)
        assert not channel.gone()
        assert host.stdin is not None
        host.stdin.write("\n")
        host.stdin.flush()
        host.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not channel.gone() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert channel.gone()
        for call in (lambda: channel.set("k", "w"), lambda: channel.read("k"),
                     lambda: channel.wait(["k"]), lambda: channel.add("n", 1)):  # fmt: skip
            with pytest.raises(StoreGoneError, match=rf"store at 127.0.0.1:{port} is gone"):
                call()
        # torch's client prints a C++ stack trace for each call to a gone store; none came.
        assert "Exception raised from" not in capfd.readouterr().err
        # The gone store met before its closed connection is seen (the host exited a moment
        # before): torch's trace is caught and kept, the console gets nothing.
        store_traces()
        monkeypatch.setattr(store_channel, "_closed", lambda link: False)
        with pytest.raises(RuntimeError) as caught:
            channel.read("k")  # a set may still go out; a read needs the server's answer
        assert not isinstance(caught.value, StoreGoneError)
        print("a line of its own", file=sys.stderr, flush=True)
        assert capfd.readouterr().err == "a line of its own\n"
        (trace,) = store_traces()
        assert "TCPStore" in trace.splitlines()[0]
        assert trace.splitlines()[1].startswith("Exception raised from ")
        assert store_traces() == []
    finally:
        host.kill()
        host.wait()


def test_a_file_store_is_never_gone(tmp_path: Path) -> None:
    channel = StoreChannel.from_file(str(tmp_path / "store"), rank=0, world_size=1, timeout=5)
    assert channel.address is None
    assert not channel.gone()
    channel.delete("never-set")  # nothing to delete: no error
    channel.set("k", "v")
    channel.delete("k")
    assert channel.read("k") is None


def test_only_a_store_s_stack_trace_is_taken_out_of_what_c_plus_plus_wrote() -> None:
    written = (
        b"[W1206 02:52:11.933 ProcessGroupGloo.cpp:9] a warning of one line\n"
        b"[W1206 02:52:11.934 TCPStore.cpp:106] [c10d] sendBytes failed: Broken pipe\n"
        b"Exception raised from sendBytes at Utils.hpp:758 (most recent call first):\n"
        b"frame #0: c10::Error::Error(...)\n<omitting python frames>\nframe #18: _start\n\n"
        b"and a line after it\n"
    )
    rest, traces = store_channel._split_traces(written)
    assert rest == (
        b"[W1206 02:52:11.933 ProcessGroupGloo.cpp:9] a warning of one line\nand a line after it\n"
    )
    assert len(traces) == 1
    assert traces[0].startswith(b"[W1206 02:52:11.934 TCPStore.cpp:106]")
    assert traces[0].endswith(b"frame #18: _start\n\n")
