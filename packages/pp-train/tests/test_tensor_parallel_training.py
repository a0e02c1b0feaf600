"""The command and the training step at tensor-parallel size > 1.

Flag errors are checked in-process through `main` (before any process group); training runs
call the command's `run` (or the step's pieces) on ranks the test harness starts. The GPT is
tiny and dropout is off (the command's default), so a layout changes the losses only by the
order of floating-point sums.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_optim import DDPConfig, LRScheduleConfig, OptimizerConfig
from pp_state import ParallelConfig, ParallelState, Placement
from pp_testing import run_distributed
from pp_train import build_forward_backward_func, microbatches, setup_model_and_optimizer
from pp_train.app import CorpusDataset, GPTChunk, GPTConfig, build_parser, main, validate_args
from pp_train.app.auto_schedule import (
    model_figures,
    received_activations,
    warmup_tensor_parallel_group,
)
from pp_train.app.command import gpt_forward_step, run
from pp_train.arguments import ModelArgs, ParallelArgs, PretrainConfig
from pp_train.memory_plan import memory_model, stage_memory
from pp_train.norms import calc_params_l2_norm
from pp_train.pretrain import set_random_seed
from pp_train.step import train_step

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--eval-iters", "1", "--log-interval", "1", "--lr-warmup-iters", "1",
]  # fmt: skip


# --- flag errors, before any process group ----------------------------------------------


def _refused(
    argv: list[str],
    world: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """Runs the command on a world of `world` processes that does not exist; its error."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert not dist.is_initialized()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("pp-train: error:")]
    assert len(lines) == 1
    return lines[0].removeprefix("pp-train: error: ")


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        (
            ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
            6,
            "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 4 does not "
            "divide the 6 processes; choose sizes whose product is one of [1, 2, 3, 6]",
        ),
        (
            [
                "--tensor-model-parallel-size",
                "4",
                "--hidden-size",
                "30",
                "--num-attention-heads",
                "3",
            ],
            4,
            "--hidden-size 30 is not divisible by --tensor-model-parallel-size 4; "
            "tensor-parallel sizes that split the model: 1, 3",
        ),
        (
            ["--tensor-model-parallel-size", "8"],
            8,
            "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8; "
            "tensor-parallel sizes that split the model: 1, 2, 4",
        ),
        (
            [
                "--tensor-model-parallel-size",
                "4",
                "--num-attention-heads",
                "8",
                "--ffn-hidden-size",
                "90",
            ],
            4,
            "--ffn-hidden-size 90 is not divisible by --tensor-model-parallel-size 4; "
            "tensor-parallel sizes that split the model: 1, 2",
        ),
        (
            ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--seq-length", "30"],
            4,
            "--seq-length 30 is not divisible by --tensor-model-parallel-size 4; "
            "tensor-parallel sizes that split the model: 1, 2",
        ),
        (
            ["--tensor-model-parallel-size", "0"],
            1,
            "--tensor-model-parallel-size must be an integer 1 or more, got 0",
        ),
        (
            ["--make-vocab-size-divisible-by", "0"],
            1,
            "--make-vocab-size-divisible-by must be an integer 1 or more, got 0",
        ),
    ],
    ids=["world", "hidden", "heads", "ffn", "sequence", "tp-0", "vocab-divisor"],
)
def test_tensor_parallel_flags_are_refused_before_any_process_group(
    flags: list[str],
    world: int,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _refused(flags, world, monkeypatch, capsys).startswith(message)


@pytest.mark.reliability
def test_sequence_parallel_at_tensor_parallel_size_1_is_off() -> None:
    assert not ParallelArgs(sequence_parallel=True).sequence_parallel_in_use
    assert ParallelArgs(
        sequence_parallel=True, tensor_model_parallel_size=2
    ).sequence_parallel_in_use
    assert not ParallelArgs(tensor_model_parallel_size=2).sequence_parallel_in_use


# --- training runs through the command ----------------------------------------------------


def _command(argv: list[str]) -> dict[str, Any]:
    """The command's training run on this rank (the harness made the process group)."""
    parser = build_parser()
    args = validate_args(parser, parser.parse_args(argv), dist.get_world_size())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        reason = run(args)
    return {"reason": reason, "stdout": printed.getvalue()}


def _train(ranks: int, argv: list[str], timeout: float = 240) -> str:
    results = run_distributed(_command, ranks, argv, timeout=timeout)
    assert {r["reason"] for r in results} == {"train_iters"}
    return "".join(r["stdout"] for r in results)


def _losses(stdout: str) -> list[float]:
    found = re.findall(r"iteration\s+\d+/\s*\d+ \|.*? lm loss: (\S+) \|", stdout)
    return [float(loss) for loss in found]


def _validation(stdout: str) -> float:
    (found,) = re.findall(r"validation at the end of training \| lm loss: (\S+)", stdout)
    return float(found)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_losses_equal_one_process_over_20_steps(sequence_parallel: bool) -> None:
    """tp 2 (with and without sequence parallelism) trains as tp 1 does, step by step.

    The divisors pad the 256-byte vocabulary to 512 rows at both sizes (512 x 1, 256 x 2),
    so both runs hold the same model.
    """
    steps = ["--train-iters", "20"]
    one = _train(1, [*TINY, *steps, "--make-vocab-size-divisible-by", "512"])
    assert "> padded vocab (size: 256) with 256 dummy tokens (new size: 512)" in one
    flags = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "256"]
    two = _train(2, [*TINY, *steps, *flags, *(["--sequence-parallel"] * sequence_parallel)])
    sequence = " with sequence parallelism" if sequence_parallel else ""
    assert f"on 2 processes (gloo): tensor parallel 2{sequence}, pipeline 1, data parallel 1" in two
    assert two.count("> padded vocab (size: 256) with 256 dummy tokens (new size: 512)") == 1
    reference = _losses(one)
    assert len(reference) == 20
    assert reference[-1] < reference[0]
    assert _losses(two) == pytest.approx(reference, rel=1e-5)
    assert _validation(two) == pytest.approx(_validation(one), rel=1e-5)


