"""The configuration dataclasses are the single source of the flags: one field, one flag."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, get_type_hints

import pytest

from pp_train.arguments import (
    LRScheduleArgs,
    ModelArgs,
    PretrainConfig,
    add_pretrain_flags,
    pretrain_config_from_args,
)
from pp_train.flags import field_docs, flag_of


def _groups() -> list[type]:
    hints = get_type_hints(PretrainConfig)
    return [hints[field.name] for field in dataclasses.fields(PretrainConfig)]


def _parser() -> argparse.ArgumentParser:
    return add_pretrain_flags(argparse.ArgumentParser(prog="test"))


def test_each_field_has_exactly_one_flag_and_one_default() -> None:
    parser = _parser()
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    fields = [(cls, f) for cls in _groups() for f in dataclasses.fields(cls)]
    assert len({f.name for _, f in fields}) == len(fields), "a field name is in two groups"
    for cls, field in fields:
        matching = [a for a in actions if a.dest == field.name]
        assert len(matching) == 1, f"{cls.__name__}.{field.name} has {len(matching)} flags"
        (action,) = matching
        assert flag_of(field) in action.option_strings
        assert action.default == field.default, f"{field.name}: two defaults"
        assert field_docs(cls).get(field.name), f"{cls.__name__}.{field.name} has no docstring"
    assert {a.dest for a in actions} == {f.name for _, f in fields}, "a flag without a field"


def test_no_flags_give_the_dataclasses_defaults() -> None:
    assert pretrain_config_from_args(_parser().parse_args([])) == PretrainConfig()


def test_help_is_grouped_and_shows_docstrings_and_defaults() -> None:
    text = _parser().format_help()
    for title in ("Parallelism and the pipeline schedule", "The model's shape", "Checkpoints"):
        assert f"{title}:" in text
    assert "Learning rate at the end of the decay. (default: 0.0)" in " ".join(text.split())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--train-iters", "0"], "--train-iters must be an integer 1 or more, got 0"),
        (["--hidden-size", "48", "--num-attention-heads", "5"], "--hidden-size 48 is not divi"),
        (["--min-lr", "0.1", "--lr", "0.01"], "--min-lr 0.1 is above --lr 0.01"),
        (["--lr-warmup-iters", "200"], "--lr-warmup-iters 200 must be below the decay length 200"),
        (["--save-interval", "5"], "--save-interval needs --save DIR"),
        (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be a posit"),
        (["--fp16", "--bf16"], "invalid OptimizerConfig: set at most one of fp16 and bf16"),
        (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        (
            ["--load", "a", "--ckpt-convert-format", "torch"],
            "--ckpt-convert-format needs --ckpt-convert-save DIR",
        ),
        (
            ["--load", "a", "--ckpt-convert-save", "b"],
            "--ckpt-convert-save needs --ckpt-convert-format {torch,torch_dist}",
        ),
        (
            ["--ckpt-convert-format", "torch", "--ckpt-convert-save", "b"],
            "--ckpt-convert-format needs --load DIR",
        ),
        (
            ["--load", "a", "--ckpt-convert-format", "torch", "--ckpt-convert-save", "./a"],
            "--ckpt-convert-save ./a is the --load directory",
        ),
        (
            [
                "--load",
                "a",
                "--ckpt-convert-format",
                "torch",
                "--ckpt-convert-save",
                "b",
                "--finetune",
                "--no-load-rng",
            ],
            "--ckpt-convert-format copies the whole checkpoint; it cannot be combined with "
            "--finetune, --no-load-rng",
        ),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        pretrain_config_from_args(_parser().parse_args(argv))


def test_switches_tuples_and_overridden_flag_names() -> None:
    args = _parser().parse_args(
        [
            "--no-barrier-with-L1-time",
            "--rampup-batch-size", "4", "4", "16",
            "--use-checkpoint-opt_param-scheduler",
            "--timing-log-level", "2",
        ]
    )  # fmt: skip
    config = pretrain_config_from_args(args)
    assert config.logging.barrier_with_l1_time is False
    assert config.training.rampup_batch_size == (4, 4, 16)
    assert config.lr_schedule.use_checkpoint_opt_param_scheduler is True
    assert config.logging.timing_log_level == 2


def test_gpt2s_model_switches_parse_with_megatrons_spelling() -> None:
    default = pretrain_config_from_args(_parser().parse_args([])).model
    assert (default.untie_embeddings_and_output_weights, default.openai_gelu) == (False, False)
    argv = ["--untie-embeddings-and-output-weights", "--openai-gelu"]
    model = pretrain_config_from_args(_parser().parse_args(argv)).model
    assert (model.untie_embeddings_and_output_weights, model.openai_gelu) == (True, True)
    with pytest.raises(SystemExit):  # switches: they take no value
        _parser().parse_args(["--openai-gelu", "true"])


def test_groups_are_frozen_and_keyword_only() -> None:
    for cls in (*_groups(), PretrainConfig):
        params: Any = cls.__dataclass_params__  # type: ignore[attr-defined]
        assert params.frozen, cls
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelArgs().num_layers = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        LRScheduleArgs(0.1)  # type: ignore[call-arg]


def test_the_schedule_flag_offers_the_registrys_pipelined_schedules_and_auto() -> None:
    from typing import get_args

    from pp_schedules.planning import SCHEDULE_REGISTRY
    from pp_train.arguments import PipelineScheduleName

    pipelined = set(SCHEDULE_REGISTRY) - {"no_pipelining"}
    assert set(get_args(PipelineScheduleName)) == pipelined | {"auto"}
