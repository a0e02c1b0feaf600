"""Checkpoints: Megatron's layout, exact round trips, atomic saves and refused loads."""

from __future__ import annotations

import io
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pp_optim import (
    Float16Module,
    Float16OptimizerWithFloat16Params,
    LRScheduleConfig,
    MegatronOptimizer,
    OptimizerConfig,
    OptimizerParamScheduler,
    get_megatron_optimizer,
)
from pp_state import ParallelConfig, ParallelState
from pp_testing import run_distributed
from pp_train.checkpoint import (
    TRACKER_FILENAME,
    CheckpointError,
    LoadedCheckpoint,
    checkpoint_path,
    get_rng_state,
    read_tracker,
    set_rng_state,
)
from pp_train.checkpoint.torch_format import load_torch_checkpoint as load_checkpoint
from pp_train.checkpoint.torch_format import save_torch_checkpoint as save_checkpoint

WIDTH = 4
Results = tuple[Path, list[dict[str, Any]]]


def _args(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "num_layers": 2,
        "hidden_size": WIDTH,
        "num_attention_heads": 1,
        "seq_length": 8,
        "vocab_size": 16,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": None,
        "lr": 0.01,
        "betas": (0.9, 0.999),
        "data_path": ["a", "b"],
        "extra": {"note": "tiny run"},
    }
    args.update(overrides)
    return args


class _Job:
    """One rank's model, optimizer and scheduler, built the same way for save and load."""

    def __init__(
        self,
        state: ParallelState,
        *,
        seed: int,
        chunks: int = 1,
        fp16: bool = False,
        out_features: int = WIDTH,
        loss_scale: float | None = None,
        max_lr: float = 1e-2,
    ) -> None:
        torch.manual_seed(seed)
        layers: list[torch.nn.Module] = [
            torch.nn.Linear(WIDTH, out_features) for _ in range(chunks)
        ]
        if fp16:
            layers = [Float16Module(layer, torch.float16) for layer in layers]
        self.model = layers
        # A small first loss scale: Megatron's 2**32 overflows fp16 and skips the first steps.
        config = OptimizerConfig(
            lr=1e-2, clip_grad=0.0, fp16=fp16, loss_scale=loss_scale, initial_loss_scale=2.0**8
        )
        self.optimizer: MegatronOptimizer = get_megatron_optimizer(
            config, layers, parallel_state=state
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer.optimizer,
            LRScheduleConfig(max_lr=max_lr, lr_warmup_steps=2, lr_decay_steps=100),
        )

    def train(self, steps: int, seed: int) -> None:
        data = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            self.optimizer.zero_grad()
            batch = torch.randn(3, WIDTH, generator=data)
            loss = sum(chunk(batch).float().square().mean() for chunk in self.model)
            self.optimizer.scale_loss(cast(torch.Tensor, loss)).backward()
            self.optimizer.step()
            self.scheduler.step(1)

    def snapshot(self) -> dict[str, Any]:
        return {
            "model": [_clone(chunk.state_dict()) for chunk in self.model],
            "optimizer": _clone(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
        }


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(item) for item in value)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _state(tp: int = 1, pp: int = 2, vp: int | None = None) -> ParallelState:
    return ParallelState.create(
        ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
        )
    )


def _save(root: Path | str, iteration: int, job: _Job, state: ParallelState, **kw: Any) -> Path:
    kw.setdefault("args", _args())
    kw.setdefault("consumed_train_samples", 12 * iteration)
    return save_checkpoint(
        root,
        iteration,
        state=state,
        model=job.model,
        optimizer=job.optimizer,
        scheduler=job.scheduler,
        **kw,
    )


def _load(root: Path | str, job: _Job, state: ParallelState, **kw: Any) -> LoadedCheckpoint | None:
    kw.setdefault("args", _args())
    return load_checkpoint(
        root,
        state=state,
        model=job.model,
        optimizer=job.optimizer,
        scheduler=job.scheduler,
        **kw,
    )


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _draws() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


