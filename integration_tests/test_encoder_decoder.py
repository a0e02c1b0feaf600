"""An encoder-decoder pipeline (a split rank) equals the same model run on one process."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pp_comm import CommConfig, P2PCommunicator
from pp_schedules import ScheduleConfig, get_forward_backward_func
from pp_testing import run_distributed

WIDTH, SEQ, DEC_SEQ, BATCH, MICROBATCHES = 6, 3, 2, 2, 4


def weights(stages: int) -> list[tuple[torch.nn.Linear, torch.nn.Linear]]:
    """Per stage: (main layer, encoder-output layer); the same on every rank."""
    torch.manual_seed(0)
    return [(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)) for _ in range(stages)]


def data() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "enc": torch.randn(SEQ, BATCH, WIDTH, generator=generator),
            "dec": torch.randn(DEC_SEQ, BATCH, WIDTH, generator=generator),
            "y": torch.randn(DEC_SEQ, BATCH, WIDTH, generator=generator),
        }
        for _ in range(MICROBATCHES)
    ]


class Stage(torch.nn.Module):
    """An encoder stage (before the split) or a decoder stage reading the encoder's output."""

    def __init__(
        self, layers: tuple[torch.nn.Linear, torch.nn.Linear], decoder: bool, first_decoder: bool
    ) -> None:
        super().__init__()
        self.main, self.cross = layers
        self.decoder, self.first_decoder = decoder, first_decoder
        self.inputs: list[torch.Tensor | None] = [None]

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        self.inputs = tensors

    def run(self, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.decoder:
            x = microbatch["enc"] if self.inputs[0] is None else self.inputs[0]
            return torch.tanh(self.main(x))
        encoded = self.inputs[-1]
        assert encoded is not None
        x = microbatch["dec"] if self.first_decoder else self.inputs[0]
        assert x is not None
        return torch.tanh(self.main(x) + self.cross(encoded.mean(0, keepdim=True)))


def forward_step(
    it: Iterator[dict[str, torch.Tensor]], model: Stage
) -> tuple[torch.Tensor, Callable[..., Any]]:
    microbatch = next(it)
    out = model.run(microbatch)
    return out, lambda o: (
        ((o - microbatch["y"]) ** 2).mean(),
        {"loss": ((o - microbatch["y"]) ** 2).mean().detach()},
    )


def _pipelined(split: int) -> tuple[list[float], dict[int, torch.Tensor]]:
    comm = P2PCommunicator(None, config=CommConfig(timeout=datetime.timedelta(seconds=60)))
    rank, pp = comm.stage, comm.num_stages
    stage = Stage(weights(pp)[rank], decoder=rank >= split, first_decoder=rank == split)
    config = ScheduleConfig(hidden_size=WIDTH, pipeline_model_parallel_split_rank=split)
    forward_backward = get_forward_backward_func(comm, config=config)
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(data()),
        model=[stage],
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=BATCH,
        decoder_seq_length=DEC_SEQ,
    )
    comm.destroy()
    grads = {rank: stage.main.weight.grad}
    if rank >= split:
        grads[100 + rank] = stage.cross.weight.grad
    return [float(x["loss"]) for x in losses], grads  # type: ignore[return-value]


def _reference(pp: int, split: int) -> tuple[list[float], dict[int, torch.Tensor]]:
    stages = [
        Stage(w, decoder=r >= split, first_decoder=r == split) for r, w in enumerate(weights(pp))
    ]
    losses = []
    for microbatch in data():
        encoded: torch.Tensor | None = None
        hidden: torch.Tensor | None = None
        for rank, stage in enumerate(stages):
            if rank < split:
                stage.set_input_tensor([hidden])
                hidden = stage.run(microbatch)
                encoded = hidden
            else:
                stage.set_input_tensor(
                    [None if rank == split else hidden, encoded] if rank > split else [encoded]
                )
                hidden = stage.run(microbatch)
        assert hidden is not None
        loss = ((hidden - microbatch["y"]) ** 2).mean()
        losses.append(float(loss.detach()))
        (loss / MICROBATCHES).backward()
    grads: dict[int, torch.Tensor] = {}
    for rank, stage in enumerate(stages):
        assert stage.main.weight.grad is not None
        grads[rank] = stage.main.weight.grad
        if rank >= split:
            assert stage.cross.weight.grad is not None
            grads[100 + rank] = stage.cross.weight.grad
    return losses, grads


@pytest.mark.parametrize(("pp", "split"), [(4, 2), (3, 1), (4, 3)])
def test_encoder_decoder_pipeline_equals_one_process(pp: int, split: int) -> None:
    expected_losses, expected_grads = _reference(pp, split)
    results = run_distributed(_pipelined, pp, split, timeout=180)
    assert results[-1][0] == pytest.approx(expected_losses, rel=1e-6)
    grads: dict[int, torch.Tensor] = {}
    for _, rank_grads in results:
        grads.update(rank_grads)
    assert sorted(grads) == sorted(expected_grads)
    for key, grad in expected_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-7)
