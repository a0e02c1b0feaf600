"""Learning-rate and weight-decay schedule with the behaviour of Megatron-LM's scheduler.

`OptimizerParamScheduler` counts progress in whatever unit its caller passes to
`OptimizerParamScheduler.step` (Megatron's trainer passes the global batch size, so every
step count in `LRScheduleConfig` is then a number of samples). After every step it writes the
learning rate and weight decay into each param group of a ``torch.optim.Optimizer``. It is
built from an `LRScheduleConfig` or from Megatron's constructor arguments, and exposes the
settings under Megatron's attribute names.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Literal, Protocol, TypeAlias, TypeVar, get_args, overload

from pp_state.numbers import is_int, is_real

__all__ = [
    "HasParamGroups",
    "LRDecayStyle",
    "LRScheduleConfig",
    "OptimizerParamScheduler",
    "OptimizerParamSchedulerError",
    "WDIncrStyle",
    "WSDDecayStyle",
    "get_canonical_lr_for_logging",
]


class OptimizerParamSchedulerError(ValueError, AssertionError):
    """A schedule Megatron's scheduler refuses (it asserts; pp raises a ValueError).

    Raised for the values `LRScheduleConfig` refuses and for a checkpoint whose schedule
    differs from the scheduler's while neither checkpoint flag is set, so both
    ``except ValueError`` and Megatron-style ``except AssertionError`` catch it.
    """


LRDecayStyle: TypeAlias = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
"""How the learning rate falls from ``max_lr`` to ``min_lr`` after warmup (Megatron's
``--lr-decay-style``)."""

WSDDecayStyle: TypeAlias = Literal["linear", "cosine", "exponential", "minus_sqrt"]
"""Shape of the final anneal of a warmup-stable-decay ("WSD") schedule (Megatron's
``--lr-wsd-decay-style``)."""

WDIncrStyle: TypeAlias = Literal["constant", "linear", "cosine"]
"""How weight decay moves from ``start_wd`` to ``end_wd`` (Megatron's
``--weight-decay-incr-style``)."""

_LR_DECAY_STYLES: tuple[str, ...] = get_args(LRDecayStyle)
_WSD_DECAY_STYLES: tuple[str, ...] = get_args(WSDDecayStyle)
_WD_INCR_STYLES: tuple[str, ...] = get_args(WDIncrStyle)

_FLOAT_FIELDS = ("max_lr", "min_lr", "init_lr", "start_wd", "end_wd")
_INT_FIELDS = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def _choices(styles: tuple[str, ...]) -> str:
    return ", ".join(repr(style) for style in styles)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LRScheduleConfig:
    """What the scheduler anneals and how; step counts are in the unit `step` counts."""

    max_lr: float
    """Peak learning rate: reached at the end of warmup, the start of the decay."""

    min_lr: float = 0.0
    """Floor of the learning rate, held once ``lr_decay_steps`` have passed."""

    init_lr: float = 0.0
    """Learning rate at step 0; warmup rises linearly from it to ``max_lr``."""

    lr_warmup_steps: int = 0
    """Length of the linear warmup (0: none). Must be below ``lr_decay_steps``."""

    lr_decay_steps: int
    """Step at which the decay ends and ``min_lr`` is reached (warmup included)."""

    lr_decay_style: LRDecayStyle = "linear"
    """Shape of the decay after warmup."""

    wsd_decay_steps: int | None = None
    """For "WSD": length of the final anneal, which ends at ``lr_decay_steps``; the learning
    rate stays at ``max_lr`` before it. Required for "WSD", ignored otherwise."""

    lr_wsd_decay_style: WSDDecayStyle = "exponential"
    """For "WSD": shape of the final anneal."""

    start_wd: float = 0.01
    """Weight decay at step 0."""

    end_wd: float = 0.01
    """Weight decay from ``wd_incr_steps`` on."""

    wd_incr_steps: int = 0
    """Length of the weight-decay ramp; must be positive unless ``wd_incr_style`` is
    "constant"."""

    wd_incr_style: WDIncrStyle = "constant"
    """Shape of the weight-decay ramp; "constant" needs ``start_wd == end_wd``."""

    use_checkpoint_opt_param_scheduler: bool = False
    """On `OptimizerParamScheduler.load_state_dict`, take the schedule stored in the
    checkpoint in place of this config's."""

    override_opt_param_scheduler: bool = False
    """On `OptimizerParamScheduler.load_state_dict`, keep this config's schedule and ignore
    the checkpoint's (only its step count is restored)."""

    def __post_init__(self) -> None:
        """Checks types, ranges and the combinations Megatron accepts.

        Raises:
            TypeError: A step count is not an int (bools are refused), a rate is not a real
                number, or a flag is not a bool.
            OptimizerParamSchedulerError: (a ValueError and an AssertionError) A value is out
                of range, a style is unknown, "WSD" lacks a valid ``wsd_decay_steps``, a
                "constant" weight decay has ``start_wd != end_wd``, a ramped weight decay has
                no ``wd_incr_steps``, or both checkpoint flags are set.
        """
        self._check_types()
        self._check_lr()
        self._check_wd()
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise OptimizerParamSchedulerError(
                "set at most one of override_opt_param_scheduler and "
                "use_checkpoint_opt_param_scheduler (both are True)"
            )

    def _check_types(self) -> None:
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not is_real(value):
                raise TypeError(f"{name} must be a real number, got {value!r}")
            if not math.isfinite(value):
                raise OptimizerParamSchedulerError(f"{name} must be finite, got {value!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.wsd_decay_steps is not None and not is_int(self.wsd_decay_steps):
            raise TypeError(f"wsd_decay_steps must be an int or None, got {self.wsd_decay_steps!r}")
        for name in ("use_checkpoint_opt_param_scheduler", "override_opt_param_scheduler"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")

    def _check_lr(self) -> None:
        if self.min_lr < 0:
            raise OptimizerParamSchedulerError(f"min_lr must be >= 0, got {self.min_lr}")
        if self.max_lr < self.min_lr:
            raise OptimizerParamSchedulerError(
                f"max_lr ({self.max_lr}) must be >= min_lr ({self.min_lr})"
            )
        if self.init_lr < 0:
            raise OptimizerParamSchedulerError(f"init_lr must be >= 0, got {self.init_lr}")
        if self.init_lr > self.max_lr:
            raise OptimizerParamSchedulerError(
                f"init_lr ({self.init_lr}) must be <= max_lr ({self.max_lr})"
            )
        if self.lr_decay_steps <= 0:
            raise OptimizerParamSchedulerError(
                f"lr_decay_steps must be > 0, got {self.lr_decay_steps}"
            )
        if not 0 <= self.lr_warmup_steps < self.lr_decay_steps:
            raise OptimizerParamSchedulerError(
                f"lr_warmup_steps must satisfy 0 <= lr_warmup_steps < lr_decay_steps, got "
                f"lr_warmup_steps={self.lr_warmup_steps}, lr_decay_steps={self.lr_decay_steps}"
            )
        if self.lr_decay_style not in _LR_DECAY_STYLES:
            raise OptimizerParamSchedulerError(
                f"unknown lr_decay_style {self.lr_decay_style!r}; "
                f"choose one of {_choices(_LR_DECAY_STYLES)}"
            )
        if self.lr_wsd_decay_style not in _WSD_DECAY_STYLES:
            raise OptimizerParamSchedulerError(
                f"unknown lr_wsd_decay_style {self.lr_wsd_decay_style!r}; "
                f"choose one of {_choices(_WSD_DECAY_STYLES)}"
            )
        if self.lr_decay_style != "WSD":
            return
        if self.wsd_decay_steps is None:
            raise OptimizerParamSchedulerError('lr_decay_style "WSD" requires wsd_decay_steps')
        if not 0 < self.wsd_decay_steps <= self.lr_decay_steps:
            raise OptimizerParamSchedulerError(
                f"wsd_decay_steps must satisfy 0 < wsd_decay_steps <= lr_decay_steps, got "
                f"wsd_decay_steps={self.wsd_decay_steps}, lr_decay_steps={self.lr_decay_steps}"
            )

    def _check_wd(self) -> None:
        if self.start_wd < 0:
            raise OptimizerParamSchedulerError(f"start_wd must be >= 0, got {self.start_wd}")
        if self.end_wd < 0:
            raise OptimizerParamSchedulerError(f"end_wd must be >= 0, got {self.end_wd}")
        if self.wd_incr_style not in _WD_INCR_STYLES:
            raise OptimizerParamSchedulerError(
                f"unknown wd_incr_style {self.wd_incr_style!r}; "
                f"choose one of {_choices(_WD_INCR_STYLES)}"
            )
        if self.wd_incr_steps < 0:
            raise OptimizerParamSchedulerError(
                f"wd_incr_steps must be >= 0, got {self.wd_incr_steps}"
            )
        if self.wd_incr_style == "constant":
            if self.start_wd != self.end_wd:
                raise OptimizerParamSchedulerError(
                    f'wd_incr_style "constant" requires start_wd == end_wd, got '
                    f"start_wd={self.start_wd}, end_wd={self.end_wd}"
                )
        elif self.wd_incr_steps <= 0:
            raise OptimizerParamSchedulerError(
                f"wd_incr_style {self.wd_incr_style!r} requires wd_incr_steps > 0, "
                f"got {self.wd_incr_steps}"
            )


# Config field -> (accepted checkpoint keys, current name first; required in a checkpoint).
# Older Megatron checkpoints predate the weight-decay schedule, init_lr and WSD, so those
# keys may be absent; the config's value then stands.
_CHECKPOINT_FIELDS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("max_lr", ("max_lr", "start_lr"), True),
    ("min_lr", ("min_lr",), True),
    ("init_lr", ("init_lr",), False),
    ("lr_warmup_steps", ("lr_warmup_steps", "warmup_steps", "warmup_iter"), True),
    ("lr_decay_steps", ("lr_decay_steps", "decay_steps", "end_iter"), True),
    ("lr_decay_style", ("lr_decay_style", "decay_style"), True),
    ("wsd_decay_steps", ("wsd_decay_steps",), False),
    ("lr_wsd_decay_style", ("lr_wsd_decay_style",), False),
    ("start_wd", ("start_wd",), False),
    ("end_wd", ("end_wd",), False),
    ("wd_incr_steps", ("wd_incr_steps",), False),
    ("wd_incr_style", ("wd_incr_style",), False),
)
_NUM_STEPS_KEYS = ("num_steps", "num_iters")

_MISSING = object()


def _lookup(state_dict: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    """The value stored under any of ``keys``, or `_MISSING`.

    Raises:
        ValueError: Two of the keys are present with different values.
    """
    found = [(key, state_dict[key]) for key in keys if key in state_dict]
    if not found:
        return _MISSING
    first_key, first = found[0]
    for key, value in found[1:]:
        if value != first:
            raise ValueError(
                f"checkpoint scheduler state has both {first_key!r}={first!r} and "
                f"{key!r}={value!r}, which name the same setting"
            )
    return first


class HasParamGroups(Protocol):
    """What the scheduler drives: a torch optimizer, or a wrapper such as `MegatronOptimizer`."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups whose ``lr`` and ``weight_decay`` the scheduler sets."""
        ...


def get_canonical_lr_for_logging(param_groups: Sequence[Mapping[str, Any]]) -> float | None:
    """The learning rate to log: that of the first group marked ``default_config``.

    As in Megatron, groups on the default schedule carry ``default_config=True``
    (`get_param_groups` marks its groups so); a group with its own ``max_lr`` / ``min_lr``
    does not, and its rate is not the one to log.

    Args:
        param_groups: An optimizer's param groups.

    Returns:
        That group's ``lr``; None when no group is marked or the marked one has no ``lr``.
    """
    for group in param_groups:
        if group.get("default_config", False):
            lr = group.get("lr")
            return None if lr is None else float(lr)
    return None


# Megatron's constructor arguments after the optimizer, in order, with its defaults; the
# typed spelling is the second overload of `OptimizerParamScheduler.__init__`.
_REQUIRED = inspect.Parameter.empty
_MEGATRON_ARGUMENTS: tuple[tuple[str, Any], ...] = (
    ("init_lr", _REQUIRED),
    ("max_lr", _REQUIRED),
    ("min_lr", _REQUIRED),
    ("lr_warmup_steps", _REQUIRED),
    ("lr_decay_steps", _REQUIRED),
    ("lr_decay_style", _REQUIRED),
    ("start_wd", _REQUIRED),
    ("end_wd", _REQUIRED),
    ("wd_incr_steps", _REQUIRED),
    ("wd_incr_style", _REQUIRED),
    ("use_checkpoint_opt_param_scheduler", True),
    ("override_opt_param_scheduler", False),
    ("wsd_decay_steps", None),
    ("lr_wsd_decay_style", None),
)
_MEGATRON_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in _MEGATRON_ARGUMENTS
    ]
)


