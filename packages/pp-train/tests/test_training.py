"""The training pieces end to end on real gloo groups with the bundled GPT.

Each run builds its ParallelState, model chunks, optimizer and schedule through the public API
(as the `pp-train` command does) and trains a few iterations of a tiny GPT.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from pp_optim import DDPConfig, LRScheduleConfig, OptimizerConfig
from pp_schedules.planning import resolve_on_demand
from pp_state import ParallelConfig, ParallelState, Placement
from pp_testing import run_distributed
from pp_train import (
    CheckpointError,
    NonFiniteError,
    TrainingConfig,
    TrainingLogger,
    TrainingProgress,
    build_forward_backward_func,
    build_num_microbatches_calculator,
    evaluate,
    finetune,
    microbatches,
    setup_model_and_optimizer,
    tied_embedding_sync,
    train,
    unwrap_model,
)
from pp_train.app import CorpusDataset, GPTChunk, GPTConfig, chunk_layers, gpt_forward_step

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
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    overflow_at: int | None = None  # iteration (1-based) whose loss becomes inf on rank 0
    sigterm_at: int | None = None  # iteration at which the last rank gets SIGTERM
    autoresume_at: int | None = None
    eval_interval: int | None = None
    overlap: bool = False  # grad buckets all-reduced during backward
    placement: str = "looped"  # which stage each chunk holds ("v": both ends on rank 0)
    profile: str | None = None  # TrainingConfig.profile_schedule_path


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    # A learnable stream: a repeating phrase with noise.
    base = torch.arange(64).repeat(200) % 50 + 40
    noise = torch.randint(0, 5, base.shape, generator=generator)
    return (base + noise).to(torch.int64)


class _Inject:
    """forward_step wrapper that breaks one iteration as a test asks (counts its calls)."""

    def __init__(self, run: Run, microbatches_per_step: int, chunks: int) -> None:
        self.run, self.calls = run, 0
        self.per_iteration = microbatches_per_step * chunks

    def __call__(self, data_iterator: Iterator[Any], model: torch.nn.Module) -> Any:
        iteration = self.calls // self.per_iteration + 1
        self.calls += 1
        output, loss_func = gpt_forward_step(data_iterator, model)
        if self.run.sigterm_at == iteration and dist.get_rank() == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.run.overflow_at == iteration and dist.get_rank() == 0:
            output = output * math.inf
        return output, loss_func


def _setup(run: Run) -> tuple[Any, ...]:
    """ParallelState, chunks, optimizer, scheduler and checkpoint of a run (as the command)."""
    state = ParallelState.create(
        ParallelConfig(
            pipeline_model_parallel_size=run.pp, virtual_pipeline_model_parallel_size=run.vp
        )
    )
    vp = run.vp or 1
    placement = Placement.named(run.placement, run.pp, vp)

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        layers = chunk_layers(
            GPT.num_layers,
            run.pp,
            vp,
            state.pipeline_model_parallel_rank,
            vp_stage,
            placement=placement,
        )
        return GPTChunk(
            GPT, layers=layers, pre_process=pre_process, post_process=post_process, seed=7
        )

    args = {
        "num_layers": GPT.num_layers,
        "hidden_size": GPT.hidden_size,
        "num_attention_heads": GPT.num_attention_heads,
        "seq_length": GPT.seq_length,
        "vocab_size": GPT.vocab_size,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": run.pp,
        "virtual_pipeline_model_parallel_size": run.vp,
    }
    model, optimizer, scheduler, loaded = setup_model_and_optimizer(
        provider,
        state,
        optimizer_config=OptimizerConfig(
            lr=1e-2, fp16=run.fp16, initial_loss_scale=2.0**10, hysteresis=1
        ),
        lr_schedule=LRScheduleConfig(
            max_lr=1e-2,
            min_lr=1e-3,
            lr_warmup_steps=GLOBAL,
            lr_decay_steps=10 * GLOBAL,
            lr_decay_style="cosine",
        ),
        ddp_config=DDPConfig(
            overlap_grad_reduce=run.overlap, bucket_size=2000 if run.overlap else None
        ),
        load=run.load,
        checkpoint_args=args,
        placement=placement,
    )
    return state, model, optimizer, scheduler, loaded, args


def _forward_backward(run: Run, state: ParallelState, model: Any, optimizer: Any) -> Any:
    vp = run.vp or 1
    return build_forward_backward_func(
        state,
        model,
        optimizer,
        hidden_size=GPT.hidden_size,
        resolved=resolve_on_demand(
            pp_size=run.pp, vp_size=vp, placement=Placement.named(run.placement, run.pp, vp)
        ),
    )


def _tied_copies_equal(model: list[torch.nn.Module]) -> bool | None:
    """On a rank holding both ends (V placement): are the embedding and its copy equal?"""
    weights = [cast("GPTChunk", unwrap_model(c)).shared_embedding_or_output_weight() for c in model]
    first, last = weights[0], weights[-1]
    if len(model) < 2 or first is None or last is None:
        return None
    return bool(torch.equal(first, last))


def _train(run: Run) -> dict[str, Any]:
    state, model, optimizer, scheduler, loaded, args = _setup(run)
    vp = run.vp or 1
    progress = TrainingProgress()
    if loaded is not None:
        progress = TrainingProgress(
            iteration=loaded.iteration, consumed_train_samples=loaded.consumed_train_samples
        )
    dp_rank, dp_size = state.group_rank("dp_cp"), state.group_size("dp_cp")
    dataset = CorpusDataset(_tokens(), GPT.seq_length, seed=3)
    streams = [
        microbatches(
            dataset,
            consumed_samples=progress.consumed_train_samples,
            micro_batch_size=MICRO,
            data_parallel_rank=dp_rank,
            data_parallel_size=dp_size,
        )
        for _ in range(vp)
    ]
    calculator = build_num_microbatches_calculator(
        global_batch_size=GLOBAL, micro_batch_size=MICRO, data_parallel_size=dp_size
    )
    lines: list[str] = []
    logger = TrainingLogger(
        train_iters=run.iters, log_interval=1, is_logging_rank=True, print_fn=lines.append
    )
    losses: list[float] = []
    learning_rates: list[float] = []
    original = logger.training_log

    def record(loss_dict: dict[str, float], **kwargs: Any) -> Any:
        if loss_dict:
            losses.append(loss_dict["lm loss"])
        learning_rates.append(kwargs["learning_rate"])
        return original(loss_dict, **kwargs)

    logger.training_log = record  # type: ignore[method-assign,assignment]
    forward_backward = _forward_backward(run, state, model, optimizer)
    reason = train(
        _Inject(run, calculator.get(), vp),
        model,
        optimizer,
        scheduler,
        streams if vp > 1 else streams[0],
        None,
        state=state,
        config=TrainingConfig(
            train_iters=run.iters,
            micro_batch_size=MICRO,
            seq_length=GPT.seq_length,
            save=run.save,
            save_interval=run.save_interval,
            exit_interval=run.exit_interval,
            exit_duration_in_mins=run.exit_duration_in_mins,
            adlr_autoresume_interval=1,
            log_interval=1,
            profile_schedule_path=run.profile,
        ),
        forward_backward_func=forward_backward,
        calculator=calculator,
        progress=progress,
        logger=logger,
        checkpoint_args=args,
        autoresume=(lambda: progress.iteration == run.autoresume_at) if run.autoresume_at else None,
        print_fn=lines.append,
    )
    first = [p.detach().clone() for p in model[0].parameters()]
    return {
        "reason": reason,
        "iteration": progress.iteration,
        "consumed": progress.consumed_train_samples,
        "losses": losses,
        "lrs": learning_rates,
        "lines": lines,
        "last_rank": dist.get_rank() == dist.get_world_size() - 1,
        "params": first,
        "tied_equal": _tied_copies_equal(model),
    }


def _last(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The result of the rank that logs losses: the last stage of the last replica."""
    return next(r for r in reversed(results) if r["losses"])


