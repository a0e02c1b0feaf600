"""pp-train with Megatron's distributed optimizer (``--use-distributed-optimizer``).

The flags reach DDP and the optimizer and are refused as Megatron refuses them; 20 training
steps of the bundled GPT with the optimizer state sharded over data parallelism end with the
parameters and losses of the same run with the whole state on every rank, at dp 2 and 4,
pp 1 and 2, with and without overlapped reduce-scatter and all-gather, under 1F1B,
interleaved 1F1B, ZB-H1 and ZB-V.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_optim import DDPConfig, DistributedOptimizer, LRScheduleConfig, OptimizerConfig
from pp_schedules.planning import resolve_on_demand
from pp_state import ParallelConfig, ParallelState, Placement
from pp_testing import run_distributed
from pp_train import (
    build_forward_backward_func,
    calc_params_l2_norm,
    microbatches,
    setup_model_and_optimizer,
    train_step,
)
from pp_train.app import CorpusDataset, GPTChunk, GPTConfig, chunk_layers, gpt_forward_step, main
from pp_train.arguments import add_pretrain_flags, pretrain_config_from_args
from pp_train.checkpoint import CheckpointError, save_checkpoint

GPT = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16)
MICRO, GLOBAL, STEPS = 2, 16, 20


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout and schedule, trained with and without the distributed optimizer."""

    world: int
    pp: int = 1
    vp: int | None = None
    schedule: str | None = None
    overlap: bool = False  # reduce-scatter in backward, all-gather in the next forward
    bf16: bool = False
    clip_grad: float = 0.0
    params_rel: float = 1e-6
    steps: int = STEPS


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    base = torch.arange(64).repeat(100) % 50 + 40
    noise = torch.randint(0, 5, base.shape, generator=generator)
    return (base + noise).to(torch.int64)


def _ddp(case: Case, distributed: bool) -> DDPConfig:
    # Small buckets: several reduce-scatters and all-gathers per chunk, each overlapped.
    return DDPConfig(
        overlap_grad_reduce=case.overlap,
        bucket_size=3000,
        use_distributed_optimizer=distributed,
        overlap_param_gather=case.overlap and distributed,
    )


def _args(case: Case) -> dict[str, Any]:
    """The checkpoint's args: the model's shape and the layout."""
    return {
        "num_layers": GPT.num_layers, "hidden_size": GPT.hidden_size,
        "num_attention_heads": GPT.num_attention_heads, "seq_length": GPT.seq_length,
        "vocab_size": GPT.vocab_size, "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": case.pp, "virtual_pipeline_model_parallel_size": case.vp,
    }  # fmt: skip


def _build(
    case: Case, state: ParallelState, distributed: bool, load: Checkpoint | None = None
) -> tuple[Any, ...]:
    vp = case.vp or 1
    # ZB-V's chunks hold the stages of the V placement (rank 0 the first and the last).
    placement = Placement.v_shape(case.pp) if case.schedule == "zbv" else None

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        rank = state.pipeline_model_parallel_rank
        layers = chunk_layers(GPT.num_layers, case.pp, vp, rank, vp_stage, placement=placement)
        return GPTChunk(
            GPT, layers=layers, pre_process=pre_process, post_process=post_process, seed=7
        )

    model, optimizer, scheduler, loaded = setup_model_and_optimizer(
        provider,
        state,
        optimizer_config=OptimizerConfig(
            lr=1e-2, bf16=case.bf16, clip_grad=case.clip_grad, log_num_zeros_in_grad=True
        ),
        lr_schedule=LRScheduleConfig(
            max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=GLOBAL, lr_decay_steps=10 * GLOBAL,
            lr_decay_style="cosine",
        ),
        ddp_config=_ddp(case, distributed),
        load=None if load is None else load.root,
        checkpoint_args=_args(case),
        ckpt_format=load.ckpt_format if load is not None else "torch",  # type: ignore[arg-type]
        placement=placement,
    )  # fmt: skip
    assert isinstance(optimizer, DistributedOptimizer) == distributed
    return model, optimizer, scheduler, loaded


