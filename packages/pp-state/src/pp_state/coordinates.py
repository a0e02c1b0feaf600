"""Where a global rank sits in a job's parallel layout, said the way a report names a rank.

A stop report or an error that names "rank 1" must mean the global rank, and a reader wants
its place too: ``rank 1 (pipeline stage 0 of [1, 3], dp 1, tp 0)``. `RankCoordinates` holds
that place, `coordinates_in` finds it in a layout (`rank_layout`, `ParallelState.layout`),
`ParallelState.coordinates` for the job's own ranks.

Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pp_state.layout import find_group

__all__ = ["RankCoordinates", "coordinates_in"]


@dataclasses.dataclass(frozen=True)
class RankCoordinates:
    """A global rank's place in the job.

    Attributes:
        rank: The global rank.
        pipeline: The global ranks of its pipeline, in stage order.
        stage: Its pipeline stage (its index in `pipeline`).
        data_parallel: Its data-parallel rank, when known.
        tensor_parallel: Its tensor-parallel rank, when known.
        context_parallel: Its context-parallel rank, when known (shown above 0 only).
    """

    rank: int
    pipeline: tuple[int, ...]
    stage: int
    data_parallel: int | None = None
    tensor_parallel: int | None = None
    context_parallel: int | None = None

    def place(self) -> str:
        """``pipeline stage 0 of [1, 3], dp 1, tp 0``: where the rank is, without its number."""
        parts = [f"pipeline stage {self.stage} of {list(self.pipeline)}"]
        if self.data_parallel is not None:
            parts.append(f"dp {self.data_parallel}")
        if self.tensor_parallel is not None:
            parts.append(f"tp {self.tensor_parallel}")
        if self.context_parallel:
            parts.append(f"cp {self.context_parallel}")
        return ", ".join(parts)

    def describe(self) -> str:
        """``rank 1 (pipeline stage 0 of [1, 3], dp 1, tp 0)``."""
        return f"rank {self.rank} ({self.place()})"

    def to_json(self) -> dict[str, Any]:
        """Plain data (JSON-able), as `from_json` reads it."""
        return dataclasses.asdict(self) | {"pipeline": list(self.pipeline)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankCoordinates:
        """The coordinates `to_json` wrote.

        Raises:
            ValueError: A field is missing or not a whole number (a list of them for
                ``pipeline``).
        """
        try:
            pipeline = tuple(int(r) for r in data["pipeline"])
            optional = {
                name: None if data.get(name) is None else int(data[name])
                for name in ("data_parallel", "tensor_parallel", "context_parallel")
            }
            return cls(rank=int(data["rank"]), pipeline=pipeline, stage=int(data["stage"]),
                       **optional)  # fmt: skip
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"rank coordinates {dict(data)!r} are not readable: {error}") from None

    @classmethod
    def of_pipeline(cls, pipeline: Sequence[int], stage: int) -> RankCoordinates:
        """Stage `stage` of the pipeline `pipeline` (global ranks), no other coordinate."""
        return cls(rank=int(pipeline[stage]), pipeline=tuple(pipeline), stage=stage)


def coordinates_in(layout: Mapping[Any, Sequence[Sequence[int]]], rank: int) -> RankCoordinates:
    """Global rank `rank`'s coordinates in `layout` (kind -> groups of global ranks).

    Uses its ``pp`` group, and its ``dp``, ``tp`` and ``cp`` groups where the layout has them.

    Raises:
        ValueError: No pipeline group holds `rank`.
    """
    pipeline = find_group(layout.get("pp", ()), rank)
    if pipeline is None:
        known = sorted(r for group in layout.get("pp", ()) for r in group)
        span = f"ranks {known[0]} to {known[-1]}" if known else "no ranks"
        raise ValueError(f"rank {rank} is in no pipeline group of the layout (it has {span})")

    def index(kind: str) -> int | None:
        group = find_group(layout.get(kind, ()), rank)
        return None if group is None else group.index(rank)

    return RankCoordinates(
        rank=rank,
        pipeline=tuple(pipeline),
        stage=pipeline.index(rank),
        data_parallel=index("dp"),
        tensor_parallel=index("tp"),
        context_parallel=index("cp"),
    )
