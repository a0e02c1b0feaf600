"""Norms, clipping and zero counts: one process against torch, and split models against the whole."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import pp_optim
import pp_optim.grad_norm
import pp_state.params
from pp_optim import (
    all_reduce_grads,
    clip_grad_norm,
    count_zeros,
    get_grad_norm,
    grads_for_norm,
)
from pp_state import ParallelConfig, ParallelState
from pp_testing import run_distributed

NORMS = [1.0, 2.0, 3.0, math.inf]


def _params_with_grads(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for param in params:
        grad = torch.randn(param.shape, generator=generator)
        grad[grad.abs() < 0.3] = 0.0  # some exact zeros to count
        param.grad = grad
    return params


@pytest.mark.parametrize("norm_type", NORMS)
def test_single_process_matches_torch(norm_type: float) -> None:
    ours = _params_with_grads(0, [(4, 5), (7,), (3, 3, 2)])
    theirs = _params_with_grads(0, [(4, 5), (7,), (3, 3, 2)])
    total = clip_grad_norm(ours, 0.5, norm_type, group=None)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    assert total == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(ours, theirs, strict=True):
        assert a.grad is not None
        assert b.grad is not None
        torch.testing.assert_close(a.grad, b.grad)


def test_clip_coefficient_and_no_clip_below_max() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm(params, 10.0, group=None) == 5.0
    assert params[0].grad is not None
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0, 4.0]))  # coefficient >= 1
    clip_grad_norm(params, 1.0, group=None)
    coefficient = 1.0 / (5.0 + 1e-6)
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0, 4.0]) * coefficient)


def test_inf_and_nan_norms_are_reported_and_nan_clips_nothing() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    params[0].grad = torch.tensor([1.0, math.inf, 2.0])
    assert get_grad_norm(grads_for_norm(params), group=None) == math.inf
    params[0].grad = torch.tensor([1.0, math.nan, 2.0])
    assert math.isnan(clip_grad_norm(params, 1.0, group=None))
    assert params[0].grad[0].item() == 1.0


def test_shared_and_duplicate_params_are_left_out_of_the_norm_but_clipped() -> None:
    sharded, duplicated, shared = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    sharded.tensor_model_parallel = True  # type: ignore[attr-defined]
    shared.shared = True  # type: ignore[attr-defined]
    for param in (sharded, duplicated, shared):
        param.grad = torch.tensor([3.0, 4.0])
    params = [sharded, duplicated, shared]
    assert len(grads_for_norm(params, tensor_parallel_rank=0)) == 2
    assert len(grads_for_norm(params, tensor_parallel_rank=1)) == 1
    assert clip_grad_norm(params, 1.0, group=None, tensor_parallel_rank=1) == 5.0
    for param in params:
        assert param.grad is not None
        torch.testing.assert_close(param.grad.norm(), torch.tensor(1.0 / (1 + 1e-6)))


def test_the_duplicate_rule_is_pp_states_and_takes_the_rank_or_the_groups() -> None:
    assert (
        pp_optim.param_is_not_tensor_parallel_duplicate
        is pp_state.params.param_is_not_tensor_parallel_duplicate
    )
    assert "param_is_not_tensor_parallel_duplicate" in pp_optim.grad_norm.__all__
    bias = torch.nn.Parameter(torch.zeros(2))
    assert pp_optim.param_is_not_tensor_parallel_duplicate(bias, 0)
    assert not pp_optim.param_is_not_tensor_parallel_duplicate(bias, tp_group=1)
    bias.allreduce = False  # type: ignore[attr-defined]  # an expert's: its own group decides
    assert pp_optim.param_is_not_tensor_parallel_duplicate(bias, 1, expert_tp_group=0)
    with pytest.raises(ValueError, match="got -1"):
        grads_for_norm([bias], tensor_parallel_rank=-1)


def test_main_grad_is_read_when_grad_is_none() -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    param.main_grad = torch.tensor([0.0, 0.0, 3.0, 4.0])  # type: ignore[attr-defined]
    assert count_zeros([param], group=None) == 2
    assert clip_grad_norm([param], 1.0, group=None) == 5.0
    torch.testing.assert_close(param.main_grad.norm(), torch.tensor(1.0 / (1 + 1e-6)))  # type: ignore[attr-defined]


def test_bad_arguments() -> None:
    params = _params_with_grads(0, [(2,)])
    with pytest.raises(ValueError, match="max_norm must be > 0, got 0"):
        clip_grad_norm(params, 0.0, group=None)
    with pytest.raises(ValueError, match=r"norm_type must be > 0.*got -1"):
        clip_grad_norm(params, 1.0, -1.0, group=None)


# --- tensor parallel 2: a column-split weight and a duplicated bias --------------------------


def _whole_model_grads() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    grads = {
        name: torch.randn(shape, generator=generator)
        for name, shape in [("weight", (8, 6)), ("bias", (6,)), ("norm", (6,))]
    }
    grads["weight"][0] = 0.0
    grads["bias"][:2] = 0.0
    return grads


def _tp_norms(norm_type: float) -> tuple[float, int, list[torch.Tensor]]:
    state = ParallelState.create(ParallelConfig(tensor_model_parallel_size=2))
    tp_rank = state.group_rank("tp")
    whole = _whole_model_grads()
    weight = torch.nn.Parameter(torch.zeros(4, 6))
    weight.tensor_model_parallel = True  # type: ignore[attr-defined]
    weight.grad = whole["weight"].chunk(2, dim=0)[tp_rank].clone()
    bias, norm = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(6))
    bias.grad, norm.grad = whole["bias"].clone(), whole["norm"].clone()
    params = [weight, bias, norm]
    zeros = count_zeros(params, group=state.group("mp"), tensor_parallel_rank=tp_rank)
    total = clip_grad_norm(
        params, 1.0, norm_type, group=state.group("mp"), tensor_parallel_rank=tp_rank
    )
    return total, zeros, [p.grad for p in params if p.grad is not None]


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.5])
def test_tensor_parallel_duplicates_count_once(norm_type: float) -> None:
    results = run_distributed(_tp_norms, 2, norm_type)
    whole = _whole_model_grads()
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in whole.values()]
    for param, grad in zip(reference, whole.values(), strict=True):
        param.grad = grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0, norm_type).item()
    expected_zeros = sum(int((g == 0).sum()) for g in whole.values())
    for rank, (total, zeros, grads) in enumerate(results):
        assert total == pytest.approx(expected, rel=1e-5)
        assert zeros == expected_zeros
        assert reference[0].grad is not None
        torch.testing.assert_close(grads[0], reference[0].grad.chunk(2, dim=0)[rank])
        torch.testing.assert_close(grads[1], reference[1].grad)


# --- pipeline 2: the word embedding tied between the first and the last stage ----------------


def _tied_grads() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    # input-embedding use, output-layer use, a first-stage layer, a last-stage layer
    return tuple(
        torch.randn(shape, generator=generator) for shape in [(10, 4), (10, 4), (4, 4), (4,)]
    )  # type: ignore[return-value]


def _pp_shared_embedding() -> tuple[float, int, torch.Tensor]:
    state = ParallelState.create(ParallelConfig(pipeline_model_parallel_size=2))
    from_input, from_output, first_layer, last_layer = _tied_grads()
    embedding = torch.nn.Parameter(torch.zeros(10, 4))
    if state.is_pipeline_first_stage():
        embedding.grad = from_input.clone()
        layer = torch.nn.Parameter(torch.zeros(4, 4))
        layer.grad = first_layer.clone()
    else:
        embedding.shared = True  # type: ignore[attr-defined]
        embedding.main_grad = from_output.clone()  # type: ignore[attr-defined]
        layer = torch.nn.Parameter(torch.zeros(4))
        layer.grad = last_layer.clone()
    all_reduce_grads([embedding], group=state.group("embedding"))
    params = [embedding, layer]
    zeros = count_zeros(params, group=state.group("mp"))
    total = clip_grad_norm(params, 0.1, group=state.group("mp"))
    tied = embedding.grad if embedding.grad is not None else embedding.main_grad  # type: ignore[attr-defined]
    return total, zeros, tied


def test_pipeline_shared_embedding_counts_once() -> None:
    results = run_distributed(_pp_shared_embedding, 2)
    from_input, from_output, first_layer, last_layer = _tied_grads()
    tied = torch.nn.Parameter(torch.zeros(10, 4))
    tied.grad = from_input + from_output  # one model, one weight used twice
    reference = [
        tied,
        torch.nn.Parameter(first_layer.clone()),
        torch.nn.Parameter(last_layer.clone()),
    ]
    reference[1].grad, reference[2].grad = first_layer.clone(), last_layer.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.1).item()
    for total, zeros, tied_grad in results:
        assert total == pytest.approx(expected, rel=1e-5)
        assert zeros == 0
        assert tied.grad is not None
        torch.testing.assert_close(tied_grad, tied.grad)  # both copies clipped alike


def _world_all_reduce_of_mixed_dtypes() -> list[torch.Tensor]:
    rank = dist.get_rank()
    params = [
        torch.nn.Parameter(torch.zeros(3)),
        torch.nn.Parameter(torch.zeros(2, dtype=torch.float16)),
        torch.nn.Parameter(torch.zeros(1)),
    ]
    params[0].grad = torch.full((3,), float(rank + 1))
    params[1].main_grad = torch.full((2,), float(rank + 1), dtype=torch.float16)  # type: ignore[attr-defined]
    all_reduce_grads(params, group=dist.group.WORLD)
    return [params[0].grad, params[1].main_grad]  # type: ignore[attr-defined]


def test_all_reduce_grads_sums_each_dtype_and_skips_missing() -> None:
    for grad, main in run_distributed(_world_all_reduce_of_mixed_dtypes, 3):
        torch.testing.assert_close(grad, torch.full((3,), 6.0))
        torch.testing.assert_close(main, torch.full((2,), 6.0, dtype=torch.float16))