def _train(
    case: Case, state: ParallelState, built: tuple[Any, ...], consumed: int, steps: int
) -> tuple[list[float], list[float | None], list[int | None]]:
    """`steps` training steps from `consumed` samples on; losses, gradient norms, zeros."""
    model, optimizer, scheduler, _ = built
    vp, dp = case.vp or 1, state.group_size("dp_cp")
    dataset = CorpusDataset(_tokens(), GPT.seq_length, seed=3)
    streams = [
        microbatches(
            dataset, consumed_samples=consumed, micro_batch_size=MICRO,
            data_parallel_rank=state.group_rank("dp_cp"), data_parallel_size=dp,
        )
        for _ in range(vp)
    ]  # fmt: skip
    resolved = resolve_on_demand(case.schedule, pp_size=state.pipeline_model_parallel_size,
                                 vp_size=vp)  # fmt: skip
    forward_backward = build_forward_backward_func(
        state, model, optimizer, hidden_size=GPT.hidden_size, resolved=resolved
    )
    losses: list[float] = []
    norms: list[float | None] = []
    zero_counts: list[int | None] = []
    for _ in range(steps):
        loss_dict, skipped, grad_norm, zeros = train_step(
            gpt_forward_step, streams if vp > 1 else streams[0], model, optimizer, scheduler,
            forward_backward_func=forward_backward, state=state,
            num_microbatches=GLOBAL // (MICRO * dp), micro_batch_size=MICRO,
            seq_length=GPT.seq_length,
        )  # fmt: skip
        assert skipped == 0
        losses.extend(loss_dict.values())
        norms.append(grad_norm)
        zero_counts.append(zeros)
    return losses, norms, zero_counts


def _state(case: Case) -> ParallelState:
    return ParallelState.create(
        ParallelConfig(
            pipeline_model_parallel_size=case.pp, virtual_pipeline_model_parallel_size=case.vp
        )
    )


def _steps(case: Case, state: ParallelState, distributed: bool) -> dict[str, Any]:
    """`case.steps` training steps; this rank's losses, parameters and params norm."""
    built = _build(case, state, distributed)
    losses, norms, zeros = _train(case, state, built, 0, case.steps)
    model = built[0]
    norm = calc_params_l2_norm(model, state)
    params = torch.cat([p.detach().float().reshape(-1) for c in model for p in c.parameters()])
    return {"losses": losses, "params": params, "norm": norm, "grad_norms": norms, "zeros": zeros}


def _both(case: Case) -> tuple[dict[str, Any], dict[str, Any]]:
    state = _state(case)
    return _steps(case, state, False), _steps(case, state, True)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


CASES = {
    "dp2": Case(world=2),
    "dp4": Case(world=4),
    "dp2-overlap": Case(world=2, overlap=True),
    "dp4-overlap": Case(world=4, overlap=True),
    "dp2xpp2": Case(world=4, pp=2),
    "dp2xpp2-overlap": Case(world=4, pp=2, overlap=True),
    "dp2xpp2-zb_h1-overlap": Case(world=4, pp=2, schedule="zb_h1", overlap=True),
    "dp2xpp2-interleaved-overlap": Case(world=4, pp=2, vp=2, overlap=True),
    "dp2xpp2-zbv-overlap": Case(world=4, pp=2, vp=2, schedule="zbv", overlap=True),
    # The clipping factor comes from the norm summed over shards in another order (float32):
    # norms and losses agree to 1e-6 each step, the parameters drift to a few 1e-6 over 20.
    "dp2xpp2-clipped": Case(world=4, pp=2, clip_grad=1.0, params_rel=2e-5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_twenty_fp32_steps_equal_the_non_distributed_optimizers(name: str) -> None:
    case = CASES[name]
    for plain, sharded in run_distributed(_both, case.world, case, timeout=120):
        assert len(plain["losses"]) == len(sharded["losses"])
        for ours, theirs in zip(sharded["losses"], plain["losses"], strict=True):
            assert ours == pytest.approx(theirs, rel=1e-6)
        for ours, theirs in zip(sharded["grad_norms"], plain["grad_norms"], strict=True):
            assert ours == pytest.approx(theirs, rel=1e-6)
        if not case.clip_grad:  # (clipped runs drift apart by a few 1e-6: an exact 0 may not)
            assert sharded["zeros"] == plain["zeros"]  # zero gradients counted over the shards
        assert _relative(sharded["params"], plain["params"]) <= case.params_rel
        assert sharded["norm"] == pytest.approx(plain["norm"], rel=1e-6)


def test_twenty_bf16_steps_have_the_non_distributed_optimizers_losses() -> None:
    case = Case(world=4, pp=2, bf16=True, overlap=True)
    for plain, sharded in run_distributed(_both, case.world, case, timeout=120):
        for ours, theirs in zip(sharded["losses"], plain["losses"], strict=True):
            assert ours == pytest.approx(theirs, rel=0.01)


def _config(argv: list[str]) -> Any:
    parser = add_pretrain_flags(argparse.ArgumentParser(prog="test"))
    return pretrain_config_from_args(parser.parse_args(argv))


def test_the_flags_reach_the_ddp_config() -> None:
    config = _config(
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
         "--ddp-bucket-size", "1000"]
    )  # fmt: skip
    assert config.ddp == DDPConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        bucket_size=1000,
    )
    assert _config([]).ddp.use_distributed_optimizer is False


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("argv", "missing"),
    [
        (["--overlap-param-gather"], "--use-distributed-optimizer, --overlap-grad-reduce"),
        (["--overlap-param-gather", "--overlap-grad-reduce"], "--use-distributed-optimizer"),
        (["--overlap-param-gather", "--use-distributed-optimizer"], "--overlap-grad-reduce"),
    ],
)
def test_overlap_param_gather_without_its_two_flags_is_refused(
    argv: list[str], missing: str
) -> None:
    with pytest.raises(ValueError, match="--overlap-param-gather") as caught:
        _config(argv)
    assert f"missing: {missing}" in str(caught.value)
    assert not dist.is_initialized()  # refused before any process group


