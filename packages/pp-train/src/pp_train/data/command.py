"""What the data commands share: bad input is one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

__all__ = ["run_command"]


def run_command(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    action: Callable[[argparse.Namespace], None],
) -> int:
    """Parse `argv` and run `action`; a ValueError or ImportError becomes one error line.

    Returns:
        0 on success, 2 for bad input (argparse's own errors exit with 2 as well).
    """
    args = parser.parse_args(argv)
    try:
        action(args)
    except (ValueError, ImportError) as error:
        command = getattr(args, "command", None)
        print(f"{parser.prog}{f' {command}' if command else ''}: error: {error}", file=sys.stderr)
        return 2
    return 0
