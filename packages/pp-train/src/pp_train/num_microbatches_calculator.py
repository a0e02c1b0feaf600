"""How many microbatches make one global batch, with Megatron's optional batch-size ramp-up.

Every iteration of the training loop runs ``get()`` microbatches of ``micro_batch_size``
samples on each of ``data_parallel_size`` replicas, so one iteration consumes
``get_current_global_batch_size()`` samples. With a ramp-up (Megatron's
``--rampup-batch-size <start> <increment> <ramp samples>``) the global batch grows in equal
steps from ``start`` to the full global batch while the first ``ramp samples`` samples are
consumed; the loop reports its progress through ``update(consumed_samples)``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from pp_state.numbers import check_at_least, divisors

__all__ = [
    "ConstantNumMicroBatchesCalculator",
    "NumMicroBatchesCalculator",
    "RampupBatchsizeNumMicroBatchesCalculator",
    "build_num_microbatches_calculator",
]


def _nearby_multiples(value: int, step: int) -> str:
    """The multiples of `step` on either side of `value` (only the upper one below `step`)."""
    below = value // step * step
    above = below + step
    return f"{below} or {above}" if below > 0 else f"{above}"


def _multiple_hint(value: int, unit: int) -> str:
    return f"a multiple of {unit} such as {_nearby_multiples(value, unit)}"


def _nearby_divisors(value: int, near: int) -> str:
    """The divisors of `value` closest to `near` from below and from above."""
    below = [d for d in divisors(value) if d < near]
    above = [d for d in divisors(value) if d > near]
    picks = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return " or ".join(str(d) for d in picks)


class NumMicroBatchesCalculator(abc.ABC):
    """The number of microbatches per iteration and the global batch size it adds up to."""

    def __init__(self, micro_batch_size: int, data_parallel_size: int) -> None:
        """Checks and keeps the per-microbatch sizes shared by every calculator.

        Args:
            micro_batch_size: Samples in one microbatch on one data-parallel replica.
            data_parallel_size: Number of data-parallel replicas.

        Raises:
            TypeError: A size is not an int.
            ValueError: A size is below 1.
        """
        self._micro_batch_size = check_at_least("micro batch size", micro_batch_size, 1)
        self._data_parallel_size = check_at_least(
            "data-parallel size", data_parallel_size, minimum=1
        )
        self._num_micro_batches = 0
        self._current_global_batch_size = 0

    @property
    def micro_batch_size(self) -> int:
        """Samples in one microbatch on one data-parallel replica."""
        return self._micro_batch_size

    @property
    def _samples_per_microbatch_round(self) -> int:
        # One microbatch on every data-parallel replica.
        return self._micro_batch_size * self._data_parallel_size

    def _divisibility_message(self, global_batch_size: int) -> str:
        unit = self._samples_per_microbatch_round
        return (
            f"global batch size {global_batch_size} is not divisible by micro batch size "
            f"{self._micro_batch_size} x data-parallel size {self._data_parallel_size} = {unit}"
        )

    def get(self) -> int:
        """The number of microbatches each data-parallel replica runs this iteration.

        Returns:
            The current number of microbatches (at least 1).
        """
        return self._num_micro_batches

    def get_current_global_batch_size(self) -> int:
        """The number of samples one iteration consumes across all replicas.

        Returns:
            The current global batch size.
        """
        return self._current_global_batch_size

    @abc.abstractmethod
    def update(self, consumed_samples: int, consistency_check: bool = True) -> None:
        """Moves the calculator to the point where `consumed_samples` have been trained on.

        Args:
            consumed_samples: Samples consumed by training so far.
            consistency_check: Whether to require the current global batch size to be a
                multiple of micro batch size x data-parallel size.
        """


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A fixed global batch size: ``global // (micro x data-parallel)`` microbatches always."""

    def __init__(
        self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int
    ) -> None:
        """Checks that the global batch splits into whole microbatch rounds.

        Args:
            global_batch_size: Samples per iteration across all data-parallel replicas.
            micro_batch_size: Samples in one microbatch on one data-parallel replica.
            data_parallel_size: Number of data-parallel replicas.

        Raises:
            TypeError: A size is not an int.
            ValueError: A size is below 1, or `global_batch_size` is not a multiple of
                ``micro_batch_size * data_parallel_size``.
        """
        super().__init__(micro_batch_size, data_parallel_size)
        check_at_least("global batch size", global_batch_size, 1)
        unit = self._samples_per_microbatch_round
        if global_batch_size % unit:
            raise ValueError(
                f"{self._divisibility_message(global_batch_size)}; use "
                f"{_multiple_hint(global_batch_size, unit)}"
            )
        self._num_micro_batches = global_batch_size // unit
        self._current_global_batch_size = global_batch_size
        assert self._num_micro_batches >= 1

    def update(self, consumed_samples: int, consistency_check: bool = True) -> None:
        """Does nothing: the batch size never changes.

        Args:
            consumed_samples: Samples consumed by training so far (ignored).
            consistency_check: Ignored; the constructor has checked the only batch size.
        """


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A global batch that grows linearly, in equal increments, over the first samples.

    The ramp from `start_global_batch_size` to `global_batch_size` has
    ``(global - start) // increment`` increments, each lasting
    ``ramup_samples / num_increments`` samples; once more than `ramup_samples` samples have
    been consumed the full global batch is used.

    Two edge cases Megatron leaves to a division by zero are defined here: when
    `start_global_batch_size` equals `global_batch_size` there is nothing to ramp and the
    calculator behaves as a constant one; when `ramup_samples` is 0 the start batch is used
    at 0 consumed samples only, and the full batch from the first sample on.
    """

    def __init__(  # noqa: PLR0917 - Megatron passes these positionally
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        start_global_batch_size: int,
        batch_size_increment: int,
        ramup_samples: int,
    ) -> None:
        """Checks the ramp and moves to its start (0 consumed samples).

        Args:
            global_batch_size: The batch size at the end of the ramp and after it.
            micro_batch_size: Samples in one microbatch on one data-parallel replica.
            data_parallel_size: Number of data-parallel replicas.
            start_global_batch_size: The batch size at 0 consumed samples.
            batch_size_increment: How much the batch size grows at each step of the ramp.
            ramup_samples: Samples over which the batch size ramps up (Megatron's spelling).

        Raises:
            TypeError: An argument is not an int.
            ValueError: A size is below 1, `ramup_samples` is negative,
                `start_global_batch_size` exceeds `global_batch_size` or is smaller than one
                microbatch per replica, or the difference between the two is not a multiple
                of `batch_size_increment`.
        """
        super().__init__(micro_batch_size, data_parallel_size)
        self._global_batch_size = check_at_least("global batch size", global_batch_size, 1)
        self._start = check_at_least("start global batch size", start_global_batch_size, 1)
        self._increment = check_at_least("batch size increment", batch_size_increment, 1)
        self._ramp_samples = check_at_least("ramp-up samples", ramup_samples, 0)
        self._check_ramp()
        num_increments = (self._global_batch_size - self._start) // self._increment
        # Zero increments means no ramp at all: `update` then never divides by this.
        self._samples_per_increment = self._ramp_samples / num_increments if num_increments else 0.0
        self.update(0, consistency_check=False)

    def _check_ramp(self) -> None:
        difference = self._global_batch_size - self._start
        if difference < 0:
            raise ValueError(
                f"start global batch size {self._start} exceeds global batch size "
                f"{self._global_batch_size}; use a start of at most {self._global_batch_size}"
            )
        if difference % self._increment:
            raise ValueError(
                f"global batch size {self._global_batch_size} minus start global batch size "
                f"{self._start} = {difference} is not divisible by batch size increment "
                f"{self._increment}; use an increment that divides {difference} such as "
                f"{_nearby_divisors(difference, self._increment)}"
            )
        unit = self._samples_per_microbatch_round
        if self._start < unit:
            raise ValueError(
                f"start global batch size {self._start} is smaller than micro batch size "
                f"{self._micro_batch_size} x data-parallel size {self._data_parallel_size} = "
                f"{unit} and would give zero microbatches; use a start of at least {unit}"
            )

    def _global_batch_size_at(self, consumed_samples: int) -> int:
        if consumed_samples > self._ramp_samples or self._start == self._global_batch_size:
            return self._global_batch_size
        if self._samples_per_increment == 0.0:
            # Only reachable with ramup_samples == 0 and consumed_samples == 0.
            return self._start
        steps = int(consumed_samples / self._samples_per_increment)
        current = self._start + steps * self._increment
        assert current <= self._global_batch_size, (current, self._global_batch_size)
        return current

    def update(self, consumed_samples: int, consistency_check: bool = True) -> None:
        """Sets the global batch size and microbatch count for `consumed_samples`.

        Args:
            consumed_samples: Samples consumed by training so far.
            consistency_check: Whether to require the new global batch size to be a multiple
                of micro batch size x data-parallel size (otherwise it is rounded down to
                whole microbatch rounds when counting microbatches, as Megatron does).

        Raises:
            TypeError: `consumed_samples` is not an int.
            ValueError: `consumed_samples` is negative, or the consistency check fails.
        """
        check_at_least("consumed samples", consumed_samples, 0)
        current = self._global_batch_size_at(consumed_samples)
        unit = self._samples_per_microbatch_round
        if consistency_check and current % unit:
            raise ValueError(
                f"at {consumed_samples} consumed samples the ramp-up "
                f"{self._divisibility_message(current)}; make the start global batch size "
                f"({self._start}), the batch size increment ({self._increment}) and the global "
                f"batch size ({self._global_batch_size}) multiples of {unit}"
            )
        self._current_global_batch_size = current
        self._num_micro_batches = current // unit


def build_num_microbatches_calculator(
    *,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    rampup_batch_size: tuple[int, int, int] | None = None,
) -> NumMicroBatchesCalculator:
    """The calculator for Megatron's batch-size arguments.

    Args:
        global_batch_size: Samples per iteration across all replicas (after any ramp-up).
        micro_batch_size: Samples in one microbatch on one data-parallel replica.
        data_parallel_size: Number of data-parallel replicas.
        rampup_batch_size: ``(start, increment, ramp samples)`` as in Megatron's
            ``--rampup-batch-size``, or None for a constant batch size.

    Returns:
        A `ConstantNumMicroBatchesCalculator` without ramp-up, else a
        `RampupBatchsizeNumMicroBatchesCalculator`.

    Raises:
        TypeError: `rampup_batch_size` is not a sequence, or a size is not an int.
        ValueError: `rampup_batch_size` does not have three entries, or a calculator rejects
            the sizes.
    """
    if rampup_batch_size is None:
        return ConstantNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size
        )
    if not isinstance(rampup_batch_size, Sequence) or isinstance(rampup_batch_size, str):
        raise TypeError(
            "rampup_batch_size must be a (start, increment, ramp samples) tuple or None, got "
            f"{rampup_batch_size!r}"
        )
    if len(rampup_batch_size) != 3:
        raise ValueError(
            "rampup_batch_size must have 3 entries (start, increment, ramp samples), got "
            f"{len(rampup_batch_size)}: {tuple(rampup_batch_size)!r}"
        )
    start, increment, ramp_samples = rampup_batch_size
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        start,
        increment,
        ramp_samples,
    )
