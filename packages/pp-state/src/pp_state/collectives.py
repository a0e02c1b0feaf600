"""One named error for a collective whose peer died or stopped answering.

gloo reports a killed peer as a bare ``RuntimeError`` ("Connection closed by peer
[127.0.0.1]:51099") and a silent one as "Timed out waiting 5000ms for recv operation"; NCCL
as a ``DistBackendError``. Neither names the rank, the group or what the program was doing.
Wrap each collective in `collective(...)` and such a failure becomes one `CollectiveError`
naming the rank, the peer where it can be known, the operation, the group's ranks and the
iteration::

    with collective("gradient all-reduce over data parallel", group=dp_group):
        dist.all_reduce(grads, group=dp_group)

Errors that are not a lost peer (a wrong shape, a wrong dtype) pass through unchanged. An
outer ``collective(..., iteration=n)`` adds the iteration to an inner one's error that had
none. Entering and leaving costs a method call; nothing is checked unless an error comes.
With a collective hook set, each entry also looks up the group's ranks and hands the hook a
record (tensor-parallel collectives inside a forward included).

Three hooks, set by a trainer (pp-train and `pp_schedules.runtime.watch_pipeline` set them):

- `set_collective_hook(hook)`: ``hook.begin(operation, group_ranks, iteration)`` and
  ``hook.end(token, failed)`` around every `collective` (pp-schedules' flight recorder keeps them
  beside the plan steps, so a stop report knows which collective a rank was in);
- `set_peer_finder(finder)`: names the lost member of a group of more than two ranks, where
  the backend's error does not (``finder(other_ranks)`` returns the peer and the evidence, or
  None; `pp_state.liveness.lost_peer` is one);
- `set_address_book(book)`: maps the address a backend's error names ("Connection closed by
  peer [127.0.0.1]:51099") to the member of the group it belongs to, with what its liveness
  record says of it (``book(address, other_ranks)`` returns the candidates and the evidence;
  `pp_state.liveness.address_book` is one). A member found by its address is the peer; the
  peer finder is asked only when no single member holds the address.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

import torch
import torch.distributed as dist

__all__ = [
    "AddressBook",
    "CollectiveError",
    "CollectiveHook",
    "PeerFinder",
    "at_iteration",
    "collective",
    "collective_device",
    "collective_error",
    "is_lost_peer",
    "set_address_book",
    "set_collective_hook",
    "set_peer_finder",
]

# Texts of gloo's, NCCL's and the socket layer's errors for a peer that died, hung or left.
_LOST_PEER_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout",
    "communicator was aborted",
    "socket",
)
_ADDRESS = re.compile(r"\[[0-9a-fA-F.:]+\]:\d+")


class CollectiveHook(Protocol):
    """Told of every `collective` a rank enters and leaves (see `set_collective_hook`)."""

    def begin(self, operation: str, group_ranks: tuple[int, ...], iteration: int | None) -> object:
        """A collective over `group_ranks` (global ranks) starts; returns a token for `end`."""
        ...

    def end(self, token: object, failed: bool = False) -> None:
        """The collective `begin` returned `token` for is over: done, or `failed`."""
        ...


PeerFinder = Callable[[tuple[int, ...]], tuple[int, str] | None]
"""Names the lost member of some ranks: (global rank, evidence in words), or None."""
AddressBook = Callable[[str, tuple[int, ...]], tuple[tuple[int, ...], str | None]]
"""Maps a backend's peer address to the members of some ranks that hold it, and says what the
liveness record shows of a single one (None: alive, or nothing known)."""


class _Hooks:
    """The hooks this process set (module state a trainer sets once, as a logging handler)."""

    collective: CollectiveHook | None = None
    peer: PeerFinder | None = None
    addresses: AddressBook | None = None


_HOOKS = _Hooks()


def set_collective_hook(hook: CollectiveHook | None) -> CollectiveHook | None:
    """Tell `hook` of every `collective` of this process from now on (None: nobody).

    Returns:
        The hook set before, to put back.
    """
    previous, _HOOKS.collective = _HOOKS.collective, hook
    return previous


def set_peer_finder(finder: PeerFinder | None) -> PeerFinder | None:
    """Ask `finder` which member was lost when a collective's error does not say (None: nobody).

    Returns:
        The finder set before, to put back.
    """
    previous, _HOOKS.peer = _HOOKS.peer, finder
    return previous


def set_address_book(book: AddressBook | None) -> AddressBook | None:
    """Ask `book` which member a backend's peer address belongs to (None: nobody).

    Returns:
        The book set before, to put back.
    """
    previous, _HOOKS.addresses = _HOOKS.addresses, book
    return previous


class CollectiveError(RuntimeError):
    """A collective failed because a peer died, left or did not answer within the timeout.

    Attributes:
        rank: Global rank that raised.
        peer: Global rank of the peer that failed, when it can be known (a group of two), or None.
        peer_address: The peer's address as the backend reported it, or None.
        peer_evidence: What showed the peer lost, when the error itself did not name it
            ("gone: its process 4242 on this host has exited"), or None.
        operation: What the collective was for, such as "loss averaging".
        group_ranks: Global ranks of the group the collective ran over.
        iteration: The training iteration, when the caller knows it, or None.
        timed_out: True when the peer did not answer in time (rather than closing).
        peer_candidates: When the peer is unknown, the members whose published endpoints
            hold its address (two or more: the address cannot tell them apart); else ().
    """

    def __init__(
        self,
        *,
        rank: int,
        operation: str,
        group_ranks: tuple[int, ...],
        cause: str,
        peer: int | None = None,
        peer_address: str | None = None,
        iteration: int | None = None,
        timed_out: bool = False,
        peer_evidence: str | None = None,
        peer_candidates: tuple[int, ...] = (),
    ) -> None:
        """Builds the one-line message from the context."""
        self.peer_candidates = tuple(peer_candidates)
        self.rank = rank
        self.peer = peer
        self.peer_address = peer_address
        self.peer_evidence = peer_evidence
        self.operation = operation
        self.group_ranks = group_ranks
        self.iteration = iteration
        self.timed_out = timed_out
        self.cause = cause
        super().__init__(self._message())

    def _message(self) -> str:
        when = "" if self.iteration is None else f" at iteration {self.iteration}"
        who = "peer rank unknown" if self.peer is None else f"peer rank {self.peer}"
        if self.peer_evidence is not None:
            who += f" ({self.peer_evidence})"
        elif self.peer_address is not None and len(self.peer_candidates) > 1:
            *first, last = self.peer_candidates
            who += (
                f" (address {self.peer_address}: rank {', '.join(map(str, first))} or {last}; "
                "its port, read as printed or byte-swapped, is an endpoint of each)"
            )
        elif self.peer_address is not None:
            who += f" (address {self.peer_address})"
        what = "did not answer in time" if self.timed_out else "closed the connection or died"
        return (
            f"rank {self.rank}: {self.operation}{when} over ranks {list(self.group_ranks)} "
            f"failed: {who} {what}: {self.cause}"
        )

    def with_iteration(self, iteration: int) -> CollectiveError:
        """A copy of this error (same class) that names `iteration`."""
        return type(self)(
            rank=self.rank,
            operation=self.operation,
            group_ranks=self.group_ranks,
            cause=self.cause,
            peer=self.peer,
            peer_address=self.peer_address,
            iteration=iteration,
            timed_out=self.timed_out,
            peer_evidence=self.peer_evidence,
            peer_candidates=self.peer_candidates,
        )


def is_lost_peer(error: BaseException) -> bool:
    """Whether `error` is a backend's report of a dead, departed or silent peer."""
    if isinstance(error, CollectiveError):
        return False
    if isinstance(error, dist.DistError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    return any(marker in text for marker in _LOST_PEER_MARKERS)


def _group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    except (RuntimeError, ValueError):  # destroyed or not a member: say nothing wrong
        return ()


def collective_error(
    error: BaseException,
    operation: str,
    *,
    group: dist.ProcessGroup | None = None,
    iteration: int | None = None,
    error_class: type[CollectiveError] = CollectiveError,
) -> CollectiveError:
    """The `error_class` naming this rank, the group, the peer and `operation` for `error`.

    For callers that catch the backend's error themselves (a ``Work.wait()``); `collective`
    uses it too. The peer is the other member of a group of two, else the member whose
    endpoints hold the address the error names (`set_address_book`), else the one the peer
    finder (`set_peer_finder`) shows lost, else unknown; with what its liveness record says
    of it, when that is more than "alive".
    """
    rank = dist.get_rank() if dist.is_initialized() else -1
    ranks = _group_ranks(group)
    others = tuple(other for other in ranks if other != rank)
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    found = _ADDRESS.search(text)
    address = found.group(0) if found else None
    lowered = text.lower()
    held, said = _at_address(address, others)
    peer: int | None
    if len(others) == 1:
        peer, evidence = others[0], said if held == others else None
    elif len(held) == 1:
        peer, evidence = held[0], said
    else:
        peer, evidence = _found_peer(others)
    return error_class(
        rank=rank,
        operation=operation,
        group_ranks=ranks,
        cause=text,
        peer=peer,
        peer_address=address,
        iteration=iteration,
        timed_out="timed out" in lowered or "timeout" in lowered,
        peer_evidence=evidence,
        peer_candidates=held if peer is None and len(held) > 1 else (),
    )


def _at_address(address: str | None, others: tuple[int, ...]) -> tuple[tuple[int, ...], str | None]:
    """The members of `others` the address book says hold `address`, and its evidence."""
    book = _HOOKS.addresses
    if book is None or address is None or not others:
        return (), None
    try:
        return book(address, others)
    except Exception:  # a book that fails must not hide the collective's own error
        return (), None


def _found_peer(others: tuple[int, ...]) -> tuple[int | None, str | None]:
    """The lost member of `others` by the peer finder's evidence, or (None, None)."""
    finder = _HOOKS.peer
    if finder is None or not others:
        return None, None
    try:
        found = finder(others)
    except Exception:  # a finder that fails must not hide the collective's own error
        return None, None
    return (None, None) if found is None else found


class collective:  # noqa: N801 - used as a context manager, named like one
    """Context manager: a lost peer inside becomes a `CollectiveError`.

    Args:
        operation: What the collective is for, as a reader of the error needs it
            ("gradient all-reduce over data parallel", "checkpoint agreement").
        group: The group the collective runs over (None: the default group).
        iteration: The training iteration, when known.
        error_class: The class of the error raised (a `CollectiveError`).
    """

    __slots__ = ("error_class", "group", "iteration", "operation", "token")

    def __init__(
        self,
        operation: str,
        *,
        group: dist.ProcessGroup | None = None,
        iteration: int | None = None,
        error_class: type[CollectiveError] = CollectiveError,
    ) -> None:
        self.operation = operation
        self.group = group
        self.iteration = iteration
        self.error_class = error_class
        self.token: object = None

    def __enter__(self) -> None:
        hook = _HOOKS.collective
        if hook is not None:
            self.token = hook.begin(self.operation, _group_ranks(self.group), self.iteration)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        hook = _HOOKS.collective
        if hook is not None:
            hook.end(self.token, error is not None)
        if error is None:
            return
        if isinstance(error, CollectiveError):
            _name_iteration(error, self.iteration)
            return
        if is_lost_peer(error):
            raise collective_error(
                error, self.operation, group=self.group, iteration=self.iteration,
                error_class=self.error_class,
            ) from error  # fmt: skip


class at_iteration:  # noqa: N801 - used as a context manager, named like one
    """Context manager: a `CollectiveError` raised inside names `iteration` (others pass)."""

    __slots__ = ("iteration",)

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if isinstance(error, CollectiveError):
            _name_iteration(error, self.iteration)


def _name_iteration(error: CollectiveError, iteration: int | None) -> None:
    """Raises `error` again naming `iteration`, when it names none yet (else returns)."""
    if error.iteration is None and iteration is not None:
        raise error.with_iteration(iteration) from error.__cause__


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a small tensor of a collective over `group` lives.

    The current GPU under NCCL (which reduces device tensors only), else the CPU.

    Args:
        group: The process group; None for the default one.
    """
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
