"""The Hugging Face converter without transformers: round trips, fine-tuning, refusals.

A GPT-2 directory is written by hand (config.json and model.safetensors of random tensors);
``import-hf`` then ``export-hf`` must give back bitwise the same tensors; an imported model
fine-tuned 5 steps at pp 2 must give the losses of the same fine-tune at pp 1. Checkpoints of
any layout export the same model: a torch_dist checkpoint and its conversion to the torch
format, and the fp32 main copies of a bf16 run with the distributed optimizer (rounded, the
bf16 model), and a run split unevenly over the pipeline exports the tensors pp-train's own
loader reads at one stage. A run with a Hugging Face tokenizer exports its files and its
end-of-document id. Every bad input is one error naming the file and the tensor, nothing
written.
(test_hf_transformers.py checks the exports against the transformers library.)
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as safetensors_torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pp_state import ParallelConfig, ParallelState
from pp_tensor import pad_vocab_size
from pp_testing import run_distributed
from pp_train.app import build_parser, load_corpus, validate_args
from pp_train.app.command import run
from pp_train.app.gpt import GPTChunk, GPTConfig
from pp_train.checkpoint import (
    CheckpointError,
    export_hf,
    import_hf,
    load_checkpoint,
    read_tracker,
)
from pp_train.checkpoint.__main__ import main as checkpoint_main
from pp_train.checkpoint.hf import to_hf_tensors
from pp_train.data import HuggingFaceTokenizer
from pp_train.preprocess import main as preprocess

HIDDEN, HEADS, SEQ, VOCAB = 32, 4, 32, 256
TRAIN = [
    "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "0",
    "--log-interval", "1", "--lr", "1e-2", "--lr-warmup-iters", "1", "--lr-decay-iters", "10",
]  # fmt: skip
SAVE = [
    *TRAIN, "--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads",
    str(HEADS), "--seq-length", str(SEQ), "--train-iters", "3",
    "--make-vocab-size-divisible-by", "96",
]  # fmt: skip


def _shapes(layers: int, tied: bool) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (VOCAB, HIDDEN), "transformer.wpe.weight": (SEQ, HIDDEN),
        "transformer.ln_f.weight": (HIDDEN,), "transformer.ln_f.bias": (HIDDEN,),
    }  # fmt: skip
    for i in range(layers):
        h = f"transformer.h.{i}."
        shapes.update({
            h + "ln_1.weight": (HIDDEN,), h + "ln_1.bias": (HIDDEN,), h + "ln_2.weight": (HIDDEN,),
            h + "ln_2.bias": (HIDDEN,), h + "attn.c_attn.weight": (HIDDEN, 3 * HIDDEN),
            h + "attn.c_attn.bias": (3 * HIDDEN,), h + "attn.c_proj.weight": (HIDDEN, HIDDEN),
            h + "attn.c_proj.bias": (HIDDEN,), h + "mlp.c_fc.weight": (HIDDEN, 4 * HIDDEN),
            h + "mlp.c_fc.bias": (4 * HIDDEN,), h + "mlp.c_proj.weight": (4 * HIDDEN, HIDDEN),
            h + "mlp.c_proj.bias": (HIDDEN,),
        })  # fmt: skip
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def _hf_dir(path: Path, *, tied: bool = True, layers: int = 2, **config: Any) -> Path:
    """A GPT-2 directory of random tensors, written without transformers."""
    path.mkdir(parents=True)
    generator = torch.Generator().manual_seed(3)
    tensors = {
        name: torch.randn(shape, generator=generator) * 0.05
        for name, shape in _shapes(layers, tied).items()
    }
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    content = {
        "model_type": "gpt2", "vocab_size": VOCAB, "n_positions": SEQ, "n_embd": HIDDEN,
        "n_layer": layers, "n_head": HEADS, "activation_function": "gelu",
        "tie_word_embeddings": tied, **config,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(content), encoding="utf-8")
    return path


def _load(path: Path) -> dict[str, torch.Tensor]:
    return dict(safetensors_torch.load_file(str(path / "model.safetensors")))


def _command(argv: list[str]) -> str:
    """The pp-train command on this rank; what it printed."""
    parser = build_parser()
    args = validate_args(parser, parser.parse_args(argv), dist.get_world_size())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run(args)
    return printed.getvalue()


def _losses(printed: str) -> list[float]:
    return [
        float(x) for x in re.findall(r"iteration\s+\d+/\s*\d+ \|.*? lm loss: (\S+) \|", printed)
    ]


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize(("tied", "activation"), [(True, "gelu"), (False, "gelu_new")])
def test_import_then_export_gives_bitwise_the_same_tensors(
    tmp_path: Path, tied: bool, activation: str
) -> None:
    source = _hf_dir(tmp_path / "hf", tied=tied, activation_function=activation)
    imported = import_hf(source, tmp_path / "ckpt")
    assert ("--untie-embeddings-and-output-weights" in imported.flags) is not tied
    assert ("--openai-gelu" in imported.flags) is (activation == "gelu_new")
    exported = export_hf(tmp_path / "ckpt", tmp_path / "again")
    before, after = _load(source), _load(tmp_path / "again")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert exported.config["activation_function"] == activation
    assert exported.config["tie_word_embeddings"] is tied


def test_an_imported_model_fine_tunes_at_pp2_with_the_losses_of_pp1(tmp_path: Path) -> None:
    source = _hf_dir(tmp_path / "hf", layers=4)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = checkpoint_main(
            ["import-hf", "--input", str(source), "--output", str(tmp_path / "c")]
        )
    assert code == 0
    command = printed.getvalue().splitlines()[-1].split()
    assert command[:4] == ["pp-train", "--load", str(tmp_path / "c"), "--finetune"]
    argv = [*command[1:], *TRAIN, "--train-iters", "5"]
    one = _losses(run_distributed(_command, 1, argv, timeout=300)[0])
    pipelined = run_distributed(_command, 2, [*argv, "--pipeline-model-parallel-size", "2"])
    two = _losses("".join(pipelined))
    assert len(one) == len(two) == 5
    difference = max(abs(a - b) / abs(b) for a, b in zip(two, one, strict=True))
    print(f"fine-tune losses {one}: pp 2 differs from pp 1 by {difference:.2e} relative at most")
    assert two == pytest.approx(one, rel=1e-6, abs=0)


def test_a_torch_dist_checkpoint_and_its_torch_conversion_export_alike(tmp_path: Path) -> None:
    """tp 2 x pp 2, untied: the vocabulary's padding (96 x 2) and the qkv order undone."""
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    extra = ["--untie-embeddings-and-output-weights", "--ckpt-format", "torch_dist"]
    run_distributed(_command, 4, [*SAVE, *layout, *extra, "--save", str(tmp_path / "dist")])
    assert checkpoint_main(["convert", "--input", str(tmp_path / "dist"), "--output",
                            str(tmp_path / "torch"), "--to", "torch"]) == 0  # fmt: skip
    export_hf(tmp_path / "dist", tmp_path / "a")
    assert checkpoint_main(["export-hf", "--input", str(tmp_path / "torch"), "--output",
                            str(tmp_path / "b")]) == 0  # fmt: skip
    a, b = _load(tmp_path / "a"), _load(tmp_path / "b")
    assert sorted(a) == sorted(b)
    assert "lm_head.weight" in a
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert a["transformer.wte.weight"].shape == (VOCAB, HIDDEN)


