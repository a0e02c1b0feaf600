"""The command's schedule flags: named schedules, plan files and schedule profiles.

Flag errors are checked in-process through `main` (they must come before any process group);
training runs call the command's `run` on ranks that the test harness started.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_testing import run_distributed
from pp_testing.distributed import DistributedTestError
from pp_train import CheckpointError, pretrain
from pp_train.app import GPTChunk, GPTConfig, build_parser, load_corpus, main, validate_args
from pp_train.app.command import gpt_forward_step, run
from pp_train.data import IndexedDatasetBuilder
from pp_train.models import check_document_ids_chunk
from pp_train.preprocess import main as preprocess

TINY = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
    "--train-iters",
    "3",
]
PP2 = [*TINY, "--pipeline-model-parallel-size", "2"]

GPIPE = """\
# GPipe on two ranks, four microbatches: every forward, then every backward
rank 0: F0 F1 F2 F3 B0 B1 B2 B3
rank 1: F0 F1 F2 F3 B0 B1 B2 B3
"""

V_GPIPE = """\
placement: v   # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
rank 0: F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 B0.1 B1.1 B2.1 B3.1 B0 B1 B2 B3
rank 1: F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 B0.1 B1.1 B2.1 B3.1 B0 B1 B2 B3
"""


def _write(folder: Path, name: str, text: str) -> str:
    path = folder / name
    path.write_text(text)
    return str(path)


# --- flag errors, before any process group ----------------------------------------------


def _refused(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    """Runs the command on a 2-process world that does not exist; returns its error."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert not dist.is_initialized()
    err = capsys.readouterr().err
    assert "usage: pp-train" in err
    assert len([x for x in err.splitlines() if x.startswith("pp-train: error:")]) == 1
    return err


