"""benchmarks/vocab.py and the benchmarks' CPU paths with a tokenizer directory: the embedding count comes from the
directory's config.json or the tokenizer's length rounded up to 128, an empty directory is refused by name, and a
CPU benchmark's model gets that count and that tokenizer. Tiny tokenizers trained here: no network, no Qwen files."""
import argparse
import importlib.util
import json
import os
import sys

import pytest
from safetensors import safe_open

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.vocab import load_vocabulary, reusable_model  # noqa: E402
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


def test_a_model_left_for_another_vocabulary_stops_the_run(tmp_path):
    """ppo_step.make_model reuses a model of the same count and refuses one of another, which the table would
    misname."""
    vocabulary = load_vocabulary(tokenizer_dir(tmp_path / "tok"))
    assert not reusable_model(str(tmp_path / "empty"), vocabulary)
    tokenizer_dir(tmp_path / "model", {"model_type": "qwen2", "vocab_size": 384})
    assert reusable_model(str(tmp_path / "model"), vocabulary)
    tokenizer_dir(tmp_path / "other", {"model_type": "qwen2", "vocab_size": 151936})
    with pytest.raises(SystemExit, match="holds a model of 151936 embeddings, not 384"):
        reusable_model(str(tmp_path / "other"), vocabulary)


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def embedding_rows(model_dir: str) -> int:
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as weights:
        return weights.get_slice("model.embed_tokens.weight").get_shape()[0]


def test_partial_rollout_cpu_model_takes_the_tokenizer_and_its_count(tmp_path):
    """The CPU path's model (what both main_ppo runs train; a whole run takes minutes) with --tokenizer: 384
    embeddings for the 260-token tokenizer, and that tokenizer saved beside it, which tokenizes the prompts."""
    directory = tokenizer_dir(tmp_path / "tok")
    args = argparse.Namespace(device="cpu", model=None, tokenizer=directory)
    model_dir, vocabulary = load_benchmark("partial_rollout").model_and_vocabulary(args, str(tmp_path / "run"))
    assert vocabulary.embeddings == load_vocabulary(directory).embeddings == 384
    assert embedding_rows(model_dir) == 384
    saved = load_vocabulary(model_dir)
    assert saved.embeddings == 384 and len(saved.tokenizer) == 260
    prompt = "say something about apple"
    assert saved.tokenizer(prompt)["input_ids"] == vocabulary.tokenizer(prompt)["input_ids"]


def test_partial_rollout_cpu_default_trains_its_own_tokenizer(tmp_path):
    """Without --tokenizer the CPU default is unchanged: a tokenizer trained on the prompts, one embedding a token."""
    args = argparse.Namespace(device="cpu", model=None, tokenizer=None)
    model_dir, vocabulary = load_benchmark("partial_rollout").model_and_vocabulary(args, str(tmp_path))
    assert embedding_rows(model_dir) == vocabulary.embeddings == len(vocabulary.tokenizer) == 300
    assert "trained on the prompts" in vocabulary.describe()
