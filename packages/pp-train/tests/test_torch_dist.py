"""torch_dist checkpoints: global keys, resharding on load, async saves and refused loads.

Each multi-process test trains the tiny GPT of test_training through the public API; the
saved run and the resumed run may use different (pipeline, virtual, data) layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pp_optim import LRScheduleConfig, OptimizerConfig
from pp_state import ParallelConfig, ParallelState, Placement
from pp_testing import run_distributed
from pp_train import (
    CheckpointArgs,
    LRScheduleArgs,
    ModelArgs,
    ParallelArgs,
    PretrainConfig,
    TrainingArgs,
    TrainingConfig,
    TrainingLogger,
    TrainingProgress,
    build_forward_backward_func,
    build_num_microbatches_calculator,
    microbatches,
    pretrain,
    setup_model_and_optimizer,
    train,
)
from pp_train.app import CorpusDataset, GPTChunk, GPTConfig, chunk_layers
from pp_train.app import gpt_forward_step as forward_step
from pp_train.checkpoint import (
    CheckpointError,
    ShardedStateKeys,
    detect_format,
    load_checkpoint,
    read_tracker,
)
from pp_train.checkpoint.__main__ import main as checkpoint_main
from pp_train.checkpoint.keys import chunk_global_keys
from pp_train.checkpoint.torch_dist import write_common, writer_and_planner

GPT = GPTConfig(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16)
MICRO, GLOBAL = 2, 8


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run's settings (picklable, sent to every rank)."""

    pp: int = 1
    vp: int | None = None
    iters: int = 4
    fp16: bool = False
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    ckpt_format: str = "torch_dist"
    auto_detect: bool = False
    async_save: bool = False
    layers: int = GPT.num_layers
    hidden: int = GPT.hidden_size


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    base = torch.arange(64).repeat(200) % 50 + 40
    noise = torch.randint(0, 5, base.shape, generator=generator)
    return (base + noise).to(torch.int64)


def _gpt(run: Run) -> GPTConfig:
    return dataclasses.replace(GPT, num_layers=run.layers, hidden_size=run.hidden)


def _args(run: Run) -> dict[str, Any]:
    gpt = _gpt(run)
    return {
        "num_layers": gpt.num_layers,
        "hidden_size": gpt.hidden_size,
        "num_attention_heads": gpt.num_attention_heads,
        "seq_length": gpt.seq_length,
        "vocab_size": gpt.vocab_size,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": run.pp,
        "virtual_pipeline_model_parallel_size": run.vp,
    }


def _setup(run: Run) -> tuple[Any, ...]:
    config = ParallelConfig(
        pipeline_model_parallel_size=run.pp, virtual_pipeline_model_parallel_size=run.vp
    )
    state = ParallelState.create(config)
    vp, gpt = run.vp or 1, _gpt(run)

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        rank = state.pipeline_model_parallel_rank
        layers = chunk_layers(gpt.num_layers, run.pp, vp, rank, vp_stage)
        return GPTChunk(
            gpt, layers=layers, pre_process=pre_process, post_process=post_process, seed=7
        )

    model, optimizer, scheduler, loaded = setup_model_and_optimizer(
        provider,
        state,
        optimizer_config=OptimizerConfig(lr=1e-2, fp16=run.fp16, initial_loss_scale=2.0**10),
        lr_schedule=LRScheduleConfig(
            max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=GLOBAL, lr_decay_steps=10 * GLOBAL,
            lr_decay_style="cosine",
        ),
        load=run.load,
        checkpoint_args=_args(run),
        ckpt_format=run.ckpt_format,  # type: ignore[arg-type]
        auto_detect_ckpt_format=run.auto_detect,
    )  # fmt: skip
    return state, model, optimizer, scheduler, loaded