def test_losses_equal_across_layouts() -> None:
    single = _last(run_distributed(_train, 1, Run()))
    assert len(single["losses"]) == 4
    assert single["losses"][-1] < single["losses"][0]  # it learns
    layouts = [
        (2, Run(pp=2)),
        (4, Run(pp=4)),
        (4, Run(pp=2, vp=2)),
        (4, Run(pp=4, vp=2)),
        (4, Run(pp=2)),
        (4, Run(pp=2, overlap=True)),
    ]
    for ranks, run in layouts:
        other = _last(run_distributed(_train, ranks, run, timeout=120))
        assert other["losses"] == pytest.approx(single["losses"], rel=2e-5), (ranks, run)


def test_v_placement_sums_the_tied_embedding_on_rank_0_and_matches_one_stage() -> None:
    single = _last(run_distributed(_train, 1, Run()))
    results = run_distributed(_train, 2, Run(pp=2, vp=2, placement="v"), timeout=120)
    # Both ends sit on rank 0: it reports the losses and holds both copies.
    assert results[0]["losses"] == pytest.approx(single["losses"], rel=2e-5)
    assert results[1]["losses"] == []
    assert results[0]["tied_equal"] is True  # same summed gradient, same update, every step
    assert results[1]["tied_equal"] is None


def test_tied_embedding_sync_follows_the_placement() -> None:
    assert tied_embedding_sync(Placement.looped(1, 1)) == "none"
    assert tied_embedding_sync(Placement.looped(4, 2)) == "embedding_group"
    assert tied_embedding_sync(Placement.v_shape(4, 2)) == "local"
    assert tied_embedding_sync(Placement.looped(1, 2)) == "local"
    with pytest.raises(ValueError, match=r"first stage on pipeline rank 1 and the last on rank 0"):
        tied_embedding_sync(Placement.from_table([[3, 1], [0, 2]]))