def _bf16_model(directory: Path) -> dict[str, torch.Tensor]:
    """The bf16 model tensors of a torch_dist iteration, read directly."""
    reader = dcp.FileSystemReader(directory)
    names = [k for k in reader.read_metadata().state_dict_metadata if k.startswith("model.")]
    entries = reader.read_metadata().state_dict_metadata
    buffers = {k: torch.empty(tuple(entries[k].size), dtype=torch.bfloat16) for k in names}  # type: ignore[union-attr]
    dcp.load(buffers, storage_reader=reader, no_dist=True)
    return {k.removeprefix("model."): v for k, v in buffers.items()}


def test_a_bf16_run_with_the_distributed_optimizer_exports_its_fp32_main_copies(
    tmp_path: Path,
) -> None:
    """tp 2 x dp 2: shards of parts split along rows and columns put together."""
    flags = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"]
    root = tmp_path / "ckpt"
    run_distributed(
        _command, 4, [*SAVE, *flags, "--ckpt-format", "torch_dist", "--save", str(root)]
    )
    fp32 = export_hf(root, tmp_path / "fp32")
    assert fp32.main_copies
    assert checkpoint_main(["export-hf", "--input", str(root), "--output", str(tmp_path / "bf16"),
                            "--dtype", "bfloat16"]) == 0  # fmt: skip
    main, half = _load(tmp_path / "fp32"), _load(tmp_path / "bf16")
    model = to_hf_tensors(
        _bf16_model(root / "iter_0000003"), num_attention_heads=HEADS, vocab_size=VOCAB,
        dtype=torch.bfloat16,
    )  # fmt: skip
    assert all(main[name].dtype == torch.float32 for name in main)
    assert all(torch.equal(main[name].bfloat16(), half[name]) for name in main)
    assert all(torch.equal(model[name], half[name]) for name in main)
    assert any(not torch.equal(main[name], half[name].float()) for name in main)