@pytest.mark.parametrize(
    ("plan", "flags", "message"),
    [
        (
            "rank 0: F0 F1 X2 F3\nrank 1: F0 F1 F2 F3\n",
            [],
            "plan.txt: line 1 (rank 0): 'X2' is not an action such as F3",
        ),
        (
            "rank 0: F0 F1 F2 F3 B0 B1 B2 B3\n",
            [],
            "plan.txt writes 1 rank line(s), but --pipeline-model-parallel-size is 2",
        ),
        (
            "# 1F1B order on rank 0 against GPipe order on rank 1\n"
            "rank 0: F0 B0 F1 B1 F2 B2 F3 B3\n"
            "rank 1: F0 F1 F2 F3 B0 B1 B2 B3\n",
            [],
            "plan.txt: the plan deadlocks: rank 0 waits at step 1 (SEND_F0+RECV_B0)",
        ),
        (
            "rank 0: B0 F0 F1 F2 F3 B1 B2 B3\nrank 1: F0 F1 F2 F3 B0 B1 B2 B3\n",
            [],
            "plan.txt: rank 0 step 0: B0 runs before its forward",
        ),
        (
            "rank 0: F0 F1 B0 B1\nrank 1: F0 F1 B0 B1\n",
            [],
            "covers 2 microbatch(es), but each step runs 4 (--global-batch-size 8 / "
            "(--micro-batch-size 2 x data-parallel size 1)); write a plan for 4 microbatches "
            "or use --global-batch-size 4",
        ),
        (
            V_GPIPE,
            [],
            "runs 2 model chunk(s) per rank, but the run has 1 (--num-layers 4, "
            "--num-layers-per-virtual-pipeline-stage None); use "
            "--num-layers-per-virtual-pipeline-stage 1",
        ),
        (
            GPIPE,
            ["--rampup-batch-size", "4", "4", "16", "--global-batch-size", "8"],
            "a fixed plan needs a fixed microbatch count",
        ),
    ],
    ids=["bad-token", "rank-count", "deadlock", "order", "microbatches", "chunks", "rampup"],
)
def test_a_bad_plan_file_is_one_argparse_error(
    plan: str,
    flags: list[str],
    message: str,
    *,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _write(tmp_path, "plan.txt", plan)
    err = _refused([*PP2, *flags, "--pipeline-schedule-file", path], monkeypatch, capsys)
    assert f"pp-train: error: --pipeline-schedule-file {path}" in err
    assert message in err


def test_a_deadlocking_plan_error_draws_the_grid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(
        tmp_path, "plan.txt", "rank 0: F0 B0 F1 B1 F2 B2 F3 B3\nrank 1: F0 F1 F2 F3 B0 B1 B2 B3\n"
    )
    err = _refused([*PP2, "--pipeline-schedule-file", path], monkeypatch, capsys)
    assert re.search(r"^rank 0: F0 +\[SEND_F0\+RECV_B0\]", err, re.MULTILINE)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--pipeline-schedule", "gpipe", "--pipeline-schedule-file", "plan.txt"],
            "--pipeline-schedule gpipe and --pipeline-schedule-file plan.txt exclude each other",
        ),
        (
            ["--pipeline-schedule-file", "no-such-plan.txt"],
            "--pipeline-schedule-file no-such-plan.txt: cannot be read: No such file or directory",
        ),
        (
            ["--pipeline-schedule", "interleaved_1f1b"],
            "--pipeline-schedule interleaved_1f1b with 1 chunk(s) per rank: interleaved_1f1b "
            "needs vp_size of 2 or more",
        ),
        (
            ["--pipeline-schedule", "1f1b", "--num-layers-per-virtual-pipeline-stage", "1"],
            "1f1b runs one model chunk per rank, but vp_size is 2; use 'interleaved_1f1b' or "
            "'gpipe'",
        ),
        (["--pipeline-schedule", "zb"], "invalid choice: 'zb'"),
        (
            ["--pipeline-schedule", "zbv"],
            "--pipeline-schedule zbv with 1 chunk(s) per rank: zbv runs two model chunks per "
            "rank in a V, but vp_size is 1",
        ),
        (
            ["--profile-schedule", "no-such-folder/trace.json"],
            "--profile-schedule: trace path no-such-folder/trace.json: folder no-such-folder "
            "does not exist",
        ),
        (["--profile-schedule", "."], "is a folder; give a file name such as trace.json"),
        (
            ["--profile-schedule-iteration", "2"],
            "--profile-schedule-iteration needs --profile-schedule PATH",
        ),
        (
            ["--profile-schedule", "trace.json", "--profile-schedule-iteration", "4"],
            "--profile-schedule-iteration 4 is past --train-iters 3; use 1 .. 3",
        ),
    ],
)
def test_bad_schedule_flags_are_argparse_errors(
    flags: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert message in _refused([*PP2, *flags], monkeypatch, capsys)


def test_an_unwritable_trace_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Read-only folders do not stop root, so the folder refuses the probe file here.
    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("pp_schedules.runtime._profiling.tempfile.NamedTemporaryFile", refuse)
    err = _refused([*PP2, "--profile-schedule", str(tmp_path / "t.json")], monkeypatch, capsys)
    assert "cannot be written: Permission denied" in err


def test_a_valid_plan_file_is_parsed_with_its_placement(tmp_path: Path) -> None:
    parser = build_parser()
    path = _write(tmp_path, "v.txt", V_GPIPE)
    flags = [*PP2, "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule-file"]
    args = validate_args(parser, parser.parse_args([*flags, path]), 2)
    assert args.virtual_pipeline_model_parallel_size == 2
    assert str(args.pipeline_plan.placement) == "v"
    assert args.pipeline_plan.num_microbatches == 4
    named = validate_args(parser, parser.parse_args(PP2), 2)
    assert named.pipeline_plan is None
    assert named.pipeline_schedule is None  # the executor picks Megatron's default


# --- training runs (2 ranks) ----------------------------------------------------------------


def _command(argv: list[str]) -> dict[str, Any]:
    """The command's training run on this rank (the harness made the process group)."""
    parser = build_parser()
    args = validate_args(parser, parser.parse_args(argv), dist.get_world_size())
    args.device = torch.device("cpu")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        reason = run(args)
    return {"reason": reason, "stdout": printed.getvalue()}


def _train(argv: list[str]) -> str:
    results = run_distributed(_command, 2, argv, timeout=120)
    assert {r["reason"] for r in results} == {"train_iters"}
    return "".join(r["stdout"] for r in results)


def _losses(stdout: str) -> list[float]:
    found = re.findall(r"iteration\s+\d+/\s*\d+ \|.*? lm loss: (\S+) \|", stdout)
    return [float(loss) for loss in found]


def test_named_schedules_and_plan_files_train_alike(tmp_path: Path) -> None:
    one_f_one_b = _train(PP2)
    assert "data parallel 1, 1F1B;" in one_f_one_b
    reference = _losses(one_f_one_b)
    assert len(reference) == 3
    gpipe = _train([*PP2, "--pipeline-schedule", "gpipe"])
    assert "data parallel 1, GPipe;" in gpipe
    assert _losses(gpipe) == pytest.approx(reference, rel=1e-6)
    path = _write(tmp_path, "gpipe.txt", GPIPE)
    planned = _train([*PP2, "--pipeline-schedule-file", path])
    assert f"plan {path} (looped placement)" in planned
    assert _losses(planned) == pytest.approx(reference, rel=1e-6)
    # The V placement: both ends of the tied embedding are chunks of rank 0.
    v_path = _write(tmp_path, "v.txt", V_GPIPE)
    v_flags = ["--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule-file", v_path]
    v_run = _train([*PP2, *v_flags])
    assert f"pipeline 2 x 2 virtual stages, data parallel 1, plan {v_path} (v placement)" in v_run
    assert _losses(v_run) == pytest.approx(reference, rel=2e-5)


def _train_on(ranks: int, argv: list[str]) -> str:
    results = run_distributed(_command, ranks, argv, timeout=180)
    assert {r["reason"] for r in results} == {"train_iters"}
    return "".join(r["stdout"] for r in results)


@pytest.mark.parametrize(
    ("ranks", "flags", "title"),
    [
        (2, ["--pipeline-schedule", "zb_h1"], "zero-bubble ZB-H1"),
        (4, ["--pipeline-schedule", "zb_h1"], "zero-bubble ZB-H1"),
        (
            2,
            ["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "1"],
            "zero-bubble ZB-V (V placement)",
        ),
    ],
)
def test_zero_bubble_schedules_train_as_one_process(
    ranks: int, flags: list[str], title: str
) -> None:
    """Split backwards (I then W) give pp 1's losses with the same seed."""
    one = _train_on(1, [*TINY, "--pipeline-model-parallel-size", "1"])
    split = _train_on(ranks, [*TINY, "--pipeline-model-parallel-size", str(ranks), *flags])
    assert f"{title};" in split
    assert _losses(split) == pytest.approx(_losses(one), rel=2e-5)


def test_auto_schedule_prints_its_candidates_and_picks_zero_bubble() -> None:
    run = _train([*PP2, "--pipeline-schedule", "auto"])
    assert "pipeline schedule chosen by simulation with step costs measured in a warm-up" in run
    assert re.search(r"\(ms per chunk: F [\d.]+, I [\d.]+, W [\d.]+\)", run)
    assert "* zb_h1" in run
    assert "data parallel 1, zero-bubble ZB-H1;" in run


def test_layers_that_do_not_divide_are_balanced_with_measured_costs() -> None:
    """4 layers on 3 ranks: the command weighs the embedding and the loss in a warm-up, prints
    the balanced layout it trains, and gives pp 1's losses."""
    one = _train_on(1, [*TINY, "--pipeline-model-parallel-size", "1"])
    split = _train_on(3, [*TINY, "--pipeline-model-parallel-size", "3"])
    found = re.search(
        r"layer layout (E\S*L), chosen by simulation \(1f1b, \d+ microbatches; embedding "
        r"[\d.]+ and loss [\d.]+ transformer layers, measured\): step [\d.]+",
        split,
    )
    assert found, split
    assert found.group(1).count("t") == 4
    assert found.group(1).count("|") == 2
    assert _losses(split) == pytest.approx(_losses(one), rel=2e-5)


def _spans(path: Path) -> dict[int, set[int]]:
    """Process (0 measured, 1 simulated) -> the pipeline ranks it has spans for."""
    events = json.loads(path.read_text())["traceEvents"]
    tracks: dict[int, set[int]] = {}
    for event in events:
        if event["ph"] == "X":
            tracks.setdefault(event["pid"], set()).add(event["tid"])
    return tracks


SUMMARY = re.compile(
    r"^schedule profile of iteration (\d+) written to (\S+): measured makespan [\d.]+ ms, "
    r"bubble .*; simulated [\d.]+ ms.*; measured/simulated [\d.]+$",
    re.MULTILINE,
)


def test_profile_schedule_writes_every_rank_and_the_simulation(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    stdout = _train([*PP2, "--profile-schedule", str(path)])
    assert _spans(path) == {0: {0, 1}, 1: {0, 1}}
    (match,) = SUMMARY.finditer(stdout)  # printed once, by the logging rank
    assert match.groups() == ("2", str(path))
    assert len(_losses(stdout)) == 3


def test_profile_schedule_with_data_parallel_replicas(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    # Pipeline size 1, data parallel 2: one replica's pipeline is profiled.
    stdout = _train([*TINY, "--profile-schedule", str(path), "--profile-schedule-iteration", "3"])
    assert "pipeline 1, data parallel 2, no pipelining;" in stdout
    assert _spans(path) == {0: {0}, 1: {0}}
    (match,) = SUMMARY.finditer(stdout)
    assert match.group(1) == "3"


def _log_lines(stdout: str, prefix: str) -> list[str]:
    return [line.strip() for line in stdout.splitlines() if line.strip().startswith(prefix)]


def _params_norms(stdout: str) -> list[float]:
    return [float(norm) for norm in re.findall(r" params norm: (\S+) \|", stdout)]


def test_params_norm_and_timing_flags() -> None:
    """--log-params-norm agrees across pipeline sizes; the timing flags shape the timers line."""
    default = _train(PP2)
    assert " params norm" not in default
    assert "time across ranks" not in default  # --timing-log-level 0: iteration time only
    detailed = _train(
        [*PP2, "--log-params-norm", "--timing-log-level", "2", "--timing-log-option", "all"]
    )
    timers = _log_lines(detailed, "times across ranks (ms) | ")
    assert len(timers) == 3
    # Every phase, each rank's time: forward-compute and the gradient reduction run on both.
    assert re.search(r"forward-backward: \[[\d.]+, [\d.]+\]", timers[0])
    assert re.search(r"forward-compute: \[[\d.]+, [\d.]+\]", timers[0])
    minmax = _train([*PP2, "--timing-log-level", "1", "--no-barrier-with-L1-time"])
    phases = _log_lines(minmax, "(min, max) time across ranks (ms) | ")
    assert len(phases) == 3
    assert re.search(r"optimizer: \([\d.]+, [\d.]+\)", phases[0])
    assert "forward-compute" not in phases[0]  # a level-2 timer
    # The norm of the whole model, each weight once: the same on one stage as on two.
    one_stage = _train([*TINY, "--log-params-norm"])
    norms = _params_norms(detailed)
    assert len(norms) == 3
    assert norms == pytest.approx(_params_norms(one_stage), rel=1e-5)


def test_preprocess_then_train_on_the_data(tmp_path: Path) -> None:
    """JSON lines -> Megatron's .bin/.idx -> the command with --data-path: the loss falls."""
    lines = [line for line in load_corpus().decode().splitlines() if line.strip()]
    documents = tmp_path / "docs.jsonl"
    documents.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:600]))
    prefix = str(tmp_path / "corpus")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert preprocess([
            "--input", str(documents), "--output-prefix", prefix, "--json-keys", "text",
            "--append-eod",
        ]) == 0  # fmt: skip
    flags = [
        *PP2, "--data-path", f"{prefix}_text_document", "--split", "90,10,0",
        "--train-iters", "12", "--log-interval", "4", "--lr", "1e-2", "--min-lr", "1e-3",
    ]  # fmt: skip
    printed = _train(flags)
    losses = _losses(printed)
    assert len(losses) == 3
    assert losses[-1] < losses[0]
    assert "validation at the end of training | lm loss:" in printed
    # The GPT's vocabulary is the tokenizer's: 256 bytes and EOD.
    assert "training samples per epoch" in printed


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data-path", "no/such/prefix"], "no/such/prefix"),
        (["--split", "1,2,3,4"], "split '1,2,3,4' must be 1 to 3 non-negative numbers"),
        (["--tokenizer-type", "Word"], "tokenizer_type 'Word' is unknown"),
        (["--eod-mask-loss"], "eod_mask_loss (--eod-mask-loss) needs indexed data (--data-path"),
        (["--reset-attention-mask"], "reset_attention_mask (--reset-attention-mask) needs ind"),
    ],
)
def test_bad_data_flags_are_refused_before_any_process_group(
    flags: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert message in _refused([*PP2, *flags], monkeypatch, capsys)


def test_help_lists_the_packed_document_flags() -> None:
    text = " ".join(build_parser().format_help().split())
    for flag in ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"):
        assert f"{flag} Megatron's ``{flag}``:" in text


PACKING = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


def _packed_documents(folder: Path) -> list[str]:
    """300 documents of 1 to 39 letters, each ended by EOD (256), as --data-path flags."""
    generator = torch.Generator().manual_seed(0)
    with IndexedDatasetBuilder(folder / "docs") as builder:
        for _ in range(300):
            length = int(torch.randint(1, 40, (1,), generator=generator))
            builder.add_document([*torch.randint(97, 123, (length,)).tolist(), 256])
        builder.finalize()
    return ["--data-path", str(folder / "docs"), "--split", "90,10,0"]


def test_the_packed_document_flags_train_on_indexed_data(tmp_path: Path) -> None:
    """The three flags on --data-path: every microbatch carries its fields through 2 stages."""
    flags = [*PP2, *_packed_documents(tmp_path), *PACKING]
    losses = _losses(_train([*flags, "--train-iters", "2"]))
    assert len(losses) == 2
    assert all(math.isfinite(loss) for loss in losses)


def _pretrain_a_plain_model(argv: list[str]) -> None:
    parser = build_parser()
    config = validate_args(parser, parser.parse_args(argv), dist.get_world_size()).config

    def provider(**_: object) -> torch.nn.Module:
        return torch.nn.Linear(4, 4)

    pretrain(lambda sizes: (None, None, None), provider, gpt_forward_step, config=config)


def test_document_masks_with_a_model_that_cannot_take_them_are_refused(tmp_path: Path) -> None:
    """A model without ``takes_document_ids`` would let tokens attend across documents."""
    check_document_ids_chunk(GPTChunk(
        GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=8,
                  vocab_size=16),
        layers=range(1), pre_process=True, post_process=True, seed=0,
    ))  # fmt: skip
    argv = [*_packed_documents(tmp_path), *PACKING, "--train-iters", "1"]
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_pretrain_a_plain_model, 1, argv, timeout=120)
    message = str(caught.value)
    assert (
        "--reset-attention-mask gives every microbatch document_ids, but the model chunk "
        "Linear does not say that its attention takes them" in message
    )