def _train(run: Run) -> dict[str, Any]:
    state, model, optimizer, scheduler, loaded = _setup(run)
    progress = TrainingProgress()
    if loaded is not None:
        progress = TrainingProgress(
            iteration=loaded.iteration, consumed_train_samples=loaded.consumed_train_samples
        )
    dp_rank, dp_size = state.group_rank("dp_cp"), state.group_size("dp_cp")
    dataset = CorpusDataset(_tokens(), GPT.seq_length, seed=3)
    vp = run.vp or 1
    streams = [
        microbatches(dataset, consumed_samples=progress.consumed_train_samples,
                     micro_batch_size=MICRO, data_parallel_rank=dp_rank, data_parallel_size=dp_size)
        for _ in range(vp)
    ]  # fmt: skip
    calculator = build_num_microbatches_calculator(
        global_batch_size=GLOBAL, micro_batch_size=MICRO, data_parallel_size=dp_size
    )
    losses: list[float] = []
    logger = TrainingLogger(train_iters=run.iters, log_interval=1, is_logging_rank=True,
                            print_fn=lambda line: None)  # fmt: skip
    original = logger.training_log

    def record(loss_dict: dict[str, float], **kwargs: Any) -> Any:
        if loss_dict:
            losses.append(loss_dict["lm loss"])
        return original(loss_dict, **kwargs)

    logger.training_log = record  # type: ignore[method-assign,assignment]
    lines: list[str] = []
    train(
        forward_step, model, optimizer, scheduler, streams if vp > 1 else streams[0], None,
        state=state,
        config=TrainingConfig(
            train_iters=run.iters, micro_batch_size=MICRO, seq_length=GPT.seq_length,
            save=run.save, save_interval=run.save_interval, log_interval=1,
            ckpt_format=run.ckpt_format, async_save=run.async_save,  # type: ignore[arg-type]
        ),
        forward_backward_func=build_forward_backward_func(state, model, optimizer,
                                                          hidden_size=GPT.hidden_size),
        calculator=calculator, progress=progress, logger=logger, checkpoint_args=_args(run),
        print_fn=lines.append,
    )  # fmt: skip
    return {
        "losses": losses,
        "iteration": progress.iteration,
        "notes": list(loaded.notes) if loaded is not None else [],
        "lines": lines,
    }


def _last(results: list[dict[str, Any]]) -> dict[str, Any]:
    return next(r for r in reversed(results) if r["losses"])


# ----------------------------------------------------------------------------- pure
def _global_names(pp: int, vp: int) -> set[str]:
    names: set[str] = set()
    for rank in range(pp):
        for stage in range(vp):
            placement = Placement.looped(pp, vp)
            chunk = GPTChunk(
                GPT, layers=chunk_layers(GPT.num_layers, pp, vp, rank, stage), seed=7,
                pre_process=placement.is_first(rank, stage),
                post_process=placement.is_last(rank, stage),
            )  # fmt: skip
            names.update(chunk_global_keys(chunk, stage).values())
    return names


def test_gpt_global_keys_do_not_depend_on_the_layout() -> None:
    single = _global_names(1, 1)
    assert "layers.7.mlp.fc1.weight" in single
    assert "output_layer.weight" not in single  # tied: saved as the word embedding
    for pp, vp in ((2, 1), (4, 1), (2, 2), (4, 2)):
        assert _global_names(pp, vp) == single, (pp, vp)


def test_last_stage_names_its_tied_output_layer_as_the_word_embedding() -> None:
    chunk = GPTChunk(GPT, layers=range(4, 8), pre_process=False, post_process=True, seed=7)
    assert isinstance(chunk, ShardedStateKeys)
    keys = chunk.sharded_state_keys()
    assert keys["output_layer.weight"] == "embedding.word_embeddings.weight"
    assert keys["layers.0.mlp.fc1.weight"] == "layers.4.mlp.fc1.weight"


def test_a_model_without_global_keys_is_refused_clearly() -> None:
    with pytest.raises(TypeError, match=r"chunk 0 \(Linear\) has no sharded_state_keys"):
        chunk_global_keys(torch.nn.Linear(2, 2), 0)


