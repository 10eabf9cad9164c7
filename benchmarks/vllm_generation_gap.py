"""Where the hybrid vLLM engine loses generation speed against a standalone one (benchmarks/hybrid_engine.py measured
0.72x on an H200, 2026-12-01), one suspect per row, all in one invocation on one GPU:

    PYTHONPATH=.:/tmp/site-vllm:/tmp/site python benchmarks/vllm_generation_gap.py --model-dir /tmp/q05 --out gap.json

In the hybrid process (FSDP2 actor trained one step, engine pushed to, as the trainer runs it):
  hybrid/generate_sequences   the rollout's own call (prompt lists in, DataProto out), as hybrid_engine.py times it
  hybrid/llm.generate         the engine's LLM.generate on the same token lists: the rollout's packing left out
  hybrid/llm.generate, gc frozen  the same after gc.freeze(): the trainer's Python objects out of the collector's scans
In spawned processes, the checkpoint read from disk, the hybrid engine's arguments:
  standalone                  as hybrid_engine.py's standalone engine
  standalone, after sleep(1) + wake_up   the same engine after one sleep/wake cycle
  standalone, torch.distributed first    an NCCL world of 1 initialised before the engine, as the trainer's is
Each row: the best of --repeats runs, tokens/s and the ratio to `standalone`.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time

import torch

from benchmarks.hybrid_engine import (EOS_ID, PAD_ID, build_actor, build_hybrid, hybrid_config, in_own_process,
                                      init_single_gpu_process_group, make_qwen05b_model, random_prompts,
                                      rollout_window, time_generation, train_step)


def timed(generate, repeats: int) -> dict:
    seconds, tokens = time_generation(generate, None, repeats)
    return {"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds}


def llm_generate(llm, sampling, token_lists):
    """A generate(_) for time_generation: the engine's own call on `token_lists`, returning the tokens made."""
    prompts = [{"prompt_token_ids": ids} for ids in token_lists]

    def generate(_):
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        return sum(len(output.outputs[0].token_ids) for output in outputs)
    return generate


def standalone(engine_kwargs: dict, token_lists, params: dict, repeats: int, variant: str) -> dict:
    """Runs in its own spawned process: a vllm.LLM reading the checkpoint, timed as `variant` asks."""
    import vllm

    if variant == "distributed_first":
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
        torch.distributed.init_process_group("nccl")
    llm = vllm.LLM(**engine_kwargs)
    generate = llm_generate(llm, vllm.SamplingParams(**params), token_lists)
    result = {"fresh": timed(generate, repeats)}
    if variant == "sleep_wake":
        llm.sleep(level=1)
        llm.wake_up()
        result["after_sleep_wake"] = timed(generate, repeats)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="the random Qwen2.5-0.5B-shaped model (made if absent)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="write the rows here as JSON (after each row)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)
    from hybridrl.workers.rollout.vllm_rollout import sampling_params

    make_qwen05b_model(args.model_dir)
    init_single_gpu_process_group()
    config = hybrid_config(args.model_dir, [
        f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.new_tokens}",
        "actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.multi_stage_wake_up=true"],
        engine="vllm")
    rows: dict[str, dict] = {}

    def record(name: str, row: dict) -> None:
        rows[name] = row
        print(f"{name:<48} {row['tok_per_s']:>10,.0f} tok/s ({row['seconds']:.2f} s)", flush=True)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                           "args": vars(args), "rows": rows}, handle, indent=1)

    module, optimizer, _ = build_actor(config)
    train_step(module, optimizer)
    rollout, switch = build_hybrid(config, module)
    prompts = random_prompts(args.prompts, args.prompt_length, module.config.vocab_size).repeat(args.n, interleave=True)
    prompts.meta_info.update(eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    token_lists = [row.tolist() for row in prompts.batch["input_ids"]]
    params = sampling_params(config.actor_rollout_ref.rollout, {}, [EOS_ID])
    with rollout_window(switch):
        record("hybrid/generate_sequences", timed(
            lambda _: int(rollout.generate_sequences(prompts).batch["response_mask"].sum()), args.repeats))
        direct = llm_generate(rollout.llm, rollout.vllm.SamplingParams(**params), token_lists)
        record("hybrid/llm.generate", timed(direct, args.repeats))
        gc.collect()
        gc.freeze()
        record("hybrid/llm.generate, gc frozen", timed(direct, args.repeats))
        gc.unfreeze()
    engine_kwargs = dict(rollout.engine_kwargs, load_format="auto")
    rollout.shutdown()

    for variant in ("sleep_wake", "distributed_first"):
        measured = in_own_process(standalone, engine_kwargs, token_lists, params, args.repeats, variant)
        if variant == "sleep_wake":
            record("standalone", measured["fresh"])
            record("standalone, after sleep(1) + wake_up", measured["after_sleep_wake"])
        else:
            record("standalone, torch.distributed first", measured["fresh"])
    base = rows["standalone"]["tok_per_s"]
    print("\n| run | tok/s | / standalone |\n|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['tok_per_s']:,.0f} | {row['tok_per_s'] / base:.3f} |")


if __name__ == "__main__":
    main()
