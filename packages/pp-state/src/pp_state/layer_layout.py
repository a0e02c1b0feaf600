"""Layer layouts: which transformer layers, and whether the embedding or the loss, each stage holds.

A layout is the number of transformer layers of every virtual pipeline stage, in pipeline
order, plus the `Placement` that puts each virtual stage on a (rank, chunk). The embedding is
always at the start of virtual stage 0 and the output layer with the loss at the end of the
last one; stage s holds the global layers ``[sum(counts[:s]), sum(counts[:s + 1]))``.

Layouts are written in Megatron-LM's ``--pipeline-model-parallel-layout`` syntax:

- ``E`` the embedding, ``t`` one transformer layer, ``L`` the output layer and the loss;
- ``|`` ends a virtual stage; the number of stages divided by the pipeline size is the
  virtual pipeline size (stage i sits on rank ``i mod p``, chunk ``i div p`` when looped);
- ``x*N`` repeats the item before it (one character, ``|`` included, or a parenthesised group)
  N times; parentheses may nest; commas and whitespace are cosmetic.

``"Et*3|(tt|)*2,tL"`` reads as ``"Ettt|tt|tt|tL"``. Megatron's ``m`` (a multi-token-prediction
layer) is refused: pp builds none. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pp_state.errors import LayerLayoutError
from pp_state.numbers import check_int, divisors
from pp_state.placement import Placement

__all__ = ["LayerLayoutError", "PipelineLayerLayout"]

_ITEMS = {"E": "the embedding", "t": "a transformer layer", "L": "the loss", "|": "a stage end"}
_COSMETIC = frozenset(" \t\r\n,")
_MAX_ITEMS = 1_000_000
_MAX_DEPTH = 32
_SYNTAX = "E, t, L, '|', '*N', parentheses, commas and spaces"

_Item = tuple[str, int]  # (character, its index in the text)


def _write(counts: Sequence[int]) -> str:
    """The layout text of `counts`: one character per layer, E first, L last."""
    stages = ["t" * count for count in counts]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return "|".join(stages)


def _choices(values: Sequence[int], last_word: str = "or") -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last_word} {words[-1]}"


@dataclasses.dataclass(frozen=True)
class PipelineLayerLayout:
    """The transformer layers of every virtual stage, and which (rank, chunk) holds each stage.

    Attributes:
        counts: Transformer layers of each virtual stage, stage 0 first. The first and last
            stage may hold none (they hold E and L); every stage between needs one.
        placement: Which (rank, chunk) holds each virtual stage;
            ``placement.num_stages == len(counts)``.
    """

    counts: tuple[int, ...]
    placement: Placement

    def __post_init__(self) -> None:
        """Checks the counts against each other and against the placement.

        Raises:
            TypeError: `counts` is not a tuple of ints or `placement` not a `Placement`.
            LayerLayoutError: A negative count, a count per stage that does not match the
                placement's stages, or a middle stage with no layer.
        """
        if not isinstance(self.counts, tuple) or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in self.counts
        ):
            raise TypeError(f"counts must be a tuple of ints, got {self.counts!r}")
        if not isinstance(self.placement, Placement):
            raise TypeError(f"placement must be a Placement, got {self.placement!r}")
        if not self.counts:
            raise LayerLayoutError("", "a layout needs at least one stage")
        text = _write([max(c, 0) for c in self.counts])
        for stage, count in enumerate(self.counts):
            if count < 0:
                raise LayerLayoutError(
                    text,
                    f"stage {stage} has {count} layers; a count must be 0 or more",
                    stage=stage,
                )
        if len(self.counts) != self.placement.num_stages:
            raise LayerLayoutError(
                text,
                f"{len(self.counts)} stages, but the placement {self.placement} has "
                f"{self.placement.pp_size} ranks x {self.placement.vp_size} chunks = "
                f"{self.placement.num_stages} stages",
            )
        for stage in range(1, len(self.counts) - 1):
            if self.counts[stage] == 0:
                raise LayerLayoutError(text, _nothing(stage, len(self.counts)), stage=stage)

    # ------------------------------------------------------------------------- constructors
    @classmethod
    def parse(
        cls,
        text: str,
        pp_size: int,
        *,
        num_layers: int | None = None,
        placement: str | Placement = "looped",
    ) -> PipelineLayerLayout:
        """A layout from Megatron's layout text (see the module) for `pp_size` ranks.

        Args:
            text: The layout, such as ``"Ettt|tttL"`` or ``"Et*3|(tt|)*29,tL"``.
            pp_size: Pipeline ranks; the stage count must be a multiple of it.
            num_layers: When given, the layout must hold exactly this many ``t``.
            placement: "looped" (Megatron's), "v", or a `Placement` of the same size.

        Returns:
            The layout; ``str()`` of it gives the text back with every repetition written out.

        Raises:
            TypeError: `text` is not a string.
            LayerLayoutError: A syntax error, E or L out of place, a stage count that is not a
                multiple of `pp_size`, a middle stage with nothing, or another layer count
                than `num_layers`; the message names the position and the rule.
        """
        if not isinstance(text, str):
            raise TypeError(f"a layout must be a string, got {text!r}")
        pp = check_int("pp_size", pp_size, 1)
        stages = _split(text, _Parser(text).parse())
        _check_stage_count(text, len(stages), pp)
        _check_ends(text, stages)
        _check_middle(text, stages)
        counts = tuple(sum(1 for char, _ in stage[1] if char == "t") for stage in stages)
        if num_layers is not None and sum(counts) != check_int("num_layers", num_layers, 0):
            raise LayerLayoutError(
                text,
                f"the layout holds {sum(counts)} transformer layers (t) but num_layers is "
                f"{num_layers}; write {num_layers} t in all",
            )
        return cls(counts, _placement(text, placement, pp, len(stages) // pp))

    @classmethod
    def from_counts(
        cls, counts: Sequence[int], pp_size: int, *, placement: str | Placement = "looped"
    ) -> PipelineLayerLayout:
        """A layout from the transformer layers of each virtual stage, stage 0 first.

        Raises:
            LayerLayoutError: The stage count is not a multiple of `pp_size`, or the counts
                break a rule of the class.
        """
        pp = check_int("pp_size", pp_size, 1)
        counts = tuple(counts)
        if not counts:
            raise LayerLayoutError(None, "a layout needs at least one stage; counts is empty")
        text = _write([c if isinstance(c, int) and c > 0 else 0 for c in counts] or [0])
        _check_stage_count(text, len(counts), pp)
        return cls(counts, _placement(text, placement, pp, len(counts) // pp))

    @classmethod
    def even(
        cls,
        num_layers: int,
        pp_size: int,
        vp_size: int = 1,
        *,
        placement: str | Placement = "looped",
    ) -> PipelineLayerLayout:
        """The even split: every virtual stage holds ``num_layers / (pp_size * vp_size)``.

        Raises:
            LayerLayoutError: The layers do not divide over the stages; the message names
                layer counts that would.
        """
        layers = check_int("num_layers", num_layers, 0)
        pp, vp = check_int("pp_size", pp_size, 1), check_int("vp_size", vp_size, 1)
        where = _placement(None, placement, pp, vp)
        try:
            where.layers(0, 0, layers)
        except ValueError as error:
            raise LayerLayoutError(None, str(error)) from None
        return cls((layers // where.num_stages,) * where.num_stages, where)

    @classmethod
    def from_first_last(
        cls,
        num_layers: int,
        pp_size: int,
        *,
        first: int | None = None,
        last: int | None = None,
        vp_size: int = 1,
        placement: str | Placement = "looped",
    ) -> PipelineLayerLayout:
        """Megatron's ``--decoder-first/last-pipeline-num-layers``: fixed first and last ranks.

        As in Megatron, `first` and `last` count the layers of the whole first and last
        pipeline rank: each of its `vp_size` chunks holds ``first / vp_size``. The other
        layers split evenly over the ranks between, and over their chunks. Unlike Megatron,
        0 is accepted where it leaves no middle stage empty (a first stage holding only E).

        Raises:
            TypeError: `first` or `last` is not an int.
            LayerLayoutError: A count that does not split over the chunks, counts that leave
                a negative middle or one that does not divide over the middle ranks, or
                that leave layers when no middle rank exists; the message names the numbers
                and the values that would work.
        """
        layers = check_int("num_layers", num_layers, 0)
        pp, vp = check_int("pp_size", pp_size, 1), check_int("vp_size", vp_size, 1)
        if first is None and last is None:
            return cls.even(layers, pp, vp, placement=placement)
        for name, value in (("first", first), ("last", last)):
            if value is not None:
                check_int(name, value, 0)
        problem = _first_last_problem(layers, pp, vp, first, last)
        if problem:
            raise LayerLayoutError(None, problem + _first_last_choices(layers, pp, vp, first, last))
        per_rank = _per_rank(layers, pp, first, last)
        where = _placement(None, placement, pp, vp)
        counts = tuple(per_rank[where.holder(s)[0]] // vp for s in range(where.num_stages))
        return cls(counts, where)

    # ------------------------------------------------------------------------------ queries
    @property
    def pp_size(self) -> int:
        """Pipeline ranks."""
        return self.placement.pp_size

    @property
    def vp_size(self) -> int:
        """Model chunks per rank (the virtual pipeline size)."""
        return self.placement.vp_size

    @property
    def num_stages(self) -> int:
        """Virtual stages: pp_size * vp_size."""
        return len(self.counts)

    @property
    def num_layers(self) -> int:
        """Transformer layers in all."""
        return sum(self.counts)

    def stage_layers(self, stage: int) -> range:
        """The global layers of virtual stage `stage`.

        Raises:
            ValueError: `stage` is not a stage of this layout.
        """
        if (
            isinstance(stage, bool)
            or not isinstance(stage, int)
            or not 0 <= stage < len(self.counts)
        ):
            raise ValueError(f"stage {stage!r} is outside the {len(self.counts)} virtual stages")
        start = sum(self.counts[:stage])
        return range(start, start + self.counts[stage])

    def layers(self, rank: int, chunk: int = 0) -> range:
        """The global layers `chunk` of `rank` holds (empty for a stage of only E or L).

        ``len()`` of it is Megatron's ``get_num_layers_to_build`` and ``.start`` its
        ``get_transformer_layer_offset`` for the same layout.

        Raises:
            ValueError: `rank` or `chunk` is outside the pipeline.
        """
        return self.stage_layers(self.placement.stage(rank, chunk))

    def holds_embedding(self, rank: int, chunk: int = 0) -> bool:
        """Whether `chunk` of `rank` holds the embedding (virtual stage 0)."""
        return self.placement.stage(rank, chunk) == 0

    def holds_loss(self, rank: int, chunk: int = 0) -> bool:
        """Whether `chunk` of `rank` holds the output layer and the loss (the last stage)."""
        return self.placement.stage(rank, chunk) == len(self.counts) - 1

    def table(self) -> str:
        """A text table of what each rank's chunks hold, such as ``E t0-2`` or ``t3 L``."""
        cells = [[self._cell(r, c) for c in range(self.vp_size)] for r in range(self.pp_size)]
        rows = [[f"rank {r}", *cells[r]] for r in range(self.pp_size)]
        rows.insert(0, ["", *(f"chunk {c}" for c in range(self.vp_size))])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows
        )

    def _cell(self, rank: int, chunk: int) -> str:
        held = self.layers(rank, chunk)
        words = ["E"] if self.holds_embedding(rank, chunk) else []
        if len(held) == 1:
            words.append(f"t{held.start}")
        elif held:
            words.append(f"t{held.start}-{held.stop - 1}")
        if self.holds_loss(rank, chunk):
            words.append("L")
        return f"s{self.placement.stage(rank, chunk)}: {' '.join(words)}"

    def __str__(self) -> str:
        """The layout text, one character per layer: counts (3, 3) give ``Ettt|tttL``."""
        return _write(self.counts)


