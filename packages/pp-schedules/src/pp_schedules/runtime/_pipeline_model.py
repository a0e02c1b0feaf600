"""A model split into pipeline stages: this rank's chunks, their contracts and their ties.

`PipelineModel.from_model(model, module_names, placement=..., state=...)` splits a model by
the dotted names of its submodules, one list per virtual stage (torchtitan's module names per
model part; `split_module_names` writes them for layers between an embedding and an output
layer); `PipelineModel.from_parts(parts, ...)` splits an ordered list of modules, or of
functions that build one, by counts. Either way this rank keeps only the chunks its placement
gives it (`PipelineModel.chunks`, one `PipelineChunk` per virtual stage
it holds, in chunk order): parts built by a function are built only where they live, and a
model built on the meta device is materialised part by part (`PipelineModel.materialize`),
then initialised or loaded under the model's own parameter names.

What crosses each boundary is inferred from one forward of a sample microbatch
(`infer_contracts`) or declared (`declare_contracts`).

Parameters tied across parts (the word embedding and the output layer) are found from the
model (one parameter under two names) or declared (``ties=``); `reduce_tied_grads` sums their
gradients between the pipeline ranks that hold different copies, and every copy but the first
is marked ``shared`` so that norms count the tie once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pp_schedules.runtime._stages import Boundary, PipelineChunk
from pp_state import ParallelState
from pp_state.collectives import collective
from pp_state.placement import Placement

__all__ = ["PipelineModel", "Tie", "split_module_names"]

PartSource = torch.nn.Module | Callable[[], torch.nn.Module]
"""A part of a model, or a function that builds it (called only on the rank that holds it)."""


@dataclasses.dataclass
class Tie:
    """Parameters that are one weight of the model under several names.

    Attributes:
        names: The names, in model order (the first is the embedding's, say).
        holders: The pipeline ranks holding a copy, ascending.
        group: The process group of this pipeline's holders; None when this rank holds no
            copy or holds the only one.
        params: This rank's copy (one parameter, shared by its chunks), or none.
    """

    names: tuple[str, ...]
    holders: tuple[int, ...]
    group: dist.ProcessGroup | None = None
    params: list[torch.nn.Parameter] = dataclasses.field(default_factory=list)


def _placement_of(placement: Any) -> Placement:
    """A `Placement`, or the placement of a `ResolvedSchedule` (anything with one)."""
    found = placement if isinstance(placement, Placement) else getattr(placement, "placement", None)
    if not isinstance(found, Placement):
        raise TypeError(
            f"placement must be a pp_state.Placement or a resolved schedule "
            f"(resolve_schedule(...)), got {type(placement).__name__}"
        )
    return found


def _owner(names_by_stage: Sequence[Sequence[str]], param: str) -> tuple[int, str] | None:
    """The virtual stage and part whose module holds parameter `param`, if any."""
    for stage, names in enumerate(names_by_stage):
        for name in names:
            if param.startswith(f"{name}."):
                return stage, name
    return None


def _check_module_names(
    model: torch.nn.Module, module_names: Sequence[Sequence[str]], num_stages: int
) -> None:
    """Refuse a split that names a missing module, repeats one, or leaves parameters out.

    Raises:
        ValueError: Naming the stage, the module and the fix.
    """
    kind = type(model).__name__
    if isinstance(module_names, str) or len(module_names) != num_stages:
        raise ValueError(
            f"module_names has {len(module_names)} lists for {num_stages} virtual stages; "
            "give one list of module names per virtual stage, in stage order"
        )
    seen: dict[str, int] = {}
    for stage, names in enumerate(module_names):
        if isinstance(names, str) or not names:
            raise ValueError(
                f"virtual stage {stage}'s module names must be a non-empty list of names, "
                f"got {names!r}"
            )
        for name in names:
            if not _has_module(model, name):
                raise ValueError(
                    f"virtual stage {stage}: {kind} has no module {name!r}; "
                    f"{_missing_module_hint(model, name)}"
                )
            for other, where in seen.items():
                relation = (
                    "repeats" if other == name
                    else "is inside" if name.startswith(f"{other}.")
                    else "contains" if other.startswith(f"{name}.")
                    else None
                )  # fmt: skip
                if relation is not None:
                    raise ValueError(
                        f"module {name!r} of virtual stage {stage} {relation} {other!r} of "
                        f"virtual stage {where}: each part of the model belongs to one stage"
                    )
            seen[name] = stage
    left = [
        n for n, _ in model.named_parameters(remove_duplicate=False)
        if _owner(module_names, n) is None
    ]  # fmt: skip
    if left:
        raise ValueError(
            f"{len(left)} parameters of {kind} are in no virtual stage ({', '.join(left[:4])}"
            f"{' ...' if len(left) > 4 else ''}); add their modules to a stage's module names"
        )


def _has_module(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _missing_module_hint(model: torch.nn.Module, name: str) -> str:
    """What exists near a module name that does not, for its refusal.

    The longest leading part of the name that is a module (the model itself at worst), that
    module's children, and the model's closest module name where one is close.
    """
    parts = name.split(".")
    prefixes = (".".join(parts[:n]) for n in range(len(parts) - 1, -1, -1))
    found = next(p for p in prefixes if _has_module(model, p))  # "" (the model) always is
    children = [n for n, _ in model.get_submodule(found).named_children()]
    where = "the model" if not found else repr(found)
    if found and found != name.rpartition(".")[0]:
        where += " (the longest part of the name that exists)"
    hint = f"the modules under {where} are {children}"
    close = _closest_module(model, name)
    return f"{hint}; did you mean {close!r}?" if close else hint


def _closest_module(model: torch.nn.Module, name: str) -> str | None:
    """The model's module name closest to `name`, if one is close.

    A name that differs from `name` only in its numbers is no suggestion: ``layers.7`` of a
    model with 4 layers is not a misspelt ``layers.1``.
    """
    names = [n for n, _ in model.named_modules() if n]
    for close in difflib.get_close_matches(name, names, n=3, cutoff=0.7):
        if re.sub(r"\d+", "#", str(close)) != re.sub(r"\d+", "#", name):
            return str(close)
    return None


def _found_ties(
    model: torch.nn.Module, module_names: Sequence[Sequence[str]]
) -> list[tuple[str, ...]]:
    """Parameters that are one object under names in different parts of the split."""
    by_object: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(param), []).append(name)
    ties = []
    for names in by_object.values():
        parts = {_owner(module_names, n) for n in names}
        if len(names) > 1 and len(parts) > 1:
            ties.append(tuple(names))
    return ties


def split_module_names(
    layers: Sequence[str],
    num_stages: int,
    *,
    first: Sequence[str] = (),
    last: Sequence[str] = (),
) -> list[list[str]]:
    """Module names per virtual stage: `layers` split near-evenly, `first` and `last` at the ends.

    ``split_module_names([f"model.layers.{i}" for i in range(8)], 4, first=["model.
    embed_tokens"], last=["model.norm", "lm_head"])`` (torchtitan's module names per model
    part); the first stages take one layer more when the split is uneven.

    Raises:
        ValueError: Fewer layers than stages, or no stages.
    """
    if num_stages < 1 or len(layers) < num_stages:
        raise ValueError(
            f"cannot split {len(layers)} layers over {num_stages} virtual stages: give at least "
            "one layer per stage (or write the module names per stage yourself)"
        )
    share, extra = divmod(len(layers), num_stages)
    names, start = [], 0
    for stage in range(num_stages):
        end = start + share + (1 if stage < extra else 0)
        names.append(list(layers[start:end]))
        start = end
    names[0][:0] = first
    names[-1].extend(last)
    return names


class PipelineModel:
    """This rank's chunks of a model split into pipeline stages, with contracts and ties.

    Build it with `from_model` or `from_parts`; hand `chunks` (wrapped in a data-parallel
    wrapper if you like) to the executor built for the same placement.
    """

    def __init__(
        self,
        chunks: list[PipelineChunk],
        *,
        placement: Placement,
        state: ParallelState,
        stage_of: Callable[[str], int],
        ties: Sequence[Sequence[str]] = (),
    ) -> None:
        """Use `from_model` or `from_parts`; this binds built chunks to their pipeline.

        `stage_of` names the virtual stage holding a parameter of the whole model.
        """
        self.chunks = chunks
        """This rank's chunks, one per virtual stage it holds, in chunk order."""
        self.placement = placement
        self.state = state
        self.rank = state.pipeline_model_parallel_rank
        """This rank's pipeline stage (its index in `placement`)."""
        self.contracts: list[Boundary] | None = None
        """What crosses each boundary (stage v to v + 1), once inferred or declared."""
        self._stage_of = stage_of
        self.ties = [self._tie(names) for names in _merged(ties)]
        """The tied parameters; `reduce_tied_grads` sums their gradients."""
        self._agree(self._joined())  # a tie refused on one rank is refused on every rank
        for tie in self.ties:
            self._make_group(tie)
        self._check_tie_shapes()

    def _joined(self) -> str | None:
        """Join this rank's copies of every tie; the first refusal, else None."""
        try:
            for tie in self.ties:
                self._join_copies(tie)
        except ValueError as error:
            return str(error)
        return None

    def _agree(self, refusal: str | None) -> None:
        """Every rank raises the first rank's refusal, so none waits in a later collective.

        Raises:
            ValueError: Some rank refused.
        """
        found: list[str | None] = [None] * dist.get_world_size()
        with collective("tie agreement", group=None):
            dist.all_gather_object(found, refusal)
        first = next((r for r in found if r is not None), None)
        if first is not None:
            raise ValueError(first)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        module_names: Sequence[Sequence[str]],
        *,
        placement: Any,
        state: ParallelState,
        ties: Sequence[Sequence[str]] = (),
    ) -> PipelineModel:
        """Split `model` by module names, one list per virtual stage.

        Args:
            model: The whole model; on the meta device if it is too large for one rank
                (then `materialize` this rank's chunks).
            module_names: ``module_names[v]``: the dotted names of the submodules virtual
                stage v runs, in order (``["model.embed_tokens", "model.layers.0"]``).
            placement: Which stage each rank's chunks hold: a `Placement` or a resolved
                schedule (``resolve_schedule(...)``, whose placement is used).
            state: The job's process groups (its pipeline rank decides the chunks).
            ties: Further parameter names that are one weight (``[("model.embed_tokens.
                weight", "lm_head.weight")]``); a parameter the model holds under two names
                in different stages is tied without being named.

        Raises:
            ValueError: The split names a missing module, repeats one or leaves a parameter
                out; a tie names a missing parameter, or parameters of different shapes.
        """
        placed = _placement_of(placement)
        _check_placement(placed, state)
        _check_module_names(model, module_names, placed.num_stages)
        chunks = [
            PipelineChunk(
                [(name, model.get_submodule(name)) for name in module_names[stage]],
                stage=stage,
                placement=placed,
            )
            for stage in placed.stages[state.pipeline_model_parallel_rank]
        ]
        all_ties = _found_ties(model, module_names) + [tuple(t) for t in ties]
        known = dict(model.named_parameters(remove_duplicate=False))
        for tie in ties:
            missing = [n for n in tie if n not in known]
            if missing or len(tie) < 2:
                raise ValueError(
                    f"tie {tuple(tie)}: {type(model).__name__} has no parameter {missing}"
                    if missing else f"a tie needs two or more parameter names, got {tuple(tie)}"
                )  # fmt: skip

        def stage_of(param: str) -> int:
            owner = _owner(module_names, param)
            assert owner is not None, "every parameter is in a stage (checked)"
            return owner[0]

        return cls(chunks, placement=placed, state=state, stage_of=stage_of, ties=all_ties)

    @classmethod
    def from_parts(
        cls,
        parts: Sequence[PartSource],
        *,
        placement: Any,
        state: ParallelState,
        counts: Sequence[int] | None = None,
        ties: Sequence[Sequence[str]] = (),
    ) -> PipelineModel:
        """Split an ordered list of parts (modules, or functions that build one) by counts.

        A part built by a function is built only on the rank that holds it. Parts are named
        by their index (``"3"``), as in an ``nn.Sequential``: a tie names ``"0.weight"``.

        Args:
            parts: The model's parts in order (an ``nn.Sequential`` is one).
            placement: A `Placement` or a resolved schedule.
            state: The job's process groups.
            counts: Parts per virtual stage; by default an even split.
            ties: Parameter names that are one weight (``[("0.weight", "5.weight")]``).

        Raises:
            ValueError: Counts that leave a part out, repeat one or do not match the stages;
                a part listed twice; a tie naming a part that does not exist.
        """
        placed = _placement_of(placement)
        _check_placement(placed, state)
        sources = list(parts)
        split = _check_counts(sources, counts, placed.num_stages)
        starts = [sum(split[:v]) for v in range(len(split))]
        chunks = []
        for stage in placed.stages[state.pipeline_model_parallel_rank]:
            held = range(starts[stage], starts[stage] + split[stage])
            chunks.append(
                PipelineChunk(
                    [(str(i), _built(sources[i], i)) for i in held], stage=stage, placement=placed
                )
            )

        def stage_of(param: str) -> int:
            index = param.partition(".")[0]
            if not index.isdigit() or int(index) >= len(sources):
                raise ValueError(
                    f"tie names {param!r}, but the parts are numbered 0 .. {len(sources) - 1} "
                    "(name a parameter as '<part index>.<name in the part>')"
                )
            return max(v for v, start in enumerate(starts) if start <= int(index))

        for tie in ties:
            if len(tie) < 2:
                raise ValueError(f"a tie needs two or more parameter names, got {tuple(tie)}")
        return cls(chunks, placement=placed, state=state, stage_of=stage_of, ties=ties)

    # ------------------------------------------------------------------ ties
    def _tie(self, names: tuple[str, ...]) -> Tie:
        holders = sorted({self.placement.holder(self._stage_of(n))[0] for n in names})
        return Tie(names, tuple(holders))

    def _local_copies(self, tie: Tie) -> list[tuple[str, torch.nn.Module, str]]:
        """(name, owning module, attribute) of each of the tie's names this rank holds."""
        found = []
        for name in tie.names:
            for chunk in self.chunks:
                for part_name, part in zip(chunk.part_names, chunk.parts, strict=True):
                    if not name.startswith(f"{part_name}."):
                        continue
                    path, _, attr = name[len(part_name) + 1 :].rpartition(".")
                    try:
                        module = part.get_submodule(path) if path else part
                    except AttributeError:
                        module = None
                    if module is None or not isinstance(
                        getattr(module, attr, None), torch.nn.Parameter
                    ):
                        raise ValueError(
                            f"tie {tie.names}: part {part_name!r} has no parameter {name!r}"
                        )
                    found.append((name, module, attr))
        return found

    def _join_copies(self, tie: Tie) -> None:
        """Make this rank's copies one parameter; mark it shared unless it is the first's."""
        copies = self._local_copies(tie)
        tie.params = []
        if not copies:
            return
        first_name, module, attr = copies[0]
        first: torch.nn.Parameter = getattr(module, attr)
        for name, other_module, other_attr in copies[1:]:
            other = getattr(other_module, other_attr)
            if other.shape != first.shape:
                raise ValueError(
                    f"a tie between parameters of different shapes: {first_name!r} is "
                    f"{tuple(first.shape)} and {name!r} is {tuple(other.shape)}"
                )
            if other is not first:
                setattr(other_module, other_attr, first)
        if self.rank != tie.holders[0]:
            first.shared = True  # type: ignore[attr-defined]  # counted by the first holder
        tie.params = [first]

    def _make_group(self, tie: Tie) -> None:
        """The holders' group in every pipeline (every rank takes part in creating them)."""
        if len(tie.holders) < 2:
            return
        for pipeline in self.state.layout["pp"]:
            ranks = [pipeline[h] for h in tie.holders]
            group = dist.new_group(ranks, timeout=self.state.config.timeout)
            if self.state.rank in ranks:
                tie.group = group

    def _check_tie_shapes(self) -> None:
        """The copies on different ranks have one shape (every rank raises otherwise)."""
        refusal = None
        for tie in self.ties:
            if tie.group is None:
                continue
            shapes: list[Any] = [None] * len(tie.holders)
            with collective(f"tie shape exchange {tie.names}", group=tie.group):
                dist.all_gather_object(shapes, tuple(tie.params[0].shape), group=tie.group)
            if len(set(shapes)) > 1 and refusal is None:
                held = ", ".join(
                    f"pipeline rank {h}: {s}" for h, s in zip(tie.holders, shapes, strict=True)
                )
                refusal = f"a tie between parameters of different shapes: {tie.names} ({held})"
        self._agree(refusal)
        self.broadcast_tied_weights()

    def broadcast_tied_weights(self) -> None:
        """Every copy of a tied weight takes the first holder's values (after init or load)."""
        pipeline = self.state.group_ranks("pp")
        for tie in self.ties:
            if tie.group is None or tie.params[0].is_meta:
                continue
            with torch.no_grad(), collective(f"tied-weight broadcast {tie.names}", group=tie.group):
                dist.broadcast(tie.params[0].data, src=pipeline[tie.holders[0]], group=tie.group)

    def reduce_tied_grads(self) -> None:
        """Sum each tied weight's gradient over the ranks holding different copies.

        Call it after the step's forward and backward, before the data-parallel gradient
        sync (``finish_grad_sync``: the sum commutes with it, and a distributed optimizer
        keeps only its shard afterwards) and before the optimizer step. A ``main_grad``
        (pp-optim's grad buffers) is summed where there is one, else ``grad``.
        """
        for tie in self.ties:
            if tie.group is None:
                continue
            param = tie.params[0]
            grad = getattr(param, "main_grad", None)
            if grad is None:
                if param.grad is None:  # unused this step: the other copies still need a share
                    param.grad = torch.zeros_like(param)
                grad = param.grad
            with collective(f"tied-weight gradient all-reduce {tie.names}", group=tie.group):
                dist.all_reduce(grad, group=tie.group)

    # ------------------------------------------------------------------ weights
    def materialize(
        self,
        device: torch.device | str,
        init: Callable[[str, torch.nn.Module], None] | None = None,
    ) -> None:
        """Allocate this rank's chunks on `device` (from the meta device) and initialise them.

        Args:
            device: Where the parameters go.
            init: ``init(part_name, part)`` initialises one part; by default every submodule
                with a ``reset_parameters`` runs it. Buffers computed at construction (rotary
                frequencies) are the init's job; or load weights afterwards with
                `PipelineChunk.load_model_state_dict` and call `broadcast_tied_weights`.
        """
        for chunk in self.chunks:
            chunk.to_empty(device=device)
            for name, part in zip(chunk.part_names, chunk.parts, strict=True):
                if init is not None:
                    init(name, part)
                    continue
                for module in part.modules():
                    reset = getattr(module, "reset_parameters", None)
                    if callable(reset):
                        reset()
        for tie in self.ties:
            self._join_copies(tie)
        self.broadcast_tied_weights()

    # ------------------------------------------------------------------ contracts
    def declare_contracts(self, boundaries: Sequence[Boundary]) -> None:
        """Set what crosses each boundary without a sample: one `Boundary` per stage but the last.

        Raises:
            ValueError: Not one boundary per boundary of the pipeline.
        """
        expected = self.placement.num_stages - 1
        if len(boundaries) != expected:
            raise ValueError(
                f"{len(boundaries)} boundaries declared for {self.placement.num_stages} virtual "
                f"stages; give {expected}, what stage v sends to stage v + 1 for each v"
            )
        for v, boundary in enumerate(boundaries):
            if not boundary.grad_specs:
                raise ValueError(
                    f"virtual stage {v} sends {boundary.describe()}: no floating-point tensor, "
                    "so no gradient can flow back to it; send the hidden states along, or "
                    "compute these tensors on the next stage from the microbatch"
                )
        self.contracts = list(boundaries)
        for chunk in self.chunks:
            v = chunk.stage
            chunk.input_boundary = self.contracts[v - 1] if v > 0 else None
            chunk.output_boundary = self.contracts[v] if v < expected else None

    def infer_contracts(self, *inputs: Any, **side: Any) -> list[Boundary]:
        """Infer every boundary from one forward of a sample microbatch, stage after stage.

        Every rank of the pipeline calls it with the same sample (the first stage reads
        `inputs`; every stage gets `side`, as in a step). The rank holding each stage runs
        it without gradients on what the stage before produced and hands the result on
        over the pipeline group; nothing is trained. The last stage runs on the sample too
        (its output is dropped), so a part that cannot take what the one before returns
        (an output layer listed before the final norm) is refused here, not at step 1.

        Returns:
            What stage v sends to stage v + 1, for each v (also set on the chunks).

        Raises:
            TypeError: A stage that is not the last returned something other than tensors;
                naming the stage and its last part.
            RuntimeError: A stage failed on the sample, naming the stage, the part that
                failed and what it was given (raised on every rank of the pipeline).
        """
        pipeline = self.state.group_ranks("pp")
        group = self.state.group("pp")
        last = self.placement.num_stages - 1
        value: Any = None
        boundaries: list[Boundary] = []
        for v in range(last + 1):
            holder, chunk_index = self.placement.holder(v)
            sent: list[Any] = [None]
            if holder == self.rank:
                received = (boundaries[-1], value) if boundaries else None
                sent[0] = self._sample_forward(self.chunks[chunk_index], received, inputs, side)
            # The holder's outcome, refusal included, reaches every rank of the pipeline.
            with collective(f"contract inference of virtual stage {v}", group=group):
                dist.broadcast_object_list(sent, src=pipeline[holder], group=group)
            status, value = sent[0]
            if status != "ok":
                raise (TypeError if status == "type" else RuntimeError)(value)
            if v < last:
                boundaries.append(Boundary.of(value, f"virtual stage {v}"))
        self.declare_contracts(boundaries)
        return boundaries

    def _sample_forward(
        self,
        chunk: PipelineChunk,
        received: tuple[Boundary, Any] | None,
        inputs: Sequence[Any],
        side: Mapping[str, Any],
    ) -> tuple[str, Any]:
        """Run `chunk` on the sample (and what the stage before sent, by its boundary).

        Returns:
            ("ok", the output on the CPU; None for the last stage), or ("type" or "error",
            the message).
        """
        device = next((p.device for p in chunk.parameters()), torch.device("cpu"))
        if received is not None:
            boundary, value = received
            chunk.input_boundary = boundary
            sent = boundary.flatten(value, f"virtual stage {chunk.stage - 1}")
            chunk.set_input_tensor([t.to(device) for t in sent])
        calls: list[tuple[int, str]] = []  # (part index, what it was given), as parts start
        try:
            with torch.no_grad(), _parts_watched(chunk, calls):
                output = chunk(*inputs, **side)
        except Exception as error:  # every rank must hear of it, or they wait for this one
            return "error", _sample_failure(chunk, calls, error)
        finally:
            chunk.set_input_tensor(None)
        if chunk.is_last:
            return "ok", None  # what the loss takes is the loss function's business
        where = f"virtual stage {chunk.stage} (its last part {chunk.part_names[-1]!r})"
        try:
            produced = Boundary.of(output, where)
        except TypeError as error:
            return "type", str(error)
        tensors = produced.flatten(output, where)
        return "ok", produced.unflatten([t.detach().cpu() for t in tensors])


@contextlib.contextmanager
def _parts_watched(chunk: PipelineChunk, calls: list[tuple[int, str]]) -> Iterator[None]:
    """Within it, each part of `chunk` that starts adds (its index, what it was given)."""

    def watcher(index: int) -> Callable[..., None]:
        def started(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls.append((index, _given(args, kwargs)))

        return started

    handles = [
        part.register_forward_pre_hook(watcher(i), with_kwargs=True)
        for i, part in enumerate(chunk.parts)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _given(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """What a part was called with, in words (``a tensor (2, 16, 32) float32``).

    Its positional inputs, or its keyword inputs where it has none (a dict from the part
    before); keyword inputs of the chunk beside positional ones are left out.
    """
    value: Any = (args[0] if len(args) == 1 else args) if args else dict(kwargs)
    try:
        return Boundary.of(value, "the part before").describe()
    except TypeError:
        return ", ".join(type(v).__name__ for v in (*args, *kwargs.values())) or "nothing"


def _sample_failure(
    chunk: PipelineChunk, calls: Sequence[tuple[int, str]], error: Exception
) -> str:
    """The refusal of a stage that raised on the sample: the stage, the part, its input."""
    stage = f"virtual stage {chunk.stage} failed on the sample microbatch"
    if not calls:
        return f"{stage}: {error!r}"
    index, given = calls[-1]
    return (
        f"{stage} in its part {chunk.part_names[index]!r} (parts {list(chunk.part_names)}), "
        f"given {given}: {error!r}; check that each stage's parts are listed in the order the "
        "model runs them (module_names or parts) and that the sample is one microbatch of "
        "the model's inputs"
    )


def _merged(ties: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """Ties sharing a name joined into one (found and declared alike), names in first order."""
    groups: list[list[str]] = []
    for tie in ties:
        touching = [g for g in groups if set(g) & set(tie)]
        merged = [n for g in touching for n in g]
        merged += [n for n in tie if n not in merged]
        groups = [g for g in groups if g not in touching] + [merged]
    return [tuple(g) for g in groups]


def _check_placement(placement: Placement, state: ParallelState) -> None:
    """The placement is for this pipeline's size.

    Raises:
        ValueError: Naming both sizes.
    """
    pp = state.pipeline_model_parallel_size
    if placement.pp_size != pp:
        raise ValueError(
            f"the placement {placement} is for {placement.pp_size} pipeline ranks, but the "
            f"pipeline has {pp}; take the placement of the schedule resolved for pp {pp}"
        )


def _check_counts(parts: Sequence[Any], counts: Sequence[int] | None, stages: int) -> list[int]:
    """Parts per virtual stage: `counts`, or an even split; refused if they do not fit.

    Raises:
        ValueError: Naming the counts, the number of parts and valid choices.
    """
    ids = [id(p) for p in parts if isinstance(p, torch.nn.Module)]
    if len(ids) != len(set(ids)):
        twice = next(i for i, p in enumerate(parts) if ids.count(id(p)) > 1)
        raise ValueError(f"part {twice} is listed more than once; each part is one stage's")
    if counts is None:
        if len(parts) % stages:
            raise ValueError(
                f"{len(parts)} parts do not split evenly over {stages} virtual stages; give "
                f"counts (parts per stage, summing to {len(parts)})"
            )
        return [len(parts) // stages] * stages
    split = list(counts)
    if len(split) != stages or any(c < 1 for c in split) or sum(split) != len(parts):
        raise ValueError(
            f"counts {split} do not split {len(parts)} parts over {stages} virtual stages: "
            f"give {stages} counts of 1 or more summing to {len(parts)}"
            + (
                f" (counts {split} sum to {sum(split)}: "
                f"{'leaving parts out' if sum(split) < len(parts) else 'repeating parts'})"
                if sum(split) != len(parts)
                else ""
            )
        )
    return split


def _built(source: PartSource, index: int) -> torch.nn.Module:
    """The part itself, or what its function builds (only here, where it lives)."""
    if isinstance(source, torch.nn.Module):
        return source
    built = source()
    if not isinstance(built, torch.nn.Module):
        raise TypeError(
            f"part {index}'s function returned {type(built).__name__}, not a torch.nn.Module"
        )
    return built