def test_detect_format(tmp_path: Path) -> None:
    assert detect_format(tmp_path / "absent") is None
    (tmp_path / "a" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metadata.json").write_text("{}")
    assert detect_format(tmp_path / "a") == "torch"
    assert detect_format(tmp_path / "b") == "torch_dist"


# ----------------------------------------------------------------------------- resharding
@pytest.fixture(scope="module")
def saved_at_pp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """A pp-4 torch_dist checkpoint of iteration 3, and an unbroken pp-1 run's 6 losses."""
    root = tmp_path_factory.mktemp("pp4")
    unbroken = _last(run_distributed(_train, 1, Run(iters=6)))["losses"]
    run_distributed(_train, 4, Run(pp=4, iters=3, save=str(root)), timeout=120)
    return root, unbroken


@pytest.mark.parametrize(
    ("pp", "vp"), [(2, None), (2, 2), (1, None)], ids=["pp2", "pp2-vp2", "pp1-dp2"]
)
def test_a_pp4_checkpoint_resumes_at_another_layout(
    saved_at_pp4: tuple[Path, list[float]], pp: int, vp: int | None
) -> None:
    root, unbroken = saved_at_pp4
    assert read_tracker(root) == 3
    assert (root / "iter_0000003" / ".metadata").is_file()
    results = run_distributed(_train, 2, Run(pp=pp, vp=vp, iters=6, load=str(root)))
    resumed = _last(results)
    assert resumed["iteration"] == 6
    assert resumed["losses"] == pytest.approx(unbroken[3:], abs=1e-4)
    assert any("random generator states not restored" in n for n in resumed["notes"])
    assert read_tracker(root) == 3  # the load changed nothing on disk


def test_same_layout_resume_is_exact_and_restores_rng(tmp_path: Path) -> None:
    unbroken = _last(run_distributed(_train, 2, Run(pp=2, iters=5, fp16=True)))["losses"]
    run_distributed(_train, 2, Run(pp=2, iters=3, fp16=True, save=str(tmp_path)))
    resumed = _last(run_distributed(_train, 2, Run(pp=2, iters=5, fp16=True, load=str(tmp_path))))
    assert resumed["notes"] == []
    assert resumed["losses"] == pytest.approx(unbroken[3:], rel=1e-6)
    assert read_tracker(tmp_path) == 3
    assert not list(tmp_path.glob("*.partial"))


# ----------------------------------------------------------------------------- async
def test_async_save_resumes_like_a_blocking_one(tmp_path: Path) -> None:
    unbroken = _last(run_distributed(_train, 2, Run(pp=2, iters=6)))["losses"]
    run = Run(pp=2, iters=4, save=str(tmp_path), save_interval=1, async_save=True)
    first = run_distributed(_train, 2, run)
    assert read_tracker(tmp_path) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]  # fmt: skip
    assert any("saved checkpoint at iteration 4" in line for line in first[0]["lines"])
    resumed = _last(run_distributed(_train, 2, Run(pp=2, iters=6, load=str(tmp_path))))
    assert resumed["losses"] == pytest.approx(unbroken[4:], rel=1e-6)


# ----------------------------------------------------------------------------- refusals
def _refused_load(root: str, run: Run) -> tuple[str, bool]:
    before = sorted((p.name, p.stat().st_mtime_ns) for p in Path(root).rglob("*"))
    try:
        _setup(run)
    except CheckpointError as error:
        after = sorted((p.name, p.stat().st_mtime_ns) for p in Path(root).rglob("*"))
        return str(error), before == after
    return "loaded", True


@pytest.mark.reliability
def test_refused_loads_name_file_expected_and_found(tmp_path: Path) -> None:
    base = tmp_path / "base"
    run_distributed(_train, 2, Run(pp=2, iters=1, save=str(base)))
    cases = {
        "layers": Run(pp=2, layers=4, load=str(base)),
        "hidden": Run(pp=2, hidden=64, load=str(base)),
        "format": Run(pp=2, ckpt_format="torch", load=str(base)),
    }
    missing = tmp_path / "missing"
    shutil.copytree(base, missing)
    os.remove(sorted((missing / "iter_0000001").glob("*.distcp"))[0])
    cases["shard"] = Run(pp=2, load=str(missing))
    found = {name: run_distributed(_refused_load, 2, run.load, run) for name, run in cases.items()}
    for name, per_rank in found.items():
        assert all(unchanged for _, unchanged in per_rank), name
    layers = found["layers"][0][0]
    assert "common.pt holds another model" in layers
    assert "num_layers: expected 4" in layers
    assert "found 8" in layers
    assert "hidden_size: expected 64 (this run), found 32" in found["hidden"][1][0]
    assert "is in the 'torch_dist' format; this run loads 'torch'" in found["format"][0][0]
    assert "--auto-detect-ckpt-format" in found["format"][0][0]
    assert "missing shard file(s)" in found["shard"][0][0]
    assert ".distcp" in found["shard"][0][0]


