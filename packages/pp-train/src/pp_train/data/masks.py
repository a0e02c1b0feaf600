"""Packed documents: Megatron's loss mask, position ids and document boundaries for a sample.

A sample of packed data holds the end of one document, whole documents and the start of
another, separated by end-of-document (EOD) tokens. Megatron's three flags decide what a
sample carries besides its tokens and labels:

- ``--eod-mask-loss``: ``loss_mask`` (float32) is 0 where the *input* token is EOD (the
  prediction of a new document's first token from the previous document's EOD is not
  trained), 1 elsewhere.
- ``--reset-position-ids``: ``position_ids`` (int64) restart at 0 after each EOD; otherwise
  they are ``0 .. seq - 1``.
- ``--reset-attention-mask``: no token attends to an earlier document. Megatron hands a dense
  ``[seq, seq]`` mask per sample; here a sample carries ``document_ids`` (int64: the index,
  from 0, of the document each token belongs to within the sample, an EOD token belonging to
  the document it ends), the same information in ``seq`` numbers: token ``i`` may attend to
  token ``j`` iff ``j <= i`` and ``document_ids[i] == document_ids[j]``.
  `attention_mask_from_document_ids` expands it into Megatron's boolean mask.

Everything is computed with whole-tensor torch operations (a cumulative sum and maximum over
the sequence), for one sample ``[seq]`` or a batch ``[batch, seq]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

__all__ = ["SampleMasks", "attention_mask_from_document_ids", "ltor_masks_and_position_ids"]

_FLAGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_tokens(tokens: object, name: str) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer ids, got dtype {tokens.dtype}")
    if tokens.dim() not in (1, 2) or tokens.shape[-1] == 0:
        raise ValueError(
            f"{name} must be [seq] or [batch, seq] with seq >= 1, got shape {tuple(tokens.shape)}"
        )
    return tokens


def _check_switches(flags: Mapping[str, object], eod_token: object) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if eod_token is None:
        wanted = [_flag(name) for name, value in flags.items() if value]
        if wanted:
            raise ValueError(
                f"{' and '.join(wanted)} need{'s' if len(wanted) == 1 else ''} the "
                "end-of-document id: give eod_token (the tokenizer's eod)"
            )
    elif isinstance(eod_token, bool) or not isinstance(eod_token, int) or eod_token < 0:
        raise ValueError(f"eod_token must be an int 0 or more (a token id), got {eod_token!r}")


def ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    *,
    eod_token: int | None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
) -> dict[str, torch.Tensor]:
    """Megatron's loss mask and position ids of left-to-right samples, and document ids.

    Equals megatron-core's ``GPTDataset`` for the same flags: its ``loss_mask`` and
    ``position_ids``, and with `reset_attention_mask` the ``document_ids`` from which
    `attention_mask_from_document_ids` makes its ``attention_mask``.

    Args:
        tokens: The input ids, ``[seq]`` or ``[batch, seq]``, any integer dtype (each row
            its own sample).
        eod_token: The end-of-document id (the tokenizer's ``eod``); None only when no flag
            is set.
        reset_position_ids: Position ids restart at 0 after each EOD (``--reset-position-ids``).
        reset_attention_mask: Add ``document_ids`` (``--reset-attention-mask``).
        eod_mask_loss: The loss mask is 0 where the input token is EOD (``--eod-mask-loss``).

    Returns:
        ``{"loss_mask": float32, "position_ids": int64}`` of `tokens`' shape, plus
        ``"document_ids"`` (int64, same shape) with `reset_attention_mask`.

    Raises:
        TypeError: `tokens` is not an integer tensor, or a flag is not a bool.
        ValueError: `tokens` is not ``[seq]`` or ``[batch, seq]`` with seq >= 1, a flag is set
            without `eod_token`, or `eod_token` is negative or not an int.
    """
    tokens = _check_tokens(tokens, "tokens")
    flags = {
        "reset_position_ids": reset_position_ids,
        "reset_attention_mask": reset_attention_mask,
        "eod_mask_loss": eod_mask_loss,
    }
    _check_switches(flags, eod_token)
    return _fields(
        tokens,
        eod_token,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
    )


def _fields(
    tokens: torch.Tensor,
    eod_token: int | None,
    *,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> dict[str, torch.Tensor]:
    """`ltor_masks_and_position_ids` on checked arguments."""
    positions = torch.arange(tokens.shape[-1], dtype=torch.int64, device=tokens.device)
    if tokens.dim() == 2:
        positions = positions.repeat(tokens.shape[0], 1)
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
    out = {"loss_mask": loss_mask, "position_ids": positions}
    if eod_token is None or not (reset_position_ids or reset_attention_mask or eod_mask_loss):
        return out
    is_eod = tokens == eod_token
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    if reset_position_ids:
        # A document starts one past the last EOD before it: the running maximum of
        # "EOD position + 1", shifted one token right so an EOD stays in its own document.
        after_eod = torch.where(is_eod, positions + 1, 0)
        before = torch.nn.functional.pad(after_eod[..., :-1], (1, 0))
        out["position_ids"] = positions - torch.cummax(before, dim=-1).values
    if reset_attention_mask:
        eods = is_eod.to(torch.int64)
        out["document_ids"] = torch.cumsum(eods, dim=-1) - eods
    return out


def attention_mask_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean attention mask of packed samples (True: masked out).

    Token ``i`` may attend to token ``j`` iff ``j <= i`` and both lie in the same document.
    All-zero document ids give the plain causal mask (Megatron's without
    ``--reset-attention-mask``). The mask holds ``seq * seq`` booleans per sample: carry
    document ids and make it only where a dense mask is needed.

    Args:
        document_ids: ``[seq]`` (one sample) or ``[batch, seq]``, as
            `ltor_masks_and_position_ids` returns them.

    Returns:
        ``[1, seq, seq]`` for one sample (megatron-core's ``GPTDataset`` sample) or
        ``[batch, 1, seq, seq]`` for a batch, bool.

    Raises:
        TypeError: `document_ids` is not an integer tensor.
        ValueError: `document_ids` is not ``[seq]`` or ``[batch, seq]`` with seq >= 1.
    """
    document_ids = _check_tokens(document_ids, "document_ids")
    seq = document_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    return (~(causal & same)).unsqueeze(-3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SampleMasks:
    """Which of Megatron's fields a dataset adds to each sample, and the EOD id they use.

    Every sample gets ``loss_mask`` and ``position_ids`` (as megatron-core's ``GPTDataset``
    returns them, all ones and ``0 .. seq - 1`` without flags), and ``document_ids`` with
    `reset_attention_mask`; see `ltor_masks_and_position_ids`.

    Raises:
        TypeError: A flag is not a bool.
        ValueError: A flag is set without `eod_token`, or `eod_token` is negative.
    """

    eod_token: int | None = None
    """The end-of-document id (the tokenizer's ``eod``); None only when no flag is set."""

    reset_position_ids: bool = False
    """Megatron's ``--reset-position-ids``."""

    reset_attention_mask: bool = False
    """Megatron's ``--reset-attention-mask``."""

    eod_mask_loss: bool = False
    """Megatron's ``--eod-mask-loss``."""

    def __post_init__(self) -> None:
        """Checks the flags and the EOD id."""
        _check_switches({name: getattr(self, name) for name in _FLAGS}, self.eod_token)

    def __call__(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fields of `tokens` (``[seq]`` or ``[batch, seq]``).

        Raises:
            TypeError: `tokens` is not an integer tensor.
            ValueError: `tokens` is not ``[seq]`` or ``[batch, seq]`` with seq >= 1.
        """
        # The flags were checked when this was made; a dataset calls it once per sample.
        return _fields(
            _check_tokens(tokens, "tokens"),
            self.eod_token,
            reset_position_ids=self.reset_position_ids,
            reset_attention_mask=self.reset_attention_mask,
            eod_mask_loss=self.eod_mask_loss,
        )
