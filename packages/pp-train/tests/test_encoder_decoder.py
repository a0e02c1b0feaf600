"""An encoder-decoder model trained through pp-train with a split rank equals one process.

The model is a tiny T5: a word embedding shared by the encoder, the decoder and the output
layer, and a position embedding shared by encoder and decoder. With a pipeline, the first
encoder stage, the first decoder stage (the split rank) and the last stage each hold a copy of
the word embedding (summed over the embedding group) and the first two a copy of the position
embedding (its group), as Megatron lays them out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pp_optim import LRScheduleConfig, OptimizerConfig
from pp_state import ParallelConfig, ParallelState
from pp_testing import run_distributed
from pp_train import (
    ModelType,
    build_forward_backward_func,
    get_model,
    setup_model_and_optimizer,
    train_step,
    unwrap_model,
)

VOCAB, HIDDEN, ENC_SEQ, DEC_SEQ, MICRO, MICROBATCHES = 13, 8, 5, 4, 2, 2
ENC_LAYERS = DEC_LAYERS = 2
ITERATIONS = 4
Microbatch = dict[str, torch.Tensor]


def _linear(seed: int) -> torch.nn.Linear:
    """A layer whose weights depend on its global index only (equal in every layout)."""
    layer = torch.nn.Linear(HIDDEN, HIDDEN)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=generator) * 0.3)
        layer.bias.copy_(torch.randn(HIDDEN, generator=generator) * 0.1)
    return layer


class Embedding(torch.nn.Module):
    """Word and position embeddings (Megatron's ``embedding.position_embeddings`` layout)."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.word_embeddings = torch.nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = torch.nn.Embedding(max(ENC_SEQ, DEC_SEQ), HIDDEN)
        with torch.no_grad():
            self.word_embeddings.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator))
            self.position_embeddings.weight.copy_(
                torch.randn(max(ENC_SEQ, DEC_SEQ), HIDDEN, generator=generator)
            )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        embedded: torch.Tensor = self.word_embeddings(tokens) + self.position_embeddings(positions)
        return embedded.transpose(0, 1)  # (seq, batch, hidden), as between stages


class TinyT5(torch.nn.Module):
    """One stage of the encoder-decoder (or, on one process, all of it)."""

    share_embeddings_and_output_weights = True

    def __init__(
        self,
        *,
        pre_process: bool,
        post_process: bool,
        add_encoder: bool,
        add_decoder: bool,
        stage: int,
        stages: int,
        split: int,
    ) -> None:
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.add_encoder, self.add_decoder = add_encoder, add_decoder
        if stages == 1:
            encoder, decoder = range(ENC_LAYERS), range(DEC_LAYERS)
        else:
            encoder = _share(ENC_LAYERS, stage, split) if add_encoder else range(0)
            decoder = _share(DEC_LAYERS, stage - split, stages - split) if add_decoder else range(0)
        self.encoder = torch.nn.ModuleList(_linear(100 + i) for i in encoder)
        self.decoder = torch.nn.ModuleList(_linear(200 + i) for i in decoder)
        self.cross = torch.nn.ModuleList(_linear(300 + i) for i in decoder)
        self.embedding: Embedding | None = None
        # The first encoder stage holds the embeddings; the split stage and the last stage copies.
        if pre_process or (post_process and add_decoder):
            self.embedding = Embedding()
            if stage > 0:  # a copy: its gradient is counted on the first stage (clipping)
                for weight in self.embedding.parameters():
                    weight.shared = True  # type: ignore[attr-defined]
        self.inputs: list[torch.Tensor | None] = [None]

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        self.inputs = tensors

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter | None:
        if self.embedding is None:
            return None
        weight = self.embedding.word_embeddings.weight
        assert isinstance(weight, torch.nn.Parameter)
        return weight

    def forward(self, microbatch: Microbatch) -> torch.Tensor:
        encoded = self.inputs[-1]
        if self.add_encoder:
            x = self._embed(microbatch["enc"]) if self.pre_process else self.inputs[0]
            assert x is not None
            for layer in self.encoder:
                x = x + torch.tanh(layer(x))
            if not self.add_decoder:
                return x
            encoded = x  # one process: straight on to the decoder
        assert encoded is not None
        first_decoder = self.pre_process and not self.add_encoder
        x = self._embed(microbatch["dec"]) if first_decoder or self.add_encoder else self.inputs[0]
        assert x is not None
        context = encoded.mean(0, keepdim=True)
        for layer, cross in zip(self.decoder, self.cross, strict=True):
            x = x + torch.tanh(layer(x) + cross(context))
        if not self.post_process:
            return x
        weight = self.shared_embedding_or_output_weight()
        assert weight is not None
        logits = x.transpose(0, 1) @ weight.t()  # (batch, seq, vocab)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), microbatch["labels"].reshape(-1)
        )

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.embedding is not None
        return self.embedding(tokens)  # type: ignore[no-any-return]


