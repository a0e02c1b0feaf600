"""Run one plain function on N CPU ranks over gloo, with a hard timeout.

Ranks start from a forkserver that has torch imported already (starting a rank then costs a
fork, not a fresh interpreter), meet through a FileStore in a fresh temporary directory (no
port to collide on), run with one thread each, and are all killed in a ``finally``: no test
that uses this can hang.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import importlib
import importlib.util
import multiprocessing
import multiprocessing.context
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["DistributedTestError", "RankFailure", "preload_in_ranks", "run_distributed"]

# torch._dynamo is imported by torch itself the first time a tensor is initialised on the meta
# device (about a second of CPU per process): imported once here, every rank starts with it.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]
# After the first rank fails, the others get this long to finish or fail on their own before
# they are killed: long enough to report their side of a broken collective.
_GRACE_AFTER_FAILURE_S = 5.0
_POLL_S = 0.02
_STACK_DUMP_WAIT_S = 0.5


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """What one rank left behind when a distributed run failed.

    Attributes:
        rank: The global rank.
        status: "raised", "killed at timeout", "exited with code N" or "finished".
        detail: The traceback it raised, or the stack it was stuck in when killed.
    """

    rank: int
    status: str
    detail: str


class DistributedTestError(AssertionError):
    """A rank raised, died or overran the timeout; the message holds every rank's story.

    Attributes:
        failures: Each rank's status and traceback, indexed by rank.
        results: What the ranks that finished returned, by rank (a test that kills a rank on
            purpose reads the survivors' outcomes here).
    """

    def __init__(
        self,
        summary: str,
        failures: Sequence[RankFailure],
        results: dict[int, Any] | None = None,
    ) -> None:
        """Builds the message from `summary` and each rank's status and traceback."""
        self.failures = list(failures)
        self.results = dict(results or {})
        parts = [summary]
        for failure in self.failures:
            parts.append(f"--- rank {failure.rank}: {failure.status} ---")
            if failure.detail:
                parts.append(failure.detail.rstrip())
        super().__init__("\n".join(parts))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float = 20.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on `world_size` ranks, each in its own process, and collect results.

    Each rank calls ``torch.distributed.init_process_group`` before `fn` and destroys it
    after. `fn` must be defined at module level (it is loaded by module and name in each rank);
    its return value must pickle.

    Args:
        fn: The test body, run on every rank; it reads its rank from torch.distributed.
        world_size: Number of ranks, 1 or more.
        *args: Arguments for `fn`, the same on every rank; they must pickle.
        timeout: Seconds the whole run may take before every rank is killed.
        pg_timeout: Timeout of the process group: a collective or receive that waits longer
            raises inside the rank.
        backend: torch.distributed backend: "gloo" on CPU, or "nccl" (rank r then uses CUDA
            device r modulo the device count).
        env: Extra environment variables for the ranks.

    Returns:
        The value `fn` returned on each rank, indexed by rank.

    Raises:
        ValueError: `world_size` or a timeout is not positive.
        DistributedTestError: A rank raised, exited abnormally or the run overran `timeout`;
            the message holds every rank's traceback or the stack it was stuck in.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be 1 or more, got {world_size}")
    if timeout <= 0 or pg_timeout <= 0:
        raise ValueError(
            f"timeouts must be positive, got timeout={timeout} pg_timeout={pg_timeout}"
        )
    with tempfile.TemporaryDirectory(prefix="pp-testing-") as tmp:
        workdir = Path(tmp)
        spec = _RunSpec(
            target=_FunctionRef.of(fn),
            args=pickle.dumps(args),
            world_size=world_size,
            store_path=str(workdir / "store"),
            workdir=str(workdir),
            backend=backend,
            pg_timeout=pg_timeout,
            env=dict(env or {}),
        )
        return _run_ranks(spec, workdir, timeout)


def _run_ranks(spec: _RunSpec, workdir: Path, timeout: float) -> list[Any]:
    """Start one process per rank, wait for them, and collect; never leave one running."""
    context = _context()
    processes = [
        # Not daemonic, so a test body may start processes of its own (DataLoader
        # workers); every rank is killed in the finally below either way.
        context.Process(target=_rank_main, args=(spec, rank), name=f"rank{rank}")
        for rank in range(spec.world_size)
    ]
    try:
        for process in processes:
            process.start()
        timed_out = _wait(processes, workdir, timeout)
        return _collect(processes, workdir, timed_out, timeout)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=5)


