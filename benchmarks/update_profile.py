"""Where the actor update's GPU time goes at a real model shape: what bounds its MFU.

    PYTHONPATH=. python benchmarks/update_profile.py --shape 0.5b --token-lens 32768 --variants base,liger

Builds the real actor worker (FSDP2, remove padding, dynamic batch size, one GPU) on random bf16 weights of the
Qwen2.5 layer shapes (vocabulary 336, the built-in task's), gives it the trainer's layout (42-token prompts, 512
rows, responses of 2..512 tokens, mean ~257), times `update_actor` (mean of 3 after a warm-up) and profiles one
more update with torch.profiler. The kernels' time is split into GEMMs, attention, the optimizer and everything
else (elementwise, norms, casts, copies: memory-bound work). The FLOP rate of the GEMMs alone says how far the
shape's matmuls are from the peak; the rest of the time is what keeps the update's MFU below it. The variants
are the knobs that change the memory-bound share: `base` (HF's kernels) and `liger` (model.use_liger: fused
RMSNorm, RoPE and SwiGLU).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hybridrl.checks  # noqa: F401  registers the subsystems' config checks
from hybridrl.config import compose_config, validate_config
from hybridrl.models.flops import model_flops_utilization
from hybridrl.protocol import DataProto
from hybridrl.models.spec import policy_model_spec
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
}
PROMPT, PROMPT_TOKENS, RESPONSE, ROWS, VOCAB, EOS, PAD = 64, 42, 512, 512, 336, 3, 0
CATEGORIES = [("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")), ("attention", ("flash", "fmha", "attn", "cudnn", "sdpa", "varlen")),
              ("optimizer", ("adam", "multi_tensor", "foreach"))]


def make_model(shape: str, out: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if not os.path.exists(os.path.join(out, "config.json")):
        config = Qwen2Config(**SHAPES[shape], vocab_size=VOCAB, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD,
                             use_sliding_window=False, rms_norm_eps=1e-6, rope_theta=1e6)
        torch.manual_seed(0)
        with torch.device("cuda"):
            Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def rollout_batch() -> DataProto:
    """The trainer's layout: 42-token prompts left-padded to 64, responses of 2..512 tokens, random advantages."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, RESPONSE + 1, (ROWS,), generator=generator)
    prompt_mask = torch.zeros(ROWS, PROMPT, dtype=torch.long)
    prompt_mask[:, PROMPT - PROMPT_TOKENS:] = 1
    response_mask = (torch.arange(RESPONSE) < lengths[:, None]).long()
    prompts = torch.randint(4, VOCAB, (ROWS, PROMPT), generator=generator).masked_fill(prompt_mask == 0, PAD)
    responses = torch.randint(4, VOCAB, (ROWS, RESPONSE), generator=generator).masked_fill(response_mask == 0, PAD)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, RESPONSE + 1)], dim=1)
    return DataProto.from_dict({"prompts": prompts, "responses": responses,
                                "input_ids": torch.cat([prompts, responses], dim=1),
                                "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
                                "position_ids": positions, "response_mask": response_mask,
                                "old_log_probs": -6 * response_mask.float(),
                                "advantages": torch.randn(ROWS, RESPONSE, generator=generator) * response_mask},
                               meta_info={"temperature": 1.0})


def actor_worker(model_dir: str, token_len: int, liger: bool) -> ActorRolloutRefWorker:
    config = validate_config(compose_config([
        f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cuda", "trainer.n_gpus_per_node=1",
        f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}", "data.train_batch_size=64",
        "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={token_len}",
        f"actor_rollout_ref.model.use_liger={str(liger).lower()}"]))
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, policy_model_spec(config),
                                   role="actor", seed=1, device="cuda")
    worker.init_model()
    return worker


def kernel_split(prof) -> dict[str, float]:
    """Seconds of GPU kernel time per category (name matching, lower case)."""
    split = {name: 0.0 for name, _ in CATEGORIES} | {"other (elementwise, norms, casts, copies)": 0.0}
    for event in prof.key_averages():
        seconds = event.device_time_total / 1e6 if hasattr(event, "device_time_total") else event.cuda_time_total / 1e6
        if seconds <= 0 or event.key.startswith("ProfilerStep") or not _is_kernel(event):
            continue
        name = event.key.lower()
        category = next((cat for cat, needles in CATEGORIES if any(needle in name for needle in needles)),
                        "other (elementwise, norms, casts, copies)")
        split[category] += seconds
    return split


def _is_kernel(event) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is not None and "CUDA" in str(device_type) and not event.key.startswith("aten::")


def measure(model_dir: str, token_len: int, variant: str) -> dict:
    worker = actor_worker(model_dir, token_len, liger=variant == "liger")
    batch = rollout_batch()
    seqlens = batch.batch["attention_mask"].sum(-1).tolist()
    seconds = []
    for repeat in range(4):
        torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = worker.update_actor(DataProto.from_dict(dict(batch.batch), meta_info=dict(batch.meta_info)))
        torch.cuda.synchronize()
        if repeat:
            seconds.append(time.perf_counter() - started)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        worker.update_actor(DataProto.from_dict(dict(batch.batch), meta_info=dict(batch.meta_info)))
        torch.cuda.synchronize()
    split = kernel_split(prof)
    update_s = statistics.mean(seconds)
    from hybridrl.models.fsdp_utils import hf_module

    model_config = hf_module(worker.actor_module).config
    mfu = model_flops_utilization(model_config, seqlens, update_s, "cuda", passes=3)
    gemm_share_mfu = model_flops_utilization(model_config, seqlens, split["gemm"], "cuda", passes=3)
    del worker
    torch.cuda.empty_cache()
    return {"update_s": update_s, "mfu": mfu, "split": split, "kernel_total": sum(split.values()),
            "gemm_only_mfu": gemm_share_mfu, "tokens": int(sum(seqlens)),
            "peak_gb": metrics.meta_info["metrics"]["perf/max_memory_allocated_gb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--token-lens", default="32768", help="ppo_max_token_len_per_gpu values, comma separated")
    parser.add_argument("--variants", default="base,liger")
    parser.add_argument("--work-dir", default="/tmp/update_profile")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    model_dir = make_model(args.shape, os.path.join(args.work_dir, f"model_{args.shape}"))
    rows = []
    for token_len in [int(value) for value in args.token_lens.split(",")]:
        for variant in args.variants.split(","):
            try:
                rows.append((token_len, variant, measure(model_dir, token_len, variant)))
            except Exception as err:  # an OOM or a missing package ends this cell, not the table
                rows.append((token_len, variant, {"error": f"{type(err).__name__}: {str(err)[:160]}"}))
                torch.cuda.empty_cache()
    print(f"\nactor update, {args.shape} shape, {torch.cuda.get_device_name()}, {ROWS} rows, "
          f"2 optimizer steps, remove padding + dynamic batch size")
    print("| tokens/micro-batch | variant | update (s) | MFU | kernel time (s) | GEMM | attention | optimizer | other "
          "| MFU if only GEMMs ran | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for token_len, variant, result in rows:
        if "error" in result:
            print(f"| {token_len} | {variant} | {result['error']} |")
            continue
        split, total = result["split"], result["kernel_total"]
        shares = " | ".join(f"{seconds:.2f} ({seconds / total:.0%})" for seconds in split.values())
        print(f"| {token_len} | {variant} | {result['update_s']:.2f} | {result['mfu']:.1%} | {total:.2f} | {shares} "
              f"| {result['gemm_only_mfu']:.1%} | {result['peak_gb']:.1f} |")


if __name__ == "__main__":
    main()