@pytest.mark.reliability
@pytest.mark.parametrize("size", ["0", "-5"])
def test_a_bucket_size_below_one_is_refused_naming_the_flag(size: str) -> None:
    with pytest.raises(ValueError, match=f"got {size}.*--ddp-bucket-size"):
        _config(["--ddp-bucket-size", size])


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Where a run saves or loads, in which format, with which optimizer."""

    root: str
    ckpt_format: str = "torch_dist"
    distributed: bool = True


SAVED_AT = 3  # iterations before the save
AFTER = 2  # steps after it: the second step's loss is the first to see the optimizer state


def _save_then_step(case: Case, checkpoint: Checkpoint) -> list[float]:
    """Trains, saves at `SAVED_AT`, and returns the losses of the `AFTER` steps after it."""
    state = _state(case)
    built = _build(case, state, checkpoint.distributed)
    _train(case, state, built, 0, SAVED_AT)
    model, optimizer, scheduler, _ = built
    save_checkpoint(
        checkpoint.root, SAVED_AT, state=state, model=model, optimizer=optimizer,
        scheduler=scheduler, args=_args(case), consumed_train_samples=SAVED_AT * GLOBAL,
        ckpt_format=checkpoint.ckpt_format, report=None,  # type: ignore[arg-type]
    )  # fmt: skip
    return _train(case, state, built, SAVED_AT * GLOBAL, AFTER)[0]


def _load_then_step(case: Case, checkpoint: Checkpoint) -> list[float]:
    """Loads the checkpoint at `case`'s layout; the losses of the `AFTER` next steps."""
    state = _state(case)
    built = _build(case, state, checkpoint.distributed, load=checkpoint)
    assert built[3] is not None
    assert built[3].iteration == SAVED_AT
    return _train(case, state, built, SAVED_AT * GLOBAL, AFTER)[0]


def _only_losses(results: list[list[float]]) -> list[float]:
    """The losses the last stage's ranks report (all equal: averaged over data parallel)."""
    reported = [result for result in results if result]
    assert all(result == reported[0] for result in reported), reported
    assert len(reported[0]) == AFTER
    return reported[0]


RESHARDS = {
    "dp2-to-dp4": (Case(world=2), Case(world=4), True, True),
    "dp4-to-dp1": (Case(world=4), Case(world=1), True, True),
    "dp2xpp2-to-dp2": (Case(world=4, pp=2), Case(world=2), True, True),
    "dp2-distributed-to-whole": (Case(world=2), Case(world=2), True, False),
    "dp4-whole-to-distributed-dp2": (Case(world=4), Case(world=2), False, True),
}


@pytest.mark.parametrize("name", list(RESHARDS))
def test_a_torch_dist_checkpoint_resumes_at_another_layout_with_the_same_next_loss(
    name: str, tmp_path: Path
) -> None:
    saver, loader, saved_distributed, loads_distributed = RESHARDS[name]
    saved = Checkpoint(str(tmp_path), distributed=saved_distributed)
    expected = _only_losses(run_distributed(_save_then_step, saver.world, saver, saved))
    loading = dataclasses.replace(saved, distributed=loads_distributed)
    resumed = _only_losses(run_distributed(_load_then_step, loader.world, loader, loading))
    assert resumed == pytest.approx(expected, rel=1e-6)