# ----------------------------------------------------------------------------- no processes
def test_checkpoint_path_is_megatrons_layout() -> None:
    assert checkpoint_path("/ck", 7, tensor_rank=0, pipeline_rank=0, pipeline_size=1) == Path(
        "/ck/iter_0000007/mp_rank_00/model_optim_rng.pt"
    )
    assert checkpoint_path(
        Path("/ck"), 1234567, tensor_rank=3, pipeline_rank=1, pipeline_size=4
    ) == Path("/ck/iter_1234567/mp_rank_03_001/model_optim_rng.pt")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"iteration": -1}, ValueError, "iteration must be an int >= 0, got -1"),
        ({"iteration": True}, TypeError, "iteration must be an int"),
        ({"pipeline_rank": 2}, ValueError, r"0 \.\. pipeline_size - 1 = 1.*pipeline_rank=2"),
        ({"tensor_rank": 1.0}, TypeError, "tensor_rank"),
    ],
)
def test_checkpoint_path_refuses_bad_numbers(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    values: dict[str, Any] = {
        "iteration": 1,
        "tensor_rank": 0,
        "pipeline_rank": 0,
        "pipeline_size": 2,
    }
    values.update(kwargs)
    iteration = values.pop("iteration")
    with pytest.raises(error, match=match):
        checkpoint_path("/ck", iteration, **values)


def test_read_tracker(tmp_path: Path) -> None:
    assert read_tracker(tmp_path / "missing") is None
    assert read_tracker(tmp_path) is None
    tracker = tmp_path / TRACKER_FILENAME
    tracker.write_text("42\n")
    assert read_tracker(tmp_path) == 42
    tracker.write_text("release")
    with pytest.raises(CheckpointError, match=r"'release'.*not supported"):
        read_tracker(tmp_path)
    for content in ("banana", "-3", "", "1.5"):
        tracker.write_text(content)
        with pytest.raises(
            CheckpointError, match=re.escape(f"{TRACKER_FILENAME} holds '{content}'")
        ):
            read_tracker(tmp_path)


def test_rng_state_round_trips_through_a_weights_only_load() -> None:
    buffer = io.BytesIO()
    torch.save(get_rng_state(), buffer)
    expected = _draws()
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["cuda"] is None or isinstance(state["cuda"], list)
    assert isinstance(state["numpy"], list)
    _draws()
    set_rng_state(state)
    assert _draws() == expected


def test_malformed_rng_state_changes_nothing() -> None:
    state = get_rng_state()
    state["torch"] = torch.zeros(3, dtype=torch.uint8)
    torch.manual_seed(5)
    before = torch.get_rng_state(), random.getstate()
    with pytest.raises(ValueError, match="RNG state 'torch' has 3 bytes"):
        set_rng_state(state)
    with pytest.raises(ValueError, match="lacks"):
        set_rng_state({"torch": torch.get_rng_state()})
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]


def test_loaded_checkpoint_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="iteration must be an int >= 0, got -1"):
        LoadedCheckpoint(iteration=-1, consumed_train_samples=0, consumed_valid_samples=0, args={})
    with pytest.raises(TypeError, match="args must be a dict"):
        LoadedCheckpoint(
            iteration=1, consumed_train_samples=0, consumed_valid_samples=0, args=cast(Any, [])
        )


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"dtype": torch.float16}, r"args\['dtype'\] is a dtype; checkpoint args hold only"),
        ({"nested": [1, {"x": object()}]}, r"args\['nested'\]\[1\]\['x'\] is a object"),
        ({3: "three"}, "key 3 of type int"),
    ],
)
def test_save_refuses_args_that_are_not_plain_values(
    tmp_path: Path, args: dict[Any, Any], match: str
) -> None:
    model: list[torch.nn.Module] = [torch.nn.Linear(2, 2)]
    with pytest.raises(TypeError, match=match):
        save_checkpoint(
            tmp_path,
            1,
            state=cast(Any, None),  # refused before the state is used
            model=model,
            optimizer=None,
            scheduler=None,
            args=args,
            consumed_train_samples=0,
        )
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- round trips
def _round_trip_pp2(root: str) -> dict[str, Any]:
    state = _state(pp=2)
    job = _Job(state, seed=10 + state.rank)
    job.train(3, seed=state.rank)
    path = _save(root, 7, job, state, consumed_train_samples=96, consumed_valid_samples=8)
    saved = job.snapshot()
    draws = _draws()
    content = torch.load(path, weights_only=True)
    job.train(2, seed=99)
    moved = not _same(job.snapshot()["model"], saved["model"])
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    loaded = _load(root, job, state)
    after = job.snapshot()
    dist.barrier()
    return {
        "path": str(Path(path).relative_to(root)),
        "files": _files(Path(root)),
        "tracker": (Path(root) / TRACKER_FILENAME).read_text(),
        "keys": sorted(content),
        "version": content["checkpoint_version"],
        "saved_args": content["args"],
        "loaded": loaded,
        "model": _same(after["model"], saved["model"]),
        "optimizer": _same(after["optimizer"], saved["optimizer"]),
        "adam_state": len(after["optimizer"]["optimizer"]["state"]),
        "moved": moved,
        "scheduler": after["scheduler"] == saved["scheduler"],
        "lr": job.scheduler.current_lr,
        "draws": _draws() == draws,
    }


