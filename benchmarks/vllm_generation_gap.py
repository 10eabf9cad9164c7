"""Where the hybrid vLLM engine loses generation speed against a standalone one (benchmarks/hybrid_engine.py measured
0.72x on an H200, 2026-12-01), all in one invocation on one GPU:

    PYTHONPATH=.:/tmp/site-vllm:/tmp/site python benchmarks/vllm_generation_gap.py --model-dir /tmp/q05 --out gap.json

What it found on an H200 (2026-12-02, two runs, benchmarks/README.md): the same batch of 512 x 512 tokens takes
5.5 to 11.4 s on one engine, batch after batch, in every sequence (CPU seconds = wall seconds throughout; the GPU's
clock stays 1,980 MHz); over all batches the hybrid engine averages 0.79x the standalone ones (10 batches against
22), with no sequence below explaining it: not sleep/wake, the prefix cache, torch.distributed, the rollout's
packing or the garbage collector. So every batch is timed on its own, with this process's CPU seconds and the GPU's
busy share in it (which bounds the loop) and the GPU's SM clock and the host CPU's frequency after it, in sequences
that tell the suspects apart:
  hybrid            the trainer's process (FSDP2 actor, NCCL world of 1): --batches batches of generate_sequences
                    in one rollout window, after one sync, then 2 of the engine's own llm.generate (without the
                    rollout's packing), then 2 more with Python's garbage collector off
  repeated          a standalone engine (own process, checkpoint from disk): --batches batches in a row, nothing else
  sleep_wake        standalone: 2 batches, sleep(1) + wake_up, 2 batches, sleep(2) + wake_up, 2 batches
  no_prefix_cache   standalone with enable_prefix_caching=False: --batches batches
  distributed_first standalone started after an NCCL torch.distributed world of 1: --batches batches
  trainer_first     standalone started in a process that first built the FSDP actor and took an optimizer step, as
                    the hybrid one's does (NCCL world of 1 included): --batches batches
  multiprocessing   standalone with vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's
                    default; the rollout runs it in-process to load weights without IPC): --batches batches
Prints one line per batch and a table of each sequence's mean, slowest and fastest batch, the mean against all the
in-process standalone batches' (every sequence but hybrid and multiprocessing).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch

from benchmarks.hybrid_engine import (EOS_ID, PAD_ID, build_actor, build_hybrid, hybrid_config, in_own_process,
                                      init_single_gpu_process_group, llm_generate, make_qwen05b_model,
                                      random_prompts, rollout_window, time_generation, train_step)


class GpuBusy:
    """NVML's GPU utilization (the share of its last sample period in which a kernel ran), sampled every 50 ms while
    the block runs; mean_pct is their mean. A loop bound by its host keeps this well under 100 % while its CPU seconds
    match the wall clock; a loop waiting on the GPU spins in a CUDA sync, which counts as CPU time too, at ~100 %."""

    def __enter__(self):
        import threading

        self.samples: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, name="gpu-busy", daemon=True)
        self.thread.start()
        return self

    def sample(self) -> None:
        while not self.stop.wait(0.05):
            self.samples.append(torch.cuda.utilization())

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.mean_pct = sum(self.samples) / len(self.samples) if self.samples else float("nan")


def batch_record(generate) -> dict:
    """One timed batch: seconds, tokens made, tokens/s, this process's CPU seconds in it and the GPU's busy share
    (GpuBusy: which of the two bounds the loop), Python's full (generation-2) garbage collections in it, then the GPU's SM clock (MHz,
    NVML) and the host CPU's mean frequency (MHz) right after it."""
    import gc

    import psutil

    cpu_started, full_collections = time.process_time(), gc.get_stats()[2]["collections"]
    with GpuBusy() as busy:
        seconds, tokens = time_generation(generate, None, repeats=1)
    return {"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds,
            "cpu_s": time.process_time() - cpu_started, "gpu_busy_pct": busy.mean_pct,
            "gc_full_collections": gc.get_stats()[2]["collections"] - full_collections,
            "gpu_clock_mhz": torch.cuda.clock_rate(), "cpu_mhz": psutil.cpu_freq().current}


def without_gc(generate):
    """generate with Python's garbage collector off (and everything alive frozen out of its reach) for the call."""
    import gc

    def call(prompts):
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            return generate(prompts)
        finally:
            gc.enable()
            gc.unfreeze()
    return call