def test_the_torch_format_writes_distrib_optim_pt_and_resumes_at_the_same_layout(
    tmp_path: Path,
) -> None:
    case, saved = Case(world=4, pp=2), Checkpoint(str(tmp_path), ckpt_format="torch")
    expected = _only_losses(run_distributed(_save_then_step, case.world, case, saved))
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.pt"))
    assert files == [
        f"iter_{SAVED_AT:07d}/mp_rank_00_{pp:03d}/{name}"
        for pp in range(2)
        for name in ("distrib_optim.pt", "model_optim_rng.pt")
    ]
    resumed = _only_losses(run_distributed(_load_then_step, case.world, case, saved))
    assert resumed == pytest.approx(expected, rel=1e-6)


def _refused(case: Case, checkpoint: Checkpoint) -> str:
    """The load's error message on this rank (every rank must refuse)."""
    state = _state(case)
    try:
        _build(case, state, checkpoint.distributed, load=checkpoint)
    except CheckpointError as error:
        return str(error)
    return "loaded"


@pytest.mark.reliability
def test_a_torch_dist_checkpoint_missing_a_ranks_shards_is_refused_naming_the_file(
    tmp_path: Path,
) -> None:
    case, saved = Case(world=2), Checkpoint(str(tmp_path))
    run_distributed(_save_then_step, case.world, case, saved)
    missing = tmp_path / f"iter_{SAVED_AT:07d}" / "__1_0.distcp"
    missing.unlink()
    for message in run_distributed(_refused, 4, Case(world=4), saved):
        assert "missing shard file(s)" in message
        assert str(missing) in message


@pytest.mark.reliability
def test_a_torch_checkpoint_missing_distrib_optim_pt_is_refused_naming_the_file(
    tmp_path: Path,
) -> None:
    case, saved = Case(world=4, pp=2), Checkpoint(str(tmp_path), ckpt_format="torch")
    run_distributed(_save_then_step, case.world, case, saved)
    missing = tmp_path / f"iter_{SAVED_AT:07d}" / "mp_rank_00_001" / "distrib_optim.pt"
    missing.unlink()
    for message in run_distributed(_refused, case.world, case, saved):
        assert f"{missing} is missing" in message


@pytest.mark.reliability
def test_the_torch_format_refuses_the_other_kind_of_optimizer_state(tmp_path: Path) -> None:
    case, saved = Case(world=2), Checkpoint(str(tmp_path), ckpt_format="torch")
    run_distributed(_save_then_step, case.world, case, saved)
    whole = dataclasses.replace(saved, distributed=False)
    for message in run_distributed(_refused, case.world, case, whole):
        assert "saved with --use-distributed-optimizer" in message


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--overlap-param-gather", "--overlap-grad-reduce"],
            "--overlap-param-gather (overlap_param_gather) needs --use-distributed-optimizer",
        ),
        (["--ddp-bucket-size", "0"], "bucket_size must be a positive int or None, got 0"),
    ],
)
def test_the_command_prints_one_error_line_before_any_process_group(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert not dist.is_initialized()
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith(f"pp-train: error: {message}")


COMMAND = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0", "--log-params-norm",
    "--pipeline-model-parallel-size", "2", "--overlap-grad-reduce", "--ddp-bucket-size", "5000",
]  # fmt: skip
NORM = re.compile(r"lm loss: ([\d.E+-]+) .*params norm: ([\d.]+)")


def _command(argv: list[str]) -> str:
    """The pp-train command's `main` on this rank; what it printed."""
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return printed.getvalue()


def test_the_command_logs_the_same_losses_and_params_norm_with_overlapped_gathers() -> None:
    sharded = [*COMMAND, "--use-distributed-optimizer", "--overlap-param-gather"]
    lines = {
        name: NORM.findall("".join(run_distributed(_command, 4, argv, timeout=180)))
        for name, argv in (("whole", COMMAND), ("sharded", sharded))
    }
    assert len(lines["whole"]) == 3, lines
    for (loss, norm), (their_loss, their_norm) in zip(
        lines["sharded"], lines["whole"], strict=True
    ):
        assert float(loss) == pytest.approx(float(their_loss), rel=1e-5)
        assert norm == their_norm
