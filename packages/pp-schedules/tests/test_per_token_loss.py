"""Megatron's loss normalisation: per-token loss, the context-parallel factor, the finalise hook.

Microbatches here count different numbers of tokens (a mask over their positions), as packed
documents do. With per-token loss the gradients after finalisation are those of the whole
batch's token losses summed and divided by its token count, however the batch is cut; without
it, the mean over microbatches of each microbatch's own mean.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import ScheduleConfig, get_forward_backward_func
from pp_state import ParallelConfig, ParallelState, collective
from pp_testing import StageStack, run_distributed, stage_chunks, tiny_layers, tiny_microbatches

WIDTH, SEQ, BATCH, LAYERS, MICROBATCHES, PP = 4, 3, 2, 4, 3, 2
TOKEN_COUNTS = ([1, 4, 6], [2, 3, 5])
"""Unmasked positions of each microbatch (of SEQ x BATCH = 6), per data-parallel rank."""
Microbatch = dict[str, torch.Tensor]


def _data(dp_rank: int) -> list[Microbatch]:
    """The rank's microbatches, each with a mask keeping its first positions."""
    data = tiny_microbatches(MICROBATCHES, seq=SEQ, batch=BATCH, width=WIDTH, seed=10 + dp_rank)
    for microbatch, count in zip(data, TOKEN_COUNTS[dp_rank], strict=True):
        mask = torch.zeros(SEQ * BATCH)
        mask[:count] = 1.0
        microbatch["mask"] = mask.view(SEQ, BATCH)
    return data


def _token_sum(out: torch.Tensor, microbatch: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The squared error of each unmasked position (averaged over the width), summed; the count."""
    mask = microbatch["mask"]
    return (((out - microbatch["y"]) ** 2).mean(-1) * mask).sum(), mask.sum()


def _forward_step(
    data: Iterator[Microbatch], model: StageStack
) -> tuple[torch.Tensor, Callable[..., Any]]:
    """Modern Megatron's forward step: the loss function returns (sum, count, reported)."""
    microbatch = next(data)
    output = model(microbatch["x"] if model.input_tensor is None else model.input_tensor)

    def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        total, count = _token_sum(out, microbatch)
        return total, count, {"lm loss": torch.stack([total, count]).detach()}

    return output, loss_func


def _finalize(state: ParallelState, seen: list[Any]) -> Callable[..., None]:
    """An own trainer's finalisation: gradients summed over dp (then per token) or averaged."""
    pp_group, dp_cp = state.group("pp"), state.group("dp_cp")
    last = dist.get_global_rank(pp_group, state.pipeline_model_parallel_size - 1)

    def finalize(chunks: list[torch.nn.Module], num_tokens: torch.Tensor | None) -> None:
        seen.append((len(chunks), None if num_tokens is None else float(num_tokens)))
        grads = [p.grad for chunk in chunks for p in chunk.parameters() if p.grad is not None]
        with collective("gradient all-reduce over dp_cp", group=dp_cp):
            for grad in grads:
                dist.all_reduce(grad, group=dp_cp)
        if num_tokens is None:  # Megatron's average over the data-parallel replicas
            scale = 1.0 / state.group_size("dp_cp")
        else:  # the count from the last stage, summed over the replicas
            dist.broadcast(num_tokens, src=last, group=pp_group)
            dist.all_reduce(num_tokens, group=dp_cp)
            scale = 1.0 / max(float(num_tokens), 1.0)
        for grad in grads:
            grad.mul_(scale)

    return finalize


def _step(state: ParallelState, comm: P2PCommunicator, per_token: bool) -> dict[str, Any]:
    """One call on fresh weights; the gradients of this rank's layers after finalisation."""
    chunk = stage_chunks(
        tiny_layers(LAYERS, WIDTH), stages=[state.pipeline_model_parallel_rank], num_stages=PP
    )
    seen: list[Any] = []
    config = ScheduleConfig(
        hidden_size=WIDTH,
        calculate_per_token_loss=per_token,
        finalize_model_grads_func=_finalize(state, seen),
    )
    forward_backward = get_forward_backward_func(comm, config=config)
    store = forward_backward(
        forward_step_func=_forward_step, data_iterator=iter(_data(state.data_parallel_rank)),
        model=chunk, num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=BATCH,
    )  # fmt: skip
    total = forward_backward.total_num_tokens
    return {
        "grads": [p.grad.clone() for p in chunk[0].parameters() if p.grad is not None],
        "seen": seen,
        "total": None if total is None else float(total),
        "reported": [r["lm loss"].tolist() for r in store],
    }


def _both_modes() -> dict[str, Any]:
    timeout = datetime.timedelta(seconds=30)
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=PP, timeout=timeout))
    comm = P2PCommunicator.from_parallel_state(state, config=CommConfig(timeout=timeout))
    try:
        results: dict[str, Any] = {
            "per_token": _step(state, comm, True),
            "plain": _step(state, comm, False),
            "stage": state.pipeline_model_parallel_rank,
        }
    finally:
        comm.destroy()
        state.destroy()
    return results


