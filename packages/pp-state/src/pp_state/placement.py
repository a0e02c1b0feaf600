"""Placement: which virtual pipeline stage each (pipeline rank, model chunk) holds.

This is the one place that turns a chunk into a stage. Schedules, their lowering, validator,
simulator and executor, the stage predicates of `ParallelState`, and model building all ask a
`Placement` instead of writing the arithmetic themselves.

Two placements have names:

- ``looped`` (Megatron's interleaving): chunk c of rank r holds stage ``c * pp + r``; the
  activations go round the ring of ranks once per chunk.
- ``v`` (V-shape, zero-bubble V): chunks alternate direction, so rank r holds stages r and
  ``2 * pp - 1 - r`` with two chunks; the last stage sits on rank 0 next to the first, and the
  hand-over between chunks stays on one rank.

Any other assignment can be given as a table (`Placement.from_table`). Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pp_state.numbers import check_int

__all__ = ["PLACEMENTS", "Placement"]

PLACEMENTS = ("looped", "v")
"""The placements known by name."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """The virtual stage of every (rank, chunk) of a pipeline.

    Attributes:
        stages: ``stages[rank][chunk]`` is the virtual stage that chunk holds; every rank has
            the same number of chunks, and every stage ``0 .. pp * vp - 1`` is held once.
        name: "looped", "v", or "table" for any other assignment.
    """

    stages: tuple[tuple[int, ...], ...]
    name: str = "table"
    _holder: dict[int, tuple[int, int]] = dataclasses.field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        """Checks that the table is rectangular and holds every stage exactly once.

        Raises:
            ValueError: An empty table, ranks with different chunk counts, a stage out of
                range, held twice, or not held at all; the message names it.
        """
        if not self.stages or not self.stages[0]:
            raise ValueError("a placement needs at least one rank holding at least one chunk")
        vp = len(self.stages[0])
        for rank, chunks in enumerate(self.stages):
            if len(chunks) != vp:
                raise ValueError(
                    f"rank {rank} holds {len(chunks)} chunks but rank 0 holds {vp}: every rank "
                    "holds the same number of model chunks"
                )
        total = len(self.stages) * vp
        holder: dict[int, tuple[int, int]] = {}
        for rank, chunks in enumerate(self.stages):
            for chunk, stage in enumerate(chunks):
                if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < total:
                    raise ValueError(
                        f"rank {rank} chunk {chunk} holds stage {stage!r}, outside the "
                        f"{total} virtual stages 0 .. {total - 1}"
                    )
                if stage in holder:
                    first = holder[stage]
                    raise ValueError(
                        f"stage {stage} is held twice: by rank {first[0]} chunk {first[1]} and "
                        f"by rank {rank} chunk {chunk}"
                    )
                holder[stage] = (rank, chunk)
        object.__setattr__(self, "_holder", holder)

    # ------------------------------------------------------------------------- constructors
    @classmethod
    def looped(cls, pp_size: int, vp_size: int = 1) -> Placement:
        """Megatron's placement: chunk c of rank r holds stage ``c * pp_size + r``."""
        pp, vp = check_int("pp_size", pp_size, 1), check_int("vp_size", vp_size, 1)
        return cls(tuple(tuple(c * pp + r for c in range(vp)) for r in range(pp)), "looped")

    @classmethod
    def v_shape(cls, pp_size: int, vp_size: int = 2) -> Placement:
        """The V (zig-zag) placement: even chunks go down the ranks, odd chunks come back.

        With two chunks rank r holds stages r and ``2 * pp_size - 1 - r``.

        Raises:
            ValueError: `vp_size` is odd (a V needs chunks in pairs).
        """
        pp, vp = check_int("pp_size", pp_size, 1), check_int("vp_size", vp_size, 1)
        if vp % 2:
            raise ValueError(
                f"the V placement pairs chunks (down, then back up): vp_size must be even, "
                f"got {vp}; use 'looped' for an odd number of chunks"
            )
        return cls(
            tuple(
                tuple(c * pp + (r if c % 2 == 0 else pp - 1 - r) for c in range(vp))
                for r in range(pp)
            ),
            "v",
        )

    @classmethod
    def named(cls, name: str, pp_size: int, vp_size: int = 1) -> Placement:
        """The placement called `name` ("looped" or "v") for a pipeline of that size.

        Raises:
            ValueError: An unknown name.
        """
        if name == "looped":
            return cls.looped(pp_size, vp_size)
        if name == "v":
            return cls.v_shape(pp_size, vp_size)
        raise ValueError(f"unknown placement {name!r}; valid: {', '.join(PLACEMENTS)}")

    @classmethod
    def from_table(cls, stages: Sequence[Sequence[int]]) -> Placement:
        """A placement from ``stages[rank][chunk]`` (validated; see the class)."""
        table = tuple(tuple(chunks) for chunks in stages)
        placement = cls(table)
        for name in PLACEMENTS:
            if _fits(name, table) and cls.named(name, len(table), len(table[0])).stages == table:
                return cls(table, name)
        return placement

    @classmethod
    def parse(cls, text: str, pp_size: int, vp_size: int) -> Placement:
        """A placement from its text: a name, or the table as ``0 3 | 1 2`` (ranks split by '|').

        Raises:
            ValueError: Not a name and not a table of integers, or a table of another size.
        """
        text = text.strip()
        if text in PLACEMENTS:
            return cls.named(text, pp_size, vp_size)
        try:
            table = [[int(token) for token in part.split()] for part in text.split("|")]
        except ValueError:
            raise ValueError(
                f"placement {text!r} is neither a name ({', '.join(PLACEMENTS)}) nor a table "
                "of stages such as '0 3 | 1 2' (one group per rank)"
            ) from None
        placement = cls.from_table(table)
        if (placement.pp_size, placement.vp_size) != (pp_size, vp_size):
            raise ValueError(
                f"placement {text!r} has {placement.pp_size} ranks x {placement.vp_size} chunks, "
                f"but the pipeline has {pp_size} x {vp_size}"
            )
        return placement

    # ------------------------------------------------------------------------------ queries
    @property
    def pp_size(self) -> int:
        """Pipeline ranks."""
        return len(self.stages)

    @property
    def vp_size(self) -> int:
        """Model chunks per rank."""
        return len(self.stages[0])

    @property
    def num_stages(self) -> int:
        """Virtual stages: pp_size * vp_size."""
        return self.pp_size * self.vp_size

    def stage(self, rank: int, chunk: int = 0) -> int:
        """The virtual stage that `chunk` of `rank` holds.

        Raises:
            ValueError: `rank` or `chunk` is outside the pipeline.
        """
        if not 0 <= rank < self.pp_size or not 0 <= chunk < self.vp_size:
            raise ValueError(
                f"rank {rank} chunk {chunk} is outside a pipeline of {self.pp_size} ranks x "
                f"{self.vp_size} chunks"
            )
        return self.stages[rank][chunk]

    def holder(self, stage: int) -> tuple[int, int]:
        """The (rank, chunk) holding virtual stage `stage`.

        Raises:
            ValueError: `stage` is not a virtual stage of this pipeline.
        """
        if stage not in self._holder:
            raise ValueError(f"stage {stage} is outside the {self.num_stages} virtual stages")
        return self._holder[stage]

    def chunk_of(self, rank: int, stage: int) -> int:
        """The chunk of `rank` that holds `stage`.

        Raises:
            ValueError: `rank` does not hold `stage`.
        """
        holder = self.holder(stage)
        if holder[0] != rank:
            raise ValueError(
                f"stage {stage} is on rank {holder[0]} chunk {holder[1]}, not on rank {rank}"
            )
        return holder[1]

    def neighbour(self, rank: int, chunk: int, step: int) -> tuple[int, int] | None:
        """The (rank, chunk) `step` stages away (+1 next, -1 previous); None past either end."""
        stage = self.stage(rank, chunk) + step
        return self._holder.get(stage) if stage >= 0 else None

    def is_first(self, rank: int, chunk: int = 0) -> bool:
        """Whether `chunk` of `rank` holds the first stage (it reads the data)."""
        return self.stage(rank, chunk) == 0

    def is_last(self, rank: int, chunk: int = 0) -> bool:
        """Whether `chunk` of `rank` holds the last stage (it computes the loss)."""
        return self.stage(rank, chunk) == self.num_stages - 1

    def holds_first(self, rank: int) -> bool:
        """Whether some chunk of `rank` holds the first stage."""
        return self.holder(0)[0] == rank

    def holds_last(self, rank: int) -> bool:
        """Whether some chunk of `rank` holds the last stage."""
        return self.holder(self.num_stages - 1)[0] == rank

    def layers(self, rank: int, chunk: int, num_layers: int) -> range:
        """The global layers `chunk` of `rank` holds when `num_layers` split evenly over stages.

        Raises:
            ValueError: The layers do not divide over the virtual stages; the message lists
                layer counts that would.
        """
        if num_layers % self.num_stages:
            near = [n for n in range(self.num_stages, 2 * num_layers + 1, self.num_stages)][:4]
            raise ValueError(
                f"{num_layers} layers do not split evenly over {self.num_stages} virtual stages "
                f"({self.pp_size} ranks x {self.vp_size} chunks); use a multiple of "
                f"{self.num_stages}, such as {', '.join(map(str, near))}"
            )
        per = num_layers // self.num_stages
        stage = self.stage(rank, chunk)
        return range(stage * per, (stage + 1) * per)

    def __str__(self) -> str:
        """The name, or the table as ``0 3 | 1 2``."""
        if self.name != "table":
            return self.name
        return " | ".join(" ".join(map(str, chunks)) for chunks in self.stages)


def _fits(name: str, table: tuple[tuple[int, ...], ...]) -> bool:
    """Whether a named placement exists for the table's size (the V needs an even chunk count)."""
    return name != "v" or len(table[0]) % 2 == 0
