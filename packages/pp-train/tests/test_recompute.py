"""Activation recomputation and dropout, in one process: settings, groups, the GPT, the flags.

`RecomputeConfig` refuses Megatron's contradictions with the flags' names; `run_layers`
checkpoints the groups Megatron's uniform and block methods make (counted by wrapping the
checkpoint call); `checkpoint_core_attention` finds Megatron's ``core_attention`` or says what
to do; the GPT's dropout is off in eval mode and recomputation leaves its parameter names and
state-dict keys alone. Flag errors come from the ``pp-train`` command before any process group.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint

import pp_train.recompute as recompute_module
from pp_train import (
    ModelArgs,
    ParallelArgs,
    PretrainConfig,
    RecomputeConfig,
    TrainingArgs,
    check_world,
    checkpoint_core_attention,
    pretrain_config_from_args,
    run_layers,
)
from pp_train.app import GPTChunk, GPTConfig, build_parser, main
from pp_train.app.command import _gpt_config

FULL_UNIFORM = RecomputeConfig(granularity="full", method="uniform", num_layers=2)
FULL_BLOCK = RecomputeConfig(granularity="full", method="block", num_layers=2)
SELECTIVE = RecomputeConfig(granularity="selective")


# ----------------------------------------------------------------------------- RecomputeConfig
@pytest.mark.reliability
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"granularity": "partial"},
         r"--recompute-granularity 'partial' is not a granularity; use full or selective"),
        ({"granularity": "full", "method": "every", "num_layers": 1},
         r"--recompute-method 'every' is not a method; use uniform or block"),
        ({"granularity": "full", "num_layers": 2},
         r"--recompute-granularity full needs --recompute-method: uniform .* or block"),
        ({"granularity": "full", "method": "block"},
         r"--recompute-granularity full with --recompute-method block needs "
         r"--recompute-num-layers N \(1 or more\)"),
        ({"granularity": "full", "method": "uniform", "num_layers": 0},
         r"--recompute-num-layers must be 1 or more .*, got 0"),
        ({"method": "uniform"},
         r"--recompute-method uniform needs --recompute-granularity full; no "
         r"--recompute-granularity is set"),
        ({"num_layers": 2},
         r"--recompute-num-layers 2 needs --recompute-granularity full"),
        ({"granularity": "selective", "method": "block", "num_layers": 1},
         r"--recompute-method block and --recompute-num-layers 1 need "
         r"--recompute-granularity full; --recompute-granularity selective recomputes the core "
         r"attention only"),
    ],
)  # fmt: skip
def test_contradicting_settings_are_refused_naming_the_flags(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        RecomputeConfig(**settings)


@pytest.mark.reliability
def test_a_layer_count_that_is_not_an_int_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"--recompute-num-layers must be an int, got float 2.0"):
        RecomputeConfig(granularity="full", method="block", num_layers=2.0)  # type: ignore[arg-type]


def test_enabled_and_the_per_chunk_cap() -> None:
    assert not RecomputeConfig().enabled
    assert SELECTIVE.enabled
    assert FULL_BLOCK.enabled
    assert FULL_BLOCK.for_chunk(1).num_layers == 1  # a shorter chunk recomputes all it holds
    assert FULL_BLOCK.for_chunk(3) is FULL_BLOCK
    assert FULL_BLOCK.for_chunk(0) is FULL_BLOCK  # nothing to run
    assert SELECTIVE.for_chunk(1) is SELECTIVE


# ----------------------------------------------------------------------------- run_layers
class _Scale(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(factor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.tanh(x * self.weight), 0.2)


def _counted_checkpoints(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layers each checkpoint covers, as `run_layers` makes them (1 for core attention)."""
    sizes: list[int] = []
    original = torch.utils.checkpoint.checkpoint

    def counting(function: Any, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        sizes.append(len(first) if isinstance(first, list) else 1)
        assert kwargs["use_reentrant"] is False
        assert kwargs["preserve_rng_state"] is True
        return original(function, *args, **kwargs)

    monkeypatch.setattr(recompute_module, "checkpoint", counting)
    return sizes


@pytest.mark.parametrize(
    ("config", "groups"),
    [
        (None, []),
        (RecomputeConfig(), []),
        (SELECTIVE, []),  # checkpoint_core_attention's job, not run_layers'
        (FULL_UNIFORM, [2, 2, 1]),  # the last group is shorter
        (dataclasses.replace(FULL_UNIFORM, num_layers=5), [5]),
        (FULL_BLOCK, [1, 1]),  # the first two alone; the other three kept
        (dataclasses.replace(FULL_BLOCK, num_layers=5), [1, 1, 1, 1, 1]),
    ],
    ids=["none", "off", "selective", "uniform-2", "uniform-5", "block-2", "block-5"],
)
def test_run_layers_checkpoints_megatrons_groups_and_changes_no_bit(
    config: RecomputeConfig | None, groups: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = [_Scale(1.0 + i / 10) for i in range(5)]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    torch.manual_seed(1)
    plain = run_layers(layers, x, None)
    plain_grads = torch.autograd.grad(plain.sum(), [x, *(layer.weight for layer in layers)])
    sizes = _counted_checkpoints(monkeypatch)
    torch.manual_seed(1)
    out = run_layers(layers, x, config)
    grads = torch.autograd.grad(out.sum(), [x, *(layer.weight for layer in layers)])
    assert sizes == groups
    assert torch.equal(out, plain)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))


