"""NCCL's matching rules applied to a lowered plan: what pp-comm posts there, and whether it runs.

What pp-comm posts on CUDA tensors for one exchange (one ``P2PCommunicator.exchange`` call)
with ``batch_p2p_comm`` (its default):

- Process groups. Each *stream* (one sending rank, one receiving rank, one channel:
  activations or gradients) travels on a two-rank process group of its own
  (`pp_comm.topology.Topology`). So a link that carries activations both ways (interleaved
  with two ranks) or activations and gradients the same way (the V placement) keeps each
  stream on its own communicator.
- One ``batch_isend_irecv`` per group the call uses, holding all of that stream's messages of
  the call in order (``Transport._post_coalesced``); NCCL launches it as one group call, one
  work, complete once every operation in it is.
- With shape headers (``variable_seq_lengths`` or ``debug``): first one batch per group of
  fixed-size headers, one per message; then the sends' data; then a wait for the batches that
  hold a received header (the shapes are read on the host), and only then the receives' data
  (``ShapeHeaders.post``). Headers and data share their stream: a call's headers go before
  its data.
- Contract frames (``check_contracts``) are gloo's only; nothing else travels.
- The executor waits for a receive right before the compute step that uses it (on CUDA the
  compute is ordered after the batch, and every later post after the compute), so nothing a
  rank posts after that step can start before the receive is in.

The rules checked (`nccl_problem`):

- One communicator per process group, and on each rank one stream of work per communicator:
  a rank's batches on one group run one after another, in posting order.
- Between two ranks on one communicator, the n-th send from A to B meets B's n-th receive
  from A: tags are ignored. A header meeting data, or two different tensors meeting (another
  microbatch or chunk), is a mis-pairing.
- An operation completes only while the batch of its partner runs too (a rendezvous: the
  strictest reading, as for large messages); a batch completes when all its operations have.

``stream_groups=False`` models one group for every stream of the pipeline instead (what
Megatron's p2p posts): there two streams between the same two ranks pair with each other, and
a receive posted early holds up every later batch of the rank. Several built-in schedules
mis-pair or hang that way, which is why pp-comm gives each stream its own group.

Not modelled: ``batch_p2p_comm=False`` (individual posts in `pp_comm.ordering`'s parity order,
whose freedom from deadlock ``pp_comm.find_deadlock`` checks) and ``debug``'s expectations
(small messages from each receiver back to its sender, posted after the headers).

Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import TypeAlias

from pp_schedules.planning._lowering import Message, Step

__all__ = ["TRANSPORTS", "Problem", "check_transport", "nccl_problem"]

TRANSPORTS = ("gloo", "nccl")
"""The transports a plan is validated for: gloo (CPU tensors) and NCCL (CUDA tensors)."""

Problem: TypeAlias = tuple[str, dict[int, int]]
"""What is wrong, and the step of each rank to mark in the grid."""

_Queue = tuple[str, int, int]  # (process group, sender, receiver)


def check_transport(transport: str) -> str:
    """`transport`, checked to be one of `TRANSPORTS`.

    Raises:
        ValueError: Another transport; the message lists the valid ones.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; valid: {', '.join(TRANSPORTS)}")
    return transport


@dataclasses.dataclass(frozen=True)
class _Operation:
    """One send or receive of one batch: a message's header or its data."""

    rank: int
    step: int
    message: Message
    header: bool | None  # None: no headers travel
    batch: int

    def describe(self) -> str:
        """The action, and which half of it travels: "RECV_F2 (header)" or "SEND_B0.1"."""
        half = "" if self.header is None else " (header)" if self.header else " (data)"
        return f"{self.message.action}{half}"

    def matches(self, other: _Operation) -> bool:
        """Whether `other` moves what this operation expects (same half, same tensor)."""
        return (self.header, self.message.key(self.rank)) == (
            other.header,
            other.message.key(other.rank),
        )


@dataclasses.dataclass(frozen=True)
class _Wait:
    """A rank cannot go on until these batches have completed."""

    step: int
    batches: frozenset[int]