def test_sequence_parallel_at_size_1_trains_without_it_and_says_so() -> None:
    plain = _train(1, [*TINY, "--train-iters", "2"])
    flagged = _train(1, [*TINY, "--train-iters", "2", "--sequence-parallel"])
    warning = (
        "pp-train: warning: --sequence-parallel is turned off: it needs "
        "--tensor-model-parallel-size 2 or more, got 1"
    )
    assert flagged.count(warning) == 1
    assert warning not in plain
    assert _losses(flagged) == _losses(plain)


def test_tp2_pp2_dp2_on_8_ranks_equals_one_process() -> None:
    """tensor 2 x pipeline 2 x data 2 with 1F1B gives the single process's losses.

    Eight ranks share the machine's cores: about half a minute on two cores.
    """
    flags = [*TINY, "--train-iters", "4", "--global-batch-size", "8", "--num-layers", "4"]
    one = _train(1, flags)
    sizes = [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "1f1b",
    ]  # fmt: skip
    eight = _train(8, [*flags, *sizes], timeout=400)
    assert "on 8 processes (gloo): tensor parallel 2, pipeline 2, data parallel 2, 1F1B" in eight
    assert _losses(eight) == pytest.approx(_losses(one), rel=1e-5)


SCHEDULES = {
    "gpipe": ["--pipeline-schedule", "gpipe"],
    "1f1b": ["--pipeline-schedule", "1f1b"],
    "interleaved_1f1b": [
        "--pipeline-schedule", "interleaved_1f1b", "--num-layers-per-virtual-pipeline-stage", "1",
    ],
    "zb_h1": ["--pipeline-schedule", "zb_h1"],
    "zbv": ["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "1"],
}  # fmt: skip


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_trains_at_tp2_pp2_as_at_tp1(schedule: str) -> None:
    """Each schedule at tensor 2 (sequence parallel) x pipeline 2 gives tp 1 x pp 2's losses."""
    flags = [
        *TINY, "--train-iters", "3", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
        *SCHEDULES[schedule],
    ]  # fmt: skip
    reference = _losses(_train(2, flags))
    split = _train(4, [*flags, "--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert "on 4 processes (gloo): tensor parallel 2 with sequence parallelism, pipeline 2" in split
    losses = _losses(split)
    assert len(losses) == 3
    assert all(math.isfinite(loss) for loss in losses)
    assert losses == pytest.approx(reference, rel=1e-5)


# --- the step's pieces: gradient norm, replicated gradients, tied embeddings ---------------

GPT = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=256)


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (2048,), generator=generator)


def _step_norms(sequence_parallel: bool) -> dict[str, Any]:
    """Two steps of the whole GPT on one pipeline stage; the norms and losses of each."""
    tp = dist.get_world_size()
    state = ParallelState.create(ParallelConfig(tensor_model_parallel_size=tp))
    set_random_seed(1234, state)
    group = state.group("tp") if tp > 1 else None

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        return GPTChunk(GPT, layers=range(GPT.num_layers), pre_process=pre_process,
                        post_process=post_process, seed=7, tp_group=group,
                        sequence_parallel=sequence_parallel)  # fmt: skip

    model, optimizer, scheduler, _ = setup_model_and_optimizer(
        provider, state, optimizer_config=OptimizerConfig(lr=1e-2, clip_grad=0.05),
        lr_schedule=LRScheduleConfig(max_lr=1e-2, min_lr=1e-2, lr_warmup_steps=0,
                                     lr_decay_steps=100, lr_decay_style="constant"),
        ddp_config=DDPConfig(),
    )  # fmt: skip
    forward_backward = build_forward_backward_func(
        state, model, optimizer, hidden_size=GPT.hidden_size,
        sequence_parallel=sequence_parallel and tp > 1,
    )  # fmt: skip
    data = microbatches(CorpusDataset(_tokens(), GPT.seq_length, seed=3), consumed_samples=0,
                        micro_batch_size=2, data_parallel_rank=0, data_parallel_size=1)  # fmt: skip
    result: dict[str, Any] = {"grad_norm": [], "loss": [], "params_norm": []}
    for _ in range(2):
        losses, _, grad_norm, _ = train_step(
            gpt_forward_step, data, model, optimizer, scheduler,
            forward_backward_func=forward_backward, state=state, num_microbatches=2,
            micro_batch_size=2, seq_length=GPT.seq_length,
        )  # fmt: skip
        result["grad_norm"].append(grad_norm)
        result["loss"].append(losses["lm loss"])
        result["params_norm"].append(calc_params_l2_norm(model, state))
    state.destroy()
    return result


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_gradient_norm_and_clipping_at_tp2_equal_tp1(sequence_parallel: bool) -> None:
    """The clipped norm counts each weight once over the tp group; under sequence parallelism
    the layer norms' and row-parallel biases' gradients are summed over it first."""
    (one,) = run_distributed(_step_norms, 1, False, timeout=120)
    two = run_distributed(_step_norms, 2, sequence_parallel, timeout=120)
    assert two[0] == two[1]  # every tp rank reports the same figures
    for key in ("grad_norm", "loss", "params_norm"):
        assert two[0][key] == pytest.approx(one[key], rel=1e-5), key
    assert one["grad_norm"][0] > 0.05  # clipping was on


def _embedding_groups() -> list[int]:
    state = ParallelState.create(
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    )
    ranks = [*state.group_ranks("embedding"), state.tensor_model_parallel_rank]
    state.destroy()
    return ranks


def test_the_tied_embedding_group_pairs_ranks_of_the_same_tensor_parallel_rank() -> None:
    groups = run_distributed(_embedding_groups, 4, timeout=60)
    # Ranks 0, 1 hold stage 0 (tp ranks 0, 1); ranks 2, 3 stage 1.
    assert groups == [[0, 2, 0], [1, 3, 1], [0, 2, 0], [1, 3, 1]]


# --- the byte model -------------------------------------------------------------------------

SHAPE = GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16)