def test_run_layers_without_layers_or_without_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = _counted_checkpoints(monkeypatch)
    hidden = torch.randn(2, 2)
    assert run_layers([], hidden, FULL_BLOCK) is hidden  # an embedding- or loss-only stage
    with torch.no_grad():  # forward only: nothing would be recomputed
        run_layers([_Scale(1.0), _Scale(2.0)], hidden, FULL_UNIFORM)
    assert sizes == []


@pytest.mark.reliability
def test_run_layers_refuses_more_layers_than_the_chunk_holds() -> None:
    config = dataclasses.replace(FULL_BLOCK, num_layers=4)
    with pytest.raises(
        ValueError, match=r"--recompute-num-layers 4 exceeds the 3 layers of this chunk; use 1 .. 3"
    ):
        run_layers([_Scale(1.0) for _ in range(3)], torch.ones(1), config)


# ----------------------------------------------------------------------------- selective
def _gpt(**settings: Any) -> GPTConfig:
    return GPTConfig(num_layers=3, hidden_size=16, num_attention_heads=2, seq_length=8, **settings)


def _chunk(config: GPTConfig, layers: range = range(3)) -> GPTChunk:
    return GPTChunk(config, layers=layers, pre_process=True, post_process=True, seed=5)


@pytest.mark.reliability
def test_selective_recompute_without_core_attention_says_what_to_do() -> None:
    with pytest.raises(
        ValueError,
        match=r"selective recompute needs attention marked as core_attention; Sequential has "
        r"no submodule named core_attention .* use --recompute-granularity full",
    ):
        checkpoint_core_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_checkpoint_core_attention_wraps_each_once_and_keeps_the_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chunk = _chunk(_gpt(attention_dropout=0.1))
    names, keys = [n for n, _ in chunk.named_parameters()], list(chunk.state_dict())
    assert checkpoint_core_attention(chunk) == 3
    assert checkpoint_core_attention(chunk) == 3  # again: still one checkpoint each
    assert [n for n, _ in chunk.named_parameters()] == names
    assert list(chunk.state_dict()) == keys
    sizes = _counted_checkpoints(monkeypatch)
    chunk(torch.zeros(2, 8, dtype=torch.int64), labels=torch.zeros(2, 8, dtype=torch.int64))
    assert sizes == [1, 1, 1]
    twin = copy.deepcopy(chunk)
    attention = twin.get_submodule("layers.0.self_attention.core_attention")
    assert getattr(attention.forward, "__self__", None) is attention  # the copy runs the copy


# ----------------------------------------------------------------------------- the GPT
@pytest.mark.parametrize(
    "recompute",
    [None, FULL_UNIFORM, FULL_BLOCK, SELECTIVE],
    ids=["none", "uniform", "block", "sel"],
)
def test_gpt_names_and_state_dict_keys_do_not_depend_on_recompute(
    recompute: RecomputeConfig | None,
) -> None:
    plain, recomputed = _chunk(_gpt()), _chunk(_gpt(hidden_dropout=0.1, recompute=recompute))
    assert list(recomputed.state_dict()) == list(plain.state_dict())
    assert recomputed.sharded_state_keys() == plain.sharded_state_keys()
    assert all(
        torch.equal(a, b)
        for a, b in zip(plain.state_dict().values(), recomputed.state_dict().values(), strict=True)
    )
    assert recomputed.load_state_dict(plain.state_dict()) is not None


def test_a_chunk_without_layers_takes_any_recompute_setting() -> None:
    empty = GPTChunk(_gpt(recompute=SELECTIVE), layers=range(0), pre_process=True,
                     post_process=False, seed=5)  # fmt: skip
    tokens = torch.zeros(2, 8, dtype=torch.int64)
    assert empty(tokens).shape == (8, 2, 16)


