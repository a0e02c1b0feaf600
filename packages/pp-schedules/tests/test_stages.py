"""PipelineModel: any model split into stages, contracts inferred, several tensors, ties.

The model is batch-first and hands the next stage a dict of three tensors (hidden states, a
skip connection and integer token ids), takes a per-microbatch input from the data iterator
on every stage, and ties its output layer to its embedding. Every schedule trains it at
pp 2 (and dp 2 x pp 2) with the same losses and weights as one process. On the V placement
(zbv, dualpipev) rank 0 holds the first stage and the last, so the tie joins two of its own
chunks: one parameter, whose gradient both chunks' backwards add to.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the usual spelling

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import (
    PipelineChunk,
    PipelineModel,
    ScheduleConfig,
    get_forward_backward_func,
    resolve_schedule,
    split_module_names,
)
from pp_state import ParallelConfig, ParallelState, Placement
from pp_testing import run_distributed

VOCAB, HIDDEN, SEQ, BATCH, BLOCKS, MICROBATCHES, STEPS = 11, 8, 5, 2, 4, 4, 3
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")
TOLERANCE = 1e-6
Microbatch = dict[str, torch.Tensor]


class Embed(torch.nn.Module):
    """Token ids (batch, seq) -> the first boundary: a dict of three tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.emb(ids)
        return {"hidden": hidden, "skip": hidden * 0.5, "ids": ids}


class Block(torch.nn.Module):
    """A residual layer that also reads the skip tensor, the ids and a side input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(
        self, hidden: torch.Tensor, skip: torch.Tensor, ids: torch.Tensor, *, shift: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        mixed = hidden + torch.tanh(self.linear(hidden + 0.1 * skip)) + shift
        return {"hidden": mixed, "skip": skip + 0.01 * ids.unsqueeze(-1), "ids": ids}


class Head(torch.nn.Module):
    """Logits from the hidden states with the embedding's matrix (tied)."""

    def __init__(self, weight: torch.nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = (
            weight if weight is not None else torch.nn.Parameter(torch.empty(VOCAB, HIDDEN))
        )

    def forward(self, hidden: torch.Tensor, skip: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden + skip, self.weight)


class Model(torch.nn.Module):
    """The whole model, with the output layer's weight the embedding's (Hugging Face's way)."""

    def __init__(self, seed: int = 5) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = Embed()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = Head(cast(torch.nn.Parameter, self.embed.emb.weight))


def module_names(stages: int) -> list[list[str]]:
    """Embed and the head at the ends, blocks spread over the stages."""
    names = ["embed", *(f"blocks.{i}" for i in range(BLOCKS)), "head"]
    if stages == 2:
        return [names[:3], names[3:]]
    return [names[:2], names[2:3], names[3:4], names[4:]]


def microbatches(step: int, count: int) -> list[Microbatch]:
    generator = torch.Generator().manual_seed(100 + step)
    return [
        {
            "ids": torch.randint(VOCAB, (BATCH, SEQ), generator=generator),
            "labels": torch.randint(VOCAB, (BATCH, SEQ), generator=generator),
            "shift": 0.01 * torch.randn(BATCH, SEQ, 1, generator=generator),
        }
        for _ in range(count)
    ]


def _loss(labels: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    return loss, {"loss": loss.detach()}


def forward_step(
    data: Iterator[Microbatch], chunk: torch.nn.Module
) -> tuple[torch.Tensor, Callable[..., Any]]:
    batch = next(data)
    return chunk(batch["ids"], shift=batch["shift"]), functools.partial(_loss, batch["labels"])


def reference(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Each step's mean loss and the final weights of the whole model in one process."""
    model = Model()
    whole = PipelineChunk(
        [(n, model.get_submodule(n)) for n in module_names(2)[0] + module_names(2)[1]],
        stage=0,
        placement=Placement.looped(1),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        batches = microbatches(step, dp * MICROBATCHES)
        total = 0.0
        for batch in batches:
            loss, _ = _loss(batch["labels"], whole(batch["ids"], shift=batch["shift"]))
            (loss / len(batches)).backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total / len(batches))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(schedule: str, state: ParallelState, comm: P2PCommunicator) -> tuple[Any, ...]:
    """Train with `schedule`; the last stage's losses and this rank's weights by model name."""
    pp, dp = state.pipeline_model_parallel_size, state.data_parallel_size
    resolved = resolve_schedule(schedule, pp_size=pp, microbatch_counts=[MICROBATCHES])
    vp = resolved.vp_size  # the schedule's own: 2 for interleaved_1f1b and zbv
    model = Model()
    # The tie is found (one parameter, two names) and declared too: summed once all the same.
    pipe = PipelineModel.from_model(
        model, module_names(pp * vp), placement=resolved, state=state,
        ties=[("head.weight", "embed.emb.weight")],
    )  # fmt: skip
    pipe.infer_contracts(microbatches(0, 1)[0]["ids"], shift=microbatches(0, 1)[0]["shift"])
    params = list({id(p): p for c in pipe.chunks for p in c.parameters()}.values())
    optimizer = torch.optim.Adam(params, lr=0.01)
    forward_backward = get_forward_backward_func(comm, resolved=resolved)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        mine = microbatches(step, dp * MICROBATCHES)[
            state.data_parallel_rank * MICROBATCHES : (state.data_parallel_rank + 1) * MICROBATCHES
        ]
        dicts = forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(mine) for _ in pipe.chunks],
            model=pipe.chunks,
            num_microbatches=MICROBATCHES,
        )
        pipe.reduce_tied_grads()
        for param in params:  # data parallelism by hand: the mean gradient
            assert param.grad is not None
            dist.all_reduce(param.grad, group=state.group("dp"))
            param.grad.div_(dp)
        optimizer.step()
        if dicts:
            loss = torch.stack([d["loss"] for d in dicts]).mean()
            dist.all_reduce(loss, group=state.group("dp"))
            losses.append(float(loss) / dp)
    weights = {k: v.detach().clone() for c in pipe.chunks for k, v in c.model_state_dict().items()}
    return losses, weights, [str(b.describe()) for b in pipe.contracts or []]


def _every_schedule(pp: int) -> dict[str, tuple[Any, ...]]:
    timeout = datetime.timedelta(seconds=60)
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=pp, timeout=timeout))
    comm = P2PCommunicator.from_parallel_state(state, config=CommConfig(timeout=timeout))
    try:
        return {schedule: _train(schedule, state, comm) for schedule in SCHEDULES}
    finally:
        comm.destroy()
        state.destroy()


