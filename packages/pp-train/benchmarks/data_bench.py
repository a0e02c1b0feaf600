"""Data benchmark: preprocessing MB/s with 1 and 2 workers; GPT samples/s against megatron-core.

Every pair is measured side by side in one run, alternating A B B A over the rounds, and
reported as a ratio (the machines are shared and noisy; absolute numbers move between runs).
Prints a table, then one JSON object per comparison. Needs megatron-core (nox -s bench_data).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import statistics
import tempfile
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy

from pp_train.data import DataConfig, GPTDataset, IndexedDataset, build_train_valid_test_datasets
from pp_train.preprocess import main as preprocess

WORDS = "the quick brown fox jumps over a lazy dog while pipeline stages pass activations"


def _corpus(path: Path, documents: int) -> int:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(documents):
            text = " ".join(rng.choice(WORDS.split()) for _ in range(rng.randint(20, 400)))
            handle.write(json.dumps({"text": text}) + "\n")
    return path.stat().st_size


def _alternate(rounds: int, first: Callable[[], float], second: Callable[[], float]) -> Any:
    """Seconds of each, measured A B B A per round; the medians."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(rounds):
        a.append(first())
        b.append(second())
        b.append(second())
        a.append(first())
    return statistics.median(a), statistics.median(b)


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _preprocess_pair(root: Path, source: Path, rounds: int) -> dict[str, Any]:
    def run(workers: int) -> float:
        argv = ["--input", str(source), "--output-prefix", str(root / f"w{workers}")]
        with contextlib.redirect_stderr(io.StringIO()):
            return _timed(lambda: preprocess([*argv, "--workers", str(workers), "--append-eod"]))

    one, two = _alternate(rounds, lambda: run(1), lambda: run(2))
    megabytes = source.stat().st_size / 2**20
    return _row("preprocess MB/s", ("1 worker", megabytes / one), ("2 workers", megabytes / two))


def _row(what: str, a: tuple[str, float], b: tuple[str, float]) -> dict[str, Any]:
    return {
        "what": what,
        "a": a[0],
        "a_per_s": a[1],
        "b": b[0],
        "b_per_s": b[1],
        "ratio_b_over_a": b[1] / a[1],
    }


class _Tokenizer:
    vocab_size = 257
    eod = 256

    @property
    def unique_identifiers(self) -> OrderedDict[str, Any]:
        return OrderedDict(tokenizer="bytes")


def _megatron_train(prefix: str, seq_length: int, samples: int, cache: str) -> Any:
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=seq_length,
        blend=([prefix], None),
        split="969,30,1",
        path_to_cache=cache,
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    builder = BlendedMegatronDatasetBuilder(
        MegatronGPTDataset, [samples, 0, 0], lambda: True, config
    )
    return builder.build()[0]


def _ours_train(prefix: str, seq_length: int, samples: int, cache: str) -> GPTDataset:
    config = DataConfig(data_path=[prefix], data_cache_path=cache)
    train = build_train_valid_test_datasets(
        config, seq_length=seq_length, seed=1234, train_valid_test_num_samples=(samples, 0, 0)
    )[0]
    assert isinstance(train, GPTDataset)
    return train


def _dataset_pairs(prefix: str, root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    seq, samples = args.seq_length, args.samples

    def build(make: Callable[..., Any]) -> float:
        cache = tempfile.mkdtemp(dir=root)
        return _timed(lambda: make(prefix, seq, samples, cache))

    build_theirs, build_ours = _alternate(
        args.rounds, lambda: build(_megatron_train), lambda: build(_ours_train)
    )
    ours = _ours_train(prefix, seq, samples, str(root / "ours"))
    theirs = _megatron_train(prefix, seq, samples, str(root / "theirs"))
    assert all(
        numpy.array_equal(ours[i]["tokens"].numpy(), theirs[i]["tokens"].numpy())
        for i in range(0, samples, 97)
    )

    def read(dataset: Any) -> float:
        return _timed(lambda: [dataset[i] for i in range(samples)])

    read_theirs, read_ours = _alternate(args.rounds, lambda: read(theirs), lambda: read(ours))
    return [
        _row("index builds/s", ("megatron-core", 1 / build_theirs), ("pp_train", 1 / build_ours)),
        _row(
            "GPT samples/s",
            ("megatron-core", samples / read_theirs),
            ("pp_train", samples / read_ours),
        ),
    ]


def main() -> None:
    """Run every comparison and print the table and the JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        source = root / "docs.jsonl"
        size = _corpus(source, args.documents)
        results = [_preprocess_pair(root, source, args.rounds)]
        prefix = str(root / "w1_text_document")
        tokens = int(IndexedDataset(prefix).sequence_lengths.sum())
        results += _dataset_pairs(prefix, root, args)
    print(f"{args.documents} documents, {size / 2**20:.1f} MB, {tokens} tokens")
    print(f"each pair measured A B B A, {args.rounds} rounds; medians")
    print(f"{'per second':16} {'A':>14} {'A /s':>10} {'B':>10} {'B /s':>10} {'B/A':>6}")
    for row in results:
        print(
            f"{row['what']:16} {row['a']:>14} {row['a_per_s']:10.2f} {row['b']:>10} "
            f"{row['b_per_s']:10.2f} {row['ratio_b_over_a']:6.2f}"
        )
    for row in results:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
