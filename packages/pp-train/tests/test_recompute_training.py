"""Recomputation changes no number: with dropout on, every schedule gives the same bits.

Two ranks train the bundled GPT (hidden and attention dropout 0.1) for two iterations through
pp-train's `train_step` and pp-schedules' executor, once without recomputation and once with
each mode: full granularity with the uniform and the block method, and selective. Torch is
seeded the same way before each run, so the dropout masks are drawn in the same order; the
recomputed forwards restore the random state, so losses and gradients must be bitwise equal.
Each schedule is one spawn of two ranks that loops over the modes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_optim import DDPConfig, LRScheduleConfig, OptimizerConfig
from pp_schedules.planning import resolve_on_demand
from pp_state import ParallelConfig, ParallelState, Placement
from pp_testing import run_distributed
from pp_train import (
    RecomputeConfig,
    build_forward_backward_func,
    microbatches,
    setup_model_and_optimizer,
    train_step,
)
from pp_train.app import CorpusDataset, GPTChunk, GPTConfig, chunk_layers, gpt_forward_step

MICRO, MICROBATCHES, ITERS, SEQ = 2, 4, 2, 8


@dataclasses.dataclass(frozen=True)
class Case:
    """One schedule on two ranks (picklable, sent to both)."""

    schedule: str
    vp: int = 1
    placement: str = "looped"

    @property
    def layers_per_chunk(self) -> int:
        return 8 // (2 * self.vp)


def _modes(case: Case) -> dict[str, RecomputeConfig | None]:
    """No recompute, then each mode; uniform groups that do not divide the chunk's layers."""
    per_chunk = case.layers_per_chunk
    return {
        "none": None,
        "full-uniform": RecomputeConfig(
            granularity="full", method="uniform", num_layers=max(1, per_chunk - 1)
        ),
        "full-block": RecomputeConfig(granularity="full", method="block", num_layers=1),
        "selective": RecomputeConfig(granularity="selective"),
    }


def _gpt(recompute: RecomputeConfig | None) -> GPTConfig:
    return GPTConfig(
        num_layers=8, hidden_size=16, num_attention_heads=2, seq_length=SEQ,
        hidden_dropout=0.1, attention_dropout=0.1, recompute=recompute,
    )  # fmt: skip


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))


def _grads(model: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Every parameter's gradient as the optimizer saw it (the grad buffer's, with DDP)."""
    found = []
    for chunk in model:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            assert grad is not None
            found.append(grad.detach().clone())
    return found


def _train(case: Case, state: ParallelState, recompute: RecomputeConfig | None) -> dict[str, Any]:
    """Two iterations; the losses and the gradients of each."""
    gpt, rank = _gpt(recompute), state.pipeline_model_parallel_rank
    placement = Placement.named(case.placement, 2, case.vp)

    def provider(*, pre_process: bool, post_process: bool, vp_stage: int) -> torch.nn.Module:
        layers = chunk_layers(gpt.num_layers, 2, case.vp, rank, vp_stage, placement=placement)
        return GPTChunk(gpt, layers=layers, pre_process=pre_process, post_process=post_process,
                        seed=7)  # fmt: skip

    model, optimizer, scheduler, _ = setup_model_and_optimizer(
        provider, state, optimizer_config=OptimizerConfig(lr=1e-2),
        lr_schedule=LRScheduleConfig(max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=0,
                                     lr_decay_steps=100, lr_decay_style="constant"),
        ddp_config=DDPConfig(), placement=placement,
    )  # fmt: skip
    assert all(chunk.training for chunk in model)
    resolved = resolve_on_demand(case.schedule, pp_size=2, vp_size=case.vp, placement=placement)
    forward_backward = build_forward_backward_func(
        state, model, optimizer, hidden_size=gpt.hidden_size, resolved=resolved
    )
    streams = [
        microbatches(CorpusDataset(_tokens(), SEQ, seed=3), consumed_samples=0,
                     micro_batch_size=MICRO, data_parallel_rank=0, data_parallel_size=1)
        for _ in range(case.vp)
    ]  # fmt: skip
    torch.manual_seed(1000 + dist.get_rank())  # the same masks in every run of this rank
    losses, grads = [], []
    for _ in range(ITERS):
        result = train_step(
            gpt_forward_step, streams if case.vp > 1 else streams[0], model, optimizer,
            scheduler, forward_backward_func=forward_backward, state=state,
            num_microbatches=MICROBATCHES, micro_batch_size=MICRO, seq_length=SEQ,
            placement=placement,
        )  # fmt: skip
        losses.append(result[0])
        grads.append(_grads(model))
    return {"losses": losses, "grads": grads}


def _compare_modes(case: Case) -> dict[str, Any]:
    """Per mode: whether its losses and gradients equal the run without recompute, bitwise."""
    state = ParallelState.create(
        ParallelConfig(
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=case.vp if case.vp > 1 else None,
        )
    )
    runs = {name: _train(case, state, mode) for name, mode in _modes(case).items()}
    plain = runs.pop("none")
    equal = {}
    for name, run in runs.items():
        same_grads = all(
            len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            for a, b in zip(plain["grads"], run["grads"], strict=True)
        )
        equal[name] = (run["losses"] == plain["losses"], same_grads)
    return {"equal": equal, "losses": plain["losses"]}


CASES = [
    Case("1f1b"),
    Case("gpipe"),
    Case("interleaved_1f1b", vp=2),
    Case("zb_h1"),
    Case("zbv", vp=2, placement="v"),
]


@pytest.mark.parametrize("case", CASES, ids=[case.schedule for case in CASES])
def test_recompute_with_dropout_gives_bitwise_equal_losses_and_gradients(case: Case) -> None:
    results = run_distributed(_compare_modes, 2, case, timeout=120)
    for rank, result in enumerate(results):
        for mode, (losses, grads) in result["equal"].items():
            assert losses, f"rank {rank}, {case.schedule}, {mode}: the losses differ"
            assert grads, f"rank {rank}, {case.schedule}, {mode}: a gradient differs"
    last = results[1]["losses"] if case.placement == "looped" else results[0]["losses"]
    assert len(last) == ITERS
    assert all(loss["lm loss"] > 0 for loss in last)
