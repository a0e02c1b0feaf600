"""The GPT's shape (`GPTConfig`) and the tensor-parallel sizes it splits over.

A module of its own so that the model's building blocks (`pp_train.app.transformer`) and the
chunk (`pp_train.app.gpt`) both read the config without importing each other.
"""

from __future__ import annotations

import dataclasses
import math

from pp_state.numbers import check_int, divisors, is_int, is_real
from pp_train.recompute import RecomputeConfig

__all__ = ["GPTConfig", "check_positive_int", "check_tensor_parallel", "joined"]


def joined(values: list[int]) -> str:
    """`values` as a comma-separated list, for error messages."""
    return ", ".join(str(v) for v in values)


def check_positive_int(name: str, value: object) -> None:
    """Refuses a non-int (TypeError) or one below 1 (ValueError), naming `name`."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    assert isinstance(value, int)
    if value < 1:
        raise ValueError(f"{name} must be a positive int (1 or more), got {value}")


def _check_probability(name: str, value: object) -> None:
    if not is_real(value):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    assert isinstance(value, (int, float))
    if not 0 <= value < 1:
        raise ValueError(f"{name} must be a probability in [0, 1), got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and initialisation of the GPT model (Megatron's transformer config, reduced)."""

    num_layers: int
    """Transformer layers in the whole model (all pipeline stages together)."""

    hidden_size: int
    """Width of the residual stream; must be divisible by ``num_attention_heads``."""

    num_attention_heads: int
    """Attention heads per layer; each has ``hidden_size // num_attention_heads`` channels."""

    seq_length: int
    """Longest sequence the model takes (rows of the learned position embedding)."""

    vocab_size: int = 256
    """Rows of the word embedding and of the output layer (256: one per byte); at
    tensor-parallel size > 1 the padded vocabulary, a multiple of that size."""

    ffn_hidden_size: int | None = None
    """Width of the MLP's hidden layer; None means ``4 * hidden_size``."""

    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation of weights; the output projections
    of attention and MLP use it divided by ``sqrt(2 * num_layers)``."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm."""

    hidden_dropout: float = 0.0
    """Dropout probability on the embedding's output and on the attention's and the MLP's
    output before each residual add (Megatron's ``--hidden-dropout``; 0: none)."""

    attention_dropout: float = 0.0
    """Dropout probability on the attention probabilities (Megatron's ``--attention-dropout``;
    0: none)."""

    recompute: RecomputeConfig | None = None
    """Which activations backward recomputes instead of keeping; None: none."""

    openai_gelu: bool = False
    """The MLP's activation: GELU's tanh approximation (Megatron's ``--openai-gelu``, GPT-2's
    ``gelu_new``) when True; the exact, erf-based GELU when False."""

    def __post_init__(self) -> None:
        """Checks that the sizes are positive ints and the heads split the hidden size.

        Raises:
            TypeError: A size is not an int (bools are refused), a float field is not a real
                number, `recompute` is not a `RecomputeConfig`, or `openai_gelu` not a bool.
            ValueError: A size is below 1, ``hidden_size`` is not divisible by
                ``num_attention_heads``, a float field is not positive and finite, or a
                dropout probability is outside [0, 1).
        """
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("vocab_size", self.vocab_size)
        if self.ffn_hidden_size is not None:
            check_positive_int("ffn_hidden_size", self.ffn_hidden_size)
        for name in ("init_method_std", "layernorm_epsilon"):
            value = getattr(self, name)
            if not is_real(value):
                raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        for name in ("hidden_dropout", "attention_dropout"):
            _check_probability(name, getattr(self, name))
        if self.recompute is not None and not isinstance(self.recompute, RecomputeConfig):
            raise TypeError(
                f"recompute must be a RecomputeConfig or None, got {type(self.recompute).__name__}"
            )
        if not isinstance(self.openai_gelu, bool):
            raise TypeError(
                f"openai_gelu must be a bool, got {type(self.openai_gelu).__name__} "
                f"{self.openai_gelu!r}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden size {self.hidden_size} is not divisible by "
                f"{self.num_attention_heads} attention heads; use one of "
                f"{joined(divisors(self.hidden_size))}"
            )

    @property
    def ffn_size(self) -> int:
        """Width of the MLP's hidden layer, with None resolved to ``4 * hidden_size``."""
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size

    @property
    def head_size(self) -> int:
        """Channels of one attention head."""
        return self.hidden_size // self.num_attention_heads


def check_tensor_parallel(
    config: GPTConfig, tp_size: int, *, sequence_parallel: bool = False
) -> None:
    """Checks that the model splits evenly over `tp_size` tensor-parallel ranks.

    Each rank holds ``1 / tp_size`` of the attention heads, of the MLP's hidden layer and of
    the vocabulary (the word embedding's and the output layer's rows); under sequence
    parallelism also of the sequence. The flags alone decide this, so the command calls it
    before any process group exists.

    Args:
        config: The model's shape; ``vocab_size`` is the padded vocabulary.
        tp_size: The tensor-parallel size.
        sequence_parallel: Whether the sequence is split too (``seq_length`` must divide;
            ignored at `tp_size` 1, where sequence parallelism is off).

    Raises:
        TypeError: `config` is not a `GPTConfig` or `tp_size` not an int.
        ValueError: `tp_size` is below 1, or a size does not divide by it; the message names
            both numbers and the tensor-parallel sizes that work (or, for the vocabulary, the
            padding flag).
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    check_int("tensor-parallel size", tp_size, 1)
    # The heads divide the hidden size, so the sizes that split heads and MLP split all three.
    sizes = joined(divisors(math.gcd(config.num_attention_heads, config.ffn_size)))
    for what, value, verb in (
        ("hidden size", config.hidden_size, "does"),
        ("attention heads", config.num_attention_heads, "do"),
        ("FFN hidden size", config.ffn_size, "does"),
    ):
        if value % tp_size:
            raise ValueError(
                f"{what} {value} {verb} not divide over tensor-parallel size {tp_size}; use a "
                f"tensor-parallel size among {sizes}"
            )
    if config.vocab_size % tp_size:
        raise ValueError(
            f"vocabulary size {config.vocab_size} does not divide over tensor-parallel size "
            f"{tp_size}; pad it with --make-vocab-size-divisible-by (the padded size is a "
            "multiple of that number times the tensor-parallel size)"
        )
    if sequence_parallel and tp_size > 1 and config.seq_length % tp_size:
        raise ValueError(
            f"sequence length {config.seq_length} does not divide over tensor-parallel size "
            f"{tp_size} under --sequence-parallel; use a sequence length that is a multiple of "
            f"{tp_size}"
        )
