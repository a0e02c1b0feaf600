"""`pp_tensor.megatron` against megatron-core's own ``tensor_parallel``, run on the CPU.

Names, signatures and `ModelParallelConfig`'s fields against megatron-core's; and, on a
one-rank gloo world, the layers' and the cross entropy's forward and backward against
Megatron's own code on the same weights and inputs (its layers run on the CPU with
``use_cpu_initialization``; its mappings need CUDA beyond one rank, which the tp 2 and 4
tests of test_megatron_facade.py cover against the unsplit computation instead).

Skipped where megatron-core is not installed. The nox session ``megatron_oracles`` installs it
and sets PP_TENSOR_MEGATRON_ORACLE=1, which makes a missing megatron-core a failure.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pp_state import parallel_state
from pp_tensor import megatron as facade
from pp_tensor.megatron.model_parallel_config import ModelParallelConfig
from pp_testing import run_distributed

with warnings.catch_warnings():
    # megatron.core warns at import that Transformer Engine and Apex are absent.
    warnings.simplefilter("ignore")
    if os.environ.get("PP_TENSOR_MEGATRON_ORACLE") == "1":
        import megatron.core.model_parallel_config as megatron_config
        import megatron.core.tensor_parallel as megatron
    else:
        megatron = pytest.importorskip("megatron.core.tensor_parallel")
        import megatron.core.model_parallel_config as megatron_config

# Megatron's inference layers: pp has no inference engine.
ABSENT = {"InferenceLayerNormColumnParallelLinear", "InferenceRowParallelLinear"}
# Where megatron-core 0.16.1 (the registry's) and 0.20 (which the facade follows) differ: 0.20
# put tp_group where 0.16.1 had async_grad_allreduce, which the facade takes by keyword.
KEYWORD_HERE = {("linear_with_grad_accumulation_and_async_allreduce", "async_grad_allreduce")}
# 0.20 moved these (it put new parameters before them): the facade has them at 0.20's place.
MOVED_IN_0_20 = {("model_parallel_cuda_manual_seed", "force_reset_rng")}


def test_every_megatron_name_is_in_the_facade() -> None:
    missing = sorted(set(megatron.__all__) - ABSENT - set(facade.__all__))
    assert not missing, f"pp_tensor.megatron lacks {missing}"


def _signature(target: Any) -> inspect.Signature:
    return inspect.signature(target.__init__ if inspect.isclass(target) else target)


@pytest.mark.parametrize("name", sorted(set(megatron.__all__) - ABSENT))
def test_megatron_arguments_are_accepted_where_megatron_puts_them(name: str) -> None:
    """Each of Megatron's parameters exists here: same name, kind, default and position."""
    ours = _signature(getattr(facade, name)).parameters
    positions = list(ours)
    index = 0  # the place here: a parameter taken by keyword here leaves none
    for parameter, theirs in _signature(getattr(megatron, name)).parameters.items():
        if theirs.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        assert parameter in ours, f"{name}: no parameter {parameter!r}"
        mine = ours[parameter]
        assert mine.default == theirs.default, f"{name}({parameter}=): default {mine.default!r}"
        if (name, parameter) in KEYWORD_HERE:
            assert mine.kind is inspect.Parameter.KEYWORD_ONLY, f"{name}({parameter})"
            continue
        if theirs.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            assert mine.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{name}({parameter})"
            moved = (name, parameter) in MOVED_IN_0_20
            assert moved or positions.index(parameter) == index, f"{name}: {parameter} moved"
        index += 1


def test_model_parallel_config_has_megatrons_fields_and_defaults() -> None:
    ours = {field.name: field for field in dataclasses.fields(ModelParallelConfig)}
    for field in dataclasses.fields(megatron_config.ModelParallelConfig):
        assert field.name in ours, f"ModelParallelConfig lacks {field.name}"
        theirs_default = (
            field.default_factory()
            if field.default_factory is not dataclasses.MISSING
            else field.default
        )
        assert ours[field.name].default == theirs_default, field.name
    config = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    theirs = megatron_config.ModelParallelConfig(
        tensor_model_parallel_size=2, sequence_parallel=True
    )
    for name in (
        "expert_tensor_parallel_size",
        "autocast_dtype",
        "microbatch_group_size_per_vp_stage",
    ):
        assert getattr(config, name) == getattr(theirs, name), name


