"""build_tokenizer: the byte tokenizer with EOD, NullTokenizer and a local Hugging Face file."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest

from pp_train.data import (
    ByteTokenizer,
    EodByteTokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    build_tokenizer,
)


def test_byte_tokenizer_with_eod() -> None:
    tokenizer = build_tokenizer()
    assert isinstance(tokenizer, EodByteTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (257, 256)
    ids = tokenizer.tokenize("hé\x00")
    assert ids == [104, 195, 169, 0]
    assert tokenizer.detokenize([*ids, 256, 104]) == "hé\x00<eod>h"
    with pytest.raises(ValueError, match=r"token ids must lie in 0 \.\. 256; got \[257\]"):
        tokenizer.detokenize([257])
    # The corpus tokenizer is unchanged: 256 ids, no EOD.
    assert ByteTokenizer.vocab_size == 256
    assert ByteTokenizer().decode(ByteTokenizer().encode("hé")) == "hé"


def test_null_tokenizer_reads_ids_and_refuses_ids_outside_the_vocabulary() -> None:
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tokenizer, NullTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (101, 100)
    assert tokenizer.tokenize(" 1 2\n99 ") == [1, 2, 99]
    assert tokenizer.detokenize([1, 2, 100]) == "1 2 100"
    with pytest.raises(ValueError, match=r"0 \.\. 99; got \[100, -1\]"):
        tokenizer.tokenize("3 100 -1")
    with pytest.raises(ValueError, match=r"whitespace-separated integers.*'x'"):
        tokenizer.tokenize("3 x")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tokenizer_type": "GPT2BPETokenizer"},
            "unknown tokenizer type 'GPT2BPETokenizer'; valid: ByteTokenizer, NullTokenizer, HuggingFaceTokenizer",
        ),
        ({"tokenizer_type": "NullTokenizer"}, "vocabulary size.*NullTokenizer only.*None"),
        (
            {"vocab_size": 5},
            "vocabulary size.*NullTokenizer only; got tokenizer type ByteTokenizer",
        ),
        ({"tokenizer_type": "HuggingFaceTokenizer"}, "tokenizer model.*HuggingFaceTokenizer only"),
        ({"tokenizer_type": "NullTokenizer", "vocab_size": 0}, "positive vocab_size, got 0"),
    ],
)
def test_bad_tokenizer_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_tokenizer(**kwargs)


def test_huggingface_tokenizer_names_the_extra_when_tokenizers_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real_import = builtins.__import__

    def no_tokenizers(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "tokenizers":
            raise ImportError("No module named 'tokenizers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    with pytest.raises(ImportError, match=r'pip install "pp-train\[hf\]"'):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


def _word_level(directory: Path, eos: str | None) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3, "<end>": 4}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["</s>", "<end>"])
    # A template that would prepend </s>: megatron-core's tokenize adds no special tokens.
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="</s> $A", special_tokens=[("</s>", 3)]
    )
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    if eos is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return directory


def test_huggingface_tokenizer_from_a_local_file(tmp_path: Path) -> None:
    directory = _word_level(tmp_path / "tok", eos=None)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", str(directory))
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    assert tokenizer.vocab_size == 5
    assert tokenizer.eod == 3  # </s>
    assert tokenizer.tokenize("hello world hello") == [1, 2, 1]
    assert tokenizer.detokenize([1, 2]) == "hello world"
    configured = build_tokenizer(
        "HuggingFaceTokenizer", str(_word_level(tmp_path / "tok2", eos="<end>") / "tokenizer.json")
    )
    assert configured.eod == 4


def test_huggingface_tokenizer_errors_name_the_path(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    with pytest.raises(ValueError, match=r"tokenizer model .*nowhere not found"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "nowhere"))
    directory = _word_level(tmp_path / "tok", eos="<missing>")
    with pytest.raises(ValueError, match="has no end-of-document token: looked for <missing>"):
        build_tokenizer("HuggingFaceTokenizer", str(directory)).eod  # noqa: B018