def test_profile_settings_are_checked() -> None:
    base = functools.partial(TrainingConfig, train_iters=4, micro_batch_size=2, seq_length=16)
    with pytest.raises(ValueError, match="needs profile_schedule_path"):
        base(profile_schedule_iteration=2)
    with pytest.raises(ValueError, match=r"past train_iters 4; use 1 \.\. 4"):
        base(profile_schedule_path="t.json", profile_schedule_iteration=5)
    with pytest.raises(ValueError, match="positive int or None, got 0"):
        base(profile_schedule_path="t.json", profile_schedule_iteration=0)
    assert base(profile_schedule_path="t.json").profile_schedule_iteration is None


def test_train_writes_a_schedule_trace_of_the_second_iteration(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    results = run_distributed(_train, 2, Run(pp=2, iters=3, profile=str(path)))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans if e["pid"] == 0} == {0, 1}  # measured, both ranks
    assert {e["tid"] for e in spans if e["pid"] == 1} == {0, 1}  # simulated, both ranks
    for result in results:  # every rank gets the summary line
        (line,) = [x for x in result["lines"] if x.startswith("schedule profile")]
        assert line.startswith(f"schedule profile of iteration 2 written to {path}: measured ")
        assert "simulated" in line


def _unwritable_trace(root: str) -> str:
    try:
        _train(Run(pp=2, iters=2, profile=str(Path(root) / "missing" / "t.json")))
    except ValueError as error:
        return str(error)
    return "trained"


def test_train_refuses_an_unwritable_trace_path_before_the_first_step(tmp_path: Path) -> None:
    messages = run_distributed(_unwritable_trace, 2, str(tmp_path))
    assert all("does not exist" in message for message in messages)


@pytest.mark.reliability
def test_resume_equals_an_unbroken_run(tmp_path: Path) -> None:
    unbroken = _last(run_distributed(_train, 2, Run(pp=2, iters=6)))
    first = run_distributed(_train, 2, Run(pp=2, iters=3, save=str(tmp_path)))
    assert _last(first)["reason"] == "train_iters"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (tmp_path / "iter_0000003" / "mp_rank_00_001" / "model_optim_rng.pt").is_file()
    resumed = _last(run_distributed(_train, 2, Run(pp=2, iters=6, load=str(tmp_path))))
    assert resumed["iteration"] == 6
    assert resumed["consumed"] == 6 * GLOBAL
    assert resumed["losses"] == pytest.approx(unbroken["losses"][3:], rel=1e-6)
    assert resumed["lrs"] == pytest.approx(unbroken["lrs"][3:], rel=1e-9)


