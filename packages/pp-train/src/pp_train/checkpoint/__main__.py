"""``python -m pp_train.checkpoint``: checkpoint tools that need no model and no process group.

::

    python -m pp_train.checkpoint convert --input DIR --output DIR --to {torch,torch_dist}
        [--iteration N]
    python -m pp_train.checkpoint export-hf --input DIR --output HFDIR [--iteration N]
        [--dtype {float32,bfloat16,float16}] [--tokenizer-model PATH]
    python -m pp_train.checkpoint import-hf --input HFDIR --output DIR
        [--tokenizer-type TYPE] [--tokenizer-model PATH] [--vocab-size N]
        [--make-vocab-size-divisible-by N]

``convert`` moves a checkpoint between the formats (`pp_train.checkpoint.convert`);
``export-hf`` writes a Hugging Face GPT-2 directory of a checkpoint and ``import-hf`` a
torch_dist checkpoint of one (`pp_train.checkpoint.hf`, `pp_train.checkpoint.hf_import`).
Every refusal (a missing input, a damaged file, an existing output, another model) is one
line on stderr and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from pp_train.checkpoint.convert import convert_checkpoint
from pp_train.checkpoint.errors import CheckpointError
from pp_train.checkpoint.formats import CKPT_FORMATS
from pp_train.checkpoint.hf import EXPORT_DTYPES, export_hf
from pp_train.checkpoint.hf_import import choose_tokenizer, import_hf, read_gpt2_config

__all__ = ["main"]

_PROG = "python -m pp_train.checkpoint"


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (prog: error: ...), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=_PROG, description="Checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    convert = commands.add_parser(
        "convert",
        help="convert a checkpoint between torch and torch_dist (no model needed)",
        description="Converts one iteration of a checkpoint directory into a new directory "
        "in the other format; torch_dist -> torch writes the layout that saved it.",
    )
    convert.add_argument("--input", required=True, help="checkpoint directory to convert")
    convert.add_argument(
        "--output", required=True, help="new (or empty) directory to write the conversion to"
    )
    convert.add_argument("--to", required=True, choices=CKPT_FORMATS, help="the output format")
    convert.add_argument(
        "--iteration", type=int, default=None, help="iteration to convert (default: latest)"
    )
    _export_parser(commands)
    _import_parser(commands)
    return parser


def _export_parser(commands: argparse._SubParsersAction[_Parser]) -> None:
    export = commands.add_parser(
        "export-hf",
        help="write a checkpoint of the GPT as a Hugging Face GPT-2 directory",
        description="Writes one iteration of a checkpoint (either format, any layout) as a "
        "directory transformers.GPT2LMHeadModel.from_pretrained loads.",
    )
    export.add_argument("--input", required=True, help="checkpoint directory to export")
    export.add_argument("--output", required=True, help="new (or empty) Hugging Face directory")
    export.add_argument(
        "--iteration", type=int, default=None, help="iteration to export (default: latest)"
    )
    export.add_argument(
        "--dtype", choices=list(EXPORT_DTYPES), default="float32",
        help="dtype of the weights written (default: float32, the fp32 main copies where the "
        "run kept them)",
    )  # fmt: skip
    export.add_argument(
        "--tokenizer-model", default=None,
        help="where the run's Hugging Face tokenizer is now (default: the saved path)",
    )  # fmt: skip


def _import_parser(commands: argparse._SubParsersAction[_Parser]) -> None:
    imported = commands.add_parser(
        "import-hf",
        help="write a Hugging Face GPT-2 directory as a torch_dist checkpoint",
        description="Writes a Hugging Face GPT-2 (config.json, model.safetensors) as a "
        "torch_dist checkpoint at iteration 0 for pp-train --load DIR --finetune, and prints "
        "the model flags that run needs. The tokenizer flags name the fine-tuning run's "
        "tokenizer (default: the directory's tokenizer.json, else one that fits the model).",
    )
    imported.add_argument("--input", required=True, help="Hugging Face directory to import")
    imported.add_argument("--output", required=True, help="new (or empty) checkpoint directory")
    imported.add_argument(
        "--tokenizer-type", default=None,
        choices=["ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer"],
        help="the fine-tuning run's --tokenizer-type",
    )  # fmt: skip
    imported.add_argument("--tokenizer-model", default=None, help="its --tokenizer-model")
    imported.add_argument("--vocab-size", type=int, default=None, help="its --vocab-size")
    imported.add_argument(
        "--make-vocab-size-divisible-by", type=int, default=128,
        help="its --make-vocab-size-divisible-by (default 128)",
    )  # fmt: skip


def _run(args: argparse.Namespace) -> str:
    """The command's work; the line it prints on success."""
    if args.command == "convert":
        written = convert_checkpoint(args.input, args.output, args.to, iteration=args.iteration)
        return f"converted {args.input} to {args.to} in {written}"
    if args.command == "export-hf":
        exported = export_hf(
            args.input, args.output, iteration=args.iteration,
            dtype=EXPORT_DTYPES[args.dtype], tokenizer_model=args.tokenizer_model,
        )  # fmt: skip
        source = "fp32 main copies" if exported.main_copies else "model weights"
        return (
            f"exported iteration {exported.iteration} of {args.input} ({source}, "
            f"{args.dtype}) to {exported.directory}"
        )
    hf_dir = Path(args.input)
    tokenizer = choose_tokenizer(
        hf_dir, read_gpt2_config(hf_dir)["vocab_size"], tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
    )  # fmt: skip
    imported = import_hf(
        hf_dir, args.output, tokenizer=tokenizer,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )  # fmt: skip
    flags = shlex.join(imported.flags)
    return (
        f"imported {args.input} to {imported.directory} (iteration 0); fine-tune it with:\n"
        f"  pp-train --load {shlex.quote(str(imported.directory))} --finetune {flags}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; 0 on success, 2 (one line on stderr) on a refusal."""
    args = _parser().parse_args(argv)
    try:
        line = _run(args)
    except (CheckpointError, OSError, ImportError) as error:
        print(f"{_PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    print(line)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