def _rank_parameters() -> int:
    """The parameters one of two tensor-parallel ranks holds of a one-stage, 3-layer GPT."""
    chunk = GPTChunk(SHAPE, layers=range(3), pre_process=True, post_process=True, seed=0,
                     tp_group=dist.group.WORLD)  # fmt: skip
    return sum(p.numel() for p in chunk.parameters())


def test_the_byte_model_counts_a_tensor_parallel_rank_s_share_of_the_parameters() -> None:
    one = model_figures(SHAPE, micro_batch_size=1, seed=0, rounds=1)
    two = model_figures(SHAPE, micro_batch_size=1, seed=0, rounds=1, tensor_model_parallel_size=2)
    predicted = stage_memory(two, 3, first=True, last=True, recompute=None).parameters
    assert run_distributed(_rank_parameters, 2, timeout=60) == [predicted, predicted]
    # Transformer layers: everything but the layer norms and row-parallel biases splits.
    assert two.layer.parameters == pytest.approx(one.layer.parameters / 2, rel=0.01)
    assert two.shared_parameters == one.shared_parameters // 2
    config = PretrainConfig(model=ModelArgs(num_layers=4, hidden_size=64, seq_length=16))
    static = [
        memory_model(config, (2, 2), figures, data_parallel_size=1, recompute=None)
        .rank_static(Placement.looped(2, 1), 1)
        .total
        for figures in (one, two)
    ]
    assert static[1] == pytest.approx(static[0] / 2, rel=0.02)


