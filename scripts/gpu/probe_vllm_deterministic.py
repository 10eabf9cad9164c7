"""GPU probe (issue 62): vLLM starts and compiles in a process with torch's deterministic mode on, as the colocated
worker runs it under rollout.full_determinism, and a seeded request gives the same tokens alone and in a batch.

    python3 scripts/gpu/probe_vllm_deterministic.py [--fix | --no-fix]     # prints RESULT {json}

torch.use_deterministic_algorithms(True) sets Inductor's deterministic mode, which refused vLLM's default combo-kernel
timing (the gate's first vLLM runs, 2026-12-06); --fix (the default) passes the compilation config the vllm rollout
builds under full_determinism (vllm_rollout.deterministic_compilation). A tiny random Qwen2 keeps the start short.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def tiny_model(directory: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=1023, bos_token_id=1023, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fix", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_BATCH_INVARIANT="1")
    from hybridrl.utils.determinism import enable_full_determinism
    from hybridrl.workers.rollout.vllm_rollout import deterministic_compilation

    enable_full_determinism(42)
    import vllm

    compilation = {"max_cudagraph_capture_size": 8}
    if args.fix:
        compilation = deterministic_compilation(compilation)
    result = {"fix": args.fix, "compilation_config": compilation, "vllm": vllm.__version__}
    with tempfile.TemporaryDirectory() as directory:
        started = time.perf_counter()
        try:
            llm = vllm.LLM(model=tiny_model(directory), skip_tokenizer_init=True, dtype="bfloat16", seed=42,
                           gpu_memory_utilization=0.2, max_model_len=256, enforce_eager=False,
                           compilation_config=compilation)
        except Exception as error:  # the probe reports the failure it is looking for
            result.update(started=False, error=f"{type(error).__name__}: {str(error)[:300]}")
            print("RESULT " + json.dumps(result), flush=True)
            return
        result["start_s"] = round(time.perf_counter() - started, 1)
        params = vllm.SamplingParams(max_tokens=32, temperature=1.0, seed=7, ignore_eos=True)
        other = vllm.SamplingParams(max_tokens=32, temperature=1.0, seed=8, ignore_eos=True)
        prompt = {"prompt_token_ids": [5, 6, 7, 8]}
        alone = llm.generate([prompt], params)[0].outputs[0].token_ids
        crowd = [{"prompt_token_ids": [9 + i, 10, 11]} for i in range(7)]
        batched = llm.generate([*crowd, prompt], [other] * 7 + [params])[-1].outputs[0].token_ids
        result.update(started=True, same_tokens_alone_and_in_a_batch=list(alone) == list(batched),
                      tokens=list(alone)[:8])
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
