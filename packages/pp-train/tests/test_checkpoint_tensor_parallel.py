"""Checkpoints across tensor-parallel sizes: a small hand-made model, then the bundled GPT.

The hand-made model's parameters carry Megatron's tensor-parallel marks as pp-tensor's layers set them: a word
embedding split along the (padded) vocabulary, a column-parallel weight and bias (dim 0), a
row-parallel weight (dim 1) and a replicated norm weight. Each one's full initial value
depends only on its name, and each element's gradient only on its place in the full tensor
(the loss is a fixed weighted sum of the parameters), so Adam takes the same steps at every
(tensor, pipeline, data) layout: loading at another layout must give the saved full tensors,
and the step after the load must give the saving run's next step exactly.

The GPT runs through the command (`pp_train.app.command.run`): saved at tp 2 (and tp 2 x pp
2, tp 2 x dp 2 with the distributed optimizer), resumed at other sizes with the losses of an
unbroken run, or with another padded vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import pickle
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_optim import DDPConfig, DistributedOptimizer, LRScheduleConfig, OptimizerConfig
from pp_state import ParallelConfig, ParallelState
from pp_tensor import get_rng_tracker, join_shards, model_parallel_manual_seed, shard_of
from pp_testing import run_distributed
from pp_train import setup_model_and_optimizer
from pp_train.app import build_parser, validate_args
from pp_train.app.command import run
from pp_train.checkpoint import (
    AsyncCheckpointSaver,
    CheckpointError,
    get_rng_state,
    read_tracker,
    save_checkpoint,
    set_rng_state,
)
from pp_train.checkpoint.__main__ import main as checkpoint_main
from pp_train.checkpoint.keys import main_params
from pp_train.step import finalize_model_grads
from pp_train.wrappers import unwrap_model

VOCAB, HIDDEN, FFN = 13, 4, 8
"""Real tokens (the tokenizer's vocabulary), hidden and MLP sizes."""

EMBEDDING = "embedding.word_embeddings.weight"
PARAMS: dict[str, tuple[int, int, tuple[int, ...]]] = {
    # global name: (pipeline stage of 2, split dim (-1: replicated), full shape; rows: padded)
    EMBEDDING: (0, 0, (0, HIDDEN)),
    "layers.0.mlp.fc1.weight": (0, 0, (FFN, HIDDEN)),
    "layers.0.mlp.fc1.bias": (0, 0, (FFN,)),
    "layers.1.mlp.fc2.weight": (1, 1, (HIDDEN, FFN)),
    "final_layernorm.weight": (1, -1, (HIDDEN,)),
}
SAVED_AT = 2


@dataclasses.dataclass(frozen=True)
class Layout:
    """One run's layout and settings (picklable, sent to every rank)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    padded: int = 16
    distributed: bool = False
    bf16: bool = False
    ckpt_format: str = "torch_dist"
    async_save: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def _shape(name: str, padded: int) -> tuple[int, ...]:
    shape = PARAMS[name][2]
    return (padded, *shape[1:]) if name == EMBEDDING else shape


def _full_init(name: str, padded: int) -> torch.Tensor:
    """The full initial value: the same real rows at any padded vocabulary, zero padding."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name == EMBEDDING:
        real = torch.randn(VOCAB, HIDDEN, generator=generator)
        return torch.cat([real, torch.zeros(padded - VOCAB, HIDDEN)])
    return torch.randn(_shape(name, padded), generator=generator)


def _full_weight(name: str, padded: int) -> torch.Tensor:
    """d loss / d element: a function of the element's place in the full tensor only."""
    shape = _shape(name, padded)
    flat = torch.arange(math.prod(shape), dtype=torch.float32)
    return torch.sin(flat * 0.7 + zlib.crc32(name.encode()) % 7).reshape(shape)


def _part(full: torch.Tensor, dim: int, layout: Layout, tp_rank: int) -> torch.Tensor:
    return full if dim < 0 else shard_of(full, dim, tp_rank, layout.tp)


class Tiny(torch.nn.Module):
    """This rank's part of the stages' parameters, marked as pp-tensor's layers mark them."""

    def __init__(self, layout: Layout, tp_rank: int, stage: int) -> None:
        super().__init__()
        self.names: dict[str, str] = {}
        for name, (owner, dim, _) in PARAMS.items():
            if layout.pp > 1 and owner != stage:
                continue
            local = name.replace(".", "_")
            param = torch.nn.Parameter(_part(_full_init(name, layout.padded), dim, layout, tp_rank))
            param.tensor_model_parallel = dim >= 0  # type: ignore[attr-defined]
            param.partition_dim = dim  # type: ignore[attr-defined]
            param.partition_stride = 1  # type: ignore[attr-defined]
            self.register_parameter(local, param)
            self.names[local] = name

    def sharded_state_keys(self) -> dict[str, str]:
        return dict(self.names)

    def loss(self, layout: Layout, tp_rank: int) -> torch.Tensor:
        total = torch.zeros(())
        for local, name in self.names.items():
            weight = _part(_full_weight(name, layout.padded), PARAMS[name][1], layout, tp_rank)
            total = total + (getattr(self, local).float() * weight).sum()
        return total


def _args(layout: Layout) -> dict[str, Any]:
    return {
        "hidden_size": HIDDEN, "vocab_size": VOCAB, "padded_vocab_size": layout.padded,
        "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": None,
    }  # fmt: skip


def _build(layout: Layout, load: str | None = None) -> tuple[ParallelState, Any, Any, Any, Any]:
    state = ParallelState.create(
        ParallelConfig(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp)
    )
    tp_rank = state.tensor_model_parallel_rank
    model_parallel_manual_seed(11, tp_rank=tp_rank)

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        return Tiny(layout, tp_rank, state.pipeline_model_parallel_rank)

    model, optimizer, scheduler, loaded = setup_model_and_optimizer(
        provider, state,
        optimizer_config=OptimizerConfig(lr=1e-2, clip_grad=0.0, bf16=layout.bf16),
        lr_schedule=LRScheduleConfig(max_lr=1e-2, lr_decay_steps=100, lr_decay_style="constant"),
        ddp_config=DDPConfig(use_distributed_optimizer=layout.distributed, bucket_size=40),
        load=load, checkpoint_args=_args(layout),
        ckpt_format=layout.ckpt_format,  # type: ignore[arg-type]
    )  # fmt: skip
    return state, model, optimizer, scheduler, loaded


def _tiny(chunk: torch.nn.Module) -> Tiny:
    inner = unwrap_model(chunk)
    assert isinstance(inner, Tiny)
    return inner


def _step(layout: Layout, state: ParallelState, model: Any, optimizer: Any) -> None:
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    tp_rank = state.tensor_model_parallel_rank
    loss = torch.zeros(())
    for chunk in model:
        loss = loss + _tiny(chunk).loss(layout, tp_rank)
    loss.backward()
    finalize_model_grads(model, state)
    assert optimizer.step()[0]


Piece = tuple[int, tuple[int, ...], int, torch.Tensor]
"""A rank's elements of one entry: its tensor-parallel rank, its part's shape, the first
element's place in the flattened part, and the values (fp32, flat)."""


def _parts(state: ParallelState, model: Any, optimizer: Any) -> dict[str, dict[str, Any]]:
    """This rank's elements of each parameter, its fp32 main copy and its Adam moments."""
    tp_rank = state.tensor_model_parallel_rank
    parts: dict[str, dict[str, list[Piece]]] = {}

    def add(name: str, entry: str, like: torch.Tensor, start: int, values: torch.Tensor) -> None:
        flat = values.detach().float().reshape(-1).clone()
        parts.setdefault(name, {}).setdefault(entry, []).append(
            (tp_rank, tuple(like.shape), start, flat)
        )

    names: dict[int, str] = {}
    for chunk in model:
        inner = _tiny(chunk)
        for local, param in inner.named_parameters():
            names[id(param)] = inner.names[local]
            add(inner.names[local], "param", param, 0, param)
    owned: list[tuple[str, torch.Tensor, int, torch.Tensor]]
    if isinstance(optimizer, DistributedOptimizer):
        owned = [(names[id(s.param)], s.param, s.start, s.main_param)
                 for s in optimizer.shard_ranges()]  # fmt: skip
    else:
        owned = [(m.name, m.param, 0, m.param) for m in main_params(model, optimizer)]
    for name, like, start, main in owned:
        add(name, "main", like, start, main)
        for entry in ("exp_avg", "exp_avg_sq"):
            add(name, entry, like, start, optimizer.optimizer.state[main][entry])
    return parts


def _save_then_step(layout: Layout, root: str) -> dict[str, Any]:
    """`SAVED_AT` steps, a save, one more step: this rank's parts at the save and after."""
    state, model, optimizer, scheduler, _ = _build(layout)
    for _ in range(SAVED_AT):
        _step(layout, state, model, optimizer)
    with torch.no_grad(), get_rng_tracker().fork():
        torch.rand(3)  # the tracker's state moves on before the save
    saver = AsyncCheckpointSaver() if layout.async_save else None
    save_checkpoint(
        root, SAVED_AT, state=state, model=model, optimizer=optimizer, scheduler=scheduler,
        args=_args(layout), consumed_train_samples=SAVED_AT, report=None,
        ckpt_format=layout.ckpt_format, async_saver=saver,  # type: ignore[arg-type]
    )  # fmt: skip
    saved = _parts(state, model, optimizer)
    draws = _draws()
    _step(layout, state, model, optimizer)  # while an asynchronous save writes
    if saver is not None:
        saver.wait(state)
    return {"saved": saved, "after": _parts(state, model, optimizer), "draws": draws}


def _draws() -> list[float]:
    with get_rng_tracker().fork():
        forked = torch.rand(2).tolist()
    return forked + torch.rand(2).tolist()


def _load_then_step(layout: Layout, root: str) -> dict[str, Any]:
    """Loads at `layout`: this rank's parts after the load and after one more step."""
    state, model, optimizer, _, loaded = _build(layout, load=root)
    assert loaded is not None
    assert loaded.iteration == SAVED_AT
    result = {"loaded": _parts(state, model, optimizer), "notes": list(loaded.notes)}
    result["draws"] = _draws()
    _step(layout, state, model, optimizer)
    result["after"] = _parts(state, model, optimizer)
    return result


def _whole(results: list[dict[str, Any]], key: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's whole tensors, put together from every rank's elements."""
    held: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for result in results:
        for name, entries in result[key].items():
            for entry, pieces in entries.items():
                slots = held.setdefault(name, {}).setdefault(entry, {})
                for tp_rank, shape, start, values in pieces:
                    shapes[name] = shape
                    flat = slots.setdefault(tp_rank, torch.full((math.prod(shape),), math.nan))
                    flat[start : start + values.numel()] = values
    wholes: dict[str, dict[str, torch.Tensor]] = {}
    for name, entries in held.items():
        dim = PARAMS[name][1]
        for entry, slots in entries.items():
            parts = [slots[rank].view(shapes[name]) for rank in sorted(slots)]
            assert not any(part.isnan().any() for part in parts), (name, entry)
            wholes.setdefault(name, {})[entry] = parts[0] if dim < 0 else join_shards(parts, dim)
    return wholes


def _rows(name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    return tensor[:rows] if name == EMBEDDING else tensor


def _assert_same(
    ours: dict[str, dict[str, torch.Tensor]],
    theirs: dict[str, dict[str, torch.Tensor]],
    rows: int = 1 << 30,
    rel: float = 0.0,
) -> None:
    assert ours.keys() == theirs.keys()
    for name, entries in theirs.items():
        for entry, value in entries.items():
            mine = _rows(name, ours[name][entry], rows)
            expected = _rows(name, value, rows)
            assert mine.shape == expected.shape, (name, entry)
            assert torch.allclose(mine, expected, rtol=rel, atol=0.0), (name, entry)


# ----------------------------------------------------------------------------- resharding
@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """torch_dist checkpoints saved at tp 2 (pp 1 and pp 2), and the saving runs' parts."""
    saved = {}
    for pp in (1, 2):
        root = tmp_path_factory.mktemp(f"tp2pp{pp}")
        layout = Layout(tp=2, pp=pp)
        saved[pp] = (root, run_distributed(_save_then_step, layout.world, layout, str(root)))
    return saved


@pytest.mark.parametrize(
    ("saved_pp", "loader"),
    [
        (1, Layout(tp=1)),
        (1, Layout(tp=2)),
        (1, Layout(tp=4)),
        (1, Layout(tp=1, pp=2)),
        (2, Layout(tp=1)),
        (2, Layout(tp=4)),
        (2, Layout(tp=1, pp=2, dp=2)),
    ],
    ids=["tp2-tp1", "tp2-tp2", "tp2-tp4", "tp2-tp1pp2", "tp2pp2-tp1", "tp2pp2-tp4", "tp2pp2-dp2"],
)
def test_a_tp2_checkpoint_loads_at_other_tensor_and_pipeline_sizes(
    saved_tp2: dict[int, Any], saved_pp: int, loader: Layout
) -> None:
    root, saving = saved_tp2[saved_pp]
    loaded = run_distributed(_load_then_step, loader.world, loader, str(root))
    _assert_same(_whole(loaded, "loaded"), _whole(saving, "saved"))
    _assert_same(_whole(loaded, "after"), _whole(saving, "after"), rel=1e-6)
    same_layout = loader == Layout(tp=2, pp=saved_pp)
    rng_notes = [n for n in loaded[0]["notes"] if "random generator states" in n]
    assert bool(rng_notes) != same_layout
    if same_layout:  # the tracker's and the generators' states restored
        assert [r["draws"] for r in loaded] == [r["draws"] for r in saving]
    assert read_tracker(root) == SAVED_AT


def test_an_asynchronous_save_at_tp2_loads_at_tp1(tmp_path: Path) -> None:
    saver = Layout(tp=2, async_save=True)
    saving = run_distributed(_save_then_step, 2, saver, str(tmp_path))
    assert read_tracker(tmp_path) == SAVED_AT
    loaded = run_distributed(_load_then_step, 1, Layout(), str(tmp_path))
    _assert_same(_whole(loaded, "loaded"), _whole(saving, "saved"))
    _assert_same(_whole(loaded, "after"), _whole(saving, "after"), rel=1e-6)


# ----------------------------------------------------------------------------- vocabulary
@pytest.mark.parametrize(
    ("loader", "how"),
    [
        (Layout(tp=1, padded=14), "16 -> 14: rows trimmed"),
        (Layout(tp=4, padded=20), "16 -> 20: rows padded with zeros"),
        (Layout(tp=4, padded=20, distributed=True, bf16=True), "16 -> 20: rows padded"),
    ],
    ids=["trim-tp1", "pad-tp4", "pad-tp4-distributed"],
)
def test_a_padded_vocabulary_of_another_size_is_trimmed_or_padded(
    tmp_path: Path, loader: Layout, how: str
) -> None:
    saver = dataclasses.replace(loader, tp=2, padded=16)
    saving = run_distributed(_save_then_step, saver.world, saver, str(tmp_path))
    loaded = run_distributed(_load_then_step, loader.world, loader, str(tmp_path))
    assert sum(f"padded vocabulary {how}" in n for n in loaded[0]["notes"]) == 1
    rows = min(16, loader.padded)
    ours, theirs = _whole(loaded, "loaded"), _whole(saving, "saved")
    _assert_same(ours, theirs, rows=rows)
    for entry, value in ours[EMBEDDING].items():
        assert value.shape[0] == loader.padded
        assert not value[16:].any(), entry  # padding rows start at zero
    # Adam is elementwise: the real rows take the saving run's next step.
    _assert_same(_whole(loaded, "after"), _whole(saving, "after"), rows=VOCAB, rel=1e-6)


# ----------------------------------------------------------------------------- distributed
@pytest.mark.parametrize(
    "loader",
    [
        Layout(tp=1, dp=2, distributed=True, bf16=True),
        Layout(tp=4, distributed=True, bf16=True),
        Layout(tp=1, bf16=True),
    ],
    ids=["tp1-dp2", "tp4", "tp1-whole-optimizer"],
)
def test_the_distributed_optimizers_shards_reshard_across_tensor_parallel_sizes(
    tmp_path: Path, loader: Layout
) -> None:
    saver = Layout(tp=2, dp=2, distributed=True, bf16=True)
    saving = run_distributed(_save_then_step, saver.world, saver, str(tmp_path))
    loaded = run_distributed(_load_then_step, loader.world, loader, str(tmp_path))
    _assert_same(_whole(loaded, "loaded"), _whole(saving, "saved"))
    _assert_same(_whole(loaded, "after"), _whole(saving, "after"))


# ----------------------------------------------------------------------------- torch format
def _refused(layout: Layout, root: str) -> str:
    try:
        _build(layout, load=root)
    except CheckpointError as error:
        return str(error)
    return "loaded"


def _command(*args: str) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return checkpoint_main(list(args))


@pytest.mark.reliability
def test_the_torch_format_at_tp2_refuses_tp1_and_converts_to_torch_dist(tmp_path: Path) -> None:
    source, target = tmp_path / "torch", tmp_path / "dist"
    saver = Layout(tp=2, pp=2, ckpt_format="torch")
    saving = run_distributed(_save_then_step, saver.world, saver, str(source))
    assert sorted(p.name for p in (source / "iter_0000002").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001",
    ]  # fmt: skip
    same = run_distributed(_load_then_step, 4, saver, str(source))
    _assert_same(_whole(same, "loaded"), _whole(saving, "saved"))
    assert [r["draws"] for r in same] == [r["draws"] for r in saving]
    messages = run_distributed(_refused, 2, Layout(pp=2, ckpt_format="torch"), str(source))
    for message in messages:
        assert "saved at tensor-parallel size 2" in message
        assert "this run has tensor-parallel size 1" in message
        assert "--to torch_dist" in message
    assert _command("convert", "--input", str(source), "--output", str(target), "--to",
                    "torch_dist") == 0  # fmt: skip
    loaded = run_distributed(_load_then_step, 1, Layout(), str(target))
    _assert_same(_whole(loaded, "loaded"), _whole(saving, "saved"))
    _assert_same(_whole(loaded, "after"), _whole(saving, "after"), rel=1e-6)


def test_a_tp2_torch_dist_checkpoint_converts_to_the_torch_format_at_tp2(tmp_path: Path) -> None:
    source, target = tmp_path / "dist", tmp_path / "torch"
    saver = Layout(tp=2)
    saving = run_distributed(_save_then_step, 2, saver, str(source))
    assert _command("convert", "--input", str(source), "--output", str(target), "--to",
                    "torch") == 0  # fmt: skip
    assert sorted(p.name for p in (target / "iter_0000002").iterdir()) == [
        "mp_rank_00", "mp_rank_01",
    ]  # fmt: skip
    torch_layout = dataclasses.replace(saver, ckpt_format="torch")
    loaded = run_distributed(_load_then_step, 2, torch_layout, str(target))
    _assert_same(_whole(loaded, "loaded"), _whole(saving, "saved"))
    _assert_same(_whole(loaded, "after"), _whole(saving, "after"), rel=1e-6)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.reliability
def test_parts_that_do_not_cover_a_tensor_are_refused_naming_the_ranges(tmp_path: Path) -> None:
    root = tmp_path / "tp2"
    run_distributed(_save_then_step, 2, Layout(tp=2), str(root))
    metadata_root = tmp_path / "gap_metadata"
    _copy_with_gap(root, metadata_root, "model.layers.1.mlp.fc2.weight")
    message = run_distributed(_refused, 1, Layout(), str(metadata_root))[0]
    assert "model.layers.1.mlp.fc2.weight (shape (4, 8), split along dimension 1)" in message
    assert "[0, 8) of dimension 1 is needed, its saved chunks cover [0, 4), missing [4, 8)" in (
        message
    )
    missing_root = tmp_path / "missing"
    shutil.copytree(root, missing_root)
    (missing_root / "iter_0000002" / "__1_0.distcp").unlink()
    message = run_distributed(_refused, 1, Layout(), str(missing_root))[0]
    assert "missing shard file(s)" in message
    assert f"{EMBEDDING} (shape (16, 4), split along dimension 0)" in message
    assert "its saved chunks cover [0, 8), missing [8, 16)" in message


def _copy_with_gap(source: Path, target: Path, key: str) -> None:
    """A copy of `source` whose ``.metadata`` forgets the second chunk of `key`."""
    shutil.copytree(source, target)
    path = target / "iter_0000002" / ".metadata"
    with open(path, "rb") as file:
        metadata = pickle.load(file)
    entry = metadata.state_dict_metadata[key]
    entry.chunks = [chunk for chunk in entry.chunks if not any(chunk.offsets)]
    with open(path, "wb") as file:
        pickle.dump(metadata, file)


def test_rng_tracker_states_round_trip_with_the_rng_state() -> None:
    tracker = model_parallel_manual_seed(5, tp_rank=1)
    state = get_rng_state()
    expected = _draws()
    model_parallel_manual_seed(9, tp_rank=0)
    set_rng_state(state)
    assert tracker.get_states().keys() == state["rng_tracker_states"].keys()
    assert _draws() == expected


# ----------------------------------------------------------------------------- the GPT
GPT_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--eval-iters", "1", "--log-interval", "1", "--lr-warmup-iters", "1",
    "--lr-decay-iters", "10", "--train-iters", "5", "--ckpt-format", "torch_dist",
]  # fmt: skip
"""The bundled GPT's run: 5 iterations; a saving run stops and saves at 3 (--exit-interval)."""


def _gpt(argv: list[str]) -> dict[str, Any]:
    """The command's run on this rank (the harness made the process group)."""
    parser = build_parser()
    args = validate_args(parser, parser.parse_args(argv), dist.get_world_size())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        reason = run(args)
    return {"reason": reason, "stdout": printed.getvalue()}


def _gpt_run(ranks: int, *flags: str) -> str:
    results = run_distributed(_gpt, ranks, [*GPT_FLAGS, *flags], timeout=300)
    assert len({r["reason"] for r in results}) == 1
    return "".join(r["stdout"] for r in results)


def _gpt_losses(stdout: str) -> list[float]:
    found = re.findall(r"iteration\s+\d+/\s*\d+ \|.*? lm loss: (\S+) \|", stdout)
    return [float(loss) for loss in found]


def _tp(size: int, divisor: int) -> list[str]:
    return [
        "--tensor-model-parallel-size",
        str(size),
        "--make-vocab-size-divisible-by",
        str(divisor),
    ]


@pytest.fixture(scope="module")
def gpt_tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """A tp 2 checkpoint of the GPT at iteration 3 (padded vocabulary 512), and the losses of
    an unbroken tp 1 run of the same model (512 rows too)."""
    root = tmp_path_factory.mktemp("gpt-tp2")
    unbroken = _gpt_losses(_gpt_run(1, *_tp(1, 512)))
    saved = _gpt_run(2, *_tp(2, 256), "--exit-interval", "3", "--save", str(root))
    assert _gpt_losses(saved) == pytest.approx(unbroken[:3], rel=1e-5)
    assert read_tracker(root) == 3
    return root, unbroken


@pytest.mark.parametrize(
    ("ranks", "flags"),
    [(4, _tp(4, 128)), (2, [*_tp(1, 512), "--pipeline-model-parallel-size", "2"])],
    ids=["tp4", "tp1-pp2"],
)
def test_the_gpt_saved_at_tp2_resumes_with_the_unbroken_runs_losses(
    gpt_tp2: tuple[Path, list[float]], ranks: int, flags: list[str]
) -> None:
    """The padded vocabulary is 512 at both sizes (divisor 256 x tp 2, 128 x tp 4, 512 x 1)."""
    root, unbroken = gpt_tp2
    resumed = _gpt_run(ranks, *flags, "--load", str(root))
    assert "loaded checkpoint from" in resumed
    assert "padded vocabulary" not in resumed
    assert _gpt_losses(resumed) == pytest.approx(unbroken[3:], rel=1e-5)


@pytest.mark.parametrize(
    ("ranks", "flags", "note"),
    [
        (1, _tp(1, 128), "padded vocabulary 512 -> 256: rows trimmed"),
        (4, _tp(4, 256), "padded vocabulary 512 -> 1024: rows padded with zeros"),
    ],
    ids=["trim-tp1", "pad-tp4"],
)
def test_the_gpt_resumes_with_another_padded_vocabulary(
    gpt_tp2: tuple[Path, list[float]], ranks: int, flags: list[str], note: str
) -> None:
    root, _ = gpt_tp2
    resumed = _gpt_run(ranks, *flags, "--load", str(root))
    assert resumed.count(note) == 1
    losses = _gpt_losses(resumed)
    assert len(losses) == 2
    assert all(math.isfinite(loss) for loss in losses)


def test_the_gpt_saved_at_tp2_pp2_resumes_at_tp1(tmp_path: Path) -> None:
    """tp and pp changed at once: a 4-rank save, a one-process resume and reference."""
    unbroken = _gpt_losses(_gpt_run(1, *_tp(1, 512)))
    pipeline = ["--pipeline-model-parallel-size", "2"]
    _gpt_run(4, *_tp(2, 256), *pipeline, "--exit-interval", "3", "--save", str(tmp_path))
    resumed = _gpt_run(1, *_tp(1, 512), "--load", str(tmp_path))
    assert _gpt_losses(resumed) == pytest.approx(unbroken[3:], rel=1e-5)


def test_the_gpts_distributed_optimizer_state_saved_at_tp2_dp2_resumes_at_tp1_dp2(
    tmp_path: Path,
) -> None:
    """The optimizer's shards saved by 4 ranks reshard to 2; the next losses are the
    unbroken run's (the second step after the load is the first to use the Adam moments)."""
    unbroken = _gpt_losses(_gpt_run(1, *_tp(1, 512)))
    flags = ["--use-distributed-optimizer"]
    _gpt_run(4, *_tp(2, 256), *flags, "--exit-interval", "3", "--save", str(tmp_path))
    resumed = _gpt_run(2, *_tp(1, 512), *flags, "--load", str(tmp_path))
    assert _gpt_losses(resumed) == pytest.approx(unbroken[3:], rel=1e-5)
