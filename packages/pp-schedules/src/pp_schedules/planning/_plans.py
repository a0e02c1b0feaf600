"""A plan as data: each rank's actions, the placement they run on, and optionally its exchanges.

`plan(...)` returns a `Plan`; a user writes one as text (`parse_schedule`) or builds it from
action lists (`Plan.of`). The text form is one line per rank::

    # 1F1B on two ranks, two microbatches
    placement: looped
    rank 0: F0 F1 B0 B1
    rank 1: F0 B0 F1 B1

A line's tokens are compute actions (``F3``, ``B3.1``: microbatch 3, chunk 1) and, when the
plan writes its own transfers, exchanges: ``SEND_F0+RECV_B0`` is one exchange (posted as one
pp-comm call), ``SEND_F0 RECV_B0`` two. A plan that writes transfers must write all of them;
one that writes none is lowered automatically. ``F3&B1.1`` is an F&B step (DualPipeV): the
forward of microbatch 3 on chunk 0 and the backward of microbatch 1 on chunk 1, run together.
torch.distributed.pipelining's action strings
(``0F1``: stage 0, forward, microbatch 1; ``1RECV_B0``) are read too: their stage gives the
chunk, and without a ``placement:`` line the stages each rank uses give the placement.

Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import overload

from pp_schedules.planning._actions import Action, parse_action
from pp_schedules.planning._lowering import Exchange, Step, message_for
from pp_state.placement import Placement

__all__ = ["Plan", "PlanLike", "as_plan", "format_schedule", "parse_schedule"]

_TORCH = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_CHUNK = re.compile(r"^[A-Z_]+\d+(?:\.(\d+))?$")
_RANK = re.compile(r"^\s*rank\s+(\d+)\s*:(.*)$")


@dataclasses.dataclass(frozen=True)
class Plan(Sequence[tuple[Action, ...]]):
    """Each rank's compute actions in order, the placement, and the exchanges if written.

    A `Plan` is a sequence of per-rank action tuples, so it reads like the lists the
    generators returned before (``plan[rank]``, ``format_plan(plan)``).

    Attributes:
        actions: ``actions[rank]``: the rank's compute actions in execution order.
        placement: Which virtual stage each (rank, chunk) holds.
        steps: The lowered steps as written (computes and exchanges), or None to lower
            automatically.
        overlapped: For each rank, the indices ``i`` whose actions ``i`` (a forward) and
            ``i + 1`` (a backward on another chunk) run as one F&B step (DualPipeV); None
            when the plan has none.
    """

    actions: tuple[tuple[Action, ...], ...]
    placement: Placement
    steps: tuple[tuple[Step, ...], ...] | None = None
    overlapped: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        """Checks that the placement covers the plan's ranks, and the F&B steps.

        Raises:
            ValueError: The placement has a different number of ranks, or an F&B step is
                not a forward followed by a backward on another chunk.
        """
        if self.placement.pp_size != len(self.actions):
            raise ValueError(
                f"the plan has {len(self.actions)} ranks but its placement covers "
                f"{self.placement.pp_size}"
            )
        if self.overlapped is not None:
            _check_overlapped(self.actions, self.overlapped)

    @classmethod
    def of(
        cls,
        actions: Sequence[Sequence[Action]],
        placement: Placement | None = None,
        overlapped: Sequence[Sequence[int]] | None = None,
    ) -> Plan:
        """A plan from compute action lists (looped placement over the chunks used, by default).

        `overlapped` marks F&B steps: for each rank, the indices of their forwards.
        """
        if placement is None:
            vp = 1 + max((a.chunk for rank in actions for a in rank), default=0)
            placement = Placement.looped(max(len(actions), 1), vp)
        pairs = None
        if overlapped is not None and any(overlapped):
            pairs = tuple(tuple(sorted(rank)) for rank in overlapped)
        return cls(tuple(tuple(rank) for rank in actions), placement, overlapped=pairs)

    @property
    def has_overlap(self) -> bool:
        """Whether the plan has F&B steps (a forward and a backward run together)."""
        return self.overlapped is not None and any(self.overlapped)

    @property
    def pp_size(self) -> int:
        """Pipeline ranks."""
        return len(self.actions)

    @property
    def vp_size(self) -> int:
        """Model chunks per rank."""
        return self.placement.vp_size

    @property
    def num_microbatches(self) -> int:
        """One more than the highest microbatch any action names."""
        return 1 + max((a.microbatch for rank in self.actions for a in rank), default=-1)

    @property
    def forward_only(self) -> bool:
        """Whether the plan has no backward step."""
        return all(a.kind == "F" for rank in self.actions for a in rank)

    def without_backward(self) -> Plan:
        """The same plan with every backward step and gradient transfer left out (evaluation)."""
        actions = tuple(tuple(a for a in rank if a.kind == "F") for rank in self.actions)
        steps = None  # and no F&B step: nothing is left to overlap
        if self.steps is not None:
            steps = tuple(_forward_steps(rank) for rank in self.steps)
        return Plan(actions, self.placement, steps)

    @overload
    def __getitem__(self, index: int) -> tuple[Action, ...]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[Action, ...]]: ...
    def __getitem__(self, index: int | slice) -> tuple[Action, ...] | Sequence[tuple[Action, ...]]:
        """The actions of a rank (or of a slice of ranks)."""
        return self.actions[index]

    def __len__(self) -> int:
        """The number of ranks."""
        return len(self.actions)

    def __iter__(self) -> Iterator[tuple[Action, ...]]:
        """Each rank's actions in rank order."""
        return iter(self.actions)