def _nothing(stage: int, stages: int) -> str:
    return f"stage {stage} of {stages} holds nothing: a stage needs a layer, E or L"


def _placement(
    text: str | None, placement: str | Placement, pp_size: int, vp_size: int
) -> Placement:
    """The named placement for the size, or `placement` itself once its size is checked."""
    if isinstance(placement, Placement):
        if (placement.pp_size, placement.vp_size) != (pp_size, vp_size):
            raise LayerLayoutError(
                text,
                f"the placement has {placement.pp_size} ranks x {placement.vp_size} chunks, "
                f"but the layout needs {pp_size} x {vp_size}",
            )
        return placement
    try:
        return Placement.named(placement, pp_size, vp_size)
    except ValueError as error:
        raise LayerLayoutError(text, str(error)) from None


def _check_stage_count(text: str, stages: int, pp_size: int) -> None:
    if stages % pp_size == 0:
        return
    below = stages - stages % pp_size
    multiples = ([below] if below else []) + [below + pp_size]
    sizes = divisors(stages)
    raise LayerLayoutError(
        text,
        f"{stages} stages (split by '|') are not a multiple of the pipeline size {pp_size}: "
        f"write {_choices(multiples)} stages, or use a pipeline size dividing {stages} "
        f"({_choices(sizes)})",
    )