def test_dropout_is_off_in_eval_mode_and_on_in_training() -> None:
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    plain = _chunk(_gpt()).eval()
    dropped = _chunk(_gpt(hidden_dropout=0.1, attention_dropout=0.1, recompute=FULL_BLOCK))
    dropped.eval()
    reference = plain(tokens)
    assert torch.equal(dropped(tokens), reference)
    assert torch.equal(dropped(tokens), reference)
    dropped.train()
    first, second = dropped(tokens), dropped(tokens)
    assert not torch.equal(first, second)


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"hidden_dropout": 1.0}, ValueError,
         r"hidden_dropout must be a probability in \[0, 1\), got 1.0"),
        ({"attention_dropout": -0.1}, ValueError,
         r"attention_dropout must be a probability in \[0, 1\), got -0.1"),
        ({"attention_dropout": "0.1"}, TypeError, r"attention_dropout must be a float, got str"),
        ({"recompute": "full"}, TypeError, r"recompute must be a RecomputeConfig or None, got str"),
    ],
)  # fmt: skip
def test_gpt_config_refuses_bad_dropout_and_recompute(
    settings: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        _gpt(**settings)


# ----------------------------------------------------------------------------- flags
def test_the_flags_make_the_recompute_config_and_the_command_drops_no_dropout() -> None:
    assert ModelArgs().recompute is None
    assert (ModelArgs().hidden_dropout, ModelArgs().attention_dropout) == (0.1, 0.1)
    assert ModelArgs(recompute_activations=True).recompute == SELECTIVE
    parser = build_parser()
    args = parser.parse_args(
        ["--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "2", "--attention-dropout", "0.2"]
    )  # fmt: skip
    gpt = _gpt_config(pretrain_config_from_args(args))
    assert gpt.recompute == FULL_UNIFORM
    assert (gpt.hidden_dropout, gpt.attention_dropout) == (0.0, 0.2)  # the command's default: 0


def _config(pp: int, **model: Any) -> PretrainConfig:
    return PretrainConfig(
        parallel=ParallelArgs(pipeline_model_parallel_size=pp),
        model=ModelArgs(num_layers=6, hidden_size=16, num_attention_heads=2, **model),
        training=TrainingArgs(micro_batch_size=1, global_batch_size=4, eval_iters=0),
    )


@pytest.mark.reliability
def test_check_world_refuses_more_recomputed_layers_than_the_fullest_chunk_holds() -> None:
    flags = {"recompute_granularity": "full", "recompute_method": "block"}
    assert check_world(_config(2, **flags, recompute_num_layers=3), 2).layer_counts == (3, 3)
    with pytest.raises(
        ValueError,
        match=r"--recompute-num-layers 4 is more than the 3 transformer layer\(s\) the fullest "
        r"model chunk holds \(layers per virtual stage: 3, 3\); use 1 .. 3",
    ):
        check_world(_config(2, **flags, recompute_num_layers=4), 2)


TINY = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--pipeline-model-parallel-size", "2"]  # fmt: skip


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--recompute-method", "block"],
         "--recompute-method block needs --recompute-granularity full; no "
         "--recompute-granularity is set"),
        (["--recompute-granularity", "full", "--recompute-num-layers", "1"],
         "--recompute-granularity full needs --recompute-method: uniform"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform"],
         "--recompute-granularity full with --recompute-method uniform needs "
         "--recompute-num-layers N (1 or more)"),
        (["--recompute-granularity", "full", "--recompute-method", "block",
          "--recompute-num-layers", "3"],
         "--recompute-num-layers 3 is more than the 2 transformer layer(s) the fullest model "
         "chunk holds (layers per virtual stage: 2, 2); use 1 .. 2"),
        (["--recompute-activations", "--recompute-granularity", "full"],
         "--recompute-activations means --recompute-granularity selective, but "
         "--recompute-granularity is full; give one of the two"),
        (["--recompute-activations", "--recompute-num-layers", "2"],
         "--recompute-num-layers 2 needs --recompute-granularity full; "
         "--recompute-granularity selective recomputes the core attention only"),
        (["--hidden-dropout", "1"], "--hidden-dropout must be a probability in [0, 1), got 1.0"),
        (["--attention-dropout", "-0.5"],
         "--attention-dropout must be a probability in [0, 1), got -0.5"),
    ],
    ids=["method-alone", "no-method", "no-layers", "too-many-layers", "alias-and-full",
         "alias-and-layers", "hidden-dropout", "attention-dropout"],
)  # fmt: skip
def test_bad_recompute_and_dropout_flags_are_one_error_before_any_process_group(
    flags: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, *flags])
    assert exit_info.value.code == 2
    assert not dist.is_initialized()
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("pp-train: error:")]
    assert line.startswith(f"pp-train: error: {message}")
