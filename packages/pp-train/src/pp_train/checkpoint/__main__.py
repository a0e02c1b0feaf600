"""``python -m pp_train.checkpoint convert``: points to the training command's conversion flags.

A checkpoint does not record the global names of its tensors (the model's
``sharded_state_keys()`` gives them), so a conversion needs the model that wrote it. This
command therefore converts nothing: it refuses with the equivalent command line, which
loads ``--input`` with the model and writes ``--output`` (Megatron's ``--ckpt-convert-format``
and ``--ckpt-convert-save``). Nothing is read or written.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from pp_train.checkpoint.formats import CKPT_FORMATS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pp_train.checkpoint",
        description="Checkpoint tools. Conversion runs in the training command (see convert).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser(
        "convert",
        help="convert a checkpoint between torch and torch_dist (prints the command that does)",
        description="Conversion needs the model that wrote the checkpoint; this prints the "
        "training command that converts it (--ckpt-convert-format / --ckpt-convert-save).",
    )
    convert.add_argument("--input", required=True, help="checkpoint directory to convert")
    convert.add_argument("--output", required=True, help="directory to write the conversion to")
    convert.add_argument("--to", required=True, choices=CKPT_FORMATS, help="the output format")
    convert.set_defaults(parser=convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parses `argv`; ``convert`` always ends in a usage error (exit status 2)."""
    parser = _parser()
    args = parser.parse_args(argv)
    flags = shlex.join(
        ["--load", args.input, "--ckpt-convert-format", args.to, "--ckpt-convert-save", args.output]
    )
    convert: argparse.ArgumentParser = args.parser
    convert.error(
        "cannot run without the model: a checkpoint does not record its tensors' global "
        "names. Convert with the training command, using the flags of the run that saved it "
        f"(model, layout, optimizer, schedule) and:\n  {flags}\ne.g. torchrun "
        f"--nproc-per-node N -m pp_train ... {flags}\n(see docs/checkpoints.md, 'Converting "
        "between the formats'); nothing was read or written"
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