class _Posts:
    """Every batch pp-comm posts on NCCL for a lowered plan, in each rank's posting order."""

    def __init__(
        self,
        steps: Sequence[Sequence[Step]],
        consumer: Mapping[tuple[int, int], Sequence[tuple[int, int]]],
        headers: bool,
        stream_groups: bool = True,
    ) -> None:
        self.steps = steps
        self.stream_groups = stream_groups
        self.operations: list[_Operation] = []
        self.batches: list[tuple[int, int, str, list[int]]] = []  # rank, step, group, ops
        self.programs: list[list[int | _Wait]] = []
        self._data: dict[tuple[int, int, int], int] = {}  # (rank, step, message) -> batch
        for rank, rank_steps in enumerate(steps):
            program: list[int | _Wait] = []
            for index, step in enumerate(rank_steps):
                if step.exchange is not None:
                    program += self._exchange(rank, index, step.exchange.messages, headers)
                    continue
                used = consumer.get((rank, index), ())
                if used:
                    waits = frozenset(self._data[(rank, at, number)] for at, number in used)
                    program.append(_Wait(index, waits))
            self.programs.append(program)

    def _exchange(
        self, rank: int, index: int, messages: Sequence[Message], headers: bool
    ) -> list[int | _Wait]:
        """What one pp-comm call posts and waits for.

        Without headers: one batch per group. With them: header batches, the sends' data,
        a wait for the received headers, then the receives' data.
        """
        numbered = list(enumerate(messages))
        if not headers:
            return list(self._post(rank, index, numbered, None))
        program: list[int | _Wait] = list(self._post(rank, index, numbered, True))
        receiving = [b for b in program if isinstance(b, int) and not all(self._sends(b))]
        program += self._post(rank, index, [(n, m) for n, m in numbered if m.is_send], False)
        if receiving:
            program.append(_Wait(index, frozenset(receiving)))
        program += self._post(rank, index, [(n, m) for n, m in numbered if not m.is_send], False)
        return program

    def _sends(self, batch: int) -> list[bool]:
        return [self.operations[o].message.is_send for o in self.batches[batch][3]]

    def group(self, rank: int, message: Message) -> str:
        """The process group `message` of `rank` travels on."""
        src, dst = (rank, message.peer) if message.is_send else (message.peer, rank)
        if self.stream_groups:
            return f"{message.channel} {src}->{dst}"
        two_ranks = len(self.steps) == 2
        return "gradients" if two_ranks and message.channel == "backward" else "pipeline"

    def _post(
        self, rank: int, index: int, numbered: Sequence[tuple[int, Message]], header: bool | None
    ) -> list[int]:
        """One batch per process group the messages use (headers, data or both: None)."""
        by_group: dict[str, list[tuple[int, Message]]] = defaultdict(list)
        for number, message in numbered:
            by_group[self.group(rank, message)].append((number, message))
        made = []
        for group, members in by_group.items():
            batch = len(self.batches)
            ops = []
            for number, message in members:
                ops.append(len(self.operations))
                self.operations.append(_Operation(rank, index, message, header, batch))
                if not header:
                    self._data[(rank, index, number)] = batch
            self.batches.append((rank, index, group, ops))
            made.append(batch)
        return made

    def queue(self, operation: _Operation) -> _Queue:
        """Where NCCL pairs `operation`: its group, the sending and the receiving rank."""
        message = operation.message
        group = self.batches[operation.batch][2]
        if message.is_send:
            return (group, operation.rank, message.peer)
        return (group, message.peer, operation.rank)

    def partners(self) -> tuple[list[int], Problem | None]:
        """Each operation's partner under NCCL's order-only pairing, or the first mis-pairing."""
        sends: dict[_Queue, list[int]] = defaultdict(list)
        receives: dict[_Queue, list[int]] = defaultdict(list)
        for number, operation in enumerate(self.operations):
            side = sends if operation.message.is_send else receives
            side[self.queue(operation)].append(number)
        partner = [-1] * len(self.operations)
        for queue in sorted(set(sends) | set(receives)):
            sent, received = sends.get(queue, []), receives.get(queue, [])
            for k, (s, r) in enumerate(zip(sent, received, strict=False)):
                if not self.operations[s].matches(self.operations[r]):
                    return partner, self._mispaired(queue, k, s, r)
                partner[s], partner[r] = r, s
            if len(sent) != len(received):
                return partner, self._unpaired(queue, sent, received)
        return partner, None

    def _mispaired(self, queue: _Queue, k: int, sent: int, received: int) -> Problem:
        group, src, dst = queue
        send, receive = self.operations[sent], self.operations[received]
        return (
            f"the plan mis-pairs on NCCL: rank {src} step {send.step} posts "
            f"{send.describe()} and rank {dst} step {receive.step} posts "
            f"{receive.describe()}: both are transfer {k} from rank {src} to rank {dst} on "
            f"the {group} group, which NCCL pairs by posting order alone (tags ignored)",
            {src: send.step, dst: receive.step},
        )

    def _unpaired(self, queue: _Queue, sent: list[int], received: list[int]) -> Problem:
        group, src, dst = queue
        k = min(len(sent), len(received))
        extra = self.operations[(sent if len(sent) > k else received)[k]]
        return (
            f"the plan mis-pairs on NCCL: rank {src} sends {len(sent)} and rank {dst} "
            f"receives {len(received)} "
            f"messages on the {group} group: {extra.describe()} at rank {extra.rank} step "
            f"{extra.step} has no partner",
            {extra.rank: extra.step},
        )


