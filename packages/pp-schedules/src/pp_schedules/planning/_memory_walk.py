"""One rank's bytes over its lowered steps, held the way the executor holds them.

The simulator's memory follower (`pp_schedules.simulate(..., memory=...)`) walks each rank's
steps of a validated plan, exchanges included, and keeps what the executor keeps:

- **a forward** (``F``) holds its chunk's activations until the microbatch's last backward
  step on the chunk (``B``, or ``W`` after a split backward), and its output until the send
  that moves it completes (or, handed to a chunk of the same rank, until both chunks' last
  backward steps; not freed after its send, until its own);
- **a receive** holds its tensor from the exchange that posts it: an activation until its
  chunk's last backward step, a gradient until the backward that uses it ends (``W`` after
  an ``I``, which keeps it);
- **an exchange's handle** (pp-comm's, for the whole call) keeps every tensor the exchange
  sent or received until its sends have completed and all its receives have been used;
- **a backward** (``B`` or ``I``) makes its input's gradient, held until its send completes
  (or until the backward of the chunk on this rank that uses it); an ``I`` also keeps its
  deferred gradients until ``W``;
- **sends complete** where the plan shows they have arrived (`sends_delivered`), or at the
  end of the call, as the executor waits for them;
- **the transport's frames** (`TransferBuffers`): each receive holds a frame from its posting
  until it is used, then the frame is kept for reuse or freed; a small send is copied into a
  frame, reused once its send is complete. Frames kept for reuse outlive the call: the walk
  runs the step twice and reports the second, as a step after the first finds them.

Each compute step's ``during`` is the most held from the previous compute step's end (the
point where the executor takes its previous sample) to this one's end, its own transient
included; ``after`` is what is held right after it. The two halves of an F&B step (DualPipeV)
are walked forward first, then backward, and noted as the executor samples them: both once
the step is done, the first with the step's peak. Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pp_schedules.planning._actions import Action
from pp_schedules.planning._lowering import Exchange, Message, Step
from pp_schedules.planning._memory import MemoryModel, StageMemory, TransferBuffers
from pp_state.placement import Placement

__all__ = ["RankBytes", "walk_rank"]

_Key = tuple[str, int, int]  # (what, microbatch, chunk)


@dataclasses.dataclass(frozen=True)
class RankBytes:
    """One rank's bytes above its static bytes over one step (the second of two).

    Attributes:
        after: Held right after each compute step, in plan order (after both halves of an
            F&B step, for each of them).
        during: The most held from the end of the compute step before (or the start) to the
            end of each compute step (for an F&B step: its first half's covers the step,
            its second half's is what the first's `after` holds).
        closing: The most held after the last compute step (its trailing exchanges).
        start: Held when the step starts: transfer frames kept from the step before.
    """

    after: tuple[int, ...]
    during: tuple[int, ...]
    closing: int
    start: int


@dataclasses.dataclass(eq=False)
class _Handle:
    """One exchange's pp-comm handle: alive until its sends complete and receives are used."""

    sends_done: bool
    receives: int = 0
    keys: list[_Key] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class _Frame:
    size: int
    kept: bool = True
    completed: bool = False


