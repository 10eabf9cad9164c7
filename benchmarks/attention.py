"""Attention layouts for the actor's log-prob + backward at a real shape, one GPU: padded rows (sdpa, the NaN-safe
4-D mask), packed rows through sdpa's dense block-diagonal mask, packed rows through the varlen kernel.

    PYTHONPATH=. python benchmarks/attention.py

Qwen2.5-0.5B layer shapes, vocabulary 151,936, random bf16 weights; rollout-like rows: prompts of 20..42 tokens
left-padded to 42, responses of 2..512 tokens right-padded to 512. Seconds per forward+backward of the response
log-probs (mean of 3 after a warm-up) and the allocator's peak; the baseline (padded) runs in the same invocation.
"""
from __future__ import annotations

import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridrl.models.attention import VARLEN, padded_attention_mask, register
from hybridrl.models.padding import response_log_probs_packed
from hybridrl.algorithms.torch_functional import logprobs_from_logits

PROMPT, RESPONSE, VOCAB = 42, 512, 151936


def model(attn_implementation: str):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         attn_implementation=attn_implementation)
    return Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)


def rollout_rows(rows: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(20, PROMPT + 1, (rows,), generator=generator)
    response_lengths = torch.randint(2, RESPONSE + 1, (rows,), generator=generator)
    mask = torch.zeros(rows, PROMPT + RESPONSE, dtype=torch.long)
    for row in range(rows):
        mask[row, PROMPT - prompt_lengths[row]:PROMPT + response_lengths[row]] = 1
    ids = torch.randint(0, VOCAB, mask.shape, generator=generator)
    return [t.cuda() for t in (ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), ids[:, PROMPT:], mask[:, PROMPT:])]


def padded_step(module, ids, mask, positions, responses, response_mask):
    logits = module(input_ids=ids, attention_mask=padded_attention_mask(mask), position_ids=positions,
                    use_cache=False).logits
    log_probs = logprobs_from_logits(logits[:, -RESPONSE - 1:-1], responses)
    ((log_probs * response_mask).sum() / response_mask.sum()).backward()


def packed_step(module, ids, mask, positions, responses, response_mask):
    log_probs, _ = response_log_probs_packed(module, ids, mask, positions, responses, 1.0)
    ((log_probs * response_mask).sum() / response_mask.sum()).backward()


def timed(step, module, batch, repeats: int = 3) -> str:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        step(module, *batch)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(repeats):
            step(module, *batch)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / repeats
        return f"{seconds:.3f} s, {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    except torch.OutOfMemoryError:
        return "out of memory"
    finally:
        module.zero_grad(set_to_none=True)


def main() -> None:
    register()
    sdpa, varlen = model("sdpa"), model(VARLEN)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| rows | real / padded tokens | padded, sdpa | packed, sdpa dense mask | packed, varlen |")
    print("| --- | --- | --- | --- | --- |")
    for rows, seed in ((8, 1), (32, 2), (64, 3)):
        batch = rollout_rows(rows, seed)
        cells = [timed(padded_step, sdpa, batch), timed(packed_step, sdpa, batch), timed(packed_step, varlen, batch)]
        print(f"| {rows} | {int(batch[1].sum())} / {batch[0].numel()} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