def _megatron_config(arguments: dict[str, Any]) -> LRScheduleConfig:
    """The config of Megatron's constructor arguments (bound, defaults applied).

    Megatron's flags are ``Optional[bool]`` read as truth values: None is False. Its
    ``lr_wsd_decay_style`` defaults to None; outside "WSD" the config's default stands.

    Raises:
        OptimizerParamSchedulerError: "WSD" without ``lr_wsd_decay_style`` (Megatron fails
            only once the anneal starts), or what `LRScheduleConfig` refuses.
    """
    fields = dict(arguments)
    for flag in ("use_checkpoint_opt_param_scheduler", "override_opt_param_scheduler"):
        if fields[flag] is None:
            fields[flag] = False
    if fields["lr_wsd_decay_style"] is None:
        del fields["lr_wsd_decay_style"]
        if fields["lr_decay_style"] == "WSD" and fields["wsd_decay_steps"] is not None:
            raise OptimizerParamSchedulerError(
                'lr_decay_style "WSD" needs lr_wsd_decay_style, one of '
                f"{_choices(_WSD_DECAY_STYLES)}; got None"
            )
    return LRScheduleConfig(**fields)


def _config_from(args: tuple[Any, ...], kwargs: dict[str, Any]) -> LRScheduleConfig:
    """The schedule given to the constructor: an `LRScheduleConfig` or Megatron's arguments.

    Raises:
        TypeError: Both forms, neither, or Megatron's arguments that do not bind.
    """
    config = kwargs.pop("config", None)
    if config is None and args and isinstance(args[0], LRScheduleConfig):
        config, args = args[0], args[1:]
    if config is not None:
        if args or kwargs:
            names = [*list(_MEGATRON_SIGNATURE.parameters)[: len(args)], *kwargs]
            raise TypeError(
                "OptimizerParamScheduler() takes an LRScheduleConfig or Megatron's arguments, "
                f"not both: got config and {', '.join(names)}"
            )
        if not isinstance(config, LRScheduleConfig):
            raise TypeError(f"config must be an LRScheduleConfig, got {type(config).__name__}")
        return config
    try:
        bound = _MEGATRON_SIGNATURE.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(
            "OptimizerParamScheduler() takes an LRScheduleConfig or Megatron's arguments ("
            f"{', '.join(_MEGATRON_SIGNATURE.parameters)}): {err}"
        ) from None
    bound.apply_defaults()
    return _megatron_config(bound.arguments)