def _check(results: list[dict[str, tuple[Any, ...]]], dp: int) -> None:
    losses, weights = reference(dp)
    for schedule in SCHEDULES:
        reported = [r[schedule][0] for r in results if r[schedule][0]]
        assert reported, schedule
        for pipelined in reported:
            worst = max(abs(a - b) / abs(b) for a, b in zip(pipelined, losses, strict=True))
            assert worst <= TOLERANCE, (schedule, pipelined, losses)
        for result in results:
            for name, value in result[schedule][1].items():
                torch.testing.assert_close(value, weights[name], rtol=1e-5, atol=1e-6)
        # Every name of the model is trained somewhere (the tie under both of its names).
        assert set().union(*(r[schedule][1] for r in results)) == set(weights), schedule


def test_every_schedule_trains_a_dict_boundary_model_as_one_process_at_pp2() -> None:
    results = run_distributed(_every_schedule, 2, 2, timeout=180)
    _check(results, dp=1)
    contracts = results[0]["1f1b"][2]
    assert contracts == [
        f"a dict {{hidden: ({BATCH}, {SEQ}, {HIDDEN}) float32, skip: ({BATCH}, {SEQ}, "
        f"{HIDDEN}) float32, ids: ({BATCH}, {SEQ}) int64}}"
    ]


def test_every_schedule_trains_as_one_process_at_dp2_pp2() -> None:
    """Four ranks, five schedules in one process group."""
    results = run_distributed(_every_schedule, 4, 2, timeout=240)
    _check(results, dp=2)


# ---------------------------------------------------------------- a tie within a rank
def _named_grads(parts: Iterator[tuple[str, torch.nn.Module]]) -> dict[str, torch.Tensor]:
    """Each parameter's gradient under the whole model's names (a tie under each name)."""
    return {
        f"{name}.{key}": param.grad.clone()
        for name, part in parts
        for key, param in part.named_parameters(remove_duplicate=False)
        if param.grad is not None
    }