def test_round_trip_over_a_two_stage_pipeline(two_ranks: Results) -> None:
    results = [rank["round_trip"] for rank in two_ranks[1]]
    expected_files = [
        "iter_0000007/mp_rank_00_000/model_optim_rng.pt",
        "iter_0000007/mp_rank_00_001/model_optim_rng.pt",
        TRACKER_FILENAME,
    ]
    for rank, result in enumerate(results):
        assert result["path"] == f"iter_0000007/mp_rank_00_{rank:03d}/model_optim_rng.pt"
        assert result["files"] == expected_files
        assert result["tracker"] == "7"
        assert result["keys"] == [
            "args",
            "checkpoint_version",
            "consumed_train_samples",
            "consumed_valid_samples",
            "iteration",
            "model",
            "opt_param_scheduler",
            "optimizer",
            "rng_state",
        ]
        assert result["version"] == 3.0
        assert result["saved_args"] == _args()
        assert result["loaded"] == LoadedCheckpoint(
            iteration=7, consumed_train_samples=96, consumed_valid_samples=8, args=_args()
        )
        assert result["model"]
        assert result["optimizer"]
        assert result["adam_state"] == 2
        assert result["moved"]  # the load had something to undo
        assert result["scheduler"]
        assert result["lr"] == pytest.approx(1e-2 * (1 - 1 / 98))  # step 3 of the schedule
        assert result["draws"]


def _fp16_pp2_dp2(root: str) -> dict[str, Any]:
    state = _state(pp=2)
    # Data-parallel replicas hold the same weights, so every replica can load the writer's.
    job = _Job(state, seed=20 + state.pipeline_model_parallel_rank, fp16=True)
    job.train(3, seed=state.pipeline_model_parallel_rank)
    with mock.patch("torch.save", wraps=torch.save) as saver:
        _save(root, 3, job, state)
    saved = job.snapshot()
    main_params = [p.clone() for p in job.optimizer.optimizer.param_groups[0]["params"]]
    job.train(2, seed=7)
    moved = not _same(job.snapshot(), saved)
    loaded = _load(root, job, state)
    after = job.snapshot()
    optimizer = job.optimizer
    dist.barrier()
    return {
        "dp_rank": state.group_rank("dp_cp"),
        "moved": moved,
        "adam_state": len(saved["optimizer"]["optimizer"]["state"]),
        "writes": saver.call_count,
        "files": _files(Path(root)),
        "loaded": loaded is not None and loaded.iteration == 3,
        "fp16_optimizer": isinstance(optimizer, Float16OptimizerWithFloat16Params),
        "model": _same(after["model"], saved["model"]),
        "model_dtype": str(after["model"][0]["module.weight"].dtype),
        "optimizer": _same(after["optimizer"], saved["optimizer"]),
        "main_params": _same(list(optimizer.optimizer.param_groups[0]["params"]), main_params),
        "main_params_fp32": all(
            p.dtype == torch.float32 for p in optimizer.optimizer.param_groups[0]["params"]
        ),
        "loss_scale": float(optimizer.get_loss_scale().item()),
        "saved_loss_scale": float(saved["optimizer"]["grad_scaler"]["scale"].item()),
    }