def _loaded_at_one_stage(root: str, layers: int) -> dict[str, torch.Tensor]:
    """The model tensors pp-train's own loader puts in a one-process GPT (tp 1, pp 1)."""
    state = ParallelState.create(ParallelConfig())
    padded = pad_vocab_size(VOCAB, 96, 1)
    config = GPTConfig(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
        vocab_size=padded,
    )  # fmt: skip
    chunk = GPTChunk(config, layers=range(layers), pre_process=True, post_process=True, seed=0)
    args = {
        "num_layers": layers, "hidden_size": HIDDEN, "num_attention_heads": HEADS,
        "seq_length": SEQ, "vocab_size": VOCAB, "padded_vocab_size": padded,
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "untie_embeddings_and_output_weights": False, "openai_gelu": False,
    }  # fmt: skip
    loaded = load_checkpoint(
        root, state=state, model=[chunk], optimizer=None, scheduler=None, args=args,
        finetune=True, ckpt_format="torch_dist", report=None,
    )  # fmt: skip
    assert loaded is not None
    return {name: value.detach().clone() for name, value in chunk.state_dict().items()}


def test_an_uneven_pipeline_exports_what_the_loader_reads_at_one_stage(tmp_path: Path) -> None:
    """pp 2 with 1 layer on the first stage and 2 on the last (Et|ttL), both formats.

    The second opinion is pp-train's checkpoint loader (not the exporter's reader) putting the
    torch_dist checkpoint in a one-stage GPT; its tensors, renamed, must be the export's.
    """
    uneven = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"]
    argv = [*SAVE, "--num-layers", "3", *uneven, "--ckpt-format", "torch_dist"]
    printed = run_distributed(_command, 2, [*argv, "--save", str(tmp_path / "dist")])
    assert "layer layout Et|ttL" in "".join(printed)
    assert checkpoint_main(["convert", "--input", str(tmp_path / "dist"), "--output",
                            str(tmp_path / "torch"), "--to", "torch"]) == 0  # fmt: skip
    export_hf(tmp_path / "dist", tmp_path / "a")
    export_hf(tmp_path / "torch", tmp_path / "b")
    loaded = run_distributed(_loaded_at_one_stage, 1, str(tmp_path / "dist"), 3)[0]
    expected = to_hf_tensors(loaded, num_attention_heads=HEADS, vocab_size=VOCAB)
    a, b = _load(tmp_path / "a"), _load(tmp_path / "b")
    assert sorted(a) == sorted(b) == sorted(expected) == sorted(_shapes(3, tied=True))
    assert all(torch.equal(a[name], expected[name]) for name in expected)
    assert all(torch.equal(b[name], expected[name]) for name in expected)
    fc = [expected[f"transformer.h.{i}.mlp.c_fc.weight"] for i in range(3)]
    assert not any(torch.equal(fc[i], fc[j]) for i, j in ((0, 1), (0, 2), (1, 2)))


