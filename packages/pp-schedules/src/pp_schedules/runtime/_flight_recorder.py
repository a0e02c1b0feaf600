"""The flight recorder: each rank's last plan steps, kept always, cheap enough to never switch off.

The executor records every lowered step it walks (compute step or exchange) in a ring buffer of
a fixed size: the call's iteration, the step's index in the rank's lowered plan, the step, when
it started and ended (``time.perf_counter``), and what it waits for while it waits (a receive a
compute step uses, or the sends of an earlier exchange). Recording stores references and two
clock readings; the plain-data form (`FlightRecorder.head`, `FlightRecorder.recent`) is built
only when asked, after a failure or on a signal.

The recorder also keeps the collectives the rank runs outside and inside its plan steps (the
data-parallel gradient sync, the loss averaging, the optimizer's reductions, the exit
decision...), when pp-state's `collective(...)` tells it (`FlightRecorder.collective_hook`,
for `pp_state.collectives.set_collective_hook`): each with its operation, its group's global
ranks, how many collectives this rank ran on that group before (so that two ranks in the same
one can be matched), the call it follows and the training iteration (`set_training_iteration`).

`head` is what the rank is doing: a collective it is in (begun and not ended), else the step
it is in (started and not ended) or last ended. A stopped pipeline's ranks publish their
heads so that one report says where every rank was (`StopReport`).

Pure Python, no torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from pp_schedules.planning import Message, Step

__all__ = [
    "DEFAULT_RECORDER_SIZE",
    "CollectiveRecord",
    "FlightRecorder",
    "NullFlightRecorder",
    "check_recorder_size",
    "transfer_record",
]

DEFAULT_RECORDER_SIZE = 256
"""Steps each rank keeps: several calls of a small plan, the tail of a large one."""

# A ring entry is a list (cheaper to build and update than an object):
# [iteration, step index, Step, start, end or None, what it waits for or None].
_END, _WAITING = 4, 5
_COLLECTIVES_KEPT = 64


def check_recorder_size(size: object) -> int:
    """`size` as a recorder size (a whole number of steps, 1 or more).

    Raises:
        ValueError: `size` is not a whole number of 1 or more.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"the flight recorder's size must be a whole number of steps, 1 or more, got {size!r}"
        )
    return size


def transfer_record(message: Message) -> dict[str, Any]:
    """One transfer as plain data: peer, direction, what moves and the tensor's key.

    ``key`` is the tensor's name on both sides (channel, microbatch, sender's chunk, receiver's
    chunk), so a receive can be matched with the send that feeds it.
    """
    action = message.action
    what = "activations" if message.channel == "forward" else "gradients"
    return {
        "peer": message.peer,
        "direction": "send" if message.is_send else "recv",
        "what": f"{what} of mb {action.microbatch} chunk {action.chunk}",
        "action": str(action),
        "key": list(message.key(0)),
    }


def _kind(step: Step) -> str:
    return step.compute.kind if step.compute is not None else "exchange"


class CollectiveRecord:
    """One collective of the rank: what, over whom, when, and where in the rank's steps."""

    __slots__ = (
        "call", "end", "failed", "group", "in_step", "iteration", "operation", "seq", "start",
    )  # fmt: skip

    def __init__(
        self, operation: str, group: tuple[int, ...], seq: int, call: int, iteration: int | None
    ) -> None:
        self.operation = operation
        self.group = group
        self.seq = seq
        self.call = call
        self.iteration = iteration
        self.start = time.perf_counter()
        self.end: float | None = None
        self.failed = False
        self.in_step: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain data, JSON-able.

        Keys: ``operation``, ``group``, ``seq``, ``call``, ``training_iteration``, ``in_step``
        (the plan step it runs inside, if any), ``start``, ``end`` and ``state``
        ("waiting", "ended" or "failed": it raised, a peer lost or not answering).
        """
        return {
            "operation": self.operation,
            "group": list(self.group),
            "seq": self.seq,
            "call": self.call,
            "training_iteration": self.iteration,
            "in_step": self.in_step,
            "start": self.start,
            "end": self.end,
            "state": "waiting" if self.end is None else "failed" if self.failed else "ended",
        }


class _RecorderHook:
    """What pp-state's `collective` tells: begin and end of each collective (see the module)."""

    __slots__ = ("recorder",)

    def __init__(self, recorder: FlightRecorder) -> None:
        self.recorder = recorder

    def begin(self, operation: str, group_ranks: tuple[int, ...], iteration: int | None) -> object:
        return self.recorder.begin_collective(operation, group_ranks, iteration)

    def end(self, token: object, failed: bool = False) -> None:
        if isinstance(token, CollectiveRecord):
            self.recorder.end_collective(token, failed=failed)