def test_auto_detect_loads_a_torch_checkpoint_when_torch_dist_is_asked(tmp_path: Path) -> None:
    run_distributed(_train, 2, Run(pp=2, iters=2, ckpt_format="torch", save=str(tmp_path)))
    assert detect_format(tmp_path / "iter_0000002") == "torch"
    resumed = run_distributed(_train, 2, Run(pp=2, iters=3, load=str(tmp_path), auto_detect=True))
    assert _last(resumed)["iteration"] == 3


def _unwritable(root: str) -> str:
    try:
        _train(Run(pp=1, iters=1, save=root))
    except CheckpointError as error:
        return str(error)
    return "trained"


@pytest.mark.reliability
def test_an_unwritable_save_directory_is_refused_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    messages = run_distributed(_unwritable, 2, str(blocker / "ckpt"))
    assert all("is not writable" in m and str(blocker / "ckpt") in m for m in messages)


def test_async_save_with_the_torch_format_is_refused() -> None:
    with pytest.raises(ValueError, match="async_save needs ckpt_format 'torch_dist'"):
        TrainingConfig(train_iters=1, micro_batch_size=1, seq_length=4, async_save=True)


def _load_without_keys(root: str) -> str:
    state = ParallelState.create(ParallelConfig())
    try:
        load_checkpoint(root, state=state, model=[torch.nn.Linear(2, 2)], optimizer=None,
                        scheduler=None, args={}, strict_args=(), ckpt_format="torch_dist")  # fmt: skip
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_torch_dist_load_into_a_model_without_global_keys_is_refused(tmp_path: Path) -> None:
    run_distributed(_train, 1, Run(iters=1, save=str(tmp_path)))
    message = run_distributed(_load_without_keys, 1, str(tmp_path))[0]
    assert "has no sharded_state_keys() method" in message
    assert dist.is_available()


# ----------------------------------------------------------------------------- conversion
@pytest.fixture(scope="module")
def unbroken_pp2() -> list[float]:
    """The losses of an unbroken 6-iteration pp-2 run (fp32)."""
    losses: list[float] = _last(run_distributed(_train, 2, Run(pp=2, iters=6)))["losses"]
    return losses


def _convert(run: Run, to: str, target: str) -> tuple[str, str]:
    """`pretrain` with --ckpt-convert-format: the same model, optimizer and schedule as _setup."""
    gpt = _gpt(run)

    def provider(
        *, pre_process: bool, post_process: bool, vp_stage: int, state: ParallelState
    ) -> torch.nn.Module:
        layers = chunk_layers(gpt.num_layers, run.pp, 1, state.pipeline_model_parallel_rank, 0)
        return GPTChunk(
            gpt, layers=layers, pre_process=pre_process, post_process=post_process, seed=7
        )

    def no_datasets(num_samples: tuple[int, int, int]) -> Any:
        raise AssertionError("a conversion builds no datasets")

    config = PretrainConfig(
        parallel=ParallelArgs(pipeline_model_parallel_size=run.pp),
        model=ModelArgs(num_layers=gpt.num_layers, hidden_size=gpt.hidden_size,
                        num_attention_heads=gpt.num_attention_heads, seq_length=gpt.seq_length),
        training=TrainingArgs(train_iters=10, micro_batch_size=MICRO, global_batch_size=GLOBAL),
        optimizer=OptimizerConfig(lr=1e-2, fp16=run.fp16, initial_loss_scale=2.0**10),
        lr_schedule=LRScheduleArgs(min_lr=1e-3, lr_warmup_iters=1, lr_decay_iters=10,
                                   lr_decay_style="cosine"),
        checkpoint=CheckpointArgs(load=run.load, ckpt_convert_format=to,  # type: ignore[arg-type]
                                  ckpt_convert_save=target),
    )  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        reason = pretrain(no_datasets, provider, forward_step, config=config,
                          checkpoint_args={"vocab_size": gpt.vocab_size})  # fmt: skip
    return reason, printed.getvalue()


