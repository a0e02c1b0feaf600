"""Microbatch counts: constant batches, the ramp-up trajectory, and the errors with their hints."""

from __future__ import annotations

import pytest

from pp_train.num_microbatches_calculator import (
    ConstantNumMicroBatchesCalculator,
    NumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatchesCalculator,
    build_num_microbatches_calculator,
)


@pytest.mark.parametrize(
    ("global_batch", "micro", "dp", "expected"),
    [(64, 2, 4, 8), (8, 2, 4, 1), (12, 3, 1, 4), (7, 7, 1, 1), (32, 1, 32, 1)],
)
def test_constant_count(global_batch: int, micro: int, dp: int, expected: int) -> None:
    calculator = ConstantNumMicroBatchesCalculator(global_batch, micro, dp)
    assert calculator.get() == expected
    assert calculator.get_current_global_batch_size() == global_batch
    assert calculator.micro_batch_size == micro
    calculator.update(10_000, consistency_check=True)
    assert calculator.get() == expected
    assert calculator.get_current_global_batch_size() == global_batch


def test_constant_not_divisible_names_numbers_and_nearby_multiples() -> None:
    with pytest.raises(ValueError, match="global batch size 10 is not divisible") as info:
        ConstantNumMicroBatchesCalculator(10, 2, 4)
    assert str(info.value) == (
        "global batch size 10 is not divisible by micro batch size 2 x data-parallel size 4 "
        "= 8; use a multiple of 8 such as 8 or 16"
    )


def test_constant_smaller_than_one_round_suggests_the_first_multiple() -> None:
    with pytest.raises(ValueError, match=r"= 8; use a multiple of 8 such as 8$"):
        ConstantNumMicroBatchesCalculator(5, 2, 4)


