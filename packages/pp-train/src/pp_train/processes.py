"""The process group a run joins: torchrun's (restarts included) or a one-process group.

`process_group` yields this process's device inside a running group: the caller's, one
joined from torchrun's environment (NCCL when every local rank has a GPU, gloo otherwise,
with a restarted worker joining its agent's store under a prefix of its own:
`restarted_store`), or a one-process group through a file without torchrun.
`default_transport` says, before any group starts, whose matching rules the run's plans are
validated under. `print_once` and `progress_line` speak for the job on its rank 0.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from pp_train.arguments import PretrainConfig

__all__ = [
    "default_transport",
    "local_gpus",
    "print_once",
    "process_group",
    "progress_line",
    "restarted_store",
    "world_size",
]


def world_size() -> int:
    """The running group's size, else torchrun's ``WORLD_SIZE`` (1 without torchrun)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def default_transport() -> str:
    """The transport the run's plans are validated for: gloo or NCCL.

    The running group's backend, else NCCL when every local rank has a GPU (as
    `_process_group` decides), gloo otherwise.
    """
    if dist.is_initialized():
        return "nccl" if dist.get_backend() == "nccl" else "gloo"
    return "nccl" if local_gpus() else "gloo"


def local_gpus() -> bool:
    """Whether every process torchrun starts on this machine gets a GPU of its own."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_world


def print_once(text: str) -> None:
    """Prints `text` on the job's rank 0 only, before or after the process group starts.

    The group's rank once it runs, else torchrun's ``RANK`` (0 without torchrun).
    """
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(text, flush=True)


def progress_line(text: str) -> None:
    """Rank 0 says what it is doing while the ranks start (before any log line)."""
    print_once(f"pp-train: {text}")


def _warn_sequence_parallel_off(config: PretrainConfig) -> None:
    """Megatron turns ``--sequence-parallel`` off at tensor-parallel size 1; said once."""
    parallel = config.parallel
    if parallel.sequence_parallel and not parallel.sequence_parallel_in_use:
        progress_line(
            "warning: --sequence-parallel is turned off: it needs --tensor-model-parallel-size "
            f"2 or more, got {parallel.tensor_model_parallel_size}"
        )


@contextlib.contextmanager
def process_group(config: PretrainConfig) -> Iterator[torch.device]:
    """This process's device in a running process group: the caller's, or one started here."""
    _warn_sequence_parallel_off(config)
    progress_line(f"configuration checked; joining the process group of {world_size()} ...")
    if dist.is_initialized():
        progress_line(f"process group ready ({dist.get_backend()}); building the model ...")
        nccl = dist.get_backend() == "nccl"
        yield torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        return
    timeout = datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory() as scratch:
        # Without torchrun this is a one-process job: rendezvous through a file, no port.
        single: dict[str, Any] = (
            {} if "RANK" in os.environ
            else {"init_method": f"file://{scratch}/rendezvous", "rank": 0, "world_size": 1}
        )  # fmt: skip
        joining = single or restarted_store(os.environ, timeout)
        if local_gpus():
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", timeout=timeout, **joining)
            device = torch.device("cuda", local_rank)
        else:
            # Ranks on one machine share its cores; more threads per rank only contend.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
            dist.init_process_group("gloo", timeout=timeout, **joining)
            device = torch.device("cpu")
        progress_line(f"process group ready ({dist.get_backend()}); building the model ...")
        try:
            yield device
        finally:
            dist.destroy_process_group()


def restarted_store(environ: Mapping[str, str], timeout: datetime.timedelta) -> dict[str, Any]:
    """How a worker that torchrun restarted joins its group: the agent's store, prefixed anew.

    torchrun's agent keeps one store for all its restarts, and torch 2.13's ``env://`` joins
    it without a per-restart prefix: a restarted gloo group reads the dead workers' addresses
    and fails to connect ("Connection refused"), so ``--max-restarts`` could never resume.
    Joined under a prefix naming the restart count, each attempt has keys of its own.

    Args:
        environ: The environment torchrun set.
        timeout: The store's timeout (the process group's).

    Returns:
        ``init_process_group``'s ``store``, ``rank`` and ``world_size`` for a restarted worker
        of an agent that hosts the store; empty (``env://`` as usual) otherwise.
    """
    restart = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world_size = int(environ["WORLD_SIZE"])
    store = dist.TCPStore(
        environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), world_size, is_master=False,
        timeout=timeout,
    )  # fmt: skip
    prefixed = dist.PrefixStore(f"pp-train/restart-{restart}", store)
    return {"store": prefixed, "rank": int(environ["RANK"]), "world_size": world_size}
