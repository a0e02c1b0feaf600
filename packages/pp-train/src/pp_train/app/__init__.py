"""The bundled application of pp-train: a GPT, its corpus and the ``pp-train`` command.

Nothing in the library (``pp_train`` outside this subpackage) imports it; it is one user of
the library among others.
"""

from __future__ import annotations

from pp_train.app.command import build_parser, gpt_forward_step, main, validate_args
from pp_train.app.corpus import CorpusDataset, corpus_tokens, load_corpus, split_corpus
from pp_train.app.gpt import GPTChunk, GPTConfig, chunk_layers

__all__ = [
    "CorpusDataset",
    "GPTChunk",
    "GPTConfig",
    "build_parser",
    "chunk_layers",
    "corpus_tokens",
    "gpt_forward_step",
    "load_corpus",
    "main",
    "split_corpus",
    "validate_args",
]