def _rank_figures(sequence_parallel: bool) -> tuple[list[int], int, tuple[int, int], int]:
    """A layer measured on the warm-up's group of 2 (of 4 ranks, pp 2): the group's ranks,
    the received activations' length, the layer's activation and output bytes, and its
    parameters."""
    with warmup_tensor_parallel_group(2, 2) as group:
        assert group is not None
        figures = model_figures(SHAPE, micro_batch_size=2, seed=0, rounds=1, tp_group=group,
                                sequence_parallel=sequence_parallel)  # fmt: skip
        chunk = GPTChunk(SHAPE, layers=range(1), pre_process=False, post_process=False, seed=0,
                         tp_group=group, sequence_parallel=sequence_parallel)  # fmt: skip
        ranks = dist.get_process_group_ranks(group)
    layer = figures.layer.memory
    assert layer is not None
    length = received_activations(chunk, 2).shape[0]
    return ranks, length, (layer.activation_bytes, layer.output_bytes), figures.layer.parameters


def test_the_warm_up_measures_a_layer_as_one_tensor_parallel_rank_holds_it() -> None:
    """On the run's tensor-parallel groups ([0, 1] and [2, 3] at tp 2 x pp 2) the layer's
    figures are one rank's: half the weights, the attention heads and the MLP's hidden layer
    split, and under sequence parallelism half the sequence received and sent."""
    whole = model_figures(SHAPE, micro_batch_size=2, seed=0, rounds=1).layer
    assert whole.memory is not None
    plain = run_distributed(_rank_figures, 4, False, timeout=120)
    split = run_distributed(_rank_figures, 4, True, timeout=120)
    assert [r[0] for r in plain] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert {r[1] for r in plain} == {16}
    assert {r[1] for r in split} == {8}
    assert len({r[2] for r in plain + split}) == 2, "every rank counts the same bytes"
    (kept, output), (kept_sp, output_sp) = plain[0][2], split[0][2]
    assert output == whole.memory.output_bytes
    assert output_sp == output // 2
    assert kept < 0.8 * whole.memory.activation_bytes
    assert kept_sp < kept
    assert plain[0][3] == pytest.approx(whole.parameters / 2, rel=0.01)
