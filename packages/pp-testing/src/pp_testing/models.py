"""A tiny model that splits into pipeline stages, and its unpipelined reference run.

The model is a stack of Linear + tanh layers with a mean-squared loss. Every rank builds the
same layers from one seed and keeps the slice of its virtual stages (virtual stage
stage ``v`` holds layers ``[v * per, (v + 1) * per)``), so a pipelined run can be
compared with `reference_run` on one process, loss for loss and gradient for gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "StageStack",
    "reference_run",
    "stage_chunks",
    "tiny_forward_step",
    "tiny_layers",
    "tiny_microbatches",
]

Microbatch = dict[str, torch.Tensor]


class StageStack(torch.nn.Module):
    """Some consecutive layers of the tiny model; takes its input from the previous stage."""

    def __init__(self, layers: Sequence[torch.nn.Module], *, final_activation: bool = True) -> None:
        """Holds `layers` in order.

        Args:
            layers: The layers.
            final_activation: Apply tanh after the last layer too. tanh saves its output for
                backward; False ends the stage with a residual add instead (as transformer
                layers end), whose output no autograd node keeps and which is no view.
        """
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.final_activation = final_activation
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None]) -> None:
        """Megatron's hook: activations from the previous stage ([None] on the first)."""
        self.input_tensor = input_tensor[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each layer then tanh; without final_activation the last layer then a residual add."""
        for index, layer in enumerate(self.layers):
            if self.final_activation or index < len(self.layers) - 1:
                x = torch.tanh(layer(x))
            else:
                x = layer(x) + x
        return x


def tiny_layers(count: int, width: int, seed: int = 0) -> list[torch.nn.Linear]:
    """`count` Linear(width, width) layers, the same on every rank for one seed."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(width, width) for _ in range(count)]
    torch.random.set_rng_state(generator_state)
    return layers


def tiny_microbatches(
    count: int, *, seq: int, batch: int, width: int, seed: int = 1
) -> list[Microbatch]:
    """Microbatches of inputs ``x`` and targets ``y``, shaped (seq, batch, width) as in Megatron."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "x": torch.randn(seq, batch, width, generator=generator),
            "y": torch.randn(seq, batch, width, generator=generator),
        }
        for _ in range(count)
    ]


def stage_chunks(
    layers: Sequence[torch.nn.Module],
    *,
    stages: Sequence[int],
    num_stages: int,
    final_activation: bool = True,
) -> list[StageStack]:
    """This rank's model chunks: chunk c holds virtual stage ``stages[c]`` of `num_stages`.

    Which stage a chunk holds is the caller's placement (pp-state's ``Placement.stages[rank]``);
    the layers split evenly over the stages, stage v holding ``[v * per, (v + 1) * per)``.

    Raises:
        ValueError: The layers do not split evenly over the virtual stages.
    """
    if len(layers) % num_stages:
        raise ValueError(f"{len(layers)} layers do not split over {num_stages} virtual stages")
    per = len(layers) // num_stages
    return [
        StageStack(layers[stage * per : (stage + 1) * per], final_activation=final_activation)
        for stage in stages
    ]


def tiny_forward_step() -> Callable[
    [Iterator[Microbatch], StageStack], tuple[torch.Tensor, Callable[..., Any]]
]:
    """Megatron's ``forward_step_func`` for the tiny model: (output, loss_func)."""

    def forward_step(
        data: Iterator[Microbatch], model: StageStack
    ) -> tuple[torch.Tensor, Callable[..., Any]]:
        microbatch = next(data)
        x = microbatch["x"] if model.input_tensor is None else model.input_tensor
        output = model(x)

        def loss_func(out: torch.Tensor, non_loss_data: bool = False) -> Any:
            if non_loss_data:
                return out.detach().sum()
            loss = ((out - microbatch["y"]) ** 2).mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    return forward_step


def reference_run(
    layers: Sequence[torch.nn.Module], microbatches: Sequence[Microbatch]
) -> tuple[list[float], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Losses and (weight, bias) gradients of the whole model on one process.

    Each microbatch's loss is divided by the number of microbatches before backward, as a
    pipeline schedule does, so gradients accumulate to the same values.
    """
    model = StageStack(layers)
    losses = []
    for microbatch in microbatches:
        loss = ((model(microbatch["x"]) - microbatch["y"]) ** 2).mean()
        losses.append(float(loss.detach()))
        (loss / len(microbatches)).backward()
    grads = []
    for layer in layers:
        assert isinstance(layer, torch.nn.Linear)
        assert layer.weight.grad is not None
        assert layer.bias.grad is not None
        grads.append((layer.weight.grad.clone(), layer.bias.grad.clone()))
    return losses, grads