def _one_process_grads() -> dict[str, torch.Tensor]:
    """One step's gradients of the whole model in one process (mean loss over microbatches)."""
    model = Model()
    names = module_names(2)[0] + module_names(2)[1]
    whole = PipelineChunk([(n, model.get_submodule(n)) for n in names], stage=0,
                          placement=Placement.looped(1))  # fmt: skip
    for batch in microbatches(0, MICROBATCHES):
        loss, _ = _loss(batch["labels"], whole(batch["ids"], shift=batch["shift"]))
        (loss / MICROBATCHES).backward()
    return _named_grads((n, model.get_submodule(n)) for n in names)


def _v_step(runs: list[tuple[str, str | None]]) -> dict[str, Any]:
    """One step of each (schedule, fb_overlap) on the V at pp 2: this rank's gradients."""
    timeout = datetime.timedelta(seconds=60)
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2, timeout=timeout))
    comm = P2PCommunicator.from_parallel_state(state, config=CommConfig(timeout=timeout))
    found: dict[str, Any] = {}
    for schedule, fb_overlap in runs:
        resolved = resolve_schedule(schedule, pp_size=2, microbatch_counts=[MICROBATCHES])
        pipe = PipelineModel.from_model(Model(), module_names(4), placement=resolved, state=state)
        sample = microbatches(0, 1)[0]
        pipe.infer_contracts(sample["ids"], shift=sample["shift"])
        config = ScheduleConfig(fb_overlap=fb_overlap)
        forward_backward = get_forward_backward_func(comm, resolved, config=config)
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(microbatches(0, MICROBATCHES)) for _ in pipe.chunks],
            model=pipe.chunks, num_microbatches=MICROBATCHES,
        )  # fmt: skip
        pipe.reduce_tied_grads()
        found[f"{schedule} {fb_overlap}"] = {
            "grads": _named_grads(
                (name, part) for c in pipe.chunks
                for name, part in zip(c.part_names, c.parts, strict=True)
            ),
            "ties": [(t.names, t.holders, t.group is None, len(t.params)) for t in pipe.ties],
        }  # fmt: skip
    comm.destroy()
    state.destroy()
    return found


def test_a_weight_tied_across_a_ranks_two_stages_gets_its_whole_gradient_on_the_v() -> None:
    """Rank 0 holds stage 0 (the embedding) and stage 3 (the head) at pp 2 on the V.

    Both copies are one parameter on rank 0, and its gradient after a step (ZB-V; DualPipeV
    with its F&B steps in order and in two threads) is one process's, as is every other.
    """
    runs = [("zbv", None), ("dualpipev", "sequential"), ("dualpipev", "threads")]
    results = run_distributed(_v_step, 2, runs, timeout=180)
    expected = _one_process_grads()
    tied = ("embed.emb.weight", "head.weight")
    for run in (f"{schedule} {overlap}" for schedule, overlap in runs):
        zero = results[0][run]
        assert zero["ties"] == [(tied, (0,), True, 1)], run  # both copies on rank 0, joined
        for name in tied:
            torch.testing.assert_close(zero["grads"][name], expected[name], rtol=1e-5,
                                       atol=1e-7, msg=f"{run}: {name}")  # fmt: skip
        grads = {**results[1][run]["grads"], **zero["grads"]}
        assert set(grads) == set(expected), run
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7,
                                       msg=f"{run}: {name}")  # fmt: skip


# ---------------------------------------------------------------- parts, meta, shapes