@dataclasses.dataclass
class _Pair:
    ours: torch.nn.Module
    theirs: torch.nn.Module


def _init(seed: int) -> Callable[[torch.Tensor], object]:
    return lambda w: w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)))


def _both(build: Callable[[Any, Any], torch.nn.Module]) -> _Pair:
    return _Pair(
        build(facade, ModelParallelConfig(use_cpu_initialization=True)),
        build(megatron, megatron_config.ModelParallelConfig(use_cpu_initialization=True)),
    )


def _forward_backward(module: torch.nn.Module, x: torch.Tensor) -> Iterator[torch.Tensor]:
    leaf = x.clone().requires_grad_(x.is_floating_point())
    out = module(leaf)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out) * 0.5)
    yield out.detach()
    if leaf.grad is not None:
        yield leaf.grad
    for param in module.parameters():
        yield param.grad if param.grad is not None else torch.zeros(0)


def _layers_against_megatron() -> None:
    from megatron.core import parallel_state as megatron_state

    megatron_state.initialize_model_parallel(1, 1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        pairs = [
            _both(
                lambda m, c: m.ColumnParallelLinear(
                    8, 12, config=c, init_method=_init(1), bias=True, gather_output=True
                )
            ),
            _both(
                lambda m, c: m.RowParallelLinear(
                    12,
                    8,
                    config=c,
                    init_method=_init(2),
                    bias=True,
                    input_is_parallel=False,
                    skip_bias_add=False,
                )
            ),
        ]
        x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(3))
        for pair, given in zip(pairs, (x, torch.randn(4, 2, 12)), strict=True):
            for ours, theirs in zip(
                _forward_backward(pair.ours, given),
                _forward_backward(pair.theirs, given),
                strict=True,
            ):
                torch.testing.assert_close(ours, theirs)
        embedding = _both(
            lambda m, c: m.VocabParallelEmbedding(20, 8, init_method=_init(4), config=c)
        )
        ids = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(5))
        for ours, theirs in zip(
            _forward_backward(embedding.ours, ids),
            _forward_backward(embedding.theirs, ids),
            strict=True,
        ):
            torch.testing.assert_close(ours, theirs)
        logits = torch.randn(4, 2, 20, generator=torch.Generator().manual_seed(6))
        target = torch.randint(0, 20, (4, 2), generator=torch.Generator().manual_seed(7))
        for smoothing in (0.0, 0.1):
            results = []
            for module in (facade, megatron):
                leaf = logits.clone().requires_grad_(True)
                loss = module.vocab_parallel_cross_entropy(leaf, target, label_smoothing=smoothing)
                loss.sum().backward()
                results.append((loss.detach(), leaf.grad))
            torch.testing.assert_close(results[0], results[1])
    finally:
        parallel_state.destroy_model_parallel()
        megatron_state.destroy_model_parallel()


def test_layers_and_cross_entropy_equal_megatrons_own_at_tp_1() -> None:
    run_distributed(_layers_against_megatron, 1)


def test_attribute_helpers_behave_as_megatrons() -> None:
    for module in (facade, megatron):
        source, destination, replicated = torch.zeros(1), torch.zeros(1), torch.zeros(1)
        module.set_tensor_model_parallel_attributes(source, True, 1, 2)
        source.is_qkv, source.expert_tp = True, True  # type: ignore[attr-defined]
        module.copy_tensor_model_parallel_attributes(destination, source)
        module.set_defaults_if_not_set_tensor_model_parallel_attributes(replicated)
        kept = {
            name: getattr(destination, name, None)
            for name in (
                "tensor_model_parallel",
                "partition_dim",
                "partition_stride",
                "is_qkv",
                "expert_tp",
            )
        }
        assert kept == {
            "tensor_model_parallel": True,
            "partition_dim": 1,
            "partition_stride": 2,
            "is_qkv": True,
            "expert_tp": True,
        }
        assert not replicated.tensor_model_parallel  # type: ignore[attr-defined]
    chunks = facade.split_tensor_along_last_dim(torch.arange(12.0).view(2, 6), 3)
    theirs = megatron.split_tensor_along_last_dim(torch.arange(12.0).view(2, 6), 3)
    for a, b in zip(chunks, theirs, strict=True):
        torch.testing.assert_close(a, b)
    assert dist.is_available()
