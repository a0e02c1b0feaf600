"""A model that is not GPT, trained by `pp_train.pretrain`: a pipelined MLP regressor.

    torchrun --standalone --nproc-per-node 2 docs/examples/pretrain_mlp.py \
        --pipeline-model-parallel-size 2

The flags are pp-train's (Megatron's names); the model, the data and the loss are ours.
"""

import argparse

import torch

from pp_train import add_pretrain_flags, pretrain, pretrain_config_from_args

WIDTH = 16


class Samples:
    """Sample i: 16 random inputs and the sum of their sines."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = torch.randn(WIDTH, generator=torch.Generator().manual_seed(index))
        return {"tokens": x, "labels": torch.sin(x).sum(0, keepdim=True)}


class Stage(torch.nn.Module):
    """Some tanh layers; the first stage reads x, the last adds a head and the loss."""

    def __init__(self, layers: int, pre_process: bool, post_process: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.head = torch.nn.Linear(WIDTH, 1) if post_process else None
        self.pre_process, self.input = pre_process, None

    def set_input_tensor(self, tensors):
        """Megatron's hook: what the previous stage sent."""
        self.input = tensors[0]

    def forward(self, batch):
        """Activations between stages are (seq 1, batch, WIDTH)."""
        x = batch["tokens"].unsqueeze(0) if self.pre_process else self.input
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x if self.head is None else ((self.head(x)[0] - batch["labels"]) ** 2).mean()


def model_provider(pre_process, post_process, vp_stage, state):
    """This rank's stage (`state`: pp-state's ParallelState, handed over when asked for)."""
    torch.manual_seed(state.pipeline_model_parallel_rank)  # the same on every replica
    layers = config.model.num_layers // state.pipeline_model_parallel_size
    return Stage(layers, pre_process, post_process)


def forward_step(data, model):
    """The next microbatch through the chunk: Megatron's (output, loss_func)."""
    loss = model(next(data))
    return loss, lambda loss: (loss, {"mse": loss.detach()})


parser = add_pretrain_flags(argparse.ArgumentParser())
parser.set_defaults(num_layers=4, hidden_size=WIDTH, num_attention_heads=1, seq_length=1, lr=3e-3)
parser.set_defaults(train_iters=60, micro_batch_size=8, global_batch_size=32, log_interval=20)
config = pretrain_config_from_args(parser.parse_args())
pretrain(lambda num_samples: (Samples(), None, None), model_provider, forward_step, config=config)