@dataclasses.dataclass(frozen=True)
class _FunctionRef:
    """Where to find a module-level function in a fresh process."""

    module: str
    qualname: str
    path: str | None

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> _FunctionRef:
        qualname = getattr(fn, "__qualname__", "")
        if not qualname or "<locals>" in qualname or "<lambda>" in qualname:
            raise ValueError(
                f"run_distributed needs a module-level function; {qualname or fn!r} is not one"
            )
        module = sys.modules.get(fn.__module__)
        path = getattr(module, "__file__", None)
        return cls(module=fn.__module__, qualname=qualname, path=path)

    def resolve(self) -> Callable[..., Any]:
        module = self._load_module()
        found: Any = module
        for part in self.qualname.split("."):
            found = getattr(found, part)
        assert callable(found)
        return found  # type: ignore[no-any-return]

    def _load_module(self) -> ModuleType:
        if self.module in sys.modules:
            return sys.modules[self.module]
        try:
            return importlib.import_module(self.module)
        except ImportError:
            # pytest's importlib mode gives test modules names that cannot be imported by name.
            if self.path is None:
                raise
        spec = importlib.util.spec_from_file_location(self.module, self.path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        # pickle finds classes through __import__, which walks the dotted name's parents
        # ("packages.pp-testing.tests.test_x" under importlib mode): give them placeholders.
        parts = self.module.split(".")
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            if parent not in sys.modules:
                placeholder = ModuleType(parent)
                placeholder.__path__ = []
                sys.modules[parent] = placeholder
        sys.modules[self.module] = module
        spec.loader.exec_module(module)
        return module


@dataclasses.dataclass(frozen=True)
class _RunSpec:
    target: _FunctionRef
    # Pickled here and unpickled inside the rank's error handling, after the target's module
    # is loaded: an argument whose class lives in a test module then unpickles, and one that
    # cannot is reported with its traceback.
    args: bytes
    world_size: int
    store_path: str
    workdir: str
    backend: str
    pg_timeout: float
    env: dict[str, str]


_CONTEXT: multiprocessing.context.ForkServerContext | None = None


def preload_in_ranks(*modules: str) -> None:
    """Import `modules` once in the process every rank is forked from.

    Ranks then start with them imported instead of importing them each (a test suite calls
    this from its ``conftest.py`` with the packages its test bodies import). torch and
    torch.distributed are always preloaded; a module that fails to import is left to each
    rank, which then reports the error.

    Args:
        modules: Dotted module names.

    Raises:
        RuntimeError: The ranks' forkserver has already started (a run happened before this
            call); the preload would not reach it.
    """
    if _CONTEXT is not None:
        raise RuntimeError(
            f"preload_in_ranks{modules} came after the first run_distributed: call it before "
            "any run (from a conftest.py), while the ranks' forkserver is not started"
        )
    _PRELOAD.extend(module for module in modules if module not in _PRELOAD)


def _context() -> multiprocessing.context.ForkServerContext:
    global _CONTEXT  # noqa: PLW0603 - one forkserver per test process, started on first use
    if _CONTEXT is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        _CONTEXT = context
    return _CONTEXT


def _result_path(workdir: Path | str, rank: int) -> Path:
    return Path(workdir) / f"rank{rank}.result"


def _stack_path(workdir: Path | str, rank: int) -> Path:
    return Path(workdir) / f"rank{rank}.stack"


def _rank_main(spec: _RunSpec, rank: int) -> None:
    """Body of one rank's process: set up, run the target, write the outcome to a file."""
    outcome: tuple[str, Any]
    try:
        _arm_stack_dumps(spec.workdir, rank)
        os.environ.update(spec.env)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if spec.backend == "nccl":
            # NCCL needs one device per rank.
            torch.cuda.set_device(rank % torch.cuda.device_count())
        target = spec.target.resolve()
        args = pickle.loads(spec.args)
        store = dist.FileStore(spec.store_path, spec.world_size)
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.pg_timeout),
        )
        # No rank starts (and so none can finish and close its sockets) before every rank
        # has connected: under load a fast rank's exit broke a slower one's connection set-up.
        dist.barrier()
        try:
            outcome = ("ok", target(*args))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:
        outcome = ("raised", traceback.format_exc())
    try:
        payload = pickle.dumps(outcome)
    except Exception:
        payload = pickle.dumps(("raised", "result did not pickle:\n" + traceback.format_exc()))
    partial = _result_path(spec.workdir, rank).with_suffix(".partial")
    partial.write_bytes(payload)
    partial.rename(_result_path(spec.workdir, rank))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: torch's atexit hooks can stall a child for seconds.
    os._exit(0 if outcome[0] == "ok" else 1)