@pytest.mark.parametrize(
    ("args", "error", "pattern"),
    [
        ((0, 1, 1), ValueError, "global batch size must be >= 1, got 0"),
        ((8, 0, 1), ValueError, "micro batch size must be >= 1, got 0"),
        ((8, 1, -2), ValueError, "data-parallel size must be >= 1, got -2"),
        ((8.0, 1, 1), TypeError, "global batch size must be an int"),
        ((8, True, 1), TypeError, "micro batch size must be an int"),
    ],
)
def test_constant_bad_sizes(args: tuple[object, ...], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        ConstantNumMicroBatchesCalculator(*args)  # type: ignore[arg-type]


def _example_ramp() -> RampupBatchsizeNumMicroBatchesCalculator:
    # start 16, increment 16, 1000 ramp samples, global 64, mbs 2, dp 2: 3 increments of
    # 333.33 samples, and 4 samples per round of microbatches.
    return RampupBatchsizeNumMicroBatchesCalculator(64, 2, 2, 16, 16, 1000)


def test_ramp_starts_at_the_start_batch() -> None:
    calculator = _example_ramp()
    assert calculator.get_current_global_batch_size() == 16
    assert calculator.get() == 4


@pytest.mark.parametrize(
    ("consumed", "global_batch", "microbatches"),
    [
        (0, 16, 4),
        (333, 16, 4),
        (334, 32, 8),
        (666, 32, 8),
        (667, 48, 12),
        (700, 48, 12),
        (999, 48, 12),
        (1001, 64, 16),
        (50_000, 64, 16),
    ],
)
def test_ramp_trajectory(consumed: int, global_batch: int, microbatches: int) -> None:
    calculator = _example_ramp()
    calculator.update(consumed, consistency_check=True)
    assert calculator.get_current_global_batch_size() == global_batch
    assert calculator.get() == microbatches


def test_ramp_can_go_back_when_updated_with_fewer_samples() -> None:
    # The calculator is a pure function of consumed samples (a checkpoint reload may rewind).
    calculator = _example_ramp()
    calculator.update(700)
    calculator.update(10)
    assert calculator.get_current_global_batch_size() == 16


def test_start_equal_to_global_is_constant() -> None:
    calculator = RampupBatchsizeNumMicroBatchesCalculator(32, 2, 2, 32, 8, 500)
    for consumed in (0, 1, 250, 500, 501, 10_000):
        calculator.update(consumed)
        assert calculator.get_current_global_batch_size() == 32
        assert calculator.get() == 8


def test_zero_ramp_samples_starts_at_start_then_jumps_to_global() -> None:
    calculator = RampupBatchsizeNumMicroBatchesCalculator(64, 2, 2, 16, 16, 0)
    assert calculator.get_current_global_batch_size() == 16
    calculator.update(1)
    assert calculator.get_current_global_batch_size() == 64
    assert calculator.get() == 16
    calculator.update(0)
    assert calculator.get_current_global_batch_size() == 16


def _unaligned_ramp() -> RampupBatchsizeNumMicroBatchesCalculator:
    # start 16, increment 6 up to 34 over 300 samples (100 per increment), 4 per round:
    # 22, 28 and 34 are not multiples of 4.
    return RampupBatchsizeNumMicroBatchesCalculator(34, 2, 2, 16, 6, 300)


def test_ramp_constructor_skips_the_consistency_check_like_megatron() -> None:
    calculator = _unaligned_ramp()
    assert calculator.get_current_global_batch_size() == 16
    assert calculator.get() == 4


def test_ramp_consistency_error_names_numbers_and_what_to_change() -> None:
    calculator = _unaligned_ramp()
    with pytest.raises(ValueError, match="at 150 consumed samples") as info:
        calculator.update(150)
    assert str(info.value) == (
        "at 150 consumed samples the ramp-up global batch size 22 is not divisible by micro "
        "batch size 2 x data-parallel size 2 = 4; make the start global batch size (16), the "
        "batch size increment (6) and the global batch size (34) multiples of 4"
    )
    # The failed update leaves the previous state in place.
    assert calculator.get_current_global_batch_size() == 16
    with pytest.raises(ValueError, match="global batch size 34 is not divisible"):
        calculator.update(301)


def test_ramp_without_consistency_check_rounds_microbatches_down() -> None:
    calculator = _unaligned_ramp()
    calculator.update(150, consistency_check=False)
    assert calculator.get_current_global_batch_size() == 22
    assert calculator.get() == 5
    calculator.update(250, consistency_check=False)
    assert calculator.get_current_global_batch_size() == 28
    assert calculator.get() == 7


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (
            (64, 2, 2, 80, 16, 100),
            ValueError,
            "start global batch size 80 exceeds global batch size 64; use a start of at most 64",
        ),
        (
            (64, 2, 2, 16, 20, 100),
            ValueError,
            "global batch size 64 minus start global batch size 16 = 48 is not divisible by "
            "batch size increment 20; use an increment that divides 48 such as 16 or 24",
        ),
        (
            (64, 2, 2, 2, 2, 100),
            ValueError,
            "start global batch size 2 is smaller than micro batch size 2 x data-parallel size "
            "2 = 4 and would give zero microbatches; use a start of at least 4",
        ),
        ((64, 2, 2, 0, 16, 100), ValueError, "start global batch size must be >= 1, got 0"),
        ((64, 2, 2, 16, 0, 100), ValueError, "batch size increment must be >= 1, got 0"),
        ((64, 2, 2, 16, 16, -1), ValueError, "ramp-up samples must be >= 0, got -1"),
        ((64, 2, 2, 16, 16, 1.5), TypeError, "ramp-up samples must be an int, got 1.5"),
    ],
)
def test_ramp_bad_arguments(args: tuple[object, ...], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        RampupBatchsizeNumMicroBatchesCalculator(*args)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_update_rejects_negative_or_non_int_samples() -> None:
    calculator = _example_ramp()
    with pytest.raises(ValueError, match="consumed samples must be >= 0, got -1"):
        calculator.update(-1)
    with pytest.raises(TypeError, match="consumed samples must be an int"):
        calculator.update(3.0)  # type: ignore[arg-type]


def test_build_without_rampup_is_constant() -> None:
    calculator = build_num_microbatches_calculator(
        global_batch_size=64, micro_batch_size=2, data_parallel_size=4
    )
    assert isinstance(calculator, ConstantNumMicroBatchesCalculator)
    assert calculator.get() == 8


def test_build_with_rampup() -> None:
    calculator = build_num_microbatches_calculator(
        global_batch_size=64,
        micro_batch_size=2,
        data_parallel_size=2,
        rampup_batch_size=(16, 16, 1000),
    )
    assert isinstance(calculator, RampupBatchsizeNumMicroBatchesCalculator)
    assert isinstance(calculator, NumMicroBatchesCalculator)
    calculator.update(700)
    assert (calculator.get_current_global_batch_size(), calculator.get()) == (48, 12)


def test_build_rejects_malformed_rampup() -> None:
    with pytest.raises(ValueError, match=r"3 entries .* got 2: \(16, 16\)"):
        build_num_microbatches_calculator(
            global_batch_size=64,
            micro_batch_size=2,
            data_parallel_size=2,
            rampup_batch_size=(16, 16),  # type: ignore[arg-type]
        )
    with pytest.raises(TypeError, match="rampup_batch_size must be a"):
        build_num_microbatches_calculator(
            global_batch_size=64,
            micro_batch_size=2,
            data_parallel_size=2,
            rampup_batch_size=16,  # type: ignore[arg-type]
        )


def test_base_class_is_abstract() -> None:
    with pytest.raises(TypeError):
        NumMicroBatchesCalculator(1, 1)  # type: ignore[abstract]
