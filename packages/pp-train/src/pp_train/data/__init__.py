"""Data for training: Megatron's indexed datasets, its GPT samples, tokenizers and sampler order.

- `microbatches` walks samples in Megatron's pretraining sampler order over any
  `SampleDataset` (``dataset[i] -> {"tokens", "labels", ...}``), stacking every key.
- `IndexedDataset` / `IndexedDatasetBuilder` read and write Megatron's ``P.bin`` / ``P.idx``
  files (``python -m pp_train.preprocess`` writes them from JSON lines).
- `build_train_valid_test_datasets(DataConfig(...), ...)` gives the train, valid and test
  samples megatron-core's ``GPTDataset`` (and ``BlendedDataset``) yield, token for token.
- Packed documents (Megatron's ``--reset-position-ids``, ``--reset-attention-mask``,
  ``--eod-mask-loss``): `ltor_masks_and_position_ids` makes a sample's (or a batch's)
  ``loss_mask``, ``position_ids`` and ``document_ids`` from its tokens;
  `attention_mask_from_document_ids` expands document ids into Megatron's boolean attention
  mask; `SampleMasks` holds the flags and EOD id a dataset applies (`sample_masks` reads them
  from a `DataConfig`).
- `build_tokenizer` makes the tokenizers named by Megatron's ``--tokenizer-type``;
  `ByteTokenizer` is the bundled corpus's byte tokenizer.
- ``python -m pp_train.data show`` prints the samples a run would see.
"""

from pp_train.data.blended_dataset import BlendedDataset, build_blending_indices
from pp_train.data.builder import (
    SPLIT_NAMES,
    TokenDataset,
    build_train_valid_test_datasets,
    check_data,
    sample_masks,
    split_matrix,
    split_sequences,
)
from pp_train.data.config import DataConfig, parse_data_path, parse_split
from pp_train.data.gpt_dataset import GPTDataset, build_gpt_indices
from pp_train.data.indexed import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from pp_train.data.masks import (
    SampleMasks,
    attention_mask_from_document_ids,
    ltor_masks_and_position_ids,
)
from pp_train.data.sampler import Microbatch, SampleDataset, microbatches
from pp_train.data.tokenizer import (
    TOKENIZER_TYPES,
    ByteTokenizer,
    EodByteTokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    Tokenizer,
    build_tokenizer,
)

__all__ = [
    "SPLIT_NAMES",
    "TOKENIZER_TYPES",
    "BlendedDataset",
    "ByteTokenizer",
    "DataConfig",
    "EodByteTokenizer",
    "GPTDataset",
    "HuggingFaceTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "Microbatch",
    "NullTokenizer",
    "SampleDataset",
    "SampleMasks",
    "TokenDataset",
    "Tokenizer",
    "attention_mask_from_document_ids",
    "build_blending_indices",
    "build_gpt_indices",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "check_data",
    "ltor_masks_and_position_ids",
    "microbatches",
    "optimal_dtype",
    "parse_data_path",
    "parse_split",
    "sample_masks",
    "split_matrix",
    "split_sequences",
]
