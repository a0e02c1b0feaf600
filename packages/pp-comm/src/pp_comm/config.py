"""`CommConfig`: how a communicator moves tensors."""

from __future__ import annotations

import dataclasses
import datetime

import torch

__all__ = ["CommConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommConfig:
    """How a communicator moves tensors; every rank of a pipeline must use the same config."""

    pipeline_dtype: torch.dtype = torch.float32
    """dtype of received tensors when a call names none (Megatron's ``pipeline_dtype``)."""

    batch_p2p_comm: bool = True
    """Post each exchange as one ``batch_isend_irecv`` (True) or as individual isend/irecv in
    a deadlock-free order (False). Both match tensors by direction at every pipeline size."""

    variable_seq_lengths: bool = False
    """Shapes travel with the data: receivers need not know them, and every message may
    differ. Costs one small extra exchange per call."""

    scatter_gather_tensors_in_pipeline: bool = False
    """Send 1/tp of each tensor and all-gather it over the tensor-parallel group after
    receiving (tensors whose size tp does not divide travel whole)."""

    check_contracts: bool = True
    """Check every message against its receive: when the count, dtype or shape differs, both
    sides raise `P2PMismatchError` (the receiver when it waits for the message, the sender at
    its next receive from that peer) and refuse further calls. The check travels inside each
    message (a header framed with the payload, see `pp_comm.framing`), so it costs no extra
    message up to 64 KiB of payload (above, the frame is one small message more, posted with
    the data). Applies to CPU tensors (gloo) with fixed shapes; CUDA tensors (NCCL) are not
    checked, since reading a header there needs a device-to-host sync per receive: use
    ``debug`` for them. Off: messages travel bare, and a mismatch of the same byte count
    goes unnoticed (a larger message makes gloo abort the receiving process)."""

    debug: bool = False
    """Check every message's contract with separate messages, on any backend and with
    variable shapes: a header says what the sender sends, an expectation says back what the
    receiver asked for, and both sides raise `P2PMismatchError` in the call itself, leaving
    the link usable. Costs two small transfers per message (measured 2 to 3x the time of a
    4 KB transfer on gloo)."""

    timeout: datetime.timedelta = datetime.timedelta(minutes=10)
    """Longest wait for one call's transfers before `P2PTimeoutError`."""

    recv_requires_grad: bool = True
    """Received tensors require grad (activations feed the stage's backward)."""

    def __post_init__(self) -> None:
        """Checks types and the timeout.

        Raises:
            TypeError: `pipeline_dtype` is not a torch.dtype or `timeout` not a timedelta.
            ValueError: The timeout is not positive.
        """
        if not isinstance(self.pipeline_dtype, torch.dtype):
            raise TypeError(f"pipeline_dtype must be a torch.dtype, got {self.pipeline_dtype!r}")
        if not isinstance(self.timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {self.timeout!r}")
        if self.timeout <= datetime.timedelta(0):
            raise ValueError(f"timeout must be positive, got {self.timeout}")

    @property
    def exchanges_shapes(self) -> bool:
        """Whether a shape header travels ahead of every message."""
        return self.variable_seq_lengths or self.debug