def standalone(engine_kwargs: dict, token_lists, params: dict, batches: int, sequence: str,
               trainer_overrides: list[str] = ()) -> list[dict]:
    """Runs in its own spawned process: a vllm.LLM reading the checkpoint, its batches timed as `sequence` says
    (each record names what came before it in `after`)."""
    import vllm

    if sequence == "trainer_first":  # the hybrid process's state, but the engine reads the checkpoint itself
        os.environ.update(MASTER_PORT="29533")  # the parent's group holds the default port
        init_single_gpu_process_group()
        module, optimizer, _ = build_actor(hybrid_config(engine_kwargs["model"], trainer_overrides, engine="vllm"))
        train_step(module, optimizer)
    if sequence == "distributed_first":
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
        torch.distributed.init_process_group("nccl")
    if sequence == "multiprocessing":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if sequence == "no_prefix_cache":
        engine_kwargs = dict(engine_kwargs, enable_prefix_caching=False)
    llm = vllm.LLM(**engine_kwargs)
    generate = llm_generate(llm, vllm.SamplingParams(**params), token_lists)
    if sequence != "sleep_wake":
        return [dict(batch_record(generate), after="start") for _ in range(batches)]
    records = [dict(batch_record(generate), after="start") for _ in range(2)]
    for level in (1, 2):  # level 2 discards the weights: the tokens are garbage, the work per token the same
        llm.sleep(level=level)
        llm.wake_up()
        llm.reset_prefix_cache()
        records += [dict(batch_record(generate), after=f"sleep({level}) + wake_up") for _ in range(2)]
    return records


def print_summary(sequences: dict[str, list[dict]]) -> None:
    """Each sequence's mean, slowest and fastest batch (tok/s), and its mean over the in-process standalone batches'."""
    import statistics

    rate = {name: [batch["tok_per_s"] for batch in batches] for name, batches in sequences.items()}
    standalone_rates = [r for name, rates in rate.items() if name not in ("hybrid", "multiprocessing") for r in rates]
    base = statistics.mean(standalone_rates) if standalone_rates else float("nan")
    print(f"\n| sequence | batches | mean tok/s | slowest | fastest | mean / standalone in-process mean "
          f"({base:,.0f}) |\n|---|---|---|---|---|---|")
    for name, rates in rate.items():
        print(f"| {name} | {len(rates)} | {statistics.mean(rates):,.0f} | {min(rates):,.0f} | {max(rates):,.0f} | "
              f"{statistics.mean(rates) / base:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="the random Qwen2.5-0.5B-shaped model (made if absent)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--batches", type=int, default=4, help="batches timed in each sequence but sleep_wake's 6")
    parser.add_argument("--out", help="write every batch here as JSON (after each sequence)")
    parser.add_argument("--sequences", default="repeated,sleep_wake,trainer_first,multiprocessing,no_prefix_cache,"
                        "distributed_first", help="the standalone sequences to run, in order (comma-separated)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)
    from hybridrl.workers.rollout.vllm_rollout import sampling_params

    make_qwen05b_model(args.model_dir)
    init_single_gpu_process_group()
    overrides = [f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.new_tokens}",
                 "actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.multi_stage_wake_up=true"]
    config = hybrid_config(args.model_dir, overrides, engine="vllm")
    sequences: dict[str, list[dict]] = {}

    def record(name: str, batches: list[dict]) -> None:
        sequences[name] = batches
        for index, batch in enumerate(batches):
            print(f"{name:<18} batch {index + 1} after {batch['after']:<18} {batch['tok_per_s']:>8,.0f} tok/s "
                  f"({batch['seconds']:.2f} s, CPU {batch['cpu_s']:.2f} s, GPU busy {batch['gpu_busy_pct']:.0f} %, {batch['gc_full_collections']} full gc, "
                  f"{batch['tokens']} tokens), GPU {batch['gpu_clock_mhz']} MHz, "
                  f"CPU {batch['cpu_mhz']:.0f} MHz", flush=True)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                           "args": vars(args), "sequences": sequences}, handle, indent=1)

    module, optimizer, _ = build_actor(config)
    train_step(module, optimizer)
    rollout, switch = build_hybrid(config, module)
    prompts = random_prompts(args.prompts, args.prompt_length, module.config.vocab_size).repeat(args.n, interleave=True)
    prompts.meta_info.update(eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    token_lists = [row.tolist() for row in prompts.batch["input_ids"]]
    params = sampling_params(config.actor_rollout_ref.rollout, {}, [EOS_ID])
    with rollout_window(switch):
        packed = lambda _: int(rollout.generate_sequences(prompts).batch["response_mask"].sum())  # noqa: E731
        engine_own = llm_generate(rollout.llm, rollout.vllm.SamplingParams(**params), token_lists)
        record("hybrid", [dict(batch_record(packed), after="one sync") for _ in range(args.batches)]
               + [dict(batch_record(engine_own), after="llm.generate") for _ in range(2)]
               + [dict(batch_record(without_gc(engine_own)), after="llm.generate, no gc") for _ in range(2)])
    engine_kwargs = dict(rollout.engine_kwargs, load_format="auto")
    rollout.shutdown()

    for sequence in args.sequences.split(","):
        record(sequence, in_own_process(standalone, engine_kwargs, token_lists, params, args.batches, sequence,
                                        overrides))
    print_summary(sequences)

if __name__ == "__main__":
    main()