def _tiny_tokenizer(directory: Path, lines: list[str]) -> None:
    """A byte-level BPE of 300 ids whose tokenizer_config.json names ``</s>`` (id 2) as eos."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<|endoftext|>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(lines, trainer)
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def test_a_run_with_a_hugging_face_tokenizer_exports_its_files_and_its_eod_id(
    tmp_path: Path,
) -> None:
    lines = [line for line in load_corpus().decode().splitlines() if line.strip()][:200]
    _tiny_tokenizer(tmp_path / "tokenizer", lines)
    eod = HuggingFaceTokenizer(tmp_path / "tokenizer").eod
    assert eod == 2  # the config's eos_token, not the <|endoftext|> found by name
    documents = tmp_path / "docs.jsonl"
    documents.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    prefix = str(tmp_path / "corpus")
    hf = ["--tokenizer-type", "HuggingFaceTokenizer",
          "--tokenizer-model", str(tmp_path / "tokenizer")]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert preprocess(["--input", str(documents), "--output-prefix", prefix,
                           "--json-keys", "text", "--append-eod", *hf]) == 0  # fmt: skip
    data = ["--data-path", f"{prefix}_text_document", "--split", "100,0,0"]
    run_distributed(_command, 1, [*SAVE, *hf, *data, "--save", str(tmp_path / "ckpt")])
    exported = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert exported.tokenizer == "copied"
    written = sorted(path.name for path in (tmp_path / "hf").iterdir())
    assert written == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "tokenizer" / name).read_bytes()
    config = json.loads((tmp_path / "hf" / "config.json").read_text(encoding="utf-8"))
    assert config["bos_token_id"] == config["eos_token_id"] == eod
    assert config["vocab_size"] == 300
    assert _load(tmp_path / "hf")["transformer.wte.weight"].shape == (300, HIDDEN)


# ----------------------------------------------------------------------------- refusals
def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], output: Path) -> str:
    assert checkpoint_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert not output.exists()
    assert not list(output.parent.glob(f"{output.name}*"))  # no temporary left either
    return err


@pytest.mark.parametrize(
    ("field", "value"),
    [("model_type", "llama"), ("scale_attn_by_inverse_layer_idx", True),
     ("scale_attn_weights", False), ("add_cross_attention", True),
     ("reorder_and_upcast_attn", True), ("activation_function", "relu"),
     ("layer_norm_epsilon", 1e-6)],
)  # fmt: skip
def test_an_hf_model_the_gpt_cannot_compute_alike_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: Any
) -> None:
    source = _hf_dir(tmp_path / "hf", **{field: value})
    output = tmp_path / "out"
    err = _refused(["import-hf", "--input", str(source), "--output", str(output)], capsys, output)
    assert field in err
    assert "config.json" in err


def test_a_vocabulary_larger_than_the_tokenizer_flags_give_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, output = _hf_dir(tmp_path / "hf", vocab_size=300), tmp_path / "out"
    argv = ["import-hf", "--input", str(source), "--output", str(output)]
    err = _refused([*argv, "--tokenizer-type", "ByteTokenizer"], capsys, output)
    assert "vocab_size 300" in err
    assert "257 ids" in err
    assert "config.json" in err


def test_hf_weights_missing_or_of_another_shape_are_refused_naming_file_and_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _hf_dir(tmp_path / "hf")
    tensors = _load(source)
    tensors["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(HIDDEN, 3 * HIDDEN)
    safetensors_torch.save_file(
        tensors, str(source / "model.safetensors"), metadata={"format": "pt"}
    )
    output = tmp_path / "out"
    err = _refused(["import-hf", "--input", str(source), "--output", str(output)], capsys, output)
    assert "model.safetensors" in err
    assert "transformer.h.1.mlp.c_fc.weight" in err
    assert "(32, 96)" in err
    (source / "model.safetensors").unlink()
    err = _refused(["import-hf", "--input", str(source), "--output", str(output)], capsys, output)
    assert "no weights" in err
    assert "model.safetensors" in err


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    run_distributed(_command, 1, [*SAVE, "--ckpt-format", "torch_dist", "--save", str(root)])
    assert read_tracker(root) == 3
    return root


def test_bad_checkpoints_are_refused_naming_the_file_and_nothing_is_written(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "exports" / "out"
    export = ["export-hf", "--output", str(output), "--input"]
    (tmp_path / "empty").mkdir()
    err = _refused([*export, str(tmp_path / "empty")], capsys, output)
    assert "latest_checkpointed_iteration.txt" in err
    err = _refused([*export, str(trained), "--iteration", "7"], capsys, output)
    assert "iter_0000007" in err
    assert "iter_0000003" in err
    damaged = tmp_path / "damaged"
    shutil.copytree(trained, damaged)
    shard = sorted((damaged / "iter_0000003").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    err = _refused([*export, str(damaged)], capsys, output)
    assert str(damaged / "iter_0000003") in err
    assert "model." in err
    shard.unlink()
    err = _refused([*export, str(damaged)], capsys, output)
    assert shard.name in err


def test_an_existing_output_is_refused(trained: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not an empty directory"):
        export_hf(trained, tmp_path / "out")
    assert (tmp_path / "out" / "keep").read_text() == "mine"
