"""Checking a plan before it runs: completeness, order, and freedom from deadlock.

The deadlock check runs the lowered plan the way the executor runs it: a rank executes its
steps in order; an exchange posts its sends and receives together and never blocks (sends
complete in the background); a compute step waits until each receive it uses has its partner
send posted; and transfers between two ranks on one channel match in the order they were
posted. It
also checks that each matched pair moves the same tensor (microbatch and chunks), so a plan
cannot silently feed a stage the wrong activations.

A plan that writes its own exchanges must write each transfer its compute steps need exactly
once, receives before and sends after their compute step. Where the placement puts two
consecutive stages on one rank, the tensor is handed over in memory: the producing step must
come first on that rank.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

from pp_schedules.planning._actions import Action
from pp_schedules.planning._lowering import (
    Message,
    Step,
    incoming_message,
    lower,
    outgoing_message,
    placement_of,
)
from pp_schedules.planning._nccl_rules import check_transport, nccl_problem
from pp_schedules.planning._planning_cost import collection_paused
from pp_state.placement import Placement

__all__ = ["Links", "PlanError", "PlanReport", "render_grid", "validate"]


class PlanError(ValueError):
    """A plan is incomplete, out of order or would deadlock; the message draws the grid."""

    __module__ = "pp_schedules"  # where users import it from, as tracebacks name it


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """What validation learnt about a valid plan.

    Attributes:
        steps: The lowered plan the executor runs (see `lower`).
        peak_in_flight: For each rank, the most (microbatch, chunk) forwards whose backward
            has not run yet: the activations it must hold at once.
        placement: Which virtual stage each (rank, chunk) holds.
        num_microbatches: Microbatches per step.
        forward_only: The plan has no backward steps.
    """

    steps: list[list[Step]]
    peak_in_flight: list[int]
    placement: Placement | None = None
    num_microbatches: int = 0
    forward_only: bool = False


def render_grid(steps: Sequence[Sequence[object]], marks: dict[int, int] | None = None) -> str:
    """Ranks as rows, steps as columns; ``marks`` maps a rank to the step to bracket."""
    marks = marks or {}
    cells = [[str(step) for step in row] for row in steps]
    width = max((len(c) for row in cells for c in row), default=1) + 2
    lines = []
    for rank, row in enumerate(cells):
        rendered = []
        for index, cell in enumerate(row):
            text = f"[{cell}]" if marks.get(rank) == index else cell
            rendered.append(text.ljust(width))
        lines.append(f"rank {rank}: " + "".join(rendered).rstrip())
    return "\n".join(lines)


def _check_complete(
    plan: Sequence[Sequence[Action]], num_microbatches: int, vp_size: int, forward_only: bool
) -> None:
    """Each (microbatch, chunk): F, then B or else I and later W (F only if forward-only)."""
    for rank, actions in enumerate(plan):
        seen: dict[tuple[str, int, int], int] = {}
        for index, action in enumerate(actions):
            problem = _misplaced(action, seen, num_microbatches, vp_size, forward_only)
            if problem:
                raise PlanError(
                    f"rank {rank} step {index}: {action} {problem}\n"
                    + render_grid(plan, {rank: index})
                )
            seen[(action.kind, action.microbatch, action.chunk)] = index
        missing = [
            f"{kind}{m}{f'.{c}' if c else ''}"
            for m in range(num_microbatches)
            for c in range(vp_size)
            for kind in _needed(seen, m, c, forward_only)
        ]
        if missing:
            raise PlanError(
                f"rank {rank} never runs {', '.join(missing[:8])}"
                f"{' ...' if len(missing) > 8 else ''}\n" + render_grid(plan)
            )


def _misplaced(
    action: Action,
    seen: dict[tuple[str, int, int], int],
    num_microbatches: int,
    vp_size: int,
    forward_only: bool,
) -> str | None:
    """Why `action` cannot come here, after the steps `seen`; None if it can."""
    if not action.is_compute:
        return "is not a compute action"
    m, c = action.microbatch, action.chunk
    if (action.kind, m, c) in seen:
        return "runs twice"
    if m >= num_microbatches or c >= vp_size or (forward_only and action.kind != "F"):
        return (
            f"is outside {num_microbatches} microbatches, "
            f"{vp_size} chunks{' (forward only)' if forward_only else ''}"
        )
    return _out_of_order(action, seen)


def _out_of_order(action: Action, seen: dict[tuple[str, int, int], int]) -> str | None:
    """Why a backward step cannot run yet (or at all) after `seen`; None if it can."""
    m, c = action.microbatch, action.chunk
    if action.kind in ("B", "I") and ("F", m, c) not in seen:
        return "runs before its forward"
    if action.kind == "W" and ("I", m, c) not in seen:
        return f"runs before I{m}{f'.{c}' if c else ''}, the input half of its backward"
    whole, half = ("B", m, c) in seen, ("I", m, c) in seen
    if (action.kind == "B" and half) or (action.kind == "I" and whole):
        return "splits a backward that also runs whole (use B, or I and W)"
    return None


def _needed(seen: dict[tuple[str, int, int], int], m: int, c: int, forward_only: bool) -> list[str]:
    """The kinds (microbatch m, chunk c) still needs on a rank that ran `seen`."""
    if forward_only:
        return [] if ("F", m, c) in seen else ["F"]
    kinds = ("F", "I", "W") if ("I", m, c) in seen or ("W", m, c) in seen else ("F", "B")
    return [kind for kind in kinds if (kind, m, c) not in seen]


def _peak_in_flight(actions: Sequence[Action]) -> int:
    """Most forwards held at once: from F until its B, or its W when the backward is split."""
    held = peak = 0
    for action in actions:
        held += 1 if action.kind == "F" else -1 if action.kind in ("B", "W") else 0
        peak = max(peak, held)
    return peak


_Key = tuple[str, int, int, int]
_Link = tuple[int, int, str]  # (sender, receiver, channel)


class Links:
    """Every transfer of a lowered plan, queued per link in posting order.

    Shared by the validator and the simulator inside the package; not part of its API.
    """

    def __init__(self, steps: Sequence[Sequence[Step]]) -> None:
        self.steps = steps
        self.sends: dict[_Link, list[tuple[_Key, int]]] = defaultdict(list)
        self.recvs: dict[_Link, list[tuple[_Key, int]]] = defaultdict(list)
        self.position: dict[tuple[int, int, int], int] = {}  # (rank, step, message) -> index
        for rank, rank_steps in enumerate(steps):
            for index, step in enumerate(rank_steps):
                for number, message in enumerate(step.exchange.messages if step.exchange else ()):
                    queue = (
                        self.sends[(rank, message.peer, message.link_channel)]
                        if message.is_send
                        else self.recvs[(message.peer, rank, message.link_channel)]
                    )
                    self.position[(rank, index, number)] = len(queue)
                    queue.append((message.key(rank), index))
        self.consumer = _consumers(steps)

    def check_pairs(self) -> None:
        """Every send has a receive, in the same order, moving the same tensor."""
        for link in sorted(set(self.sends) | set(self.recvs)):
            sent, received = self.sends.get(link, []), self.recvs.get(link, [])
            src, dst, channel = link
            if len(sent) != len(received):
                k = min(len(sent), len(received))
                rank, index = (src, sent[k][1]) if k < len(sent) else (dst, received[k][1])
                raise PlanError(
                    f"rank {src} sends {len(sent)} and rank {dst} receives {len(received)} "
                    f"tensors on the {channel} channel: transfer {k} has no partner\n"
                    + render_grid(self.steps, {rank: index})
                )
            for k, ((sent_key, sent_at), (received_key, received_at)) in enumerate(
                zip(sent, received, strict=True)
            ):
                if sent_key != received_key:
                    raise PlanError(
                        f"transfer {k} from rank {src} to rank {dst} on the {channel} channel "
                        f"would deliver {_describe(sent_key)} where {_describe(received_key)} "
                        "was expected\n" + render_grid(self.steps, {src: sent_at, dst: received_at})
                    )

    def blocking(self, rank: int, index: int, cursor: list[int]) -> int | None:
        """The exchange whose receive keeps `rank` from finishing step `index`, if any.

        Exchanges never block: they post their sends and receives and go on. A compute step
        waits for the receives it consumes, each until its partner send has been posted (the
        partner's rank has reached that step).
        """
        for at, number in self.consumer.get((rank, index), ()):
            message = self.steps[rank][at].exchange.messages[number]  # type: ignore[union-attr]
            k = self.position[(rank, at, number)]
            partner_index = self.sends[(message.peer, rank, message.link_channel)][k][1]
            if cursor[message.peer] < partner_index:
                return at
        return None


def _consumers(steps: Sequence[Sequence[Step]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """For each (rank, compute step), the (exchange step, message) of each receive it uses."""
    consumers: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, rank_steps in enumerate(steps):
        waiting: dict[tuple[str, int, int], tuple[int, int]] = {}
        for index, step in enumerate(rank_steps):
            if step.exchange is not None:
                for number, message in enumerate(step.exchange.messages):
                    if not message.is_send:
                        action = message.action
                        waiting[(message.channel, action.microbatch, action.chunk)] = (
                            index,
                            number,
                        )
                continue
            assert step.compute is not None
            if step.compute.kind == "W":
                continue  # a weight-gradient step receives nothing
            channel = "forward" if step.compute.kind == "F" else "backward"
            key = (channel, step.compute.microbatch, step.compute.chunk)
            if key in waiting:
                consumers[(rank, index)].append(waiting.pop(key))
    return dict(consumers)


def _run(steps: Sequence[Sequence[Step]], transport: str, exchanges_shapes: bool) -> None:
    """Execute the plan under the executor's rules; raise PlanError on deadlock or mismatch.

    gloo's rules first (tags keep the streams apart); on NCCL, then its own rules too (see
    NCCL's rules), which only refuse more.
    """
    links = Links(steps)
    links.check_pairs()
    _run_tagged(steps, links)
    if transport == "nccl":
        problem = nccl_problem(steps, links.consumer, exchanges_shapes=exchanges_shapes)
        if problem is not None:
            text, marks = problem
            raise PlanError(f"{text}\n" + render_grid(steps, marks))


def _run_tagged(steps: Sequence[Sequence[Step]], links: Links) -> None:
    """Exchanges never block, compute steps wait for their receives: raise on deadlock."""
    cursor = [0] * len(steps)
    progressed = True
    while progressed:
        progressed = False
        for rank, rank_steps in enumerate(steps):
            while (
                cursor[rank] < len(rank_steps)
                and links.blocking(rank, cursor[rank], cursor) is None
            ):
                cursor[rank] += 1
                progressed = True
    stuck = {}
    for rank, rank_steps in enumerate(steps):
        if cursor[rank] < len(rank_steps):
            at = links.blocking(rank, cursor[rank], cursor)
            stuck[rank] = cursor[rank] if at is None else at
    if stuck:
        waits = "; ".join(
            f"rank {rank} waits at step {index} ({steps[rank][index]})"
            for rank, index in stuck.items()
        )
        raise PlanError(f"the plan deadlocks: {waits}\n" + render_grid(steps, stuck))


def _describe(key: tuple[str, int, int, int]) -> str:
    channel, microbatch, sender_chunk, receiver_chunk = key
    what = "activations" if channel == "forward" else "gradients"
    return f"the {what} of microbatch {microbatch} (chunk {sender_chunk} -> chunk {receiver_chunk})"


def _positions(actions: Sequence[Action]) -> dict[Action, int]:
    return {action: index for index, action in enumerate(actions)}


def _check_local(plan: Sequence[Sequence[Action]], placement: Placement) -> None:
    """Hand-overs within a rank (the turn of a V): the producing step comes first."""
    for rank, actions in enumerate(plan):
        where = _positions(actions)
        for action, index in where.items():
            if action.kind == "W":
                continue  # nothing is handed over to a weight-gradient step
            step = -1 if action.kind == "F" else +1
            neighbour = placement.neighbour(rank, action.chunk, step)
            if neighbour is None or neighbour[0] != rank:
                continue
            # The step that hands the tensor over: the neighbour's F, or its B or I.
            kinds = ("F",) if action.kind == "F" else ("B", "I")
            producer = next(
                (
                    Action(kind, action.microbatch, neighbour[1])  # type: ignore[arg-type]
                    for kind in kinds
                    if Action(kind, action.microbatch, neighbour[1]) in where  # type: ignore[arg-type]
                ),
                Action(action.kind, action.microbatch, neighbour[1]),
            )
            if where.get(producer, len(actions)) > index:
                raise PlanError(
                    f"rank {rank} step {index}: {action} needs what {producer} hands over on "
                    f"the same rank (stages {placement.stage(rank, neighbour[1])} -> "
                    f"{placement.stage(rank, action.chunk)}), which runs later\n"
                    + render_grid(plan, {rank: index})
                )


def _expected(
    steps: Sequence[Step], rank: int, placement: Placement
) -> dict[Action, tuple[Message, int, bool]]:
    """Each transfer the rank's compute steps need: (message, compute index, before it)."""
    expected: dict[Action, tuple[Message, int, bool]] = {}
    for index, step in enumerate(steps):
        if step.compute is None:
            continue
        incoming = incoming_message(step.compute, rank, placement)
        outgoing = outgoing_message(step.compute, rank, placement)
        if incoming is not None:
            expected[incoming.action] = (incoming, index, True)
        if outgoing is not None:
            expected[outgoing.action] = (outgoing, index, False)
    return expected


def _check_written(steps: Sequence[Sequence[Step]], placement: Placement) -> None:
    """A plan's own exchanges hold each needed transfer once, on the right side of its step."""
    for rank, rank_steps in enumerate(steps):
        expected = _expected(rank_steps, rank, placement)
        for index, step in enumerate(rank_steps):
            for message in step.exchange.messages if step.exchange else ():
                need = expected.pop(message.action, None)
                if need is None:
                    raise PlanError(
                        f"rank {rank} step {index}: {message.action} is not needed here or "
                        "written twice\n" + render_grid(steps, {rank: index})
                    )
                _, at, before = need
                if (index > at) if before else (index < at):
                    where = "before" if before else "after"
                    raise PlanError(
                        f"rank {rank} step {index}: {message.action} must come {where} the "
                        f"compute step it serves (step {at})\n" + render_grid(steps, {rank: index})
                    )
        if expected:
            missing = ", ".join(str(action) for action in list(expected)[:8])
            raise PlanError(
                f"rank {rank} never runs {missing}: a plan that writes its transfers writes "
                "all of them\n" + render_grid(steps)
            )


@collection_paused
def validate(
    plan: Sequence[Sequence[Action]],
    *,
    num_microbatches: int | None = None,
    vp_size: int | None = None,
    forward_only: bool = False,
    placement: Placement | None = None,
    prefetch: int = 0,
    transport: str = "gloo",
    exchanges_shapes: bool = False,
) -> PlanReport:
    """Check a plan and lower it for execution.

    Checks that every rank forwards (and, unless `forward_only`, backwards) each
    (microbatch, chunk) exactly once, forward before backward; that hand-overs within a rank
    come in order; that written exchanges hold exactly the needed transfers; that every
    transfer has a partner moving the same tensor; and that the exchanges cannot deadlock.

    Args:
        plan: One list of compute actions per rank, or a `Plan` (which may carry its
            placement and its own exchanges).
        num_microbatches: Microbatches per step (by default, those the plan names).
        vp_size: Model chunks per rank (by default the placement's).
        forward_only: The plan has no backward steps.
        placement: Which stage each (rank, chunk) holds; the plan's, or looped.
        prefetch: Post each receive this many exchanges early (see `lower`); a plan that
            writes its exchanges is checked and kept as written.
        transport: Whose rules the exchanges run under: "gloo" (pairing by peer and tag)
            or "nccl" (by posting order, batches blocking; NCCL's rules).
        exchanges_shapes: Shape headers go ahead of messages (matters on NCCL only).

    Returns:
        The lowered steps and each rank's peak number of activations held.

    Raises:
        ValueError: An unknown transport; the message names the valid ones.
        PlanError: The first problem found, with the rank x step grid and the failing step in
            brackets.
    """
    check_transport(transport)
    where = placement_of(plan, vp_size, placement)
    if num_microbatches is None:
        num_microbatches = 1 + max((a.microbatch for rank in plan for a in rank), default=-1)
    _check_complete(plan, num_microbatches, where.vp_size, forward_only)
    _check_local(plan, where)
    try:
        steps = lower(plan, placement=where, prefetch=prefetch)
    except ValueError as error:
        raise PlanError(str(error)) from None
    if getattr(plan, "steps", None) is not None:
        _check_written(steps, where)
    _run(steps, transport, exchanges_shapes)
    return PlanReport(
        steps=steps,
        peak_in_flight=[_peak_in_flight(actions) for actions in plan],
        placement=where,
        num_microbatches=num_microbatches,
        forward_only=forward_only,
    )


def sends_delivered(steps: Sequence[Sequence[Step]]) -> list[dict[int, list[int]]]:
    """For each rank, the exchanges whose sends are known to have arrived after each step.

    A send to rank P has arrived once P finished the step that receives it; P finished that
    step before posting any later step. So when this rank receives from P a tensor that P
    posted at a later step, every such send is done. The executor completes (and frees) a
    send's buffers there instead of at the end of the call, since gloo reports a send complete
    only once waited for.

    Returns:
        ``result[rank][i]``: the exchange steps of `rank` whose every send is known to have
        arrived once step `i`'s receives are in; exchanges never listed complete at the end.
    """
    links = Links(steps)
    result: list[dict[int, list[int]]] = []
    for rank, rank_steps in enumerate(steps):
        # For each peer: (this rank's step, the peer's step at which it posted what arrived).
        # A receive is waited for by the compute step that uses it.
        arrivals: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for index in range(len(rank_steps)):
            for at, number in links.consumer.get((rank, index), ()):
                message = rank_steps[at].exchange.messages[number]  # type: ignore[union-attr]
                k = links.position[(rank, at, number)]
                sent_at = links.sends[(message.peer, rank, message.link_channel)][k][1]
                arrivals[message.peer].append((index, sent_at))
        done: dict[int, list[int]] = defaultdict(list)
        for index, step in enumerate(rank_steps):
            known = [
                _known_at(links, (rank, index, number), message, arrivals[message.peer])
                for number, message in enumerate(step.exchange.messages if step.exchange else ())
                if message.is_send
            ]
            if known and all(at is not None for at in known):
                done[max(at for at in known if at is not None)].append(index)
        result.append(dict(done))
    return result


def _known_at(
    links: Links,
    where: tuple[int, int, int],
    message: Message,
    arrivals: Sequence[tuple[int, int]],
) -> int | None:
    """The first step after which the send at `where` (rank, step, message) is known done."""
    rank, index, _ = where
    k = links.position[where]
    received_at = links.recvs[(rank, message.peer, message.link_channel)][k][1]
    for step, sent_at in arrivals:
        if step >= index and sent_at > received_at:
            return step
    return None
