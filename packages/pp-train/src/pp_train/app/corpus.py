"""The bundled text corpus and the dataset the pp-train command trains the GPT on.

`CorpusDataset` cuts the corpus's byte tokens into fixed windows and shuffles them anew each
epoch; pp-train's `microbatches` reads it in Megatron's pretraining sampler order.
"""

from __future__ import annotations

import importlib.resources

import torch

from pp_state.numbers import check_int, is_int
from pp_train.data import Microbatch

__all__ = [
    "CorpusDataset",
    "check_corpus_seq_length",
    "corpus_tokens",
    "load_corpus",
    "split_corpus",
]

_CORPUS_FILE = "corpus.txt"


def load_corpus() -> bytes:
    """The bundled corpus: about 220 KB of plain ASCII English-like text.

    It is read as package data, so it works from an installed wheel as well as a checkout.

    Returns:
        The corpus's bytes.
    """
    return importlib.resources.files("pp_train.app").joinpath(_CORPUS_FILE).read_bytes()


def corpus_tokens() -> torch.Tensor:
    """The bundled corpus as a 1-D int64 tensor of byte tokens (see `ByteTokenizer`)."""
    return torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).to(torch.int64)


def _check_tokens(tokens: object) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dim() != 1 or tokens.dtype != torch.int64:
        raise ValueError(
            f"tokens must be a 1-D int64 tensor, got shape {tuple(tokens.shape)} and dtype "
            f"{tokens.dtype}"
        )
    return tokens


def split_corpus(
    tokens: torch.Tensor, valid_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Splits a token stream into a training head and a validation tail.

    Args:
        tokens: 1-D int64 tokens.
        valid_fraction: Share of the tokens, rounded down, that goes to validation;
            ``0 <= valid_fraction < 1``.

    Returns:
        ``(train, valid)``: views of the first and the last tokens.

    Raises:
        TypeError: `tokens` is not a tensor or `valid_fraction` not a real number.
        ValueError: `tokens` is not 1-D int64 or `valid_fraction` is outside ``[0, 1)``.
    """
    tokens = _check_tokens(tokens)
    if not isinstance(valid_fraction, (int, float)) or isinstance(valid_fraction, bool):
        raise TypeError(f"valid_fraction must be a float, got {valid_fraction!r}")
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must lie in [0, 1), got {valid_fraction}")
    valid_size = int(tokens.numel() * valid_fraction)
    cut = tokens.numel() - valid_size
    return tokens[:cut], tokens[cut:]


def check_corpus_seq_length(seq_length: int, tokens: torch.Tensor | None = None) -> None:
    """Checks that both splits of the corpus (see `split_corpus`) hold one sample.

    A sample needs ``seq_length + 1`` tokens; the validation tail is the shorter split.

    Args:
        seq_length: Tokens per sample (``--seq-length``).
        tokens: The corpus's tokens (default: the bundled corpus's).

    Raises:
        ValueError: A split is too short; the message names ``--seq-length``, the corpus's
            tokens and the longest value that fits.
    """
    tokens = corpus_tokens() if tokens is None else tokens
    train, valid = split_corpus(tokens)
    longest = min(train.numel(), valid.numel()) - 1
    if seq_length > longest:
        raise ValueError(
            f"--seq-length {seq_length} is longer than the bundled corpus allows: it holds "
            f"{tokens.numel()} tokens, {valid.numel()} of them in the validation split, and a "
            f"sample needs --seq-length + 1; use --seq-length {longest} or less, or train on "
            "--data-path"
        )


class CorpusDataset:
    """Windows of ``seq_length + 1`` tokens, reshuffled every epoch.

    The windows start at multiples of ``seq_length`` (consecutive windows share one token: the
    last label of one is the first input of the next). Sample ``i`` is window
    ``permutation[i % n]`` of epoch ``i // n``, where ``n`` is `samples_per_epoch` and the
    permutation comes from a generator seeded with ``seed + epoch``. Every non-negative index
    is valid: the dataset wraps around into later epochs.
    """

    def __init__(self, tokens: torch.Tensor, seq_length: int, seed: int) -> None:
        """Holds the tokens and the window length.

        Args:
            tokens: 1-D int64 tokens.
            seq_length: Tokens per sample (the labels are the next `seq_length` tokens).
            seed: Shuffling seed, 0 or more.

        Raises:
            TypeError: `tokens` is not a tensor or `seq_length` or `seed` not an int.
            ValueError: `tokens` is not 1-D int64, `seq_length` is below 1, `seed` is
                negative, or there are fewer than ``seq_length + 1`` tokens.
        """
        self.tokens = _check_tokens(tokens)
        check_int("seq_length", seq_length, 1)
        check_int("seed", seed, 0)
        if tokens.numel() < seq_length + 1:
            raise ValueError(
                f"the corpus holds {tokens.numel()} tokens, fewer than the seq_length + 1 = "
                f"{seq_length + 1} one sample needs"
            )
        self.seq_length = seq_length
        self.seed = seed
        self._epoch = -1
        self._permutation = torch.empty(0, dtype=torch.int64)
        self._order(0)  # made now, before training, as host data

    def host_bytes(self) -> int:
        """Host memory it holds: its tokens and the current epoch's sample order.

        Its tokens' own bytes: a split of a corpus shares the corpus's storage.
        """
        return self.tokens.nbytes + self._permutation.nbytes

    @property
    def samples_per_epoch(self) -> int:
        """Number of distinct windows, visited once per epoch."""
        return (self.tokens.numel() - 1) // self.seq_length

    def _order(self, epoch: int) -> torch.Tensor:
        # Samplers read indices in increasing order, so caching the last epoch's
        # permutation is enough.
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._permutation = torch.randperm(self.samples_per_epoch, generator=generator)
            self._epoch = epoch
        return self._permutation

    def window_start(self, index: int) -> int:
        """Position in `tokens` of the first token of sample `index`.

        Args:
            index: A sample index, 0 or more.

        Returns:
            The window's start.

        Raises:
            IndexError: `index` is negative.
            TypeError: `index` is not an int.
        """
        if not is_int(index):
            raise TypeError(f"sample index must be an int, got {type(index).__name__}")
        if index < 0:
            raise IndexError(f"sample index must be 0 or more, got {index}")
        epoch, position = divmod(index, self.samples_per_epoch)
        return int(self._order(epoch)[position]) * self.seq_length

    def __getitem__(self, index: int) -> Microbatch:
        """Sample `index`: ``{"tokens": x[:-1], "labels": x[1:]}``, each int64 [seq_length].

        Raises:
            IndexError: `index` is negative.
            TypeError: `index` is not an int.
        """
        start = self.window_start(index)
        window = self.tokens[start : start + self.seq_length + 1]
        return {"tokens": window[:-1].clone(), "labels": window[1:].clone()}
