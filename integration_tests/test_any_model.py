"""docs/examples: any model pipelined by PipelineModel trains as the same model in one process.

Every schedule (gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv, dualpipev with its F&B steps one after
the other and overlapped in two threads) in one process group per size, at pp
2 and at dp 2 x pp 2, 5 steps of pp-optim's AdamW (Megatron's adam, weight decay 0.01) with
clipping; each step's loss within 1e-6 (relative) of the whole model trained in this process
with the same optimizer on the same microbatches, through the model's own forward (Hugging
Face's ``model(input_ids)`` for Llama and GPT-2). On the V placement (zbv, dualpipev) rank 0
holds the first stage and the last: tied Llama's embedding and output layer are one weight of
two of its chunks. The Llama benchmark against torch.distributed.pipelining gets a quick pass
here too, where transformers is installed. The Hugging Face cases need the transformers
library: the ``examples`` nox session installs it (pinned) and sets PP_HF_EXAMPLES=1, which
turns their skip into a failure.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
Torchrun = Callable[..., subprocess.CompletedProcess[str]]
TOLERANCE = 1e-6


def _example(name: str) -> Any:
    """An example module, imported as its script imports its neighbours."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def _needs_transformers() -> None:
    if os.environ.get("PP_HF_EXAMPLES") == "1":
        importlib.import_module("transformers")  # a failure here, not a skip
    else:
        pytest.importorskip("transformers")


def reference_losses(
    module: Any, model: torch.nn.Module, forward: Callable[..., Any], dp: int
) -> list[float]:
    """Each step's mean loss of `model` trained whole in this process, as the example trains."""
    trainer = _example("pipeline_trainer")
    from pp_optim import get_megatron_optimizer

    optimizer = get_megatron_optimizer(trainer.OPTIMIZER, [model])
    losses = []
    for step in range(trainer.STEPS):
        optimizer.zero_grad()
        batches = module.batches(step, dp * trainer.MICROBATCHES)
        total = 0.0
        for ids, labels in batches:
            loss, _ = trainer.lm_loss(labels, forward(model, ids))
            (loss / len(batches)).backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total / len(batches))
    return losses


def _run(torchrun: Torchrun, script: str, ranks: int, *flags: str) -> dict[str, list[float]]:
    """The example's losses per schedule, as rank 0 prints them."""
    done = torchrun(EXAMPLES / f"{script}.py", ranks, *flags, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    printed = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1, done.stdout
    results: dict[str, list[float]] = ast.literal_eval(printed[0])
    return results


def _assert_equal(
    results: dict[str, list[float]], expected: list[float], schedules: int = 7
) -> None:
    assert len(results) == schedules, results
    for schedule, losses in results.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True))
        assert worst <= TOLERANCE, (schedule, worst, losses, expected)


@pytest.mark.parametrize("ranks", [2, 4], ids=["pp2", "dp2-pp2"])
def test_a_plain_sequential_trains_as_one_process(torchrun: Torchrun, ranks: int) -> None:
    module = _example("sequential")
    results = _run(torchrun, "sequential", ranks)
    _assert_equal(
        results, reference_losses(module, module.sequential(), lambda m, ids: m(ids), ranks // 2)
    )


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits: torch.Tensor = model(input_ids=ids).logits
    return logits


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("ranks", [2, 4], ids=["pp2", "dp2-pp2"])
def test_hugging_face_llama_trains_as_one_process(
    torchrun: Torchrun, ranks: int, tied: bool
) -> None:
    """Its own forward (LlamaForCausalLM(input_ids).logits) is the reference."""
    _needs_transformers()
    module = _example("hf_llama")
    results = _run(torchrun, "hf_llama", ranks, *(["--tied"] if tied else []))
    _assert_equal(results, reference_losses(module, module.llama(tied), _hf_logits, ranks // 2))


def test_hugging_face_llama_with_the_distributed_optimizer(torchrun: Torchrun) -> None:
    """dp 2 x pp 2, tied weights, optimizer state sharded over data parallelism."""
    _needs_transformers()
    module = _example("hf_llama")
    flags = ["--tied", "--distributed-optimizer", "1f1b", "zbv", "dualpipev-threads"]
    results = _run(torchrun, "hf_llama", 4, *flags)
    _assert_equal(results, reference_losses(module, module.llama(True), _hf_logits, 2), schedules=3)


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_hugging_face_llama_at_context_parallel_2_trains_as_one_process(
    torchrun: Torchrun, comm: str
) -> None:
    """cp 2 x pp 2: every sequence split over two ranks, each decoder layer's attention pp-tensor's
    context-parallel one registered with transformers; its own whole forward is the reference."""
    _needs_transformers()
    module = _example("hf_llama_cp")
    flags = ["1f1b", "zbv", "dualpipev", *(["--all-gather"] if comm == "all_gather" else [])]
    results = _run(torchrun, "hf_llama_cp", 4, *flags)
    expected = reference_losses(module, module.llama(tied=False), _hf_logits, 1)
    _assert_equal(results, expected, schedules=3)


@pytest.mark.parametrize("ranks", [2, 4], ids=["pp2", "dp2-pp2"])
def test_hugging_face_gpt2_trains_as_one_process(torchrun: Torchrun, ranks: int) -> None:
    """GPT-2 from a list of parts, its tie declared by index; its own forward is the reference."""
    _needs_transformers()
    module = _example("hf_gpt2")
    results = _run(torchrun, "hf_gpt2", ranks)
    _assert_equal(results, reference_losses(module, module.gpt2(), _hf_logits, ranks // 2))


def test_the_llama_benchmark_runs_every_schedule_beside_torchs(torchrun: Torchrun) -> None:
    """benchmarks/any_model_vs_torch.py, a quick pass (no timing judged)."""
    _needs_transformers()
    script = ROOT / "packages" / "pp-schedules" / "benchmarks" / "any_model_vs_torch.py"
    done = torchrun(script, 2, "--steps", "1", "--microbatches", "4", "--json", timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["schedule"], r["torch_schedule"]) for r in records] == [
        ("1f1b", "Schedule1F1B"),
        ("zbv", "ScheduleZBVZeroBubble"),
        ("dualpipev", "ScheduleDualPipeV"),
    ]
    assert all(r["ratio"] > 0 for r in records)
