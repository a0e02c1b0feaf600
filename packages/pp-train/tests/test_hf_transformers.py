"""The exported GPT checked against the transformers library's own GPT-2 forward.

The bundled GPT is trained a few steps at several layouts and saved; ``export-hf`` writes each
checkpoint as a Hugging Face directory, ``GPT2LMHeadModel.from_pretrained`` loads it, and its
logits must equal pp-train's one-process forward of the same checkpoint (loaded by pp-train's
own loader at tensor and pipeline size 1, the first ``vocab_size`` columns of its padded
vocabulary) within 1e-5 relative. A Hugging Face model imported by ``import-hf`` and exported
again is bitwise the same model, and the transformers library generates from it.

Skipped where transformers is missing, except under ``PP_TRAIN_HF_ORACLE=1`` (the nox sessions
``tests(pp-train)`` and ``hf_oracle`` install it, pinned), where a missing oracle is a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("PP_TRAIN_HF_ORACLE") != "1":
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")

import safetensors.torch
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from pp_state import ParallelConfig, ParallelState
from pp_tensor import pad_vocab_size
from pp_testing import run_distributed
from pp_train.app import build_parser, validate_args
from pp_train.app.command import run
from pp_train.app.gpt import GPTChunk, GPTConfig
from pp_train.checkpoint import export_hf, import_hf, load_checkpoint, read_tracker
from pp_train.checkpoint.__main__ import main as checkpoint_main

VOCAB, DIVISOR, BATCH, SEQ = 256, 96, 2, 32
FLAGS = [
    "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
    "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "0",
    "--log-interval", "1", "--lr", "1e-2", "--lr-warmup-iters", "1", "--lr-decay-iters", "10",
    "--train-iters", "3", "--make-vocab-size-divisible-by", str(DIVISOR),
]  # fmt: skip
"""A tiny GPT on the bundled corpus (256 byte ids, padded to a multiple of 96 x tp: rows of
padding the export drops)."""


@dataclasses.dataclass(frozen=True)
class Saved:
    """A checkpoint saved by the command at one layout."""

    ranks: int
    flags: tuple[str, ...]
    layers: int = 2
    untied: bool = False
    tanh: bool = False

    def argv(self, root: Path) -> list[str]:
        extra = ["--untie-embeddings-and-output-weights"] if self.untied else []
        extra += ["--openai-gelu"] if self.tanh else []
        return [*FLAGS, "--num-layers", str(self.layers), *self.flags, *extra, "--save", str(root)]


LAYOUTS = {
    "tp1-torch": Saved(1, ("--ckpt-format", "torch")),
    "tp2-pp2-untied": Saved(
        4, ("--ckpt-format", "torch_dist", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2"), untied=True,
    ),
    "pp2-vp2-untied-tanh": Saved(
        2, ("--ckpt-format", "torch_dist", "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "1"), layers=4, untied=True, tanh=True,
    ),
    "dp2-distributed-optimizer-tanh": Saved(
        2, ("--ckpt-format", "torch", "--use-distributed-optimizer"), tanh=True
    ),
    "tp2-dp2-distributed-optimizer": Saved(
        4, ("--ckpt-format", "torch_dist", "--use-distributed-optimizer",
            "--tensor-model-parallel-size", "2"),
    ),
}  # fmt: skip


def _command(argv: list[str]) -> str:
    """The pp-train command on this rank (the harness made the process group)."""
    parser = build_parser()
    args = validate_args(parser, parser.parse_args(argv), dist.get_world_size())
    with contextlib.redirect_stdout(io.StringIO()):
        return run(args)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    layout = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    run_distributed(_command, layout.ranks, layout.argv(root), timeout=300)
    assert read_tracker(root) == 3
    return root, layout


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _pp_logits(root: str, layers: int, untied: bool, tanh: bool, ckpt_format: str) -> Any:
    """pp-train's forward of the checkpoint loaded by its own loader at tp 1, pp 1."""
    state = ParallelState.create(ParallelConfig())
    padded = pad_vocab_size(VOCAB, DIVISOR, 1)
    config = GPTConfig(
        num_layers=layers, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
        vocab_size=padded, openai_gelu=tanh,
    )  # fmt: skip
    chunk = GPTChunk(
        config, layers=range(layers), pre_process=True, post_process=True, seed=0,
        share_embeddings_and_output_weights=not untied,
    )  # fmt: skip
    args = {
        "num_layers": layers, "hidden_size": 32, "num_attention_heads": 4, "seq_length": SEQ,
        "vocab_size": VOCAB, "padded_vocab_size": padded, "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
        "untie_embeddings_and_output_weights": untied, "openai_gelu": tanh,
    }  # fmt: skip
    loaded = load_checkpoint(
        root, state=state, model=[chunk], optimizer=None, scheduler=None, args=args,
        finetune=True, ckpt_format=ckpt_format, report=None,  # type: ignore[arg-type]
    )  # fmt: skip
    assert loaded is not None
    with torch.no_grad():
        return chunk.eval()(_tokens())


def _relative(found: torch.Tensor, expected: torch.Tensor) -> float:
    return float((found - expected).abs().max() / expected.abs().max())


def test_the_exported_gpt_gives_pp_trains_logits_in_transformers(
    saved: tuple[Path, Saved], tmp_path: Path
) -> None:
    root, layout = saved
    ckpt_format = layout.flags[1]  # the torch ones are saved at tp 1 x pp 1: they load there
    exported = export_hf(root, tmp_path / "hf")
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert model.config.tie_word_embeddings is not layout.untied
    assert model.config.activation_function == ("gelu_new" if layout.tanh else "gelu")
    with torch.no_grad():
        theirs = model(_tokens()).logits
    args = (str(root), layout.layers, layout.untied, layout.tanh, ckpt_format)
    ours = run_distributed(_pp_logits, 1, *args, timeout=120)[0]
    assert ours.shape[-1] == pad_vocab_size(VOCAB, DIVISOR, 1) > VOCAB
    difference = _relative(theirs, ours[..., :VOCAB])
    print(f"{root.name}: max relative logit difference {difference:.2e}")
    assert difference < 1e-5
    assert exported.config["vocab_size"] == VOCAB


@pytest.mark.parametrize(("tied", "activation"), [(True, "gelu"), (False, "gelu_new")])
def test_a_transformers_gpt2_imports_and_exports_bitwise_and_generates(
    tmp_path: Path, tied: bool, activation: str
) -> None:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
        activation_function=activation, tie_word_embeddings=tied, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    original = GPT2LMHeadModel(config).eval()
    original.save_pretrained(tmp_path / "original")
    assert checkpoint_main(["import-hf", "--input", str(tmp_path / "original"),
                            "--output", str(tmp_path / "ckpt")]) == 0  # fmt: skip
    export_hf(tmp_path / "ckpt", tmp_path / "again")
    before = safetensors.torch.load_file(tmp_path / "original" / "model.safetensors")
    after = safetensors.torch.load_file(tmp_path / "again" / "model.safetensors")
    if tied:
        before.pop("lm_head.weight", None)
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "again").eval()
    prompt = _tokens()[:1, :4]
    with torch.no_grad():
        expected = original.generate(prompt, max_new_tokens=5, do_sample=False)
        found = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert found.shape == (1, 9)
    assert torch.equal(found, expected)


def test_an_imported_model_is_the_library_call_of_the_command(tmp_path: Path) -> None:
    """The library call writes what the command writes (one model, one set of flags)."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    imported = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert "--openai-gelu" in imported.flags  # GPT2Config's default activation is gelu_new
    assert read_tracker(tmp_path / "ckpt") == 0