class FlightRecorder:
    """A ring buffer of one rank's last `size` plan steps.

    The walk calls `begin` and `end` around each step, `wait` / `waited` around each wait for a
    transfer; `start_call` once per call. Nothing else is computed while recording.

    Args:
        size: Steps kept (1 or more).

    Raises:
        ValueError: `size` is not a whole number of 1 or more.
    """

    def __init__(self, size: int = DEFAULT_RECORDER_SIZE) -> None:
        self.size = check_recorder_size(size)
        self.rank = 0
        self.iteration = 0
        """Calls started (the current call's number, from 1)."""
        self.plan: Sequence[Sequence[Step]] = ()
        """The current call's lowered plan, every rank's steps (what a stop report draws)."""
        self._ring: list[list[Any] | None] = [None] * self.size
        self._count = 0
        self._current: list[Any] | None = None
        self.training_iteration: int | None = None
        """The training iteration the trainer says the rank is in (`set_training_iteration`)."""
        self._collectives: list[CollectiveRecord | None] = [None] * _COLLECTIVES_KEPT
        self._collective_count = 0
        self._open: list[CollectiveRecord] = []
        self._seq: dict[tuple[int, ...], int] = {}
        self._collective_lock = threading.Lock()  # hooks may run on autograd's threads

    def set_training_iteration(self, iteration: int | None) -> None:
        """The training iteration the next calls and collectives belong to."""
        self.training_iteration = iteration

    def collective_hook(self) -> _RecorderHook:
        """A hook for `pp_state.collectives.set_collective_hook` that records into this."""
        return _RecorderHook(self)

    def begin_collective(
        self, operation: str, group: tuple[int, ...], iteration: int | None = None
    ) -> CollectiveRecord:
        """A collective over `group` (global ranks) begins; returns its record."""
        known = iteration if iteration is not None else self.training_iteration
        with self._collective_lock:
            seq = self._seq.get(group, 0)
            self._seq[group] = seq + 1
            record = CollectiveRecord(operation, group, seq, self.iteration, known)
            current = self._current
            if current is not None and current[_END] is None:
                record.in_step = current[1]
            self._collectives[self._collective_count % _COLLECTIVES_KEPT] = record
            self._collective_count += 1
            self._open.append(record)
        return record

    def end_collective(self, record: CollectiveRecord, *, failed: bool = False) -> None:
        """The collective of `record` is over: done, or `failed` (it raised)."""
        record.end = time.perf_counter()
        record.failed = failed
        with self._collective_lock:
            if record in self._open:
                self._open.remove(record)

    def collectives(self) -> list[dict[str, Any]]:
        """The collectives kept (the last few dozen), oldest first, as plain data."""
        count = min(self._collective_count, _COLLECTIVES_KEPT)
        first = self._collective_count - count
        kept = [self._collectives[(first + k) % _COLLECTIVES_KEPT] for k in range(count)]
        return [record.to_json() for record in kept if record is not None]

    def start_call(self, rank: int, plan: Sequence[Sequence[Step]]) -> None:
        """A call begins: count it, and keep the rank and the lowered plan for `head`."""
        self.iteration += 1
        self.rank = rank
        self.plan = plan

    def begin(self, index: int, step: Step) -> None:
        """Step `index` of the call's plan starts."""
        entry = [self.iteration, index, step, time.perf_counter(), None, None]
        self._ring[self._count % self.size] = entry
        self._count += 1
        self._current = entry

    def end(self) -> None:
        """The step begun last has ended."""
        if self._current is not None:
            self._current[_END] = time.perf_counter()

    def wait(self, what: tuple[str, Any]) -> None:
        """The rank waits: ``("recv", (channel, microbatch, chunk))`` or ``("send", index)``."""
        if self._current is not None:
            self._current[_WAITING] = what

    def waited(self) -> None:
        """The wait is over."""
        if self._current is not None:
            self._current[_WAITING] = None

    @property
    def recorded(self) -> int:
        """Steps recorded since the recorder was made (those beyond `size` are gone)."""
        return self._count

    def head(self) -> dict[str, Any] | None:
        """Where the rank is, as plain data (JSON-able); None before any step or collective.

        Keys: ``iteration`` (the call), ``step`` (index in the rank's lowered plan),
        ``action``, ``kind`` (F, B, I, W or exchange), ``microbatch``, ``chunk``,
        ``transfers`` (an exchange's, each with ``peer``, ``direction``, ``what``), ``start``,
        ``end`` (None while running), ``state`` ("running", "posting", "waiting" or "ended"),
        ``waiting_for`` (the transfers it waits for), ``training_iteration`` and
        ``collective``: the collective the rank is in (see `CollectiveRecord.to_json`), or
        the last one when it began after the step, else None.
        """
        if self._current is None and not self._collective_count:
            return None
        head = self._record(self._current, True) if self._current is not None else _no_step(self)
        head["training_iteration"] = self.training_iteration
        head["collective"] = self._latest_collective()
        return head

    def _latest_collective(self) -> dict[str, Any] | None:
        """The collective the rank is in, or the last one if it began after the last step."""
        with self._collective_lock:
            open_now = self._open[-1] if self._open else None
            count = self._collective_count
        if open_now is not None:
            return open_now.to_json()
        if not count:
            return None
        last = self._collectives[(count - 1) % _COLLECTIVES_KEPT]
        current = self._current
        if last is None or (current is not None and current[3] > last.start):
            return None
        return last.to_json()

    def recent(self) -> list[dict[str, Any]]:
        """The steps kept, oldest first, as `head` describes them (without their waits)."""
        count = min(self._count, self.size)
        entries = [self._ring[(self._count - count + k) % self.size] for k in range(count)]
        return [self._record(entry, False) for entry in entries if entry is not None]

    def _record(self, entry: list[Any], with_waits: bool) -> dict[str, Any]:
        iteration, index, step, start, end, waiting = entry
        compute = step.compute
        first = compute if compute is not None else step.exchange.messages[0].action
        messages = step.exchange.messages if step.exchange is not None else ()
        waits = self._waits(waiting, index) if with_waits and waiting is not None else []
        paired = self._paired(index)
        return {
            "iteration": iteration,
            "step": index,
            "action": str(step) if paired is None else f"{step}&{paired}",
            "kind": _kind(step) if paired is None else "F&B",
            "microbatch": first.microbatch,
            "chunk": first.chunk,
            "transfers": [transfer_record(m) for m in messages],
            "start": start,
            "end": end,
            "state": self._state(step, end, waits),
            "waiting_for": waits,
        }

    def _paired(self, index: int) -> Step | None:
        """The backward run with step `index` of this call as one F&B step, or None."""
        plan = self.plan[self.rank] if self.rank < len(self.plan) else ()
        following = index + 1
        return plan[following] if following < len(plan) and plan[following].overlap else None

    @staticmethod
    def _state(step: Step, end: float | None, waits: list[dict[str, Any]]) -> str:
        if waits:
            return "waiting"
        if end is not None:
            return "ended"
        return "running" if step.compute is not None else "posting"

    def _waits(self, waiting: tuple[str, Any], index: int) -> list[dict[str, Any]]:
        """The transfers a wait marker names, found in the call's plan."""
        kind, what = waiting
        plan = self.plan[self.rank] if self.rank < len(self.plan) else ()
        if kind == "send" and 0 <= what < len(plan) and plan[what].exchange is not None:
            messages = plan[what].exchange.messages
            return [transfer_record(m) for m in messages if m.is_send]
        if kind != "recv":
            return []
        channel, microbatch, chunk = what
        # The receive that feeds this step was posted by the latest exchange before it.
        for earlier in reversed(plan[: min(index, len(plan))]):
            for message in earlier.exchange.messages if earlier.exchange is not None else ():
                action = message.action
                if (
                    not message.is_send
                    and message.channel == channel
                    and (action.microbatch, action.chunk) == (microbatch, chunk)
                ):
                    return [transfer_record(message)]
        return []


def _no_step(recorder: FlightRecorder) -> dict[str, Any]:
    """A head before any plan step (the rank has run collectives only)."""
    return {
        "iteration": recorder.iteration, "step": None, "action": "", "kind": "none",
        "microbatch": None, "chunk": None, "transfers": [], "start": None, "end": None,
        "state": "ended", "waiting_for": [],
    }  # fmt: skip


class NullFlightRecorder(FlightRecorder):
    """A recorder that records nothing: the baseline a cost measurement compares with."""

    def begin(self, index: int, step: Step) -> None:
        """Records nothing."""

    def end(self) -> None:
        """Records nothing."""

    def wait(self, what: tuple[str, Any]) -> None:
        """Records nothing."""

    def waited(self) -> None:
        """Records nothing."""

    def begin_collective(
        self, operation: str, group: tuple[int, ...], iteration: int | None = None
    ) -> CollectiveRecord:
        """Records nothing (the record is returned, kept nowhere)."""
        return CollectiveRecord(operation, group, 0, self.iteration, iteration)

    def end_collective(self, record: CollectiveRecord, *, failed: bool = False) -> None:
        """Records nothing."""
