"""The vocabulary a benchmark's model is built with: a tokenizer, and the embedding count that sizes the logits.

The embedding count, not the tokenizer's length, is the number of rows of the embedding and of the LM head, so it is
what the logits (and their memory and time) follow. Real models pad it: Qwen2.5's tokenizer on the Hugging Face hub
holds 151,665 tokens and its models 151,936 embeddings (the GGUF's tokenizer pads its own table to 151,936). So a
tokenizer directory's config.json `vocab_size` wins where there is one (`python -m hybridrl.models.gguf_source` and
scripts/gpu/stage_qwen_tokenizer.sh write it, 151,936 for Qwen2.5); without one the tokenizer's length is rounded up
to a multiple of 128, as Qwen's own padding is.

Every benchmark names the vocabulary it used, in its printed table (`describe`) and its JSON record (`record`), so
a row measured with a tiny task's vocabulary is never read as one measured with Qwen's.
"""
from __future__ import annotations

import dataclasses
import json
import os

EMBEDDING_MULTIPLE = 128
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")  # what transformers' save_pretrained writes


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    tokenizer: object | None  # a transformers tokenizer; None where a benchmark draws random ids without one
    embeddings: int  # rows of the embedding and of the LM head: the width of the logits
    origin: str  # where the tokens come from, for the table

    def describe(self) -> str:
        return f"{self.embeddings} ({self.origin})"

    def record(self) -> dict:
        return {"embeddings": self.embeddings, "origin": self.origin}


def load_vocabulary(directory: str) -> Vocabulary:
    """The tokenizer saved in `directory` and its embedding count (the module docstring says which)."""
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        # checked here: transformers would take a missing directory for a hub name, and an empty one for a slow
        # tokenizer it cannot convert, and say neither
        raise FileNotFoundError(
            f"{directory} holds no tokenizer (neither {' nor '.join(TOKENIZER_FILES)}); make Qwen2.5's with "
            f"`python -m hybridrl.models.gguf_source --model qwen2.5-coder-0.5b-instruct --out DIR`")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    embeddings = config_vocab_size(directory) or round_up(len(tokenizer), EMBEDDING_MULTIPLE)
    if embeddings < len(tokenizer):
        raise ValueError(f"{directory}: config.json's vocab_size {embeddings} is smaller than the tokenizer's "
                         f"{len(tokenizer)} tokens")
    return Vocabulary(tokenizer, embeddings, f"{len(tokenizer):,}-token tokenizer at {directory}")


def config_vocab_size(directory: str) -> int | None:
    """config.json's vocab_size in `directory`, or None without one."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return json.load(handle).get("vocab_size")


def round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def reusable_model(model_dir: str, vocabulary: Vocabulary) -> bool:
    """Whether `model_dir` already holds a model of `vocabulary`'s embedding count, made by an earlier run (making
    one takes minutes). One of another count stops the run: its table would name a vocabulary it did not use."""
    found = config_vocab_size(model_dir)
    if found is not None and found != vocabulary.embeddings:
        raise SystemExit(f"{model_dir} holds a model of {found} embeddings, not {vocabulary.describe()}: remove it "
                         f"or give another work directory")
    return found is not None


def tiny_model(out_dir: str, texts: list[str], vocabulary: Vocabulary | None = None,
               **layers) -> tuple[str, Vocabulary]:
    """A tiny random Qwen2 for a CPU run, saved in `out_dir` with its tokenizer, and its vocabulary: `vocabulary`'s
    tokenizer and embedding count when given, else a 300-token tokenizer trained here on `texts` (the CPU default,
    with as many embeddings as tokens). `layers` are build_tiny_model's sizes."""
    from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer

    if vocabulary is None:
        tokenizer = build_tokenizer(texts, vocab_size=300)
        vocabulary = Vocabulary(tokenizer, len(tokenizer), f"{len(tokenizer)}-token tokenizer trained on the prompts")
    build_tiny_model(out_dir, vocabulary.tokenizer, vocab_size=vocabulary.embeddings, **layers)
    return out_dir, vocabulary