def _reference(per_token: bool) -> list[torch.Tensor]:
    """Every layer's gradients on one process, over both replicas' microbatches."""
    model = StageStack(tiny_layers(LAYERS, WIDTH))
    batch = [mb for rank in range(len(TOKEN_COUNTS)) for mb in _data(rank)]
    sums = [_token_sum(model(mb["x"]), mb) for mb in batch]
    if per_token:
        loss = torch.stack([s for s, _ in sums]).sum() / sum(float(c) for _, c in sums)
    else:
        loss = torch.stack([s / c for s, c in sums]).mean()
    loss.backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


def test_per_token_gradients_are_the_whole_batchs_token_mean_at_dp2_pp2() -> None:
    results = run_distributed(_both_modes, 4, timeout=120)
    per = len(_reference(True)) // PP  # parameters per stage
    for mode, reference in (("per_token", _reference(True)), ("plain", _reference(False))):
        for result in results:
            stage = result["stage"]
            expected = reference[stage * per : (stage + 1) * per]
            for got, want in zip(result[mode]["grads"], expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # The two losses differ, so the check above could fail.
    assert not torch.allclose(_reference(True)[0], _reference(False)[0], rtol=1e-3)
    totals = [sum(counts) for counts in TOKEN_COUNTS]
    for rank, result in enumerate(results):
        last = result["stage"] == PP - 1
        dp_rank = rank % 2
        # The attribute: the call's own total on the last stage, None elsewhere or when off.
        assert result["per_token"]["total"] == (totals[dp_rank] if last else None)
        assert result["plain"]["total"] is None
        # The hook: the chunks, and the count (0 before the broadcast off the last stage).
        assert result["per_token"]["seen"] == [(1, totals[dp_rank] if last else 0.0)]
        assert result["plain"]["seen"] == [(1, None)]
        if last:
            assert [c for _, c in result["per_token"]["reported"]] == TOKEN_COUNTS[dp_rank]


# ------------------------------------------------------------------------- one stage, no processes
def _one_stage(config: ScheduleConfig, loss_func: Callable[..., Any], **call: Any) -> Any:
    chunk = StageStack(tiny_layers(2, WIDTH))
    data = tiny_microbatches(2, seq=SEQ, batch=BATCH, width=WIDTH)

    def forward_step(it: Iterator[Microbatch], model: StageStack) -> tuple[Any, Any]:
        microbatch = next(it)
        out = model(microbatch["x"])
        return out, lambda o: loss_func(((o - microbatch["y"]) ** 2).mean())

    forward_backward = get_forward_backward_func(None, config=config)
    forward_backward(
        forward_step_func=forward_step, data_iterator=iter(data), model=chunk,
        num_microbatches=2, seq_length=SEQ, micro_batch_size=BATCH, **call,
    )  # fmt: skip
    weight = chunk.layers[0].weight
    return weight.grad, forward_backward


def test_the_two_value_loss_is_scaled_by_the_context_parallel_size() -> None:
    plain, _ = _one_stage(ScheduleConfig(), lambda loss: (loss, {}))
    doubled, _ = _one_stage(ScheduleConfig(context_parallel_size=2), lambda loss: (loss, {}))
    torch.testing.assert_close(doubled, 2 * plain)
    # Three values: the cp factor stays out; a count of 0 divides by 1 (Megatron's clamp).
    counted, _ = _one_stage(
        ScheduleConfig(context_parallel_size=2), lambda loss: (loss * 3, torch.tensor(3.0), {})
    )
    torch.testing.assert_close(counted, plain)
    empty, _ = _one_stage(ScheduleConfig(), lambda loss: (loss, torch.tensor(0.0), {}))
    torch.testing.assert_close(empty, plain)


def test_the_hook_runs_after_backward_calls_only_and_the_total_is_kept() -> None:
    seen: list[Any] = []
    config = ScheduleConfig(
        calculate_per_token_loss=True,
        finalize_model_grads_func=lambda chunks, count: seen.append((chunks, count)),
    )
    summed, executor = _one_stage(config, lambda loss: (loss * 3, 3, {}))
    [(chunks, count)] = seen
    assert isinstance(chunks, list)
    assert len(chunks) == 1
    assert torch.equal(count, executor.total_num_tokens)
    assert (float(count), count.dtype) == (6.0, torch.float64)
    plain, _ = _one_stage(ScheduleConfig(), lambda loss: (loss, {}))
    # The sums are backwarded as they are: 3 tokens x 2 microbatches over the plain mean.
    torch.testing.assert_close(summed, plain * 3 * 2)
    _one_stage(config, lambda loss: (loss * 3, 3, {}), forward_only=True)
    assert len(seen) == 1


def test_bad_settings_and_loss_results_are_refused() -> None:
    for size in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"context_parallel_size must be a whole number"):
            ScheduleConfig(context_parallel_size=size)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="calculate_per_token_loss must be True or False"):
        ScheduleConfig(calculate_per_token_loss=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="finalize_model_grads_func must be callable"):
        ScheduleConfig(finalize_model_grads_func=3)  # type: ignore[arg-type]
    per_token = ScheduleConfig(calculate_per_token_loss=True)
    with pytest.raises(ValueError, match=r"needs loss_func to return 3 values.*it returned 2"):
        _one_stage(per_token, lambda loss: (loss, {}))
    with pytest.raises(ValueError, match=r"loss_func returned 4 values"):
        _one_stage(ScheduleConfig(), lambda loss: (loss, 1, 2, {}))