class _Run:
    """The posted batches run under NCCL's rules: one stream per rank and group, rendezvous."""

    def __init__(self, posts: _Posts, partner: list[int]) -> None:
        self.posts = posts
        self.partner = partner
        self.cursor = [0] * len(posts.programs)
        self.streams: dict[tuple[int, str], deque[int]] = defaultdict(deque)
        self.done_batches: set[int] = set()
        self.done_operations: set[int] = set()

    def run(self) -> None:
        """Post and complete batches until nothing moves."""
        while True:
            for rank in range(len(self.cursor)):
                self._advance(rank)
            if not self._complete():
                return

    def _advance(self, rank: int) -> None:
        """Post this rank's batches up to the first wait that cannot be met yet."""
        program = self.posts.programs[rank]
        while self.cursor[rank] < len(program):
            item = program[self.cursor[rank]]
            if isinstance(item, _Wait):
                if not item.batches <= self.done_batches:
                    return
            else:
                batch_rank, _, group, _ = self.posts.batches[item]
                self.streams[(batch_rank, group)].append(item)
            self.cursor[rank] += 1

    def heads(self) -> set[int]:
        """The batch running on each stream."""
        return {stream[0] for stream in self.streams.values() if stream}

    def _complete(self) -> bool:
        """Complete what the running batches can; whether any batch completed."""
        running = self.heads()
        operations = self.posts.operations
        for batch in running:
            for number in self.posts.batches[batch][3]:
                if operations[self.partner[number]].batch in running:
                    self.done_operations.add(number)
        finished = [b for b in running if set(self.posts.batches[b][3]) <= self.done_operations]
        for batch in finished:
            rank, _, group, _ = self.posts.batches[batch]
            self.streams[(rank, group)].popleft()
            self.done_batches.add(batch)
        return bool(finished)

    def hang(self) -> Problem | None:
        """Why the plan stops (a running batch and the partner it waits for), if it does."""
        running = self.heads()
        for batch in sorted(running, key=lambda b: self.posts.batches[b][:2]):
            for number in self.posts.batches[batch][3]:
                partner = self.partner[number]
                if self.posts.operations[partner].batch not in running:
                    return self._explain(number, partner)
        return None

    def _explain(self, waiting: int, partner: int) -> Problem:
        posts = self.posts
        ours, theirs = posts.operations[waiting], posts.operations[partner]
        group, src, dst = posts.queue(ours)
        steps = posts.steps
        cursor = self.cursor[theirs.rank]
        if cursor < len(posts.programs[theirs.rank]) and theirs.batch not in self._posted():
            held = posts.programs[theirs.rank][cursor]
            assert isinstance(held, _Wait)
            why = (
                f"rank {theirs.rank} has not posted it: it waits at step {held.step} "
                f"({steps[theirs.rank][held.step]}) for a transfer that cannot complete"
            )
        else:
            head = posts.batches[self.streams[(theirs.rank, group)][0]][1]
            why = (
                f"rank {theirs.rank} runs its batches on that group in posting order, and "
                f"the one of step {head} ({steps[theirs.rank][head]}) cannot complete first"
            )
        return (
            f"the plan hangs on NCCL: rank {ours.rank} step {ours.step} "
            f"({steps[ours.rank][ours.step]}) posts {ours.describe()}, which NCCL pairs with "
            f"{theirs.describe()} of rank {theirs.rank} step {theirs.step} (ranks {src} -> "
            f"{dst} on the {group} group match in posting order), but {why}",
            {ours.rank: ours.step, theirs.rank: theirs.step},
        )

    def _posted(self) -> set[int]:
        return self.done_batches | {b for stream in self.streams.values() for b in stream}


def nccl_problem(
    steps: Sequence[Sequence[Step]],
    consumer: Mapping[tuple[int, int], Sequence[tuple[int, int]]],
    *,
    exchanges_shapes: bool = False,
    stream_groups: bool = True,
) -> Problem | None:
    """Why the lowered plan would mis-pair or hang on NCCL, or None if it runs there.

    Args:
        steps: The lowered plan (see `lower`).
        consumer: For each (rank, compute step), the (exchange step, message) of each receive
            it uses (`Links.consumer`).
        exchanges_shapes: Whether a shape header goes ahead of every message.
        stream_groups: Whether each stream has a process group of its own, as pp-comm gives
            it; False models one group for the whole pipeline.

    Returns:
        The first problem (its text, and the step of each rank to mark), or None.
    """
    posts = _Posts(steps, consumer, exchanges_shapes, stream_groups)
    partner, mispaired = posts.partners()
    if mispaired is not None:
        return mispaired
    run = _Run(posts, partner)
    run.run()
    return run.hang()