class _Walk:
    """What one rank holds, object by object, as its steps run."""

    def __init__(
        self,
        model: MemoryModel,
        placement: Placement,
        rank: int,
        delivered: dict[int, list[int]],
    ) -> None:
        self.model, self.placement, self.rank = model, placement, rank
        self.delivered = delivered
        self.frames = model.transfers or TransferBuffers()
        self.level = 0
        self.spare = 0  # receive frames kept for reuse (counted in `level`)
        self.sent_frames: dict[int, list[_Frame]] = {}
        self.objects: dict[_Key, list[object]] = {}  # key -> [bytes, holders]
        self.pending: dict[int, list[tuple[_Key, _Frame | None]]] = {}
        self.receive_frames: set[_Key] = set()
        self.handles: dict[int, _Handle] = {}  # exchange index -> its call's handle
        self.handle_of: dict[_Key, int] = {}  # received tensor -> its exchange

    # ------------------------------------------------------------------ geometry
    def _stage(self, chunk: int) -> StageMemory:
        return self.model.stages[self.placement.stage(self.rank, chunk)]

    def _neighbour(self, chunk: int, step: int) -> tuple[int, int] | None:
        return self.placement.neighbour(self.rank, chunk, step)

    def _local(self, chunk: int, step: int) -> int | None:
        """The chunk of this rank `step` stages away, if that stage is here."""
        neighbour = self._neighbour(chunk, step)
        return neighbour[1] if neighbour is not None and neighbour[0] == self.rank else None

    # ------------------------------------------------------------------ objects
    def _hold(self, key: _Key, size: int, *holders: str) -> None:
        entry = self.objects.get(key)
        if entry is None:
            self.objects[key] = [size, set(holders)]
            self.level += size
        else:
            entry[1].update(holders)  # type: ignore[attr-defined]

    def _let_go(self, key: _Key, holder: str) -> None:
        entry = self.objects.get(key)
        if entry is None:
            return
        holders: set[str] = entry[1]  # type: ignore[assignment]
        holders.discard(holder)
        if not holders:
            del self.objects[key]
            self.level -= entry[0]  # type: ignore[operator]

    # ------------------------------------------------------------------ transfers
    def exchange(self, index: int, exchange: Exchange) -> None:
        # The call's handle keeps every tensor it sent or received until its sends have
        # completed and its receives have been used.
        handle = _Handle(sends_done=not any(m.is_send for m in exchange.messages))
        self.handles[index] = handle
        for message in exchange.messages:
            key = self._send(index, message) if message.is_send else self._receive(message)
            self._hold(key, 0, f"exchange {index}")
            handle.keys.append(key)
            if not message.is_send:
                handle.receives += 1
                self.handle_of[key] = index

    def _handle_done(self, index: int) -> None:
        handle = self.handles[index]
        if handle.sends_done and not handle.receives:
            for key in handle.keys:
                self._let_go(key, f"exchange {index}")
            del self.handles[index]

    def _send(self, index: int, message: Message) -> _Key:
        action = message.action
        if message.channel == "forward":
            key: _Key = ("out", action.microbatch, action.chunk)
            payload = self._stage(action.chunk).output_bytes
        else:
            key = ("grad_in", action.microbatch, action.chunk)
            payload = self._stage(action.chunk).input_grad_bytes
        self._hold(key, 0, "send")  # keeps the tensor until the send completes
        size = self.frames.send_frame_bytes(payload)
        frame = self._send_frame(size) if size else None
        self.pending.setdefault(index, []).append((key, frame))
        return key

    def _send_frame(self, size: int) -> _Frame:
        """pp-comm's rule: reuse the oldest kept frame of the size if its send is complete."""
        kept = self.sent_frames.setdefault(size, [])
        if kept and kept[0].completed:
            frame = kept.pop(0)
            frame.completed = False
        else:
            frame = _Frame(size)
            self.level += size
        frame.kept = len(kept) < self.frames.spare_frames
        if frame.kept:
            kept.append(frame)
        return frame

    def _receive(self, message: Message) -> _Key:
        action = message.action
        if message.channel == "forward":
            key: _Key = ("in", action.microbatch, action.chunk)
            stage = self.placement.stage(self.rank, action.chunk)
            size = self.model.stages[stage - 1].output_bytes
        else:
            key = ("grad_out", action.microbatch, action.chunk)
            size = self._stage(action.chunk).output_bytes
        self._hold(key, size, "use")
        if self.frames.receive_frame_bytes:
            if self.spare:
                self.spare -= 1
            else:
                self.level += self.frames.receive_frame_bytes
            self.receive_frames.add(key)
        return key

    def _used(self, key: _Key) -> None:
        """A receive is waited for: its frame is kept for reuse, or freed."""
        index = self.handle_of.pop(key, None)
        if index is not None:
            self.handles[index].receives -= 1
            self._handle_done(index)
        if key not in self.receive_frames:
            return
        self.receive_frames.discard(key)
        if self.spare < self.frames.spare_frames:
            self.spare += 1
        else:
            self.level -= self.frames.receive_frame_bytes

    def complete(self, index: int) -> None:
        """The sends of exchange `index` are done: their tensors and frames let go."""
        for key, frame in self.pending.pop(index, []):
            self._let_go(key, "send")
            if frame is not None:
                frame.completed = True
                if not frame.kept:
                    self.level -= frame.size
        if index in self.handles:
            self.handles[index].sends_done = True
            self._handle_done(index)

    def finish(self) -> None:
        """The end of the call: every send still in flight completes."""
        for index in list(self.pending):
            self.complete(index)

    # ------------------------------------------------------------------ compute
    def compute(self, action: Action) -> int:
        """Run one compute step; the most held during it."""
        return {
            "F": self._forward,
            "B": self._backward,
            "I": self._input_step,
            "W": self._weight_step,
        }[action.kind](action)

    def _forward(self, action: Action) -> int:
        mb, chunk = action.microbatch, action.chunk
        stage = self._stage(chunk)
        producer = self._local(chunk, -1)
        if producer is not None:  # the same storage, handed over: held for this chunk too
            self._hold(("out", mb, producer), 0, f"input {chunk}")
        else:
            self._used(("in", mb, chunk))
        during = self.level + stage.forward_peak_bytes
        self._hold(("act", mb, chunk), stage.activation_bytes, "release")
        next_stage = self._neighbour(chunk, +1)
        sent = next_stage is not None and next_stage[0] != self.rank
        freed_when_sent = sent and self.model.deallocates_outputs
        self._hold(("out", mb, chunk), stage.output_bytes, "send" if freed_when_sent else "release")
        return during

    def _gradient_used(self, action: Action) -> None:
        """Wait for the output gradient a backward uses (none on the last stage)."""
        if self._neighbour(action.chunk, +1) is not None and self._local(action.chunk, +1) is None:
            self._used(("grad_out", action.microbatch, action.chunk))

    def _make_input_grad(self, action: Action, stage: StageMemory) -> None:
        if self._neighbour(action.chunk, -1) is None:
            return
        holder = "use" if self._local(action.chunk, -1) is not None else "send"
        self._hold(("grad_in", action.microbatch, action.chunk), stage.input_grad_bytes, holder)

    def _backward(self, action: Action) -> int:
        stage = self._stage(action.chunk)
        self._gradient_used(action)
        during = self.level + stage.recompute_bytes + stage.backward_transient_bytes
        self._make_input_grad(action, stage)
        self._release(action)
        return during

    def _input_step(self, action: Action) -> int:
        stage = self._stage(action.chunk)
        self._gradient_used(action)
        during = self.level + stage.recompute_bytes + stage.input_transient_bytes
        self._hold(("deferred", action.microbatch, action.chunk), stage.deferred_bytes, "W")
        self._make_input_grad(action, stage)
        return during

    def _weight_step(self, action: Action) -> int:
        stage = self._stage(action.chunk)
        during = self.level + stage.recompute_bytes + stage.weight_transient_bytes
        self._let_go(("deferred", action.microbatch, action.chunk), "W")
        self._release(action)
        return during

    def _release(self, action: Action) -> None:
        """The microbatch's last backward step on the chunk lets go of what it held."""
        mb, chunk = action.microbatch, action.chunk
        self._let_go(("act", mb, chunk), "release")
        self._let_go(("out", mb, chunk), "release")
        self._let_go(("in", mb, chunk), "use")
        self._let_go(("grad_out", mb, chunk), "use")
        producer, consumer = self._local(chunk, -1), self._local(chunk, +1)
        if producer is not None:
            self._let_go(("out", mb, producer), f"input {chunk}")
        if consumer is not None:
            self._let_go(("grad_in", mb, consumer), "use")


