"""``python -m pp_train.data show``: the samples a run would train on, as the model sees them.

Builds the same datasets `build_train_valid_test_datasets` gives training (same flags as the
command: ``--data-path``, ``--split``, ``--seq-length``, ``--seed``, the sample counts) and
prints samples ``--indices A:B`` of each split: one line each, or one JSON object each with
``--json`` (``{"split": "train", "index": i, "tokens": [seq_length + 1 ints]}``, the window
whose first ``seq_length`` tokens are the input and last ``seq_length`` the labels).
``--text`` adds the detokenized window.
"""

from __future__ import annotations

import argparse
import json
import sys

from pp_train.data.builder import SPLIT_NAMES, TokenDataset, build_train_valid_test_datasets
from pp_train.data.command import run_command
from pp_train.data.config import DataConfig
from pp_train.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``show`` command line (Megatron's flag names for the data)."""
    parser = argparse.ArgumentParser(
        prog="python -m pp_train.data", description="Look at the samples training reads."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print samples of the train, valid and test splits")
    show.add_argument("--data-path", nargs="+", required=True, help="P, or 'W1 P1 W2 P2 ...'")
    show.add_argument("--split", default="969,30,1", help="train,valid,test weights")
    show.add_argument("--seq-length", type=int, required=True, help="tokens per sample")
    show.add_argument("--seed", type=int, default=1234, help="Megatron's --seed")
    for name in SPLIT_NAMES:
        show.add_argument(f"--{name}-samples", type=int, default=0, help=f"{name} samples")
    show.add_argument("--indices", default="0:8", help="samples A:B of each split (or one: I)")
    show.add_argument("--splits", default=",".join(SPLIT_NAMES), help="which splits to show")
    show.add_argument("--json", action="store_true", help="one JSON object per sample")
    show.add_argument("--text", action="store_true", help="add the detokenized text")
    show.add_argument("--data-cache-path", default=None, help="where indices are cached")
    show.add_argument("--mid-level-dataset-surplus", type=float, default=0.005)
    show.add_argument("--tokenizer-type", default="ByteTokenizer", choices=TOKENIZER_TYPES)
    show.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer's file")
    show.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's ids")
    return parser


def parse_indices(text: str) -> tuple[int, int | None]:
    """``"A:B"``, ``"A:"`` or ``"I"`` as a start and an end (None: to the end).

    Raises:
        ValueError: Not that form, or a negative number.
    """
    parts = text.split(":")
    try:
        if len(parts) == 1:
            start = end = int(parts[0])
            end += 1
        elif len(parts) == 2:
            start = int(parts[0] or 0)
            end = int(parts[1]) if parts[1] else -1
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"--indices {text!r} must be A:B, A: or I (sample numbers)") from None
    if start < 0 or end < -1:
        raise ValueError(f"--indices {text!r} must not be negative")
    return start, None if end == -1 else end


def _config(args: argparse.Namespace) -> DataConfig:
    return DataConfig(
        data_path=list(args.data_path),
        split=args.split,
        data_cache_path=args.data_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
    )


def _chosen_splits(text: str) -> list[str]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SPLIT_NAMES]
    if unknown or not chosen:
        raise ValueError(f"--splits {text!r}: choose from {', '.join(SPLIT_NAMES)}")
    return chosen


def _print_samples(
    args: argparse.Namespace, name: str, dataset: TokenDataset, tokenizer: Tokenizer | None
) -> None:
    start, end = parse_indices(args.indices)
    stop = len(dataset) if end is None else min(end, len(dataset))
    for index in range(start, stop):
        tokens = [int(t) for t in dataset.window(index)]
        record: dict[str, object] = {"split": name, "index": index, "tokens": tokens}
        if tokenizer is not None:
            try:
                record["text"] = tokenizer.detokenize(tokens)
            except ValueError as error:
                raise ValueError(
                    f"{name} sample {index}: {error} ({args.tokenizer_type})"
                ) from None
        if args.json:
            print(json.dumps(record))
        elif tokenizer is not None:
            print(f"{name} {index}: {record['text']!r}")
        else:
            print(f"{name} {index}: {' '.join(map(str, tokens))}")


def _show(args: argparse.Namespace) -> None:
    config = _config(args)
    chosen = _chosen_splits(args.splits)
    parse_indices(args.indices)
    tokenizer = (
        build_tokenizer(config.tokenizer_type, config.tokenizer_model, config.vocab_size)
        if args.text
        else None
    )
    counts = (args.train_samples, args.valid_samples, args.test_samples)
    datasets = build_train_valid_test_datasets(
        config, seq_length=args.seq_length, seed=args.seed, train_valid_test_num_samples=counts
    )
    for name, dataset in zip(SPLIT_NAMES, datasets, strict=True):
        if name in chosen and dataset is not None:
            _print_samples(args, name, dataset, tokenizer)


def main(argv: list[str] | None = None) -> int:
    """Run the command.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 2 for bad input (the reason printed as one line on stderr).
    """
    return run_command(build_parser(), argv, _show)


if __name__ == "__main__":
    sys.exit(main())