def _arm_stack_dumps(workdir: str, rank: int) -> None:
    """Make SIGUSR1 (sent on timeout) and fatal signals write this rank's stack to a file.

    The file appears under its final name only once the handler is installed, so the parent
    never signals a rank that would die of SIGUSR1 instead of reporting.
    """
    pending = _stack_path(workdir, rank).with_suffix(".arming")
    stack_file = open(pending, "w")  # noqa: SIM115 - stays open until the process exits
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    pending.rename(_stack_path(workdir, rank))


def _outcome(process: multiprocessing.process.BaseProcess, workdir: Path, rank: int) -> str:
    """The rank's state: "running", "ok" or "failed"."""
    if process.exitcode not in (None, 0):
        return "failed"
    path = _result_path(workdir, rank)
    if not path.exists():
        return "running"
    return "ok" if pickle.loads(path.read_bytes())[0] == "ok" else "failed"


def _wait(
    processes: Sequence[multiprocessing.process.BaseProcess], workdir: Path, timeout: float
) -> bool:
    """Wait until every rank exits; returns True when it had to give up."""
    deadline = time.monotonic() + timeout
    failure_deadline: float | None = None
    succeeded: set[int] = set()  # read each finished rank's result once
    while any(process.is_alive() for process in processes):
        now = time.monotonic()
        if failure_deadline is None:
            for rank, process in enumerate(processes):
                if rank in succeeded:
                    continue
                outcome = _outcome(process, workdir, rank)
                if outcome == "ok":
                    succeeded.add(rank)
                elif outcome == "failed":
                    failure_deadline = now + _GRACE_AFTER_FAILURE_S
                    break
        if now >= deadline or (failure_deadline is not None and now >= failure_deadline):
            _dump_stacks(processes, workdir)
            return now >= deadline
        time.sleep(_POLL_S)
    return False


def _dump_stacks(processes: Sequence[multiprocessing.process.BaseProcess], workdir: Path) -> None:
    signalled = False
    for rank, process in enumerate(processes):
        armed = _stack_path(workdir, rank).exists()
        if process.pid is None or not armed or not process.is_alive():
            continue
        try:
            os.kill(process.pid, signal.SIGUSR1)
            signalled = True
        except ProcessLookupError:  # it exited after is_alive()
            pass
    if signalled:
        time.sleep(_STACK_DUMP_WAIT_S)


def _collect(
    processes: Sequence[multiprocessing.process.BaseProcess],
    workdir: Path,
    timed_out: bool,
    timeout: float,
) -> list[Any]:
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    for rank, process in enumerate(processes):
        path = _result_path(workdir, rank)
        if path.exists():
            status, value = pickle.loads(path.read_bytes())
            if status == "ok":
                results[rank] = value
                failures.append(RankFailure(rank, "finished", ""))
            else:
                failures.append(RankFailure(rank, "raised", str(value)))
            continue
        stack = _stack_path(workdir, rank)
        detail = stack.read_text() if stack.exists() else ""
        if process.is_alive():
            failures.append(
                RankFailure(rank, "killed at timeout" if timed_out else "killed", detail)
            )
        else:
            failures.append(RankFailure(rank, f"exited with code {process.exitcode}", detail))
    if len(results) == len(processes):
        return [results[rank] for rank in range(len(processes))]
    if timed_out:
        summary = f"distributed run of {len(processes)} ranks did not finish within {timeout:g} s"
    else:
        broken = [failure.rank for failure in failures if failure.status != "finished"]
        summary = f"distributed run of {len(processes)} ranks failed on rank(s) {broken}"
    raise DistributedTestError(summary, failures, results)