def _check_overlapped(
    actions: Sequence[Sequence[Action]], overlapped: Sequence[Sequence[int]]
) -> None:
    """Each F&B step is a forward and then a backward (B or I) of another chunk, apart.

    Raises:
        ValueError: Naming the rank, the step and what it pairs.
    """
    if len(overlapped) != len(actions):
        raise ValueError(
            f"the plan has {len(actions)} ranks but marks F&B steps for {len(overlapped)}"
        )
    for rank, (row, pairs) in enumerate(zip(actions, overlapped, strict=True)):
        previous = -2
        for index in pairs:
            if not 0 <= index < len(row) - 1 or index <= previous + 1:
                raise ValueError(
                    f"rank {rank}: F&B step at {index} does not fit its {len(row)} actions "
                    "(each pairs an action with the next, and pairs do not share an action)"
                )
            first, second = row[index], row[index + 1]
            if first.kind != "F" or second.kind not in ("B", "I") or first.chunk == second.chunk:
                raise ValueError(
                    f"rank {rank}: {first}&{second} is not an F&B step: it pairs a forward "
                    "with a backward (B or I) of another chunk, forward first"
                )
            previous = index


def _forward_steps(steps: Sequence[Step]) -> tuple[Step, ...]:
    kept: list[Step] = []
    for step in steps:
        if step.compute is not None:
            if step.compute.kind == "F":
                kept.append(step)
            continue
        assert step.exchange is not None
        messages = tuple(m for m in step.exchange.messages if m.channel == "forward")
        if messages:
            kept.append(Step(exchange=Exchange(messages)))
    return tuple(kept)


PlanLike = Plan | str | Sequence[Sequence[Action]]
"""A plan, its text form (see `parse_schedule`), or compute action lists."""


def as_plan(value: PlanLike, placement: Placement | None = None) -> Plan:
    """A `Plan` from a plan, its text, or compute action lists.

    Raises:
        ValueError: The text does not parse, or a placement contradicts the plan's.
    """
    if isinstance(value, Plan):
        if placement is not None and placement != value.placement:
            raise ValueError(f"the plan runs on placement {value.placement}, not {placement}")
        return value
    if isinstance(value, str):
        return parse_schedule(value, placement=placement)
    return Plan.of(value, placement)


# --------------------------------------------------------------------------------- reading
@dataclasses.dataclass
class _Line:
    number: int
    rank: int
    tokens: list[str]


def _split_lines(text: str) -> tuple[str | None, list[_Line]]:
    placement_text: str | None = None
    lines: list[_Line] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.lower().startswith("placement:"):
            placement_text = line.split(":", 1)[1].strip()
            continue
        match = _RANK.match(line)
        rank = int(match.group(1)) if match else len(lines)
        lines.append(_Line(number, rank, (match.group(2) if match else line).split()))
    ranks = sorted(line.rank for line in lines)
    if ranks != list(range(len(lines))):
        raise ValueError(
            f"the plan's lines name ranks {ranks}; give one line for each rank 0 .. "
            f"{len(lines) - 1}"
        )
    return placement_text, sorted(lines, key=lambda line: line.rank)


def _torch_stages(lines: Sequence[_Line]) -> list[list[int]] | None:
    """Each rank's stages, if the plan is written in torch's form (None if in ours)."""
    stages: list[list[int]] = []
    torch_form = False
    for line in lines:
        used: set[int] = set()
        for token in line.tokens:
            for part in token.split("+"):
                match = _TORCH.match(part)
                if match:
                    torch_form = True
                    used.add(int(match.group(1)))
        stages.append(sorted(used))
    return stages if torch_form else None


def _parse_token(part: str, line: _Line, placement: Placement) -> Action:
    match = _TORCH.match(part)
    if match is None:
        try:
            return parse_action(part)
        except ValueError:
            raise ValueError(
                f"line {line.number} (rank {line.rank}): {part!r} is not an action such as F3, "
                "B3.1, SEND_F3.1 or (torch's form) 0F3, 1RECV_B0"
            ) from None
    stage, kind, microbatch = int(match.group(1)), match.group(2), int(match.group(3))
    try:
        chunk = placement.chunk_of(line.rank, stage)
    except ValueError as error:
        raise ValueError(f"line {line.number} (rank {line.rank}): {part!r}: {error}") from None
    return Action(kind, microbatch, chunk)  # type: ignore[arg-type]


