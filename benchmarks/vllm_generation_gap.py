"""Where the hybrid vLLM engine loses generation speed against a standalone one (benchmarks/hybrid_engine.py measured
0.72x on an H200, 2026-12-01), all in one invocation on one GPU:

    PYTHONPATH=.:/tmp/site-vllm:/tmp/site python benchmarks/vllm_generation_gap.py --model-dir /tmp/q05 --out gap.json
    (add --pyspy /tmp/pyspy/bin/py-spy --sequences repeated,trainer_first --batches 3 to profile: see below)

What it found on an H200 (2026-12-02, two runs, benchmarks/README.md): the same batch of 512 x 512 tokens takes
5.5 to 11.4 s on one engine, batch after batch, in every sequence (CPU seconds = wall seconds throughout; the GPU's
clock stays 1,980 MHz); over all batches the hybrid engine averages 0.79x the standalone ones (10 batches against
22), with no sequence below explaining it: not sleep/wake, the prefix cache or torch.distributed, and in the hybrid
process neither the rollout's packing (the engine's own llm.generate was no faster) nor Python's garbage collector
(off, frozen heap: no faster). So every batch is timed on its own, with this process's CPU seconds and the GPU's
busy share in it (which of the two bounds the loop) and the GPU's SM clock and the host CPU's frequency after it,
and with --pyspy the last batch of each sequence is sampled by py-spy with native frames (host_profile.py: the
share of samples waiting on the GPU, and the functions the rest is spent in, printed after that batch; the raw
stacks, <sequence>.raw, go next to --out). The sequences:
  hybrid            the trainer's process (FSDP2 actor, NCCL world of 1): --batches batches of generate_sequences
                    in one rollout window, after one sync
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
import contextlib
import json
import logging
import os
import time

import torch

from benchmarks.host_profile import PySpy
from benchmarks.host_profile import print_summary as print_profile
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


def host_cpu(before, after, seconds: float) -> dict[str, float]:
    """What the whole host's CPUs did between two psutil.cpu_times(): busy cores on average (every process's), and
    the share of all CPU time the hypervisor gave to other guests (steal). They tell whether a slow batch of a loop
    bound by one host core had other work beside it (busy cores well above this process's CPU seconds / wall) or
    lost its core to another guest (steal)."""
    delta = {field: getattr(after, field) - getattr(before, field) for field in after._fields}
    busy = sum(delta.get(field, 0.0) for field in ("user", "nice", "system", "irq", "softirq"))
    total = sum(delta.values()) - delta.get("guest", 0.0) - delta.get("guest_nice", 0.0)  # guest is inside user
    return {"host_busy_cores": busy / seconds, "host_steal_pct": 100 * delta.get("steal", 0.0) / total if total else 0.0}


def batch_record(generate, profile_to: tuple[str, str] | None = None) -> dict:
    """One timed batch: seconds, tokens made, tokens/s, this process's CPU seconds in it and the GPU's busy share
    (GpuBusy: which of the two bounds the loop), Python's full (generation-2) garbage collections in it, then the
    GPU's SM clock (MHz, NVML) and the host CPU's mean frequency (MHz) right after it. profile_to=(py-spy binary, raw
    file): py-spy samples the batch too (host_profile.py), and the record gets the summary of its stacks."""
    import gc

    import psutil

    profiler = PySpy(*profile_to) if profile_to else contextlib.nullcontext()
    cpu_started, full_collections = time.process_time(), gc.get_stats()[2]["collections"]
    host_started = psutil.cpu_times()
    with profiler, GpuBusy() as busy:
        seconds, tokens = time_generation(generate, None)
    record = {"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds,
              "cpu_s": time.process_time() - cpu_started, **host_cpu(host_started, psutil.cpu_times(), seconds),
              "gpu_busy_pct": busy.mean_pct,
              "gc_full_collections": gc.get_stats()[2]["collections"] - full_collections,
              "gpu_clock_mhz": torch.cuda.clock_rate(), "cpu_mhz": psutil.cpu_freq().current}
    if profile_to:
        record["profile"] = profiler.summary()
    return record


def timed_batches(generate, count: int, after: str, profile: tuple[str, str] | None, name: str) -> list[dict]:
    """`count` batch records, each naming what came before it (`after`); with profile=(py-spy binary, folder) the last
    batch is profiled into folder/<name>.raw."""
    records = []
    for index in range(count):
        profile_to = (profile[0], os.path.join(profile[1], f"{name}.raw")) if profile and index == count - 1 else None
        records.append(dict(batch_record(generate, profile_to), after=after))
    return records


def standalone(engine_kwargs: dict, token_lists, params: dict, batches: int, sequence: str,
               trainer_overrides: list[str], profile: tuple[str, str] | None) -> list[dict]:
    """Runs in its own spawned process: a vllm.LLM reading the checkpoint, its batches timed as `sequence` says."""
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
        return timed_batches(generate, batches, "start", profile, sequence)
    records = timed_batches(generate, 2, "start", None, sequence)
    for level in (1, 2):  # level 2 discards the weights: the tokens are garbage, the work per token the same
        llm.sleep(level=level)
        llm.wake_up()
        llm.reset_prefix_cache()
        records += timed_batches(generate, 2, f"sleep({level}) + wake_up", profile if level == 2 else None, sequence)
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
    parser.add_argument("--pyspy", help="py-spy binary (scripts/gpu/stage_pyspy.sh): profile each sequence's last "
                        "batch, raw stacks next to --out")
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
    profile = (args.pyspy, os.path.dirname(os.path.abspath(args.out or "gap.json"))) if args.pyspy else None

    def record(name: str, batches: list[dict]) -> None:
        sequences[name] = batches
        for index, batch in enumerate(batches):
            print(f"{name:<18} batch {index + 1} after {batch['after']:<18} {batch['tok_per_s']:>8,.0f} tok/s "
                  f"({batch['seconds']:.2f} s, CPU {batch['cpu_s']:.2f} s, host {batch['host_busy_cores']:.1f} cores busy, "
                  f"steal {batch['host_steal_pct']:.1f} %, GPU busy {batch['gpu_busy_pct']:.0f} %, {batch['gc_full_collections']} full gc, "
                  f"{batch['tokens']} tokens), GPU {batch['gpu_clock_mhz']} MHz, "
                  f"CPU {batch['cpu_mhz']:.0f} MHz", flush=True)
            if "profile" in batch:
                print_profile(f"{name} batch {index + 1}, py-spy", batch["profile"])
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
        record("hybrid", timed_batches(packed, args.batches, "one sync", profile, "hybrid"))
    engine_kwargs = dict(rollout.engine_kwargs, load_format="auto")
    rollout.shutdown()

    for sequence in args.sequences.split(","):
        record(sequence, in_own_process(standalone, engine_kwargs, token_lists, params, args.batches, sequence,
                                        overrides, profile))
    print_summary(sequences)

if __name__ == "__main__":
    main()