@pytest.mark.reliability
def test_an_injected_overflow_is_skipped_and_counted() -> None:
    result = _last(run_distributed(_train, 2, Run(pp=2, fp16=True, iters=4, overflow_at=2)))
    skipped_line = result["lines"][1]
    assert "number of skipped iterations:   1" in skipped_line
    assert result["lrs"][1] == result["lrs"][0]  # the schedule did not advance
    assert result["lrs"][2] != result["lrs"][1]  # and moves again after
    assert "loss scale: 512.0" in result["lines"][2]  # backed off from 1024
    assert all(math.isfinite(p.abs().max().item()) for p in result["params"])


def _stopped_by_nan(run: Run) -> str:
    with pytest.raises(NonFiniteError) as stopped:
        _train(run)
    return str(stopped.value)


@pytest.mark.reliability
def test_a_nan_loss_in_fp32_stops_training_on_every_rank_before_the_step(tmp_path: Path) -> None:
    """fp32 has no scaler to skip with: the NaN would destroy the model, so training stops."""
    run = Run(pp=2, iters=4, overflow_at=2, save=str(tmp_path), save_interval=1)
    messages = run_distributed(_stopped_by_nan, 2, run)
    # Rank 0's output is inf, so the last stage (rank 1) computes a non-finite loss.
    for message in messages:
        assert message.startswith("iteration 2: non-finite loss on rank(s) [1]; the gradient norm")
        assert "nothing was applied" in message
        assert "--no-check-for-nan-in-loss-and-grad" in message
    # The checkpoint of iteration 1 is the last one, as it was.
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (tmp_path / "iter_0000002").exists()


def test_exit_interval_saves_and_stops(tmp_path: Path) -> None:
    results = run_distributed(_train, 2, Run(pp=2, iters=10, exit_interval=3, save=str(tmp_path)))
    assert {r["reason"] for r in results} == {"exit_interval"}
    assert {r["iteration"] for r in results} == {3}
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


@pytest.mark.reliability
def test_sigterm_on_one_rank_saves_and_stops_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_train, 2, Run(pp=2, iters=10, sigterm_at=2, save=str(tmp_path)))
    assert {r["reason"] for r in results} == {"signal"}
    assert {r["iteration"] for r in results} == {2}
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_exit_duration_and_autoresume_are_decided_together(tmp_path: Path) -> None:
    timed = run_distributed(_train, 2, Run(pp=2, iters=10, exit_duration_in_mins=1e-9))
    assert {(r["reason"], r["iteration"]) for r in timed} == {("exit_duration", 1)}
    asked = run_distributed(_train, 2, Run(pp=2, iters=10, autoresume_at=2, save=str(tmp_path)))
    assert {(r["reason"], r["iteration"]) for r in asked} == {("autoresume", 2)}


def _corrupt_then_load(root: str) -> str:
    run = Run(pp=2, iters=2, load=root)
    try:
        _train(run)
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_a_corrupt_checkpoint_is_refused_clearly(tmp_path: Path) -> None:
    run_distributed(_train, 2, Run(pp=2, iters=2, save=str(tmp_path)))
    target = tmp_path / "iter_0000002" / "mp_rank_00_001" / "model_optim_rng.pt"
    target.write_bytes(target.read_bytes()[:100])
    messages = run_distributed(_corrupt_then_load, 2, str(tmp_path))
    assert all(message != "loaded" for message in messages)
    assert "mp_rank_00_001" in messages[1]


def _evaluate_before_training(run: Run) -> tuple[dict[str, float], list[bool]]:
    state, model, optimizer, _, _, _ = _setup(run)
    vp = run.vp or 1
    dataset = CorpusDataset(_tokens(), GPT.seq_length, seed=5)
    streams = [
        microbatches(
            dataset,
            consumed_samples=0,
            micro_batch_size=MICRO,
            data_parallel_rank=state.group_rank("dp_cp"),
            data_parallel_size=state.group_size("dp_cp"),
        )
        for _ in range(vp)
    ]
    losses = evaluate(
        gpt_forward_step,
        streams if vp > 1 else streams[0],
        model,
        forward_backward_func=_forward_backward(run, state, model, optimizer),
        state=state,
        eval_iters=2,
        num_microbatches=GLOBAL // (MICRO * state.group_size("dp_cp")),
        micro_batch_size=MICRO,
        seq_length=GPT.seq_length,
    )
    return losses, [chunk.training for chunk in model]