def _parts_on_meta() -> tuple[list[Any], list[bool], list[Any]]:
    """from_parts with functions (built where they live) and a model built on meta, loaded."""
    timeout = datetime.timedelta(seconds=60)
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2, timeout=timeout))
    comm = P2PCommunicator.from_parallel_state(
        state, config=CommConfig(timeout=timeout, variable_seq_lengths=True)
    )
    built: list[bool] = [False] * (BLOCKS + 2)

    def factory(index: int) -> Callable[[], torch.nn.Module]:
        def build() -> torch.nn.Module:
            built[index] = True
            with torch.device("meta"):
                return Embed() if index == 0 else Head() if index == BLOCKS + 1 else Block()

        return build

    resolved = resolve_schedule(
        "1f1b", pp_size=2, microbatch_counts=[MICROBATCHES], exchanges_shapes=True
    )
    pipe = PipelineModel.from_parts(
        [factory(i) for i in range(BLOCKS + 2)],
        placement=resolved,
        state=state,
        counts=[2, 4],
        ties=[("0.emb.weight", f"{BLOCKS + 1}.weight")],
    )
    # Load the whole model's weights, named by part index.
    whole = Model()
    names = ["embed", *(f"blocks.{i}" for i in range(BLOCKS)), "head"]
    by_index = {
        f"{i}.{key}": value
        for i, name in enumerate(names)
        for key, value in whole.get_submodule(name).state_dict().items()
    }
    pipe.materialize("cpu")
    for chunk in pipe.chunks:
        chunk.load_model_state_dict(by_index)
    pipe.broadcast_tied_weights()
    # Sequences of different lengths in one step: shapes travel with the data.
    lengths = [SEQ, SEQ + 2, SEQ - 1, SEQ]
    batches = []
    for length, batch in zip(lengths, microbatches(0, MICROBATCHES), strict=True):
        ids = torch.randint(VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(length))
        batches.append({"ids": ids, "labels": ids.flip(1), "shift": batch["shift"][:, :1]})
    pipe.infer_contracts(batches[0]["ids"], shift=batches[0]["shift"])
    forward_backward = get_forward_backward_func(comm, resolved=resolved)
    dicts = forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=pipe.chunks,
        num_microbatches=MICROBATCHES,
    )
    pipe.reduce_tied_grads()
    grads = [p.grad.clone() for c in pipe.chunks for p in c.parameters() if p.grad is not None]
    shared = [bool(getattr(p, "shared", False)) for c in pipe.chunks for p in c.parameters()]
    comm.destroy()
    state.destroy()
    return [float(d["loss"]) for d in dicts], built, [grads, shared, batches]


def test_parts_built_where_they_live_on_meta_and_loaded_train_with_variable_lengths() -> None:
    results = run_distributed(_parts_on_meta, 2, timeout=120)
    (_, built0, (grads0, shared0, batches)), (losses, built1, (grads1, shared1, _)) = results
    # Rank 0 built the embedding and one block; rank 1 the other three blocks and the head.
    assert built0 == [True, True, False, False, False, False]
    assert built1 == [False, False, True, True, True, True]
    # The head's copy of the tied weight is marked shared (norms count the embedding's).
    assert shared0 == [False] * len(shared0)
    assert shared1[-1]
    assert not any(shared1[:-1])
    model = Model()
    whole = PipelineChunk(
        [(n, model.get_submodule(n)) for n in module_names(2)[0] + module_names(2)[1]],
        stage=0,
        placement=Placement.looped(1),
    )
    expected = []
    for batch in batches:
        loss, _ = _loss(batch["labels"], whole(batch["ids"], shift=batch["shift"]))
        (loss / len(batches)).backward()
        expected.append(float(loss.detach()))
    assert losses == pytest.approx(expected, rel=TOLERANCE)
    reference_grads = [p.grad for p in model.parameters()]
    # Rank 0: the embedding (the tie's sum) and block 0; rank 1: blocks 1-3 and the head.
    torch.testing.assert_close(grads0[0], reference_grads[0])
    torch.testing.assert_close(grads1[-1], reference_grads[0])
    torch.testing.assert_close(grads0[1:], reference_grads[1:3])
    torch.testing.assert_close(grads1[:-1], reference_grads[3:])


# ---------------------------------------------------------------- refusals