def _placement_for(
    placement_text: str | None,
    lines: Sequence[_Line],
    given: Placement | None,
) -> Placement | None:
    """The placement named in the text, given by the caller, or implied by torch's stages."""
    if placement_text is not None:
        vp = given.vp_size if given else None
        torch_stages = _torch_stages(lines)
        if vp is None and torch_stages is not None:
            vp = max(len(s) for s in torch_stages)
        if vp is None and placement_text not in ("looped", "v"):
            vp = len(placement_text.split("|")[0].split())
        parsed = Placement.parse(placement_text, len(lines), vp or _our_vp(lines))
        if given is not None and given != parsed:
            raise ValueError(f"the plan names placement {parsed}, but {given} was given")
        return parsed
    if given is not None:
        return given
    torch_stages = _torch_stages(lines)
    if torch_stages is None:
        return None
    try:
        return Placement.from_table(torch_stages)
    except ValueError as error:
        raise ValueError(
            f"the stages each rank uses do not form a placement ({error}); add a 'placement:' line"
        ) from None


def _our_vp(lines: Sequence[_Line]) -> int:
    """Chunks per rank implied by our form's tokens (bad tokens are reported later)."""
    chunks = [
        int(match.group(1) or 0)
        for line in lines
        for token in line.tokens
        for part in token.split("+")
        if (match := _CHUNK.match(part))
    ]
    return 1 + max(chunks, default=0)


def parse_schedule(text: str, *, placement: Placement | None = None) -> Plan:
    """Read a plan from its text form (see the module docstring).

    Args:
        text: One line per rank, optionally ``rank N:`` prefixed, ``#`` comments, and a
            ``placement: looped | v | 0 3 | 1 2`` line.
        placement: The placement, when the text names none (looped by default).

    Raises:
        ValueError: A token that is not an action (the message names the line and token),
            lines that skip a rank, or a placement that contradicts the text.
    """
    placement_text, lines = _split_lines(text)
    if not lines:
        raise ValueError("the plan has no rank lines")
    where = _placement_for(placement_text, lines, placement) or Placement.looped(
        len(lines), _our_vp(lines)
    )
    steps: list[list[Step]] = []
    computes: list[list[Action]] = []
    overlapped: list[list[int]] = []
    written = False
    for line in lines:
        rank_steps: list[Step] = []
        rank_computes: list[Action] = []
        rank_pairs: list[int] = []
        for token in line.tokens:
            if "&" in token:
                pair = _parse_pair(token, line, where)
                rank_pairs.append(len(rank_computes))
                rank_steps += [Step(compute=pair[0]), Step(compute=pair[1], overlap=True)]
                rank_computes += pair
                continue
            actions = [_parse_token(part, line, where) for part in token.split("+")]
            if len(actions) == 1 and actions[0].is_compute:
                rank_steps.append(Step(compute=actions[0]))
                rank_computes.append(actions[0])
                continue
            if any(a.is_compute for a in actions):
                raise ValueError(
                    f"line {line.number} (rank {line.rank}): {token!r} joins a compute step to "
                    "an exchange; '+' joins transfers only"
                )
            written = True
            rank_steps.append(Step(exchange=_exchange(actions, line, where)))
        steps.append(rank_steps)
        computes.append(rank_computes)
        overlapped.append(rank_pairs)
    try:
        plan = Plan.of(computes, where, overlapped)
    except ValueError as error:
        raise ValueError(f"the plan's F&B steps: {error}") from None
    if written:
        plan = dataclasses.replace(plan, steps=tuple(tuple(s) for s in steps))
    return plan


def _parse_pair(token: str, line: _Line, placement: Placement) -> list[Action]:
    """An F&B step written ``F3&B1.1``: a forward and a backward run together."""
    parts = token.split("&")
    actions = [_parse_token(part, line, placement) for part in parts]
    if len(actions) != 2 or not all(a.is_compute for a in actions):
        raise ValueError(
            f"line {line.number} (rank {line.rank}): {token!r}: '&' joins two compute steps "
            "into an F&B step, such as F3&B1.1"
        )
    return actions


def _exchange(actions: Sequence[Action], line: _Line, placement: Placement) -> Exchange:
    try:
        return Exchange(tuple(message_for(a, line.rank, placement) for a in actions))
    except ValueError as error:
        raise ValueError(f"line {line.number}: {error}") from None


def format_schedule(plan: Plan) -> str:
    """The text form of `plan` (`parse_schedule` reads it back)."""
    lines = [f"placement: {plan.placement}"]
    for rank in range(plan.pp_size):
        tokens: list[str] = []
        if plan.steps is not None:
            for step in plan.steps[rank]:
                if step.overlap:
                    tokens[-1] += f"&{step}"
                else:
                    tokens.append(str(step))
        else:
            pairs = frozenset(plan.overlapped[rank]) if plan.overlapped is not None else ()
            for index, action in enumerate(plan.actions[rank]):
                if index - 1 in pairs:
                    tokens[-1] += f"&{action}"
                else:
                    tokens.append(str(action))
        lines.append(f"rank {rank}: " + " ".join(tokens))
    return "\n".join(lines) + "\n"