def walk_rank(
    model: MemoryModel,
    placement: Placement,
    rank: int,
    steps: Sequence[Step],
    delivered: dict[int, list[int]],
) -> RankBytes:
    """The bytes `rank` holds above its static bytes over its steps, in a step after the first.

    Args:
        model: Each virtual stage's figures, the transport's frames and whether sent outputs
            are freed.
        placement: Which virtual stage each chunk of `rank` holds.
        rank: The pipeline rank.
        steps: Its lowered steps.
        delivered: After which step each exchange's sends are complete
            (`sends_delivered` for the rank).
    """
    walk = _Walk(model, placement, rank, delivered)
    for _ in range(2):  # the second step finds the frames the first one kept
        start = walk.level
        after: list[int] = []
        during: list[int] = []
        high = walk.level
        for index, step in enumerate(steps):
            if step.overlap:
                continue  # walked with the forward before it, as one F&B step
            if step.compute is None:
                assert step.exchange is not None
                walk.exchange(index, step.exchange)
                high = max(high, walk.level)
                for done in delivered.get(index, ()):
                    walk.complete(done)
                continue
            halves = 2 if index + 1 < len(steps) and steps[index + 1].overlap else 1
            high = _sampled(walk, steps[index : index + halves], index, high, (after, during))
        closing = high
        walk.finish()
    return RankBytes(tuple(after), tuple(during), closing, start)


def _sampled(
    walk: _Walk, steps: Sequence[Step], index: int, high: int, samples: tuple[list[int], list[int]]
) -> int:
    """Walk one compute step, or the two of an F&B step, and note them as the probe samples.

    The executor samples an F&B step once both halves are done, once per half: the first
    sample's peak covers both halves, the second's is the bytes held at the first (between
    them only the forward's sends complete, which frees). Returns the level at the last sample.
    """
    after, during = samples
    peak = high
    for step in steps:
        assert step.compute is not None
        peak = max(peak, walk.compute(step.compute))
    for offset in range(len(steps)):
        during.append(peak)
        after.append(walk.level)
        peak = high = walk.level
        for done in walk.delivered.get(index + offset, ()):
            walk.complete(done)
    return high
