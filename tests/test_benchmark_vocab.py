"""benchmarks/vocab.py and the benchmarks' CPU paths with a tokenizer directory: the embedding count comes from the
directory's config.json or the tokenizer's length rounded up to 128, an empty directory is refused by name, and a
CPU benchmark's model gets that count and that tokenizer. Tiny tokenizers trained here: no network, no Qwen files."""
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.vocab import load_vocabulary  # noqa: E402
from hybridrl.defaults.tiny_model import build_tokenizer  # noqa: E402

TEXTS = ["the quick brown fox jumps over the lazy dog", "say something about apple"] * 10


def tokenizer_dir(path, config: dict | None = None) -> str:
    """A tokenizer of 260 tokens (the byte-level alphabet and 4 special tokens: the smallest such BPE) saved in
    `path`, with `config` as its config.json when given."""
    tokenizer = build_tokenizer(TEXTS, vocab_size=200)
    assert len(tokenizer) == 260
    tokenizer.save_pretrained(str(path))
    if config is not None:
        with open(os.path.join(path, "config.json"), "w") as handle:
            json.dump(config, handle)
    return str(path)


def test_config_vocab_size_wins(tmp_path):
    """What scripts/gpu/stage_qwen_tokenizer.sh writes: Qwen2.5's padded count, not the tokenizer's length."""
    vocabulary = load_vocabulary(tokenizer_dir(tmp_path, {"model_type": "qwen2", "vocab_size": 151936}))
    assert vocabulary.embeddings == 151936
    assert vocabulary.record() == {"embeddings": 151936, "origin": f"260-token tokenizer at {tmp_path}"}


def test_without_config_the_length_is_rounded_up_to_128(tmp_path):
    vocabulary = load_vocabulary(tokenizer_dir(tmp_path))
    assert len(vocabulary.tokenizer) == 260
    assert vocabulary.embeddings == 384
    assert vocabulary.describe() == f"384 (260-token tokenizer at {tmp_path})"


def test_a_directory_without_a_tokenizer_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} holds no tokenizer"):
        load_vocabulary(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="missing holds no tokenizer"):
        load_vocabulary(str(tmp_path / "missing"))  # not taken for a hub name


def test_a_config_smaller_than_the_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 100 is smaller than the tokenizer's"):
        load_vocabulary(tokenizer_dir(tmp_path, {"model_type": "qwen2", "vocab_size": 100}))