def test_fp16_round_trip_where_only_data_parallel_rank_0_writes(four_ranks: Results) -> None:
    results = [rank["fp16"] for rank in four_ranks[1]]
    for result in results:
        assert result["writes"] == (1 if result["dp_rank"] == 0 else 0)
        assert result["moved"]
        assert result["adam_state"] == 2
        assert result["files"] == [
            "iter_0000003/mp_rank_00_000/model_optim_rng.pt",
            "iter_0000003/mp_rank_00_001/model_optim_rng.pt",
            TRACKER_FILENAME,
        ]
        assert result["loaded"]
        assert result["fp16_optimizer"]
        assert result["model"]
        assert result["model_dtype"] == "torch.float16"
        assert result["optimizer"]  # Adam state, loss scaler and fp32 main copies, exactly
        assert result["main_params"]
        assert result["main_params_fp32"]
        assert result["loss_scale"] == result["saved_loss_scale"]
    assert sorted(result["dp_rank"] for result in results) == [0, 0, 1, 1]


def _tensor_parallel(root: str, pp: int = 1) -> dict[str, Any]:
    state = _state(tp=2, pp=pp)
    args = _args(tensor_model_parallel_size=2, pipeline_model_parallel_size=pp)
    job = _Job(state, seed=30 + state.rank)
    job.train(1, seed=state.rank)
    _save(root, 2, job, state, args=args)
    saved = job.snapshot()
    job.train(1, seed=5)
    loaded = _load(root, job, state, args=args)
    dist.barrier()
    return {
        "tp_rank": state.tensor_model_parallel_rank,
        "pp_rank": state.pipeline_model_parallel_rank,
        "files": _files(Path(root)),
        "loaded": loaded is not None and loaded.iteration == 2,
        "model": _same(job.snapshot()["model"], saved["model"]),
        "weight": saved["model"][0]["weight"],
    }


def _tensor_and_pipeline_parallel(root: str) -> dict[str, Any]:
    return _tensor_parallel(root, pp=2)


def test_tensor_parallel_ranks_write_their_own_files(two_ranks: Results) -> None:
    results = [rank["tensor_parallel"] for rank in two_ranks[1]]
    assert [result["tp_rank"] for result in results] == [0, 1]
    for result in results:
        assert result["files"] == [
            "iter_0000002/mp_rank_00/model_optim_rng.pt",
            "iter_0000002/mp_rank_01/model_optim_rng.pt",
            TRACKER_FILENAME,
        ]
        assert result["loaded"]
        assert result["model"]
    assert not torch.equal(results[0]["weight"], results[1]["weight"])  # each loaded its own


def test_tensor_and_pipeline_ranks_write_their_own_files(four_ranks: Results) -> None:
    results = [rank["tensor_and_pipeline_parallel"] for rank in four_ranks[1]]
    positions = sorted((result["tp_rank"], result["pp_rank"]) for result in results)
    assert positions == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for result in results:
        assert result["files"] == [
            "iter_0000002/mp_rank_00_000/model_optim_rng.pt",
            "iter_0000002/mp_rank_00_001/model_optim_rng.pt",
            "iter_0000002/mp_rank_01_000/model_optim_rng.pt",
            "iter_0000002/mp_rank_01_001/model_optim_rng.pt",
            TRACKER_FILENAME,
        ]
        assert result["loaded"]
        assert result["model"]


def _virtual_chunks(root: str) -> dict[str, Any]:
    state = _state(pp=2, vp=2)
    args = _args(virtual_pipeline_model_parallel_size=2)
    job = _Job(state, seed=40 + state.rank, chunks=2)
    job.train(1, seed=state.rank)
    path = _save(root, 5, job, state, args=args)
    keys = sorted(torch.load(path, weights_only=True))
    saved = job.snapshot()
    job.train(1, seed=3)
    loaded = _load(root, job, state, args=args)
    restored = _same(job.snapshot()["model"], saved["model"])
    one_chunk = _Job(state, seed=0, chunks=1)
    messages = []
    for strict_args in ((), ("virtual_pipeline_model_parallel_size",)):
        try:
            _load(root, one_chunk, state, strict_args=strict_args)
        except CheckpointError as error:
            messages.append(str(error))
    return {
        "keys": keys,
        "loaded": loaded is not None and loaded.iteration == 5,
        "model": restored,
        "messages": messages,
        "path": str(path),
    }


def test_virtual_chunks_are_saved_as_model0_model1(two_ranks: Results) -> None:
    results = [rank["virtual_chunks"] for rank in two_ranks[1]]
    for result in results:
        assert "model0" in result["keys"]
        assert "model1" in result["keys"]
        assert "model" not in result["keys"]
        assert result["loaded"]
        assert result["model"]
        chunks, vp = result["messages"]
        assert "holds 2 model chunk(s) (['model0', 'model1']); this run has 1 (['model'])" in chunks
        assert result["path"] in chunks
        assert "was saved with virtual_pipeline_model_parallel_size=2; this run has None" in vp


