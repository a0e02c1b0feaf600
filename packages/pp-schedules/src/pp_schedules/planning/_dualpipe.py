"""DualPipeV: DeepSeek's V-shaped half of DualPipe, with forward and backward overlapped.

D ranks hold 2D stages on the V placement (rank r holds stages r and 2D-1-r, as ZB-V) and
run at least 2D microbatches. After a warm-up, each step of the main phase pairs the forward
of one microbatch on one chunk with the full backward of another on the other chunk (an
"F&B" step, written ``F3&B1.1``), so that one's communication (the p2p, an expert
all-to-all) can hide behind the other's compute; weight gradients are deferred as in zero
bubble (``I`` now, ``W`` later) in the warm-up and the cool-down. DeepSeek give its bubble as
(D-1)(F&B + B - 3W) on D ranks, against (2D-1)(F + B - 2W) for ZB1P on 2D ranks, holding
2D+1 chunks' activations at most.

The phases on rank r of D (m microbatches), after DeepSeek's dualpipev.py and torch's
``ScheduleDualPipeV`` (the same order, action for action; the tests compare):

1. ``2(D-r-1)`` forwards on chunk 0;
2. ``r+1`` pairs of forwards, chunk 0 then chunk 1;
3. ``D-r-1`` times: the input half ``I`` on chunk 1, a deferred ``W``, a forward on chunk 1;
4. the main phase, ``m-2D+r+1`` times: F on chunk 0 & B on chunk 1, then F on chunk 1 & B on
   chunk 0 (the last rank's first step runs its F and B apart, one bubble less);
5. ``D-r-1`` times: B on chunk 1, then F on chunk 1 & B on chunk 0;
6. ``r+1`` times: backwards on chunk 1 then chunk 0, switching to split backwards half way;
7. ``D-r-1`` times: a deferred W, then a backward on chunk 0;
8. the deferred W left.

Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses

from pp_schedules.planning._actions import Action
from pp_state.numbers import check_int

__all__ = ["PairedActions", "dualpipev"]


@dataclasses.dataclass(frozen=True)
class PairedActions:
    """A generator's actions with the F&B steps marked.

    Attributes:
        actions: Each rank's compute actions in order.
        overlapped: Each rank's indices ``i`` whose action ``i`` (an F) and ``i + 1`` (a B)
            run as one F&B step.
    """

    actions: list[list[Action]]
    overlapped: list[list[int]]


class _Rank:
    """One rank's actions as DeepSeek's phases add them, with its microbatch counters."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.pairs: list[int] = []
        self.next: dict[tuple[str, int], int] = {}  # (F | B, chunk) -> next microbatch
        self.deferred: list[Action] = []  # W steps owed, oldest first

    def _take(self, kind: str, chunk: int) -> int:
        key = (kind, chunk)
        microbatch = self.next.get(key, 0)
        self.next[key] = microbatch + 1
        return microbatch

    def forward(self, chunk: int) -> None:
        self.actions.append(Action("F", self._take("F", chunk), chunk))

    def backward(self, chunk: int, *, split: bool = False) -> None:
        """A full backward, or with `split` its input half now and its W owed."""
        microbatch = self._take("B", chunk)
        if split:
            self.actions.append(Action("I", microbatch, chunk))
            self.deferred.append(Action("W", microbatch, chunk))
        else:
            self.actions.append(Action("B", microbatch, chunk))

    def weight(self) -> None:
        """The oldest W owed, if any."""
        if self.deferred:
            self.actions.append(self.deferred.pop(0))

    def overlapped(self, forward_chunk: int) -> None:
        """An F&B step: F on `forward_chunk` and B on the other chunk."""
        self.pairs.append(len(self.actions))
        self.forward(forward_chunk)
        self.backward(1 - forward_chunk)


def _rank_actions(rank: int, pp_size: int, num_microbatches: int) -> _Rank:
    """DeepSeek's eight phases on `rank` (module docstring)."""
    done, later = _Rank(), pp_size - rank - 1
    for _ in range(2 * later):  # 1: F0
        done.forward(0)
    for _ in range(rank + 1):  # 2: F0 F1
        done.forward(0)
        done.forward(1)
    for _ in range(later):  # 3: I1 W F1
        done.backward(1, split=True)
        done.weight()
        done.forward(1)
    for step in range(num_microbatches - 2 * pp_size + rank + 1):  # 4: F0&B1 F1&B0
        if step == 0 and rank == pp_size - 1:
            done.forward(0)  # the turn of the V: apart, one bubble less
            done.backward(1)
        else:
            done.overlapped(0)
        done.overlapped(1)
    for _ in range(later):  # 5: B1 F1&B0
        done.backward(1)
        done.overlapped(1)
    split = False
    for step in range(rank + 1):  # 6: B1 B0, split backwards from half way
        split = split or (step == (rank + 1) // 2 and rank % 2 == 1)
        done.backward(1, split=split)
        split = split or (step == (rank + 1) // 2 and rank % 2 == 0)
        done.backward(0, split=split)
    for _ in range(later):  # 7: W B0
        done.weight()
        done.backward(0, split=split)
    for _ in range(rank + 1):  # 8: W
        done.weight()
    return done


def dualpipev(*, pp_size: int, num_microbatches: int, forward_only: bool = False) -> PairedActions:
    """DualPipeV's order on each rank, with its F&B steps marked.

    Raises:
        ValueError: Fewer than 2 ranks, or fewer microbatches than the 2 x `pp_size` stages
            (the message names the numbers and the fix).
    """
    check_int("pp_size", pp_size, 1)
    check_int("num_microbatches", num_microbatches, 1)
    if pp_size < 2:
        raise ValueError(
            f"dualpipev needs 2 or more pipeline ranks (it pairs the two ends of a V), got "
            f"pp_size {pp_size}; use 'zbv' or '1f1b'"
        )
    stages = 2 * pp_size
    if num_microbatches < stages:
        raise ValueError(
            f"dualpipev needs at least as many microbatches as its {stages} stages (2 x "
            f"pp_size {pp_size}), got {num_microbatches}; use {stages} or more microbatches, or "
            "'zbv'"
        )
    if forward_only:
        forwards = [Action("F", m, c) for c in range(2) for m in range(num_microbatches)]
        return PairedActions([list(forwards) for _ in range(pp_size)], [[] for _ in range(pp_size)])
    ranks = [_rank_actions(rank, pp_size, num_microbatches) for rank in range(pp_size)]
    return PairedActions([r.actions for r in ranks], [r.pairs for r in ranks])
