"""A hand-written pipeline step over pp-comm: forward through the stages, backward through them.

Run it under torchrun, on CPU (gloo):

    torchrun --standalone --nproc-per-node 4 docs/examples/p2p_pipeline.py

Each rank holds one linear layer. Activations go forward with send_forward/recv_forward,
gradients come back with send_backward/recv_backward, and the last stage checks that the
pipelined gradient of the first layer equals the one computed on a single process.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from pp_comm import CommConfig, P2PCommunicator

BATCH, WIDTH = 4, 8


def layers(count: int) -> list[torch.nn.Linear]:
    """The same layers on every rank (same seed), one per pipeline stage."""
    torch.manual_seed(0)
    return [torch.nn.Linear(WIDTH, WIDTH) for _ in range(count)]


def main() -> int:
    """One forward and backward pass through the pipeline; 0 when gradients match."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    config = CommConfig(timeout=datetime.timedelta(seconds=30))
    comm = P2PCommunicator(None, config=config)  # None: a pipeline over every rank
    stage, stages = comm.stage, comm.num_stages
    all_layers = layers(stages)
    layer = all_layers[stage]
    torch.manual_seed(1)
    batch = torch.randn(BATCH, WIDTH)

    # Forward: the first stage reads the batch, the others receive activations.
    received = comm.recv_forward((BATCH, WIDTH), microbatch=0)
    inputs = batch.requires_grad_() if received is None else received
    assert isinstance(inputs, torch.Tensor)
    outputs = layer(inputs)
    comm.send_forward(outputs.detach(), microbatch=0)

    # Backward: the last stage starts from the loss, the others from the received gradient.
    if comm.is_last_stage:
        loss = outputs.pow(2).sum()
        loss.backward()
    else:
        grad = comm.recv_backward((BATCH, WIDTH), microbatch=0)
        assert isinstance(grad, torch.Tensor)
        outputs.backward(grad)
    comm.send_backward(inputs.grad, microbatch=0)

    # The first layer's gradient, pipelined, against a single-process reference.
    reference = layers(stages)
    x = batch.detach()
    for ref in reference:
        x = ref(x)
    x.pow(2).sum().backward()
    weight_grad = layer.weight.grad
    assert weight_grad is not None
    ok = torch.allclose(weight_grad, reference[stage].weight.grad)  # type: ignore[arg-type]
    verdicts: list[object] = [None] * stages
    dist.all_gather_object(verdicts, ok)
    if stage == 0:
        print(f"{stages} stages: gradients equal the single-process run: {all(verdicts)}")
    comm.destroy()
    dist.destroy_process_group()
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