def _files(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*"))


def _converted(source: Path, target: Path, to: str, fp16: bool = False) -> str:
    before = _files(source)
    run = Run(pp=2, fp16=fp16, load=str(source))
    results = run_distributed(_convert, 2, run, to, str(target))
    assert {reason for reason, _ in results} == {"converted"}
    assert _files(source) == before  # the input is only read
    assert read_tracker(target) == 3
    assert detect_format(target / "iter_0000003") == to
    return "".join(stdout for _, stdout in results)


def test_a_torch_checkpoint_converted_to_torch_dist_resumes_exactly(
    tmp_path: Path, unbroken_pp2: list[float]
) -> None:
    """About 70 s on 2 busy cores: four 2-rank runs (the save, the conversion, and resumes
    at two layouts) are the claim itself; none can be dropped."""
    unbroken = unbroken_pp2
    source, target = tmp_path / "torch", tmp_path / "dist"
    run_distributed(_train, 2, Run(pp=2, iters=3, ckpt_format="torch", save=str(source)))
    printed = _converted(source, target, "torch_dist")
    assert printed.count("converted the torch checkpoint of iteration 3") == 1
    assert f"to torch_dist in {target}" in printed
    resumed = _last(run_distributed(_train, 2, Run(pp=2, iters=6, load=str(target))))
    assert resumed["notes"] == []
    assert resumed["losses"] == pytest.approx(unbroken[3:], rel=1e-6)
    other = _last(run_distributed(_train, 2, Run(pp=1, iters=6, load=str(target))))
    assert other["losses"] == pytest.approx(unbroken[3:], abs=1e-4)


def test_a_torch_dist_checkpoint_converted_to_torch_resumes_exactly(tmp_path: Path) -> None:
    unbroken = _last(run_distributed(_train, 2, Run(pp=2, iters=5, fp16=True)))["losses"]
    source, target = tmp_path / "dist", tmp_path / "torch"
    run_distributed(_train, 2, Run(pp=2, iters=3, fp16=True, save=str(source)))
    printed = _converted(source, target, "torch", fp16=True)
    assert "converted the torch_dist checkpoint of iteration 3" in printed
    run = Run(pp=2, iters=5, fp16=True, ckpt_format="torch", load=str(target))
    resumed = _last(run_distributed(_train, 2, run))
    assert resumed["losses"] == pytest.approx(unbroken[3:], rel=1e-6)


def _refused_conversion(load: str, target: str) -> str:
    try:
        _convert(Run(pp=2, load=load), "torch_dist", target)
    except CheckpointError as error:
        return str(error)
    return "converted"


def test_converting_an_empty_load_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "out"
    messages = run_distributed(_refused_conversion, 2, str(tmp_path), str(target))
    assert all(f"--load {tmp_path} holds no checkpoint" in m for m in messages)
    assert not target.exists()


# ----------------------------------------------------------------------------- the command
def _command(*args: str) -> tuple[int, str]:
    """`python -m pp_train.checkpoint` in this process (no process group): status, stderr."""
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = checkpoint_main(list(args))
        except SystemExit as stopped:
            status = int(stopped.code or 0)
    return status, errors.getvalue()


def _convert_command(source: Path, target: Path, to: str) -> None:
    before = _files(source)
    assert _command("convert", "--input", str(source), "--output", str(target), "--to", to) == (
        0,
        "",
    )
    assert _files(source) == before  # the input is only read
    assert read_tracker(target) == 3
    assert detect_format(target / "iter_0000003") == to
    assert sorted(p.name for p in target.iterdir()) == [
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]
    assert not list(target.parent.glob("*.tmp-*"))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_the_command_converts_torch_to_torch_dist_that_reshards(
    tmp_path: Path, unbroken_pp2: list[float]
) -> None:
    """About 100 s on 2 busy cores: the save and resumes at two layouts are the claim; the
    round trip back to torch is compared file by file instead of by a fourth run."""
    source, dist_dir, back = tmp_path / "torch", tmp_path / "dist", tmp_path / "back"
    run_distributed(_train, 2, Run(pp=2, iters=3, ckpt_format="torch", save=str(source)))
    _convert_command(source, dist_dir, "torch_dist")
    resumed = _last(run_distributed(_train, 2, Run(pp=2, iters=6, load=str(dist_dir))))
    assert resumed["notes"] == []  # the recorded layout: RNG restored too
    assert resumed["losses"] == pytest.approx(unbroken_pp2[3:], rel=1e-6)
    other = _last(run_distributed(_train, 2, Run(pp=1, iters=6, load=str(dist_dir))))
    assert other["losses"] == pytest.approx(unbroken_pp2[3:], abs=1e-4)
    _convert_command(dist_dir, back, "torch")  # the round trip gives the same files
    for name in ("mp_rank_00_000", "mp_rank_00_001"):
        files = [root / "iter_0000003" / name / "model_optim_rng.pt" for root in (source, back)]
        original, returned = (torch.load(f, weights_only=True) for f in files)
        assert _same(original, returned), name


def test_the_command_converts_torch_dist_to_torch_at_the_saved_layout(tmp_path: Path) -> None:
    """About 80 s on 2 busy cores: an fp16 reference run, the save and the resume."""
    unbroken = _last(run_distributed(_train, 2, Run(pp=2, iters=5, fp16=True)))["losses"]
    source, target = tmp_path / "dist", tmp_path / "torch"
    run_distributed(_train, 2, Run(pp=2, iters=3, fp16=True, save=str(source)))
    _convert_command(source, target, "torch")
    run = Run(pp=2, iters=5, fp16=True, ckpt_format="torch", load=str(target))
    resumed = _last(run_distributed(_train, 2, run))
    assert resumed["losses"] == pytest.approx(unbroken[3:], rel=1e-6)


def _old_torch_checkpoint(root: Path) -> None:
    """A torch checkpoint as saved before files recorded their global names."""
    path = root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save({"checkpoint_version": 3.0, "iteration": 1, "args": {}, "model": {},
                "consumed_train_samples": 0, "consumed_valid_samples": 0}, path)  # fmt: skip
    (root / "latest_checkpointed_iteration.txt").write_text("1")


def _old_torch_dist_checkpoint(root: Path) -> None:
    """A torch_dist checkpoint as saved before it recorded each position's names."""
    directory = root / "iter_0000001"
    directory.mkdir(parents=True)
    common = {"checkpoint_version": 3.0, "iteration": 1, "args": {},
              "consumed_train_samples": 0, "consumed_valid_samples": 0}  # fmt: skip
    write_common(directory, common)
    writer, planner = writer_and_planner(directory)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model.w": torch.ones(2)}, storage_writer=writer, planner=planner, no_dist=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")