def test_the_command_converts_a_checkpoint_that_then_resumes_exactly(tmp_path: Path) -> None:
    unbroken = _losses(_train([*PP2, "--train-iters", "4"]))
    source, target = str(tmp_path / "torch"), str(tmp_path / "dist")
    first = run_distributed(
        _command, 2, [*PP2, "--train-iters", "4", "--exit-interval", "3", "--save", source]
    )
    assert {r["reason"] for r in first} == {"exit_interval"}
    convert = ["--ckpt-convert-format", "torch_dist", "--ckpt-convert-save", target]
    converted = run_distributed(
        _command, 2, [*PP2, "--train-iters", "4", "--load", source, *convert]
    )
    assert {r["reason"] for r in converted} == {"converted"}
    printed = "".join(r["stdout"] for r in converted)
    assert f"converted the torch checkpoint of iteration 3 in {source} to torch_dist" in printed
    assert "iteration    1/" not in printed  # nothing was trained
    resume = ["--train-iters", "4", "--load", target, "--ckpt-format", "torch_dist"]
    resumed = _losses(_train([*PP2, *resume]))
    assert resumed == pytest.approx(unbroken[3:], rel=1e-6)


# --- GPT-2's settings: an untied output layer and the tanh GELU ----------------------------

GPT2 = ["--untie-embeddings-and-output-weights", "--openai-gelu"]


