"""Probe for issue 29 item 2, on a host of 2 or more GPUs: can every trainer rank hold its own vLLM tensor-parallel
shard in its own process (vLLM's external launcher, as verl runs it) while torch.distributed is already set up by the
trainer, and take the trainer's full weights in place after a level-2 sleep? Not a test: the first minute of a 2-GPU
lease, before tests/gpu/test_engine_tp.py runs the design vllm_rollout.py builds on it through the whole trainer;
a failure here names the vLLM step that breaks without a trainer around it.

    python3 -m torch.distributed.run --nproc-per-node 2 scripts/gpu/probe_vllm_tp.py --model-dir /tmp/q05 \
        --out $OUT/probe_vllm_tp.json

Every rank, in order: an NCCL world of all ranks first (the trainer's); vllm.LLM(tensor_parallel_size=world,
distributed_executor_backend="external_launcher", enable_sleep_mode, the checkpoint read from disk); greedy tokens
for the same prompts (A); sleep(level=2), wake_up(["weights"]), the checkpoint's full HF tensors through
apply_model(load_weights) (each rank keeps its shard), wake_up(["kv_cache"]), reset_prefix_cache; the same prompts
again (B). Rank 0 writes one record: A equal on every rank, B equal to A, and the seconds of each step.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def timed(record: dict, name: str, fn, *args, **kwargs):
    torch.cuda.synchronize()
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    torch.cuda.synchronize()
    record[f"{name}_s"] = round(time.perf_counter() - started, 4)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="a safetensors checkpoint (benchmarks/hybrid_engine.py's "
                                                           "make_qwen05b_model writes one)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", help="rank 0 writes the record here")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as the rollout runs it
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")  # the trainer's world exists before the engine
    world, rank = dist.get_world_size(), dist.get_rank()

    import vllm
    from safetensors.torch import load_file

    record: dict = {"world": world, "vllm": vllm.__version__, "device": torch.cuda.get_device_name()}
    llm = timed(record, "engine_start", vllm.LLM, model=args.model_dir, tensor_parallel_size=world,
                distributed_executor_backend="external_launcher", enable_sleep_mode=True, skip_tokenizer_init=True,
                gpu_memory_utilization=0.4, max_model_len=256, seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(1000, 100000, (24,), generator=generator).tolist()}
               for _ in range(args.prompts)]
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, detokenize=False)

    def tokens() -> list[list[int]]:
        return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, greedy, use_tqdm=False)]

    before = timed(record, "generate", tokens)
    every_rank = [None] * world
    dist.all_gather_object(every_rank, before)
    record["same_tokens_on_every_rank"] = all(other == before for other in every_rank)

    weights = {}
    for name in sorted(os.listdir(args.model_dir)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(args.model_dir, name), device=f"cuda:{local_rank}"))
    timed(record, "sleep_level_2", llm.sleep, level=2)
    timed(record, "wake_weights", llm.wake_up, tags=["weights"])
    timed(record, "load_full_weights", llm.apply_model, lambda model: model.load_weights(weights=list(weights.items())))
    timed(record, "wake_kv_cache", llm.wake_up, tags=["kv_cache"])
    record["prefix_cache_reset"] = llm.reset_prefix_cache()
    after = tokens()
    record["tokens_after_push_equal_before"] = after == before
    record["rows_equal_after_push"] = sum(a == b for a, b in zip(after, before))
    records = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        print("PROBE " + json.dumps(records), flush=True)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(records, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