@pytest.mark.reliability
def test_the_command_refuses_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    old, full, out = tmp_path / "old", tmp_path / "full", str(tmp_path / "out")
    _old_torch_checkpoint(old)
    _old_torch_dist_checkpoint(tmp_path / "old_dist")
    full.mkdir()
    (full / "keep").write_text("x")
    cases = {
        "missing": (["--input", str(tmp_path / "absent"), "--output", out, "--to", "torch"],
                    "is not a directory"),
        "old": (["--input", str(old), "--output", out, "--to", "torch_dist"],
                "records no global tensor names"),
        "old torch_dist": (["--input", str(tmp_path / "old_dist"), "--output", out, "--to",
                            "torch"], "records no global tensor names"),
        "output": (["--input", str(old), "--output", str(full), "--to", "torch_dist"],
                   "exists and is not an empty directory"),
        "to": (["--input", str(old), "--output", out, "--to", "zarr"], "invalid choice: 'zarr'"),
        "iteration": (["--input", str(old), "--output", out, "--to", "torch_dist",
                       "--iteration", "7"], "has no iter_0000007"),
    }  # fmt: skip
    before = _files(tmp_path)
    for name, (args, expected) in cases.items():
        status, error = _command("convert", *args)
        assert status == 2, name
        assert error.endswith("\n"), (name, error)
        assert error.count("\n") == 1, (name, error)  # one line
        assert expected in error, (name, error)
    assert "--ckpt-convert-format" in _command("convert", *cases["old"][0])[1]
    assert _files(tmp_path) == before