def _refusals() -> dict[str, str]:
    """One message per bad input, every one raised before any step."""
    timeout = datetime.timedelta(seconds=30)
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2, timeout=timeout))
    comm = P2PCommunicator.from_parallel_state(state, config=CommConfig(timeout=timeout))
    looped = resolve_schedule("1f1b", pp_size=2, microbatch_counts=[MICROBATCHES])
    names = module_names(2)
    cases: dict[str, Callable[[], object]] = {
        "left out": lambda: PipelineModel.from_model(
            Model(), [names[0], names[1][:-1]], placement=looped, state=state
        ),
        "repeated": lambda: PipelineModel.from_model(
            Model(), [names[0], [*names[1], "blocks.1"]], placement=looped, state=state
        ),
        "nested": lambda: PipelineModel.from_model(
            Model(), [[*names[0], "blocks"], names[1]], placement=looped, state=state
        ),
        "missing": lambda: PipelineModel.from_model(
            Model(), [names[0], ["blocks.2", "blocks.7", "head"]], placement=looped, state=state
        ),
        "stages": lambda: PipelineModel.from_model(
            Model(), [names[0] + names[1]], placement=looped, state=state
        ),
        "counts": lambda: PipelineModel.from_parts(
            [torch.nn.Linear(2, 2) for _ in range(5)], placement=looped, state=state, counts=[2, 2]
        ),
        "even": lambda: PipelineModel.from_parts(
            [torch.nn.Linear(2, 2) for _ in range(5)], placement=looped, state=state
        ),
        "twice": lambda: PipelineModel.from_parts(
            [layer := torch.nn.Linear(2, 2), layer], placement=looped, state=state
        ),
        "tie shapes": lambda: PipelineModel.from_parts(
            [torch.nn.Linear(2, 3), torch.nn.Linear(2, 2)],
            placement=looped,
            state=state,
            ties=[("0.weight", "1.weight")],
        ),
        "tie name": lambda: PipelineModel.from_model(
            Model(), names, placement=looped, state=state, ties=[("embed.emb.weight", "nope")]
        ),
        "tie typo": lambda: PipelineModel.from_parts(
            [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)],
            placement=looped,
            state=state,
            ties=[("0.weight", "1.wieght")],
        ),
        "integers only": lambda: PipelineModel.from_parts(
            [torch.nn.Identity(), torch.nn.Identity()], placement=looped, state=state
        ).infer_contracts(torch.ones(2, dtype=torch.long)),
        "not tensors": lambda: PipelineModel.from_parts(
            [_Untyped(), torch.nn.Identity()], placement=looped, state=state
        ).infer_contracts(torch.ones(2)),
        "last stage order": lambda: PipelineModel.from_model(
            _Decoder(), DECODER_OUT_OF_ORDER, placement=looped, state=state
        ).infer_contracts(microbatches(0, 1)[0]["ids"]),
        "misspelt": lambda: PipelineModel.from_model(
            _Decoder(), DECODER_MISSPELT, placement=looped, state=state
        ),
        "unknown top": lambda: PipelineModel.from_model(
            _Decoder(),
            [DECODER_MISSPELT[0], ["model.norm", "lm_head", "head"]],
            placement=looped,
            state=state,
        ),
        "placement": lambda: _run_on_other_placement(state, comm),
    }
    messages = {}
    for name, case in cases.items():
        try:
            case()
        except (ValueError, TypeError, RuntimeError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
        else:
            messages[name] = "no error"
    comm.destroy()
    state.destroy()
    return messages


# The output layer listed before the final norm: only the last stage's own forward fails.
DECODER_OUT_OF_ORDER = [
    ["model.embed_tokens", "model.layers.0"],
    ["model.layers.1", "lm_head", "model.norm"],
]
# One letter short ("layer" for "layers"): a module that does not exist.
DECODER_MISSPELT = [
    ["model.embed_tokens", "model.layers.0"],
    ["model.layer.1", "model.norm", "lm_head"],
]


class _Decoder(torch.nn.Module):
    """Embedding, two layers, a final norm and an output layer, named as Llama's are."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.model.layers = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
        self.model.norm = torch.nn.LayerNorm(HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB)


class _Untyped(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
        return x, "a label"


def _run_on_other_placement(state: ParallelState, comm: P2PCommunicator) -> None:
    """Chunks built looped, run under ZB-V (the V placement)."""
    looped = resolve_schedule("interleaved_1f1b", pp_size=2, vp_size=2, microbatch_counts=[4])
    pipe = PipelineModel.from_model(Model(), module_names(4), placement=looped, state=state)
    pipe.infer_contracts(microbatches(0, 1)[0]["ids"], shift=microbatches(0, 1)[0]["shift"])
    zbv = resolve_schedule("zbv", pp_size=2, vp_size=2, microbatch_counts=[4])
    get_forward_backward_func(comm, resolved=zbv)(
        forward_step_func=forward_step,
        data_iterator=[iter(microbatches(0, 4)) for _ in pipe.chunks],
        model=pipe.chunks,
        num_microbatches=4,
    )


@pytest.fixture(scope="module")
def refusals() -> list[dict[str, str]]:
    return run_distributed(_refusals, 2, timeout=120)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("left out", ["parameters of Model are in no virtual stage", "head.weight"]),
        ("repeated", ["'blocks.1' of virtual stage 1 repeats 'blocks.1' of virtual stage 0"]),
        ("nested", ["'blocks' of virtual stage 0 contains 'blocks.0' of virtual stage 0"]),
        ("missing", ["virtual stage 1: Model has no module 'blocks.7'", "'0', '1', '2', '3'"]),
        (
            "misspelt",
            [
                "virtual stage 1: _Decoder has no module 'model.layer.1'",
                "the modules under 'model' (the longest part of the name that exists) are "
                "['embed_tokens', 'layers', 'norm']",
                "did you mean 'model.layers.1'?",
            ],
        ),
        (
            "unknown top",
            [
                "_Decoder has no module 'head'; the modules under the model are ['model', "
                "'lm_head']; did you mean 'lm_head'?"
            ],
        ),
        ("stages", ["1 lists for 2 virtual stages"]),
        ("counts", ["counts [2, 2] do not split 5 parts", "leaving parts out"]),
        ("even", ["5 parts do not split evenly over 2 virtual stages"]),
        ("twice", ["part 0 is listed more than once"]),
        ("tie shapes", ["different shapes", "(3, 2)", "(2, 2)"]),
        ("tie name", ["has no parameter ['nope']"]),
        ("not tensors", ["TypeError", "virtual stage 0", "items [1] are not tensors (str)"]),
        (
            # The output layer listed before the norm: the last stage runs on the sample too.
            "last stage order",
            [
                "RuntimeError: virtual stage 1 failed on the sample microbatch in its part "
                "'model.norm' (parts ['model.layers.1', 'lm_head', 'model.norm'])",
                f"given a tensor ({BATCH}, {SEQ}, {VOCAB}) float32",
                "normalized_shape=[8]",
                "in the order the model runs them",
            ],
        ),
        ("tie typo", ["part '1' has no parameter '1.wieght'"]),
        ("integers only", ["virtual stage 0 sends a tensor (2,) int64: no floating-point"]),
        (
            "placement",
            [
                "built for the looped placement (virtual stages [",
                "zbv schedule runs the v placement (virtual stages [",
                "placement=resolve_schedule(...)",
            ],
        ),
    ],
)
def test_bad_input_is_refused_before_any_step_naming_the_part(
    refusals: list[dict[str, str]], case: str, words: list[str]
) -> None:
    for messages in refusals:
        for word in words:
            assert word in messages[case], messages[case]


def test_module_names_split_layers_near_evenly_with_the_ends_at_the_ends() -> None:
    layers = [f"layers.{i}" for i in range(5)]
    assert split_module_names(layers, 2, first=["embed"], last=["norm", "head"]) == [
        ["embed", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "layers.4", "norm", "head"],
    ]
    assert split_module_names(layers, 5)[4] == ["layers.4"]
    with pytest.raises(ValueError, match="cannot split 5 layers over 6 virtual stages"):
        split_module_names(layers, 6)


@pytest.mark.parametrize(
    ("schedule", "chunks"),
    [("1f1b", 1), ("gpipe", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2)],
)
def test_a_schedule_resolves_on_its_own_chunks_per_rank(schedule: str, chunks: int) -> None:
    resolved = resolve_schedule(schedule, pp_size=2, microbatch_counts=[4])
    assert resolved.vp_size == chunks
    assert resolved.placement.vp_size == chunks


def test_a_missing_layer_number_is_not_taken_for_a_misspelling(
    refusals: list[dict[str, str]],
) -> None:
    for messages in refusals:
        assert "did you mean" not in messages["missing"], messages["missing"]