class _Parser:
    """Expands repetitions and parentheses into items that remember their character index."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.index = 0

    def error(self, rule: str, position: int) -> LayerLayoutError:
        return LayerLayoutError(self.text, rule, position=position)

    def parse(self) -> list[_Item]:
        items = self.sequence(None, 0)
        if not items:
            raise self.error("the layout is empty: write at least 'EL'", 0)
        return items

    def sequence(self, opened: int | None, depth: int) -> list[_Item]:
        """Items up to the ')' closing the '(' at `opened` (None: up to the end)."""
        items: list[_Item] = []
        while self.index < len(self.text):
            char, at = self.text[self.index], self.index
            if char in _COSMETIC:
                self.index += 1
            elif char == ")":
                if opened is None:
                    raise self.error(f"')' at character {at} closes no '('", at)
                self.index += 1
                return items
            elif char == "*":
                raise self.error(
                    f"'*' at character {at} repeats nothing: put it after E, t, L, '|' or ')'", at
                )
            else:
                atom = self.atom(depth)
                count = self.repeat()
                if len(items) + len(atom) * count > _MAX_ITEMS:
                    raise self.error(f"the layout expands past {_MAX_ITEMS} items", at)
                items.extend(atom * count)
        if opened is not None:
            raise self.error(f"'(' at character {opened} is never closed", opened)
        return items

    def atom(self, depth: int) -> list[_Item]:
        char, at = self.text[self.index], self.index
        self.index += 1
        if char == "(":
            if depth >= _MAX_DEPTH:
                raise self.error(f"parentheses nest deeper than {_MAX_DEPTH} levels", at)
            inner = self.sequence(at, depth + 1)
            if not inner:
                raise self.error(f"the parentheses at character {at} hold nothing", at)
            return inner
        if char == "m":
            raise self.error(
                f"'m' at character {at} is a multi-token-prediction layer (Megatron's MTP), "
                "which pp does not build: remove it",
                at,
            )
        if char not in _ITEMS:
            raise self.error(
                f"{char!r} at character {at} is not part of a layout; use {_SYNTAX}", at
            )
        return [(char, at)]

    def repeat(self) -> int:
        """The N of a ``*N`` after an item (1 without one)."""
        while self.index < len(self.text) and self.text[self.index] in _COSMETIC:
            self.index += 1
        if self.index == len(self.text) or self.text[self.index] != "*":
            return 1
        star = self.index
        self.index += 1
        while self.index < len(self.text) and self.text[self.index].isdigit():
            self.index += 1
        digits = self.text[star + 1 : self.index]
        if not digits.isascii() or not digits:
            raise self.error(f"'*' at character {star} needs a count, such as '*2'", star)
        if int(digits) == 0:
            raise self.error(
                f"'*{digits}' at character {star} repeats nothing: a count must be 1 or more", star
            )
        return int(digits)


_Stage = tuple[int, list[_Item]]  # (character index of the '|' opening the stage, its items)


def _split(text: str, items: list[_Item]) -> list[_Stage]:
    stages: list[_Stage] = [(-1, [])]
    for char, at in items:
        if char == "|":
            stages.append((at, []))
        else:
            stages[-1][1].append((char, at))
    return stages


def _check_ends(text: str, stages: list[_Stage]) -> None:
    """E opens stage 0 and L closes the last stage, each exactly once."""
    last = len(stages) - 1
    for char, name, want_stage, want_index, where in (
        ("E", "the embedding", 0, 0, "open stage 0"),
        ("L", "the loss", last, -1, f"close the last stage ({last})"),
    ):
        found = [
            (s, i, at)
            for s, (_, st) in enumerate(stages)
            for i, (c, at) in enumerate(st)
            if c == char
        ]
        if not found:
            raise LayerLayoutError(text, f"no {char}: {name} must {where}")
        if len(found) > 1:
            places = _choices(sorted({at for _, _, at in found})[:4], "and")
            raise LayerLayoutError(
                text,
                f"{char} appears {len(found)} times (characters {places}): {name} is built once",
                position=found[1][2],
            )
        stage, index, at = found[0]
        size = len(stages[stage][1])
        if stage != want_stage or index % size != want_index % size:
            raise LayerLayoutError(
                text,
                f"{char} at character {at} is in stage {stage} of {len(stages)}, item {index}: "
                f"{name} must {where}",
                position=at,
                stage=stage,
            )


def _check_middle(text: str, stages: list[_Stage]) -> None:
    for stage in range(1, len(stages) - 1):
        opens, items = stages[stage]
        if not items:
            closes = stages[stage + 1][0]
            raise LayerLayoutError(
                text,
                f"{_nothing(stage, len(stages))} (between the '|' at characters {opens} and "
                f"{closes})",
                position=opens,
                stage=stage,
            )


def _per_rank(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Layers per pipeline rank for checked first/last counts."""
    middle_ranks = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    ranks = [middle // middle_ranks if middle_ranks else 0] * pp
    if first is not None:
        ranks[0] = first
    if last is not None:
        ranks[-1] = last
    return ranks


def _first_last_problem(
    num_layers: int, pp: int, vp: int, first: int | None, last: int | None
) -> str | None:
    """What is wrong with these first/last counts, or None."""
    given = " and ".join(
        f"{name}={value}" for name, value in (("first", first), ("last", last)) if value is not None
    )
    if pp == 1 and first is not None and last is not None:
        return f"{given}: with one pipeline rank the first rank is the last; give only one"
    for name, value in (("first", first), ("last", last)):
        if value is not None and value % vp:
            return f"{name}={value} does not split over the {vp} chunks of a rank"
    middle_ranks = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    if middle < 0:
        return f"{given} take more than the {num_layers} layers, leaving {middle} for the middle"
    if middle_ranks == 0 and middle:
        return (
            f"{given} hold {num_layers - middle} of {num_layers} layers, and no middle rank "
            f"is left for the other {middle}"
        )
    if middle_ranks and (middle == 0 or middle % (middle_ranks * vp)):
        return (
            f"{given} leave {middle} of {num_layers} layers for {middle_ranks} middle ranks x {vp} "
            f"chunks, which does not divide into stages of one layer or more"
        )
    return None


def _first_last_choices(
    num_layers: int, pp: int, vp: int, first: int | None, last: int | None
) -> str:
    """The values of `first` (keeping `last`) and of `last` (keeping `first`) that work."""
    words = []
    if first is not None:
        good = [v for v in range(num_layers + 1) if _fits(num_layers, pp, vp, v, last)]
        words.append(_listed("first", good))
    if last is not None:
        good = [v for v in range(num_layers + 1) if _fits(num_layers, pp, vp, first, v)]
        words.append(_listed("last", good))
    words = [word for word in words if word]
    if not words:
        return "; no value of first or last fits these sizes"
    return f"; valid: {' or '.join(words)}"


def _fits(num_layers: int, pp: int, vp: int, first: int | None, last: int | None) -> bool:
    return _first_last_problem(num_layers, pp, vp, first, last) is None


def _listed(name: str, values: list[int]) -> str:
    if not values:
        return ""
    shown = ", ".join(map(str, values[:8]))
    return f"{name} one of {shown}" + (", ..." if len(values) > 8 else "")