def _share(layers: int, stage: int, stages: int) -> range:
    per = layers // stages
    return range(stage * per, (stage + 1) * per)


def _batches(iterations: int) -> list[Microbatch]:
    """The same global batch every iteration, so the loss must fall."""
    generator = torch.Generator().manual_seed(5)
    batch = [
        {
            "enc": torch.randint(0, VOCAB, (MICRO, ENC_SEQ), generator=generator),
            "dec": torch.randint(0, VOCAB, (MICRO, DEC_SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB, (MICRO, DEC_SEQ), generator=generator),
        }
        for _ in range(MICROBATCHES)
    ]
    return batch * iterations


def _forward_step(
    data: Iterator[Microbatch], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[..., Any]]:
    output = model(next(data))
    return output, lambda loss: (loss, {"lm loss": loss.detach()})


def _train(pp: int, split: int | None) -> tuple[list[float], int]:
    state = ParallelState.create(
        ParallelConfig(pipeline_model_parallel_size=pp, pipeline_model_parallel_split_rank=split)
    )
    rank = state.pipeline_model_parallel_rank

    def provider(**where: bool) -> torch.nn.Module:
        return TinyT5(**where, stage=rank, stages=pp, split=split or 1)

    model, optimizer, scheduler, _ = setup_model_and_optimizer(
        provider,
        state,
        optimizer_config=OptimizerConfig(lr=0.05, clip_grad=0.5),
        lr_schedule=LRScheduleConfig(max_lr=0.05, min_lr=0.01, lr_decay_steps=100),
        model_type=ModelType.encoder_and_decoder,
    )
    forward_backward = build_forward_backward_func(state, model, optimizer, hidden_size=HIDDEN)
    data = iter(_batches(ITERATIONS))
    losses: list[float] = []
    for _ in range(ITERATIONS):
        loss, skipped, _, _ = train_step(
            _forward_step,
            data,
            model,
            optimizer,
            scheduler,
            forward_backward_func=forward_backward,
            state=state,
            num_microbatches=MICROBATCHES,
            micro_batch_size=MICRO,
            seq_length=ENC_SEQ,
            decoder_seq_length=DEC_SEQ,
        )
        assert skipped == 0
        losses.extend(loss.values())
    parameters = sum(p.numel() for p in unwrap_model(model[0]).parameters())
    state.destroy()
    return losses, parameters


@pytest.fixture(scope="module")
def one_process() -> list[float]:
    losses: list[float] = run_distributed(_train, 1, 1, None, timeout=120)[0][0]
    assert len(losses) == ITERATIONS
    assert losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize(("pp", "split"), [(2, 1), (4, 2)])
def test_encoder_decoder_training_with_a_split_rank_equals_one_process(
    pp: int, split: int, one_process: list[float]
) -> None:
    results = run_distributed(_train, pp, pp, split, timeout=180)
    losses, _ = results[-1]
    assert losses == pytest.approx(one_process, abs=1e-5)
    assert all(not rank_losses for rank_losses, _ in results[:-1])


def _refused(pp: int, split: int | None, vp: int | None) -> str:
    state = ParallelState.create(
        ParallelConfig(
            pipeline_model_parallel_size=pp,
            pipeline_model_parallel_split_rank=split,
            virtual_pipeline_model_parallel_size=vp,
        )
    )
    try:
        with pytest.raises(ValueError, match="encoder-decoder model needs") as error:
            get_model(
                lambda **kw: TinyT5(**kw, stage=0, stages=pp, split=1),
                state,
                model_type=ModelType.encoder_and_decoder,
            )
        return str(error.value)
    finally:
        state.destroy()


def test_encoder_decoder_model_needs_a_split_rank_on_a_pipeline() -> None:
    messages = run_distributed(_refused, 2, 2, None, None, timeout=120)
    assert "pipeline size 2, split rank None" in messages[0]