def test_evaluate_is_forward_only_and_restores_train_mode() -> None:
    single = run_distributed(_evaluate_before_training, 1, Run())[0]
    piped = run_distributed(_evaluate_before_training, 4, Run(pp=2, vp=2))
    assert set(single[0]) == {"lm loss"}
    assert piped[-1][0]["lm loss"] == pytest.approx(single[0]["lm loss"], rel=1e-5)
    assert piped[0][0] == {}  # only the last stage reports losses
    assert all(all(modes) for _, modes in [single, *piped])


def _finetune(run: Run, epochs_seen: list[int]) -> dict[str, Any]:
    state, model, optimizer, scheduler, loaded, args = _setup(run)
    progress = TrainingProgress()
    if loaded is not None:
        progress = TrainingProgress(iteration=loaded.iteration)
    dataset = CorpusDataset(_tokens(), GPT.seq_length, seed=9)

    def epoch_batches(epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        order = torch.randperm(12, generator=torch.Generator().manual_seed(epoch)).tolist()
        for index in range(0, 12, MICRO):
            items = [dataset[i] for i in order[index : index + MICRO]]
            yield {key: torch.stack([item[key] for item in items]) for key in items[0]}

    lines: list[str] = []
    losses: list[float] = []
    logger = TrainingLogger(
        train_iters=6, log_interval=1, is_logging_rank=True, print_fn=lines.append
    )
    original = logger.training_log

    def record(loss_dict: dict[str, float], **kwargs: Any) -> Any:
        if loss_dict:
            losses.append(loss_dict["lm loss"])
        return original(loss_dict, **kwargs)

    logger.training_log = record  # type: ignore[method-assign,assignment]
    reason = finetune(
        gpt_forward_step,
        model,
        optimizer,
        scheduler,
        epoch_batches,
        epochs=2,
        train_iters_per_epoch=3,
        state=state,
        config=TrainingConfig(
            train_iters=6,
            micro_batch_size=MICRO,
            seq_length=GPT.seq_length,
            save=run.save,
            exit_interval=run.exit_interval,
        ),
        forward_backward_func=build_forward_backward_func(
            state, model, optimizer, hidden_size=GPT.hidden_size
        ),
        progress=progress,
        logger=logger,
        end_of_epoch_callback=lambda _model, epoch: epochs_seen.append(epoch),
        checkpoint_args=args,
        print_fn=lines.append,
    )
    return {
        "reason": reason,
        "losses": losses,
        "epochs": epochs_seen,
        "iteration": progress.iteration,
        "last_rank": dist.get_rank() == 1,
    }


def test_finetune_resumes_mid_epoch_and_calls_back_each_epoch(tmp_path: Path) -> None:
    unbroken = _last(run_distributed(_finetune, 2, Run(pp=2), []))
    assert unbroken["epochs"] == [0, 1]
    assert len(unbroken["losses"]) == 6
    first = _last(run_distributed(_finetune, 2, Run(pp=2, save=str(tmp_path), exit_interval=4), []))
    assert (first["reason"], first["iteration"], first["epochs"]) == ("exit_interval", 4, [0])
    resumed = _last(run_distributed(_finetune, 2, Run(pp=2, load=str(tmp_path)), []))
    assert resumed["epochs"] == [1]
    assert resumed["losses"] == pytest.approx(unbroken["losses"][4:], rel=1e-6)


def test_a_batch_size_ramp_changes_the_microbatch_count() -> None:
    calculator = build_num_microbatches_calculator(
        global_batch_size=GLOBAL,
        micro_batch_size=MICRO,
        data_parallel_size=1,
        rampup_batch_size=(4, 4, 16),
    )
    assert calculator.get() == 2
    calculator.update(17, True)
    assert calculator.get() == GLOBAL // MICRO
