"""Build a tiny causal LM and its tokenizer locally, as an ordinary HF model directory.

No hub, no network: the tokenizer is trained here with the `tokenizers` library on the
task's own text, and the model is a randomly initialised Qwen2 (or Llama) from transformers.
Everything that later loads `model.path` goes through the real `from_pretrained` code path.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

PAD, EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ChatML, as Qwen models use; the assistant turn ends with <|im_end|>, which is also our EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`; digits are always single tokens so arithmetic stays learnable."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=IM_END, bos_token=None, unk_token=None,
        additional_special_tokens=[EOS, IM_START],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.padding_side = "left"
    return hf_tok


def build_tiny_model(out_dir: str, tokenizer: PreTrainedTokenizerFast, arch: str = "qwen2",
                     hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                     intermediate_size: int = 128, max_position_embeddings: int = 1024, seed: int = 0,
                     tie_word_embeddings: bool = True, vocab_size: int | None = None) -> str:
    """Save a randomly initialised causal LM plus `tokenizer` to `out_dir` and return the path.

    `vocab_size` (the embedding rows) defaults to the tokenizer's length; a benchmark passes a real model's padded
    count (benchmarks/vocab.py) so the logits are as wide as that model's."""
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}.get(arch)
    if config_cls is None:
        raise ValueError(f"arch must be one of ['qwen2', 'llama'], got {arch!r}")
    config = config_cls(
        vocab_size=vocab_size or len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    os.makedirs(out_dir, exist_ok=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
