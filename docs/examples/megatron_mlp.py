"""Megatron model code ported by its imports: a sequence-parallel MLP stack, at any tp x pp.

    torchrun --standalone --nproc-per-node 4 docs/examples/megatron_mlp.py --tp 2 --pp 2

The model (between the "ported" marks) is written as for megatron.core: a column-parallel and
a row-parallel linear layer per block, sequence parallelism from the config; porting it was
replacing ``megatron.core.tensor_parallel`` by ``pp_tensor.megatron`` and
``megatron.core.model_parallel_config`` by ``pp_tensor.megatron.model_parallel_config``. The
rest is a trainer from pp's parts: Megatron's ``initialize_model_parallel`` (pp-state's
facade), the stack split into pipeline stages (pp-schedules' `PipelineModel`), pp-optim's
DDP and Adam, and the 1F1B schedule. Rank 0 prints the loss of each step.
"""

import argparse
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from pp_comm import P2PCommunicator
from pp_optim import DDPConfig, DistributedDataParallel, OptimizerConfig, get_megatron_optimizer
from pp_schedules import PipelineModel, get_forward_backward_func, resolve_schedule
from pp_state import parallel_state

# isort: split
# --- ported ---
import torch.nn.functional as F  # noqa: N812

from pp_tensor.megatron import (  # was: from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from pp_tensor.megatron.model_parallel_config import (  # was: megatron.core.model_parallel_config
    ModelParallelConfig,
)


def init_method_normal(seed: int, std: float = 0.2) -> Any:
    """Fills a full weight from its own generator: the same weights at every tp."""
    generator = torch.Generator().manual_seed(seed)
    return lambda weight: weight.normal_(0.0, std, generator=generator)


class ParallelMLP(torch.nn.Module):
    """h -> 4h -> h; under sequence parallelism the input and output are sequence parts."""

    def __init__(self, config: ModelParallelConfig, hidden_size: int, seed: int) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(
            hidden_size,
            4 * hidden_size,
            config=config,
            init_method=init_method_normal(seed),
            bias=True,
            gather_output=False,
            skip_bias_add=True,
        )
        self.dense_4h_to_h = RowParallelLinear(
            4 * hidden_size,
            hidden_size,
            config=config,
            init_method=init_method_normal(seed + 1),
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The block with its residual: ``x + mlp(x)``."""
        intermediate, bias = self.dense_h_to_4h(hidden_states)
        output, _ = self.dense_4h_to_h(F.gelu(intermediate + bias))
        return hidden_states + output


class SequenceParts(torch.nn.Module):
    """Enters (or leaves) the sequence-parallel region: [s, b, h] <-> [s / tp, b, h]."""

    def __init__(self, config: ModelParallelConfig, enter: bool) -> None:
        super().__init__()
        self.sequence_parallel, self.enter = config.sequence_parallel, enter

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's sequence part (entering), or the whole sequence (leaving)."""
        if not self.sequence_parallel:
            return hidden_states
        if self.enter:
            return scatter_to_sequence_parallel_region(hidden_states)
        return gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=False
        )


# --- end ported ---

SEQ, BATCH, HIDDEN, BLOCKS, STEPS, MICROBATCHES = 8, 2, 16, 4, 4, 4


def parts(config: ModelParallelConfig) -> list[torch.nn.Module]:
    """The stack as a list of parts for the stages: enter, the MLP blocks, leave."""
    blocks = [ParallelMLP(config, HIDDEN, seed=10 * i) for i in range(BLOCKS)]
    return [SequenceParts(config, enter=True), *blocks, SequenceParts(config, enter=False)]


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`MICROBATCHES` (input, target) pairs of [SEQ, BATCH, HIDDEN], the same on every rank."""
    generator = torch.Generator().manual_seed(step)
    return [
        (torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
         torch.randn(SEQ, BATCH, HIDDEN, generator=generator))
        for _ in range(MICROBATCHES)
    ]  # fmt: skip


def mse(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The mean squared error, and the executor's loss dict."""
    loss = F.mse_loss(output, target)
    return loss, {"loss": loss.detach()}


def forward_step(data: Iterator[Any], chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """One microbatch through one chunk (the first reads the input, the others what came)."""
    inputs, target = next(data)
    return chunk(inputs), lambda output: mse(target, output)


def sum_sequence_parallel_grads(chunks: list[Any]) -> None:
    """Megatron's finalize step for sequence parallelism.

    A weight every tp rank holds whole (the row-parallel bias) saw only this rank's part of
    the sequence: its gradients are summed over tensor parallelism.
    """
    group = parallel_state.get_tensor_model_parallel_group()
    for chunk in chunks:
        for param in chunk.parameters():
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(param.main_grad, group=group)


def train(tp: int, pp: int) -> list[float]:
    """`STEPS` steps at tp x pp (sequence parallelism when tp > 1); the loss of each."""
    parallel_state.initialize_model_parallel(tp, pp)
    state = parallel_state.get_parallel_state()
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=tp > 1,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    resolved = resolve_schedule("1f1b", pp_size=pp, microbatch_counts=[MICROBATCHES])
    pipe = PipelineModel.from_parts(parts(config), placement=resolved, state=state)
    pipe.infer_contracts(batches(0)[0][0])
    chunks = [DistributedDataParallel(c, DDPConfig(), data_parallel_group=state.group("dp"))
              for c in pipe.chunks]  # fmt: skip
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), chunks, parallel_state=state)
    comm = P2PCommunicator.from_parallel_state(state) if pp > 1 else None
    forward_backward = get_forward_backward_func(comm, resolved=resolved)
    losses = []
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        reported = forward_backward(forward_step_func=forward_step, model=chunks,
                                    data_iterator=[iter(batches(step)) for _ in chunks],
                                    num_microbatches=MICROBATCHES)  # fmt: skip
        for chunk in chunks:
            chunk.finish_grad_sync()
        sum_sequence_parallel_grads(chunks)
        optimizer.step()
        loss = torch.stack([r["loss"] for r in reported]).mean() if reported else torch.zeros(())
        dist.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
        losses.append(float(loss))
    if comm is not None:
        comm.destroy()
    parallel_state.destroy_model_parallel()
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    losses = train(args.tp, args.pp)
    if dist.get_rank() == 0:
        print(losses, flush=True)
    dist.destroy_process_group()