_T = TypeVar("_T")


class _Setting(Generic[_T]):
    """A read-only attribute of the scheduler with Megatron's name: its config's field."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, scheduler: None, owner: type) -> _Setting[_T]: ...
    @overload
    def __get__(self, scheduler: OptimizerParamScheduler, owner: type) -> _T: ...
    def __get__(self, scheduler: OptimizerParamScheduler | None, owner: type) -> _T | _Setting[_T]:
        if scheduler is None:
            return self
        value: _T = getattr(scheduler.config, self._name)
        return value

    def __set__(self, scheduler: OptimizerParamScheduler, value: object) -> None:
        raise AttributeError(
            f"{self._name} is read-only: it is config.{self._name}; build a new "
            "OptimizerParamScheduler, or load a state with use_checkpoint_opt_param_scheduler"
        )


class OptimizerParamScheduler:
    """Sets the learning rate and weight decay of an optimizer's param groups as steps pass.

    The schedule is a linear warmup from ``init_lr`` to ``max_lr`` over ``lr_warmup_steps``,
    then a decay to ``min_lr`` at ``lr_decay_steps`` in ``lr_decay_style``, then ``min_lr``.
    Weight decay moves from ``start_wd`` to ``end_wd`` over ``wd_incr_steps``.

    A param group may carry its own ``max_lr`` and ``min_lr`` (they replace the config's for
    that group) and ``lr_mult`` / ``wd_mult`` factors applied to the scheduled values.

    The constructor applies step 0, so the optimizer starts at the warmup-start learning rate.

    Two ways to build it: ``OptimizerParamScheduler(optimizer, config)`` with an
    `LRScheduleConfig`, or Megatron's ``OptimizerParamScheduler(optimizer, init_lr, max_lr,
    min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, start_wd, end_wd, wd_incr_steps,
    wd_incr_style, use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=False,
    wsd_decay_steps=None, lr_wsd_decay_style=None)``, positional or keyword, with Megatron's
    defaults (note ``use_checkpoint_opt_param_scheduler=True`` there, False in the config).
    Either way the settings read as attributes with Megatron's names (``max_lr``,
    ``lr_decay_style``, ...): read-only views of `config`.
    """

    init_lr = _Setting[float]()
    max_lr = _Setting[float]()
    min_lr = _Setting[float]()
    lr_warmup_steps = _Setting[int]()
    lr_decay_steps = _Setting[int]()
    lr_decay_style = _Setting[LRDecayStyle]()
    start_wd = _Setting[float]()
    end_wd = _Setting[float]()
    wd_incr_steps = _Setting[int]()
    wd_incr_style = _Setting[WDIncrStyle]()
    use_checkpoint_opt_param_scheduler = _Setting[bool]()
    override_opt_param_scheduler = _Setting[bool]()
    wsd_decay_steps = _Setting["int | None"]()
    lr_wsd_decay_style = _Setting[WSDDecayStyle]()

    @overload
    def __init__(self, optimizer: HasParamGroups, config: LRScheduleConfig) -> None: ...
    @overload
    def __init__(
        self,
        optimizer: HasParamGroups,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: LRDecayStyle,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: WDIncrStyle,
        use_checkpoint_opt_param_scheduler: bool | None = True,
        override_opt_param_scheduler: bool | None = False,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: WSDDecayStyle | None = None,
    ) -> None: ...
    def __init__(self, optimizer: HasParamGroups, *args: Any, **kwargs: Any) -> None:
        """Binds the schedule to ``optimizer`` and applies step 0.

        Args:
            optimizer: What receives ``lr`` and ``weight_decay``: a torch optimizer or
                anything with its ``param_groups`` (a `MegatronOptimizer`).
            *args: The `LRScheduleConfig`, or Megatron's arguments (see the class).
            **kwargs: ``config=``, or Megatron's arguments by name.

        Raises:
            TypeError: Not exactly one of a config and Megatron's arguments; a config that is
                not an `LRScheduleConfig`; Megatron's arguments missing, unknown or of the
                wrong type.
            OptimizerParamSchedulerError: (a ValueError and an AssertionError) A schedule
                Megatron refuses: ``min_lr > max_lr``, ``lr_warmup_steps >= lr_decay_steps``,
                both checkpoint flags, ... (see `LRScheduleConfig`).
        """
        self.optimizer = optimizer
        self._config = _config_from(args, dict(kwargs))
        self.num_steps: int = 0
        """Steps counted so far: the sum of every `step` increment."""
        self.step(0)

    @property
    def config(self) -> LRScheduleConfig:
        """The schedule in force (after a load that took the checkpoint's, the checkpoint's)."""
        return self._config

    @property
    def current_lr(self) -> float:
        """The learning rate last set on param group 0 (``lr_mult`` included)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def get_lr(self, param_group: Mapping[str, Any]) -> float:
        """The scheduled learning rate of ``param_group`` at `num_steps`, before ``lr_mult``.

        Args:
            param_group: A param group; its ``max_lr`` and ``min_lr`` keys, when present,
                replace the config's.

        Returns:
            The learning rate.
        """
        cfg = self._config
        max_lr = float(param_group.get("max_lr", cfg.max_lr))
        min_lr = float(param_group.get("min_lr", cfg.min_lr))
        steps = self.num_steps
        warmup = cfg.lr_warmup_steps

        if warmup > 0 and steps <= warmup:
            return cfg.init_lr + (max_lr - cfg.init_lr) * steps / warmup
        if cfg.lr_decay_style == "constant":
            return max_lr
        if steps > cfg.lr_decay_steps:
            return min_lr
        if cfg.lr_decay_style == "inverse-square-root":
            # Matches max_lr at the end of warmup; the floor of 1 keeps step 0 finite.
            scale = math.sqrt(max(warmup, 1) / max(steps, 1))
            return max(min_lr, max_lr * scale)

        ratio = (steps - warmup) / (cfg.lr_decay_steps - warmup)
        if cfg.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif cfg.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff(steps)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, steps: int) -> float:
        cfg = self._config
        assert cfg.wsd_decay_steps is not None  # the config refuses "WSD" without it
        anneal_start = cfg.lr_decay_steps - cfg.wsd_decay_steps
        if steps <= anneal_start:
            return 1.0
        r = (steps - anneal_start) / cfg.wsd_decay_steps
        style = cfg.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - r
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * r) + 1.0)
        if style == "exponential":
            return 2.0 * math.pow(0.5, r) - 1.0
        return 1.0 - math.sqrt(r)

    def get_wd(self, param_group: Mapping[str, Any] | None = None) -> float:
        """The scheduled weight decay at `num_steps`, before any group's ``wd_mult``.

        Args:
            param_group: A param group; its ``start_wd`` and ``end_wd`` keys, when present,
                replace the config's (as in Megatron). None: the config's.

        Returns:
            The weight decay.
        """
        cfg = self._config
        group = param_group if param_group is not None else {}
        start_wd = float(group.get("start_wd", cfg.start_wd))
        end_wd = float(group.get("end_wd", cfg.end_wd))
        if self.num_steps > cfg.wd_incr_steps or cfg.wd_incr_style == "constant":
            return end_wd
        ratio = self.num_steps / cfg.wd_incr_steps
        if cfg.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return start_wd + coeff * (end_wd - start_wd)

    def step(self, increment: int = 1) -> None:
        """Advances by ``increment`` and sets every param group's ``lr`` and ``weight_decay``.

        Args:
            increment: How far to advance, in the unit of the config's step counts (Megatron's
                trainer passes the global batch size, counting samples). 0 only reapplies the
                current values.

        Raises:
            TypeError: ``increment`` is not an int (bools are refused).
            ValueError: ``increment`` is negative.
        """
        if not is_int(increment):
            raise TypeError(f"increment must be an int, got {increment!r}")
        if increment < 0:
            raise ValueError(f"increment must be >= 0, got {increment}")
        self.num_steps += increment
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict[str, Any]:
        """The schedule and step count as plain Python values.

        Returns:
            A dict of floats, ints, strings and None only, loadable with
            ``torch.load(..., weights_only=True)``.
        """
        cfg = self._config
        return {
            "max_lr": float(cfg.max_lr),
            "min_lr": float(cfg.min_lr),
            "init_lr": float(cfg.init_lr),
            "lr_warmup_steps": cfg.lr_warmup_steps,
            "lr_decay_steps": cfg.lr_decay_steps,
            "lr_decay_style": cfg.lr_decay_style,
            "wsd_decay_steps": cfg.wsd_decay_steps,
            "lr_wsd_decay_style": cfg.lr_wsd_decay_style,
            "num_steps": self.num_steps,
            "start_wd": float(cfg.start_wd),
            "end_wd": float(cfg.end_wd),
            "wd_incr_steps": cfg.wd_incr_steps,
            "wd_incr_style": cfg.wd_incr_style,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores the step count and, as the config's flags say, the schedule.

        For each schedule setting: with ``override_opt_param_scheduler`` the config's value
        stays; else with ``use_checkpoint_opt_param_scheduler`` the checkpoint's is taken;
        else the two must be equal. Megatron's older key names are accepted (``start_lr``,
        ``warmup_iter``, ``warmup_steps``, ``end_iter``, ``decay_steps``, ``decay_style``,
        ``num_iters``). Settings a checkpoint lacks (older checkpoints have no weight-decay,
        ``init_lr`` or WSD entries) keep the config's value. Everything is checked before
        anything changes, so a refused load leaves the scheduler and optimizer as they were.
        The optimizer's param groups are updated at once.

        Args:
            state_dict: What `state_dict` returned, or a Megatron scheduler state dict.

        Raises:
            ValueError: A required key is missing; a setting differs from the config while
                neither flag is set; or the merged schedule or step count is invalid.
            TypeError: The merged schedule or step count has a value of the wrong type.
        """
        cfg = self._config
        missing: list[str] = []
        merged: dict[str, Any] = {}
        for field, keys, required in _CHECKPOINT_FIELDS:
            stored = _lookup(state_dict, keys)
            if stored is _MISSING:
                if required:
                    missing.append(" / ".join(repr(key) for key in keys))
                continue
            merged[field] = self._check_and_set(field, getattr(cfg, field), stored)
        num_steps = _lookup(state_dict, _NUM_STEPS_KEYS)
        if num_steps is _MISSING:
            missing.append(" / ".join(repr(key) for key in _NUM_STEPS_KEYS))
        if missing:
            raise ValueError(f"checkpoint scheduler state lacks {', '.join(missing)}")
        if not is_int(num_steps):
            raise TypeError(f"checkpoint num_steps must be an int, got {num_steps!r}")
        if num_steps < 0:
            raise ValueError(f"checkpoint num_steps must be >= 0, got {num_steps}")
        try:
            new_config = dataclasses.replace(cfg, **merged)
        except (TypeError, ValueError) as err:
            raise type(err)(f"checkpoint scheduler state is invalid: {err}") from err

        self._config = new_config
        self.num_steps = 0
        self.step(increment=num_steps)

    def _check_and_set(self, field: str, config_value: Any, checkpoint_value: Any) -> Any:
        cfg = self._config
        if cfg.override_opt_param_scheduler:
            return config_value
        if cfg.use_checkpoint_opt_param_scheduler:
            return checkpoint_value
        if config_value != checkpoint_value:
            raise OptimizerParamSchedulerError(
                f"{field}: the config has {config_value!r} but the checkpoint has "
                f"{checkpoint_value!r}; set use_checkpoint_opt_param_scheduler=True to take the "
                f"checkpoint's value or override_opt_param_scheduler=True to keep the config's"
            )
        return checkpoint_value