# ----------------------------------------------------------------------------- refusals
class _Evil:
    """Unpickles into a call of os.mkdir: a stand-in for any code a pickle could run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def _copy(root: Path, name: str) -> Path:
    target = root.parent / name
    if dist.get_rank() == 0:
        shutil.copytree(root, target)
    dist.barrier()
    return target


def _refused(root: Path, job: _Job, state: ParallelState, **kw: Any) -> tuple[str, bool, bool]:
    """Loads expecting a refusal; returns the message, whether it said so, and no change."""
    before = job.snapshot()
    try:
        _load(root, job, state, **kw)
    except CheckpointError as error:
        message, refused = str(error), True
    else:
        message, refused = "loaded", False
    return message, refused, _same(job.snapshot(), before)


def _refusals(base: str) -> dict[str, tuple[str, bool, bool]]:
    state = _state(pp=2)
    rank = state.rank
    good = Path(base) / "good"
    job = _Job(state, seed=50 + rank)
    job.train(2, seed=rank)
    path = _save(good, 4, job, state)
    job.train(1, seed=9)  # the live state now differs from the checkpoint
    results: dict[str, tuple[str, bool, bool]] = {}

    results["args"] = _refused(
        good, job, state, args=_args(pipeline_model_parallel_size=4, hidden_size=8)
    )

    corrupt = _copy(good, "corrupt")
    if rank == 1:
        own = corrupt / path.relative_to(good)
        own.write_bytes(own.read_bytes()[:200])
    dist.barrier()
    results["corrupt"] = _refused(corrupt, job, state)

    missing = _copy(good, "missing")
    if rank == 0:
        (missing / path.relative_to(good)).unlink()
    dist.barrier()
    results["missing"] = _refused(missing, job, state)

    evil = _copy(good, "evil")
    marker = Path(base) / "code_ran"
    if rank == 0:
        torch.save(
            {"checkpoint_version": 3.0, "payload": _Evil(str(marker))},
            evil / path.relative_to(good),
        )
    dist.barrier()
    results["evil"] = _refused(evil, job, state)
    results["evil_ran"] = (str(marker.exists()), False, False)

    for name, content in (("garbage", "banana"), ("release", "release")):
        tracked = _copy(good, name)
        if rank == 0:
            (tracked / TRACKER_FILENAME).write_text(content)
        dist.barrier()
        results[name] = _refused(tracked, job, state)

    # A model of another width on rank 1 only: rank 0 alone could load, but must not.
    other = _Job(state, seed=1, out_features=6 if rank == 1 else WIDTH)
    other.train(1, seed=rank)
    results["shapes"] = _refused(good, other, state)

    renamed = _Job(state, seed=1)
    renamed.model[0] = torch.nn.Sequential(renamed.model[0])
    results["keys"] = _refused(good, renamed, state, no_load_optim=True)

    scaled = _Job(state, seed=1, loss_scale=1.0)
    scaled.train(1, seed=rank)
    results["scaler"] = _refused(good, scaled, state)

    other_schedule = _Job(state, seed=1, max_lr=0.5)
    other_schedule.train(1, seed=rank)
    results["schedule"] = _refused(good, other_schedule, state)

    bare = Path(base) / "bare"
    _save(bare, 4, job, state, save_optim=False, save_rng=False)
    job.train(1, seed=11)
    results["no_optimizer"] = _refused(bare, job, state)
    results["no_rng"] = _refused(bare, job, state, no_load_optim=True)
    results["path"] = (str(path.relative_to(good)), False, False)
    return results


def test_refused_loads_name_the_cause_and_change_nothing_on_any_rank(two_ranks: Results) -> None:
    base, all_ranks = two_ranks
    tmp_path = base / "refusals"
    ranks = [rank["refusals"] for rank in all_ranks]
    for rank, results in enumerate(ranks):
        for case, (message, refused, unchanged) in results.items():
            if case in ("evil_ran", "path"):
                continue
            assert refused, (rank, case, message)
            assert unchanged, (rank, case, message)
        own = results["path"][0]
        assert (
            "was saved with hidden_size=4; this run has 8; and with "
            "pipeline_model_parallel_size=2; this run has 4" in results["args"][0]
        )
        assert f"good/{own}" in results["args"][0]
        assert "rank 1: checkpoint file" in ranks[1]["corrupt"][0]
        assert "is corrupt or truncated" in ranks[1]["corrupt"][0]
        assert "rank 0: rank(s) [1] failed" in ranks[0]["corrupt"][0]
        assert "nothing was changed" in ranks[0]["corrupt"][0]
        assert f"missing/{ranks[0]['path'][0]} of iteration 4 is missing" in ranks[0]["missing"][0]
        assert "rank(s) [0] failed" in ranks[1]["missing"][0]
        assert "refused to load" in ranks[0]["evil"][0]
        assert "GLOBAL posix.mkdir" in ranks[0]["evil"][0]
        assert results["evil_ran"][0] == "False"
        assert f"{TRACKER_FILENAME} holds 'banana'" in results["garbage"][0]
        assert "release checkpoints" in results["release"][0]
        assert "rank 0: rank(s) [1] failed" in ranks[0]["shapes"][0]
        assert (
            "shape mismatches [weight: checkpoint (4, 4), model (6, 4), bias: checkpoint (4,), model (6,)]"
            in ranks[1]["shapes"][0]
        )
        assert (
            "missing keys [0.weight, 0.bias]; unexpected keys [weight, bias]" in results["keys"][0]
        )
        assert "saved with no loss scaler" in results["scaler"][0]
        assert "max_lr" in results["schedule"][0]
        assert (
            "has no 'optimizer' state; to load without it pass no_load_optim=True"
            in results["no_optimizer"][0]
        )
        assert (
            "has no 'rng_state' state; to load without it pass no_load_rng=True"
            in results["no_rng"][0]
        )
    # The payload was live: an unsafe load would have run it.
    evil_file = tmp_path / "evil" / ranks[0]["path"][0]
    torch.load(evil_file, weights_only=False)
    assert (tmp_path / "code_ran").is_dir()


def _no_tracker(root: str) -> list[bool]:
    state = _state(pp=2)
    job = _Job(state, seed=1)
    before = job.snapshot()
    Path(root, "empty").mkdir(exist_ok=True)
    found = [
        _load(Path(root, "empty"), job, state) is None,
        _load(Path(root, "does-not-exist"), job, state) is None,
    ]
    return [*found, _same(job.snapshot(), before)]


def test_no_tracker_means_start_from_scratch(two_ranks: Results) -> None:
    assert [rank["no_tracker"] for rank in two_ranks[1]] == [[True] * 3] * 2


# ----------------------------------------------------------------------------- crashes
def _failing_replace(name: str) -> Any:
    real = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name == name:
            raise OSError(28, "No space left on device (simulated)")
        real(src, dst)

    return replace


def _crash_mid_save(root_name: str) -> dict[str, Any]:
    state = _state(pp=2)
    rank = state.rank
    root = Path(root_name)
    job = _Job(state, seed=60 + rank)
    job.train(1, seed=rank)
    path = _save(root, 1, job, state)
    first = job.snapshot()
    job.train(1, seed=8)
    messages = []
    failing = {1: "model_optim_rng.pt", 0: TRACKER_FILENAME}
    for iteration, failing_rank in ((2, 1), (3, 0)):
        replace = _failing_replace(failing[failing_rank]) if rank == failing_rank else os.replace
        with mock.patch("os.replace", replace):
            try:
                _save(root, iteration, job, state)
            except CheckpointError as error:
                messages.append(str(error))
    tracker_after_crashes = read_tracker(root)
    leftovers = sorted(p.name for p in root.rglob("*.tmp-*"))
    loaded = _load(root, job, state)
    resumed_first = loaded is not None and loaded.iteration == 1
    restored_first = _same(job.snapshot()["model"], first["model"])
    dist.barrier()
    # A crash that left temporaries behind must not trouble the next save or load.
    stale = path.parent.parent.parent / "iter_0000004" / path.parent.name
    stale.mkdir(parents=True, exist_ok=True)
    (stale / "model_optim_rng.pt.tmp-424242").write_bytes(b"half a checkpoint")
    if rank == 0:
        (root / f"{TRACKER_FILENAME}.tmp-424242").write_text("999")
    job.train(1, seed=12)
    _save(root, 4, job, state)
    fourth = job.snapshot()
    job.train(1, seed=13)
    loaded = _load(root, job, state)
    return {
        "messages": messages,
        "tracker_after_crashes": tracker_after_crashes,
        "leftovers": leftovers,
        "resumed_first": resumed_first,
        "restored_first": restored_first,
        "resumed_fourth": loaded is not None and loaded.iteration == 4,
        "restored_fourth": _same(job.snapshot()["model"], fourth["model"]),
        "path": str(path.relative_to(root)),
    }


def test_a_crash_mid_save_leaves_the_previous_checkpoint(two_ranks: Results) -> None:
    tmp_path = two_ranks[0] / "crash_mid_save"
    results = [rank["crash_mid_save"] for rank in two_ranks[1]]
    for rank, result in enumerate(results):
        file_failure, tracker_failure = result["messages"]
        if rank == 1:
            assert "rank 1 could not write checkpoint file" in file_failure
            assert "iter_0000002/mp_rank_00_001/model_optim_rng.pt" in file_failure
            assert "No space left on device (simulated)" in file_failure
            assert "rank 1: rank(s) [0] failed; the tracker" in tracker_failure
        else:
            assert "rank 0: rank(s) [1] failed; checkpoint files of iteration 2" in file_failure
            assert f"rank 0 could not publish iteration 3 in {tmp_path}: " in tracker_failure
            assert "No space left on device (simulated)" in tracker_failure
        assert result["tracker_after_crashes"] == 1
        assert result["leftovers"] == []
        assert result["resumed_first"]
        assert result["restored_first"]
        assert result["resumed_fourth"]
        assert result["restored_fourth"]
    assert (tmp_path / TRACKER_FILENAME).read_text() == "4"


def _refusing_rename_in(source: Any, target: Any) -> None:
    if Path(source).name.endswith(".partial"):
        raise OSError(5, "Input/output error (simulated)")
    _REAL_REPLACE(source, target)


_REAL_REPLACE = os.replace


def _resave(root_name: str) -> dict[str, Any]:
    """Saves iteration 1 again: the rename in fails, then a kill between the renames."""
    state, root = _state(pp=2), Path(root_name)
    job = _Job(state, seed=70 + state.rank)
    job.train(1, seed=state.rank)
    _save(root, 1, job, state)
    first = job.snapshot()
    job.train(1, seed=9)
    with mock.patch("os.replace", _refusing_rename_in), pytest.raises(CheckpointError) as caught:
        _save(root, 1, job, state)
    after_failure = sorted(p.name for p in root.iterdir())
    dist.barrier()
    if state.rank == 0:  # what a kill between moving iter_0000001 aside and renaming in leaves
        os.replace(root / "iter_0000001", root / "iter_0000001.replaced")
    dist.barrier()
    job.train(1, seed=10)
    loaded = _load(root, job, state)
    return {
        "message": str(caught.value),
        "after_failure": after_failure,
        "resumed": loaded is not None and loaded.iteration == 1,
        "restored": _same(job.snapshot()["model"], first["model"]),
        "left": sorted(p.name for p in root.iterdir()),
    }


def test_saving_an_existing_iteration_again_never_leaves_it_unloadable(
    two_ranks: Results,
) -> None:
    for rank, result in enumerate(two_ranks[1]):
        outcome = result["resave"]
        assert f"rank {rank}" in outcome["message"]
        assert "the tracker" in outcome["message"]
        if rank == 0:  # the failing step, by name
            assert "could not publish iteration 1 in " in outcome["message"]
            assert (
                "[Errno 5] could not rename iter_0000001.partial to iter_0000001: "
                "Input/output error (simulated)" in outcome["message"]
            )
        assert outcome["after_failure"] == ["iter_0000001", TRACKER_FILENAME]
        assert outcome["resumed"]
        assert outcome["restored"]
    assert two_ranks[1][0]["resave"]["left"] == ["iter_0000001", TRACKER_FILENAME]


# ----------------------------------------------------------------------------- options
def _main_copies_match_model(model: list[torch.nn.Module]) -> bool:
    params = [param for chunk in model for param in chunk.parameters()]
    copies = [getattr(param, "main_param", None) for param in params]
    return all(
        isinstance(copy, torch.Tensor) and torch.equal(copy.half(), param)
        for copy, param in zip(copies, params, strict=True)
    )


def _options(root_name: str) -> dict[str, Any]:
    state = _state(pp=1)
    root = Path(root_name)
    job = _Job(state, seed=70, fp16=True)
    job.train(2, seed=0)
    _save(
        root, 5, job, state, args=_args(pipeline_model_parallel_size=1), consumed_train_samples=40
    )
    saved = job.snapshot()
    draws = _draws()
    args = _args(pipeline_model_parallel_size=1)
    optimizer = job.optimizer
    out: dict[str, Any] = {}

    job.train(2, seed=1)
    before = job.snapshot()
    out["moved"] = (not _same(before["model"], saved["model"]),)
    finetuned = _load(root, job, state, args=args, finetune=True)
    after = job.snapshot()
    out["finetune"] = (
        finetuned
        == LoadedCheckpoint(
            iteration=0, consumed_train_samples=0, consumed_valid_samples=0, args=args
        ),
        _same(after["model"], saved["model"]),
        _same(after["optimizer"]["optimizer"], before["optimizer"]["optimizer"]),
        after["scheduler"] == before["scheduler"],
        _same(after["rng"], before["rng"]),
        # The fp32 main copies follow the loaded model, not the optimizer's old copies.
        _main_copies_match_model(job.model),
    )

    job.train(2, seed=2)
    before = job.snapshot()
    no_optim = _load(root, job, state, args=args, no_load_optim=True)
    after = job.snapshot()
    out["no_load_optim"] = (
        no_optim
        == LoadedCheckpoint(
            iteration=5, consumed_train_samples=40, consumed_valid_samples=0, args=args
        ),
        _same(after["model"], saved["model"]),
        _same(after["optimizer"]["optimizer"], before["optimizer"]["optimizer"]),
        after["scheduler"] == before["scheduler"],
        True,
    )
    # Data-parallel ranks share one file, so every rank resumes the writer's generators.
    out["draws_after_save"] = draws
    out["draws_after_load"] = _draws()

    job.train(2, seed=3)
    before = job.snapshot()
    no_rng = _load(root, job, state, args=args, no_load_rng=True)
    after = job.snapshot()
    out["no_load_rng"] = (
        no_rng is not None and no_rng.iteration == 5,
        _same(after["model"], saved["model"]),
        _same(after["optimizer"], saved["optimizer"]),
        after["scheduler"] == saved["scheduler"],
        _same(after["rng"], before["rng"]),
        isinstance(optimizer, Float16OptimizerWithFloat16Params),
    )
    return out


def test_finetune_no_load_optim_and_no_load_rng(two_ranks: Results) -> None:
    ranks = [rank["options"] for rank in two_ranks[1]]
    for options in ranks:
        for option in ("moved", "finetune", "no_load_optim", "no_load_rng"):
            assert all(options[option]), (option, options[option])
        assert options["draws_after_load"] == ranks[0]["draws_after_save"]


# ----------------------------------------------------------------------------- the runs
# Starting ranks dominates the run time (each imports torch's compiler stack on its first
# optimizer), so every scenario of one world size shares one run, each in its own directory.
_TWO_RANK_SCENARIOS: dict[str, Callable[[str], Any]] = {
    "round_trip": _round_trip_pp2,
    "tensor_parallel": _tensor_parallel,
    "virtual_chunks": _virtual_chunks,
    "refusals": _refusals,
    "no_tracker": _no_tracker,
    "crash_mid_save": _crash_mid_save,
    "options": _options,
    "resave": _resave,
}
_FOUR_RANK_SCENARIOS: dict[str, Callable[[str], Any]] = {
    "fp16": _fp16_pp2_dp2,
    "tensor_and_pipeline_parallel": _tensor_and_pipeline_parallel,
}


def _run_scenarios(base: str, world_size: int) -> dict[str, Any]:
    scenarios = _TWO_RANK_SCENARIOS if world_size == 2 else _FOUR_RANK_SCENARIOS
    results = {}
    for name, scenario in scenarios.items():
        root = Path(base) / name
        root.mkdir(exist_ok=True)
        results[name] = scenario(str(root))
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    base = tmp_path_factory.mktemp("two_ranks")
    return base, run_distributed(_run_scenarios, 2, str(base), 2, timeout=90)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    base = tmp_path_factory.mktemp("four_ranks")
    return base, run_distributed(_run_scenarios, 4, str(base), 4, timeout=90)