def test_an_untied_tanh_gelu_gpt_trains_alike_at_pp_vp_and_tp() -> None:
    """Padded vocabulary 512 everywhere (256 x tp 2 at tp 2), so every layout is one model."""
    one = _losses(_train_on(1, [*TINY, *GPT2, "--make-vocab-size-divisible-by", "512"]))
    tied = _losses(_train_on(1, [*TINY, "--make-vocab-size-divisible-by", "512"]))
    assert len(one) == 3
    assert one[-1] != pytest.approx(tied[-1], rel=1e-3)  # the flags change the model
    interleaved = [*PP2, *GPT2, "--num-layers-per-virtual-pipeline-stage", "1"]
    vp = _losses(_train_on(2, [*interleaved, "--make-vocab-size-divisible-by", "512"]))
    assert vp == pytest.approx(one, rel=2e-5)
    tp2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "256"]
    assert _losses(_train_on(2, [*TINY, *GPT2, *tp2])) == pytest.approx(one, rel=2e-5)


def _refusal(argv: list[str]) -> str:
    """The CheckpointError the command's run raises on this rank ("trained" if none)."""
    try:
        _command(argv)
    except CheckpointError as error:
        return str(error)
    return "trained"


def _saved_args(root: Path, ckpt_format: str) -> dict[str, Any]:
    """The args a checkpoint of iteration 1 records, read without building any model."""
    iteration = root / "iter_0000001"
    path = iteration / (
        "common.pt" if ckpt_format == "torch_dist" else "mp_rank_00/model_optim_rng.pt"
    )
    args: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)["args"]
    return args


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_checkpoint_records_gpt2s_settings_and_a_resume_must_match_them(
    tmp_path: Path, ckpt_format: str
) -> None:
    root = tmp_path / ckpt_format
    flags = [*TINY, "--ckpt-format", ckpt_format, "--train-iters", "2"]
    saved = run_distributed(
        _command, 1, [*flags, *GPT2, "--exit-interval", "1", "--save", str(root)]
    )
    assert saved[0]["reason"] == "exit_interval"
    args = _saved_args(root, ckpt_format)
    assert args["untie_embeddings_and_output_weights"] is True
    assert args["openai_gelu"] is True
    (tied,) = run_distributed(_refusal, 1, [*flags, "--openai-gelu", "--load", str(root)])
    (exact,) = run_distributed(_refusal, 1, [*flags, GPT2[0], "--load", str(root)])
    if ckpt_format == "torch":
        assert "was saved with untie_embeddings_and_output_weights=True; this run has False" in tied
        assert "was saved with openai_gelu=True; this run has False" in exact
    else:
        assert "untie_embeddings_and_output_weights: expected False (this run), found True" in tied
        assert "openai_gelu: expected False (this run), found True" in exact
    (resumed,) = run_distributed(_refusal, 1, [*flags, *GPT2, "--load", str(root)])
    assert resumed == "trained"
