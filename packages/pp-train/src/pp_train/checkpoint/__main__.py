"""``python -m pp_train.checkpoint convert``: converts a checkpoint between the formats.

One process, no model, no process group (`pp_train.checkpoint.convert`)::

    python -m pp_train.checkpoint convert --input DIR --output DIR --to {torch,torch_dist}
        [--iteration N]

Every refusal (a missing input, a file without conversion records, an existing output, an
unknown format) is one line on stderr and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from pp_train.checkpoint.convert import convert_checkpoint
from pp_train.checkpoint.errors import CheckpointError
from pp_train.checkpoint.formats import CKPT_FORMATS

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; 0 on success, 2 (one line on stderr) on a refusal."""
    args = _parser().parse_args(argv)
    try:
        written = convert_checkpoint(args.input, args.output, args.to, iteration=args.iteration)
    except (CheckpointError, OSError) as error:
        print(f"{_PROG} convert: error: {error}", file=sys.stderr)
        return 2
    print(f"converted {args.input} to {args.to} in {written}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
