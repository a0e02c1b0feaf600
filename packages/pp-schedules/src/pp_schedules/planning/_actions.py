"""The schedule IR: one ordered list of actions per pipeline rank, with a compact string form.

Pure Python: planning code imports no torch, so it is tested in milliseconds.

A compute action is ``F`` (forward) or ``B`` (backward) of one microbatch on one model chunk,
or, for zero-bubble schedules, a backward split in two: ``I`` computes the gradient with
respect to the stage's input (what the previous stage waits for) and ``W`` later the
gradients of the stage's parameters.
Lowering adds communication actions: ``SEND_F`` / ``RECV_F`` move the activations of a
(microbatch, chunk) to / from the next virtual stage, ``SEND_B`` / ``RECV_B`` its gradients to
/ from the previous one. Which virtual stage a chunk holds is the plan's placement
(`pp_state.Placement`).

String form: ``F3`` is the forward of microbatch 3 on chunk 0, ``B3.1`` the backward of
microbatch 3 on chunk 1, ``I3.1`` / ``W3.1`` its two halves, ``SEND_F3.1`` sends the
activations of that forward.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Literal, get_args

__all__ = [
    "BACKWARD",
    "CATEGORIES",
    "COMPUTE",
    "Action",
    "ActionKind",
    "format_plan",
    "parse_action",
    "parse_plan",
]

ActionKind = Literal["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
COMPUTE: frozenset[str] = frozenset({"F", "B", "I", "W"})
BACKWARD: frozenset[str] = frozenset({"B", "I"})
"""The kinds that take the gradient from the next stage and pass one to the previous."""
CATEGORIES: dict[str, str] = {
    "F": "forward",
    "B": "backward",
    "I": "backward input",
    "W": "backward weight",
}
"""The name of each compute kind in traces and timelines."""
_KINDS = get_args(ActionKind)
_PATTERN = re.compile(r"^(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:\.(\d+))?$")


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of one rank.

    Attributes:
        kind: "F", "B", "I" (input gradient) or "W" (weight gradient) for compute;
            "SEND_F", "RECV_F", "SEND_B", "RECV_B" for transfers.
        microbatch: The microbatch, counted from 0.
        chunk: The model chunk on this rank (0 unless interleaving).
    """

    kind: ActionKind
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        """Checks the fields, so a malformed plan fails where it is built."""
        if self.kind not in _KINDS:
            raise ValueError(f"action kind {self.kind!r} is not one of {', '.join(_KINDS)}")
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(
                f"microbatch and chunk must be 0 or more, got {self.microbatch}, {self.chunk}"
            )

    @property
    def is_compute(self) -> bool:
        """Whether this is a forward or (whole or half) backward step."""
        return self.kind in COMPUTE

    def __str__(self) -> str:
        """Compact form: ``F3``, ``B3.1``, ``SEND_F3.1``."""
        chunk = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}{chunk}"

    def __repr__(self) -> str:
        """The compact form, quoted."""
        return f"Action({str(self)!r})"


def parse_action(text: str) -> Action:
    """The action written as `text` (``F3``, ``B3.1``, ``RECV_F0``).

    Raises:
        ValueError: `text` is not an action.
    """
    match = _PATTERN.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not an action such as F3, B3.1, I3, W3 or SEND_F3.1")
    kind, microbatch, chunk = match.groups()
    return Action(kind, int(microbatch), int(chunk or 0))  # type: ignore[arg-type]


def format_plan(plan: Sequence[Iterable[Action]]) -> list[str]:
    """One line per rank: the rank's actions in their compact form, space-separated."""
    return [" ".join(str(action) for action in actions) for actions in plan]


def parse_plan(lines: Iterable[str]) -> list[list[Action]]:
    """The inverse of `format_plan`."""
    return [[parse_action(token) for token in line.split()] for line in lines]
