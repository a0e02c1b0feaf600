"""Receive buffers, and the tensor-parallel split of what travels (scatter-gather)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pp_comm.config import CommConfig
from pp_comm.transport import Transfer

__all__ = ["Buffers"]


class Buffers:
    """Allocates receive buffers and, with scatter-gather, the 1/tp shares that travel.

    With ``scatter_gather_tensors_in_pipeline`` and tp > 1, each rank of a tensor-parallel
    group sends only its share of a tensor whose size tp divides, and the receivers rebuild
    the whole with an all-gather over the tensor-parallel group (other tensors travel whole).
    """

    def __init__(
        self, config: CommConfig, device: torch.device, tp_group: dist.ProcessGroup | None
    ) -> None:
        """Allocate on `device`; split over `tp_group` when the config asks for it."""
        self._device = device
        self._tp_group = tp_group
        self._tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self._tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.scatters = config.scatter_gather_tensors_in_pipeline and self._tp_size > 1
        """Whether some tensors travel as 1/tp shares."""

    def fill(self, transfers: Sequence[Transfer], operation: str) -> None:
        """Give receives their buffers and sends their shares.

        Raises:
            ValueError: A receive's shape is unknown (none given, and no header said it).
        """
        for transfer in transfers:
            if transfer.sends:
                if self.scatters:
                    transfer.wire = [self._share(t) for t in transfer.tensors]
                continue
            grad = transfer.requires_grad
            buffers = []
            for spec in transfer.specs:
                shape, dtype = spec.shape, spec.dtype
                if shape is None:
                    raise ValueError(
                        f"{operation}: receiving needs tensor_shapes, unless the communicator "
                        "is configured with variable_seq_lengths=True"
                    )
                # Only floating-point tensors can require grad (int ids, bool masks cannot).
                grads = grad and (dtype.is_floating_point or dtype.is_complex)
                buffers.append(
                    torch.empty(shape, dtype=dtype, device=self._device, requires_grad=grads)
                )
            transfer.tensors = transfer.wire = buffers
            if self.scatters:
                transfer.wire = [self._landing(b) for b in buffers]

    def gathers(self, transfers: Sequence[Transfer]) -> bool:
        """Whether some receive of `transfers` arrives in shares to be gathered."""
        return self.scatters and any(
            wire is not buffer
            for t in transfers
            if not t.sends
            for wire, buffer in zip(t.wire, t.tensors, strict=True)
        )

    def gather(self, transfers: Sequence[Transfer]) -> None:
        """Rebuild scattered receives from the shares every tensor-parallel rank received."""
        for transfer in transfers:
            if transfer.sends:
                continue
            for buffer, wire in zip(transfer.tensors, transfer.wire, strict=True):
                if wire is buffer:
                    continue
                pieces = [torch.empty_like(wire) for _ in range(self._tp_size)]
                dist.all_gather(pieces, wire, group=self._tp_group)
                with torch.no_grad():
                    buffer.copy_(torch.cat(pieces).view(buffer.shape))

    def _splits(self, numel: int) -> bool:
        return numel > 0 and numel % self._tp_size == 0

    def _share(self, tensor: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's share of a send, or the whole when tp does not divide."""
        numel = tensor.numel()
        if not self._splits(numel):
            return tensor
        size = numel // self._tp_size
        return tensor.detach().reshape(-1)[self._tp_rank * size : (self._tp_rank + 1) * size]

    def _landing(self, buffer: torch.Tensor) -> torch.Tensor:
        """Where one share of a scattered receive lands (the buffer itself when not split)."""
        numel = buffer.numel()
        if not self._splits(numel):
            return buffer
        return torch.empty(numel // self._tp_size, dtype=buffer.dtype, device=self._device)
