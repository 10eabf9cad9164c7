"""The sample-group flow's two generate functions (trainer/ppo/generate.py) on the same SGLang engine, taking turns:
agent loops against the batched engine call (issue 26's first target: agent loops at >= 0.95x the batched call with
512 requests in flight, 1 GPU, 0.5B shape).

    PYTHONPATH=.:/tmp/site python benchmarks/agent_loop_gap.py --model-dir /tmp/q05tok --tokenizer .stage/qwen_tok \
        --out $OUT/agent_loop_gap.json
    PYTHONPATH=. python benchmarks/agent_loop_gap.py --device cpu --model-dir /tmp/tiny   # the CPU check: a tiny
        model, the hf engine (which stops at EOS: the paths' token counts differ), small batches; says nothing of GPUs

One process holds the trainer's rollout worker (ActorRolloutRefWorker: FSDP2 actor + colocated SGLang engine, decode
CUDA graphs captured up to the 512 sequences in flight, as the trainer sizes them) and its engine server; local Ray
runs the AgentLoopManager's workers. Each turn is one rollout window, rollout_mode to trainer_mode, as in a
training step; only the generation call inside it is timed:
  batch        BatchGenerate: the worker's generate_sequences, one engine.generate call for all rows (rollout.mode=sync)
  agent_loops  AgentLoopGenerate: one single_turn_agent loop per row (a group of one) on the manager's workers,
               each sending its own request to the worker's engine server (rollout.mode=async); SGLang's engine server
               admits the requests that arrive together in batches (workers/rollout/admission.py)
Both paths' samples are then padded into the batch on the controller, as a training step assembles it.
  agent_loops_per_request  (--per-request-admission) the same, with the server handing SGLang each request on its
               own (Engine.async_generate), as before admission in batches
The paths take turns A B B A (A B C C B A with three; hybrid_engine.time_interleaved) for --turns runs each, so
that none gets all the early or all the late ones: one engine's rate drifts from batch to batch at this shape (its
step loop is bound by one host core), and runs timed one after the other in separate trainer runs (ppo_step.py) met different stretches
of that drift. Responses run to the full length (rollout.ignore_eos), so both make the same tokens. For the agent
loops each turn also records where the time went (the loops' and the server's metrics): when the server saw its
first and last request (the engine has its whole batch only after the last), the slowest sample's generate, and the
whole call (what is left of it beyond the slowest generate is dispatch, results and padding). The JSON record
(--out) is rewritten after every turn, so a run cut off keeps the turns it made. The headline is a ratio of times:
the batch path's seconds per token over the agent path's, over the repeats, with its 90 % bootstrap interval
(time_ratio; issue 59).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time

import torch

from benchmarks.hybrid_engine import (hybrid_config, init_single_gpu_process_group, prepare_model, random_prompts,
                                      time_interleaved)
from benchmarks.vocab import Vocabulary, tiny_model

CPU_DEFAULTS = {  # argument: (cuda default, cpu default)
    "prompts": (64, 4), "n": (8, 2), "prompt_length": (128, 8), "new_tokens": (512, 8), "agent_workers": (8, 2)}
TURN_MARKER = "=== turn: "
AGENT_METRICS = {  # the agent-loop turn's breakdown: (label, metric key)
    "server: first request (s)": "timing_s/server_first_request",
    "server: last request (s)": "timing_s/server_last_request",
    "slowest sample's generate (s)": "timing_s/agent_loop/slowest/generate_sequences",
    "whole call (s)": "timing_s/agent_loop",
}


def build_worker(model_dir: str, args):
    """The trainer's rollout worker on this GPU with rollout.mode=async (its engine server started), sized for
    --prompts x --n sequences in flight."""
    from hybridrl.models.spec import policy_model_spec
    from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker
    from hybridrl.workers.rollout.engine_load import EngineLoad

    on_gpu = args.device == "cuda"
    init_single_gpu_process_group("nccl" if on_gpu else "gloo")
    config = hybrid_config(model_dir, [
        f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.new_tokens}",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.n}",
        *(["actor_rollout_ref.rollout.ignore_eos=true"] if on_gpu else []),  # hf generate always stops at EOS
        "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.rollout.agent.num_workers={args.agent_workers}", *args.override],
        engine="sglang" if on_gpu else "hf", device=args.device)
    load = EngineLoad(args.prompts * args.n, f"{args.prompts} prompts x {args.n} samples on 1 engine")
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, policy_model_spec(config), role="actor_rollout", seed=1,
                                   device=args.device, engine_load=load)
    worker.init_model()
    return config, worker


def prompt_rows(prompts) -> list[dict]:
    """Each prompt as the flow's prompt source makes it a row (its prompt ids), so that both paths generate from the
    same tokens."""
    return [{"raw_prompt_ids": row[mask.bool()].tolist()}
            for row, mask in zip(prompts.batch["input_ids"], prompts.batch["attention_mask"])]


def flow_generate(generator, rows: list[dict], rollout_config, pad_token_id: int):
    """Every row as a group of one through one of the flow's generate functions, all submitted at once and waited
    for, padded into the batch (data/sample.samples_to_batch) with the agent loops' metrics as a step logs them."""
    from hybridrl.agent_loop.base import AgentLoopMetrics
    from hybridrl.agent_loop.manager import agent_loop_metrics
    from hybridrl.data.sample import new_group, samples_to_batch
    from hybridrl.trainer.ppo.generate import TRAINING

    started = time.perf_counter()
    handles = [generator.submit(new_group(row, 1, index, index), TRAINING, None, 0, index)
               for index, row in enumerate(rows)]
    done: dict = {}
    while len(done) < len(handles):
        done.update(generator.wait([handle for handle in handles if handle not in done]))
    samples = [done[handle][0] for handle in handles]
    batch = samples_to_batch(samples, prompt_length=rollout_config.prompt_length,
                             response_length=rollout_config.response_length, pad_token_id=pad_token_id,
                             with_log_probs=False, scored=False)
    ran = [sample for sample in samples if sample.agent_metrics is not None]
    batch.meta_info["metrics"] = {"timing_s/agent_loop": time.perf_counter() - started, **(agent_loop_metrics(
        [sample.num_turns for sample in ran], [AgentLoopMetrics(**sample.agent_metrics) for sample in ran],
        [(len(sample.prompt_ids), len(sample.response_ids)) for sample in ran]) if ran else {})}
    return batch


def run_turns(args, vocabulary: Vocabulary, record: dict) -> None:
    import ray

    from hybridrl.agent_loop.manager import AgentLoopManager
    from hybridrl.trainer.ppo.generate import AgentLoopGenerate, BatchGenerate

    tokenizer = vocabulary.tokenizer
    config, worker = build_worker(args.model_dir, args)
    record["engine"] = config.actor_rollout_ref.rollout.name
    address = worker.start_engine_server([tokenizer.eos_token_id], tokenizer.pad_token_id)
    ray.init(num_cpus=args.agent_workers + 2, include_dashboard=False, log_to_driver=True)
    manager = AgentLoopManager(config, tokenizer, [address])
    prompts = random_prompts(args.prompts, args.prompt_length, vocabulary.embeddings).repeat(args.n, interleave=True)
    rows, rollout = prompt_rows(prompts), config.actor_rollout_ref.rollout
    agent_loop_generate = AgentLoopGenerate(manager, rollout)
    batch_generate = BatchGenerate(worker, rollout, tokenizer, weights_version=lambda: 0)
    record["turns"] = []

    def in_window(path: str, generate) -> tuple[float, int]:
        """One rollout window around generate(): the seconds of generate alone and the response tokens it made; the
        turn is recorded."""
        print(f"{TURN_MARKER}{path} {len(record['turns'])}", flush=True)  # decode_lines_by_turn's marker
        engine = worker.engine_server.engine
        batcher = getattr(engine, "batcher", None)  # SGLang's admission in batches (hf batches in its engine)
        if batcher is not None:
            engine.batch_admission = path != "agent_loops_per_request"
            batcher.batch_sizes.clear()
        worker.rollout_mode()
        if path == "batch":  # the batch path drives the engine's event loop from this thread: the server lets go of it
            worker.engine_server.pause()
        try:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            started = time.perf_counter()
            output = generate()
            seconds = time.perf_counter() - started
        finally:
            served = worker.trainer_mode()
        metrics = {**output.meta_info.get("metrics", {}), **served}
        turn = {"path": path, "seconds": seconds, "tokens": int(output.batch["response_mask"].sum()),
                **{key: float(value) for key, value in metrics.items() if key in AGENT_METRICS.values() or
                   key == "timing_s/engine_generate"}}
        if batcher is not None and path != "batch":
            turn["admission_batches"] = list(batcher.batch_sizes)
        record["turns"].append(turn)
        write_record(record, args.out)
        return seconds, turn["tokens"]

    agent_loops = lambda path: in_window(path, lambda: flow_generate(  # noqa: E731
        agent_loop_generate, rows, rollout, tokenizer.pad_token_id))
    turns = {"agent_loops": lambda: agent_loops("agent_loops")}
    if args.per_request_admission:
        if record["engine"] != "sglang":
            raise SystemExit("--per-request-admission: only the sglang engine server admits requests in batches")
        turns["agent_loops_per_request"] = lambda: agent_loops("agent_loops_per_request")
    turns["batch"] = lambda: in_window("batch", lambda: flow_generate(  # the reference: last
        batch_generate, rows, rollout, tokenizer.pad_token_id))
    try:
        for _ in range(args.warmup):  # the first agent call starts the loops' sessions; graphs and caches warm up
            for turn in turns.values():
                turn()
        record["warmup_turns"], record["turns"] = record["turns"], []
        record.update(time_interleaved(turns, None, args.turns, time_run=lambda turn, _: turn()))
        if args.pyspy:
            record["profiled_turns"] = profiled_turns(args, turns)
            record["profiled_turns"]["turns"] = record["turns"][-len(turns):]  # not among the timed turns
            del record["turns"][-len(turns):]
    finally:
        manager.shutdown()
        ray.shutdown()
        worker.engine_server.shutdown()


def profiled_turns(args, turns) -> dict:
    """One more turn of each path (not among the timed ones) with py-spy sampling this process's busy threads (the
    engine server's, whose loop admits every request and answers it; host_profile.py) and, beside it, the engine's
    scheduler process, whose step loop is bound by one host core: the same work in both paths, so what the agent
    turn's scheduler does more shows there."""
    from benchmarks.host_profile import PySpy, print_summary

    profiled = {}
    for path in turns:
        pids = {"this_process": None}
        schedulers = scheduler_pids()
        if schedulers:
            pids["scheduler"] = schedulers[0]
        raw = f"{args.out or 'agent_loop_gap'}.{path}"
        with contextlib.ExitStack() as stack:
            profilers = {name: stack.enter_context(PySpy(args.pyspy, f"{raw}.{name}.raw", pid=pid))
                         for name, pid in pids.items()}
            seconds, tokens = turns[path]()
        profiled[path] = {"seconds": seconds, "tokens": tokens,
                          **{name: profiler.summary() for name, profiler in profilers.items()}}
        for name in profilers:
            print_summary(f"{path} turn under py-spy ({seconds:.2f} s), {name}", profiled[path][name])
    return profiled


def scheduler_pids() -> list[int]:
    """The pids of SGLang's scheduler processes under this one (SGLang titles them "sglang::scheduler...":
    setproctitle; Ray's processes, also under this one, are not); none for an engine without one (hf)."""
    import psutil

    return [child.pid for child in psutil.Process().children(recursive=True)
            if " ".join(child.cmdline()).startswith("sglang::scheduler")]


def decode_lines_by_turn(log_path: str) -> dict:
    """SGLang's 'Decode batch' lines (log_level=info: every 40 decode steps, the running requests and the scheduler's
    rate over those steps) of each turn, found between the turn markers this run printed into the same log, the
    warm-up and profiled turns included; per path, the median rate over the lines of 90 % of a turn's largest batch
    or more. That rate tells whether the engine itself stepped slower in the agent turns, or the turn lost its time
    around the decoding (admission, the tail)."""
    import re

    pattern = re.compile(r"Decode batch.*?#running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+)")
    turns, current = [], None
    with open(log_path, errors="replace") as handle:
        for line in handle:
            if line.startswith(TURN_MARKER):
                current = {"turn": line[len(TURN_MARKER):].strip(), "running": [], "tok_per_s": []}
                turns.append(current)
            elif current is not None and (match := pattern.search(line)):
                current["running"].append(int(match.group(1)))
                current["tok_per_s"].append(float(match.group(2)))
    by_path = {}
    for turn in turns:
        peak = max(turn["running"], default=0)
        full = [rate for rate, running in zip(turn["tok_per_s"], turn["running"]) if running >= 0.9 * peak]
        by_path.setdefault(turn["turn"].split()[0], []).append({"lines": len(turn["tok_per_s"]),
                                                                "full_batch_tok_per_s": full})
    return {path: {"turns": len(entries), "lines_per_turn": statistics.mean(entry["lines"] for entry in entries),
                   "full_batch_tok_per_s_median": statistics.median(
                       [rate for entry in entries for rate in entry["full_batch_tok_per_s"]] or [0.0])}
            for path, entries in by_path.items()}


def summary(record: dict, path: str = "agent_loops") -> dict:
    """An agent path against the batch path as a ratio of times (time_ratio: the headline, with its bootstrap interval
    and each repeat's ratio), and the path's mean breakdown."""
    agent_turns = [turn for turn in record["turns"] if turn["path"] == path]
    batch_turns = [turn for turn in record["turns"] if turn["path"] == "batch"]
    breakdown = {label: statistics.mean(turn[key] for turn in agent_turns) for label, key in AGENT_METRICS.items()
                 if all(key in turn for turn in agent_turns)}
    if all("admission_batches" in turn for turn in agent_turns):
        breakdown["admission batches a turn"] = statistics.mean(len(turn["admission_batches"]) for turn in agent_turns)
    return {**time_ratio([(turn["seconds"], turn["tokens"]) for turn in agent_turns],
                         [(turn["seconds"], turn["tokens"]) for turn in batch_turns]),
            "agent_breakdown_mean": breakdown}


def time_ratio(agent_runs: list[tuple[float, int]], batch_runs: list[tuple[float, int]], draws: int = 4000) -> dict:
    """The agent path against the batch path as a ratio of times: the batch path's seconds per token over the agent
    path's, summed over the repeats (`time_ratio`; both make the same tokens on the GPU, so it is total batch seconds
    over total agent seconds), each repeat's own (`repeat_ratios`: the agent turn with the batch turn of the same
    repeat), and the 5th and 95th percentiles of time_ratio over `draws` bootstrap resamples of the repeats
    (`time_ratio_90`; a resample keeps each repeat's two turns together, so that they meet the same drift).
    Why times, not a mean of per-turn tok/s: a user waits for the seconds, and a mean of rates weighs a fast turn's
    rate as much as a slow one's. Seeded, so a record's interval is reproducible from its turns. Runs: (seconds,
    tokens), in the order the repeats ran."""
    import random

    if len(agent_runs) != len(batch_runs) or not agent_runs:
        raise ValueError(f"time_ratio: expected as many agent runs as batch runs (one pair a repeat), got "
                         f"{len(agent_runs)} and {len(batch_runs)}")
    repeats = list(zip(agent_runs, batch_runs))

    def over(chosen: list) -> float:
        agent_s_per_token = sum(a[0] for a, _ in chosen) / sum(a[1] for a, _ in chosen)
        batch_s_per_token = sum(b[0] for _, b in chosen) / sum(b[1] for _, b in chosen)
        return batch_s_per_token / agent_s_per_token

    rng = random.Random(0)
    resampled = sorted(over([repeats[rng.randrange(len(repeats))] for _ in repeats]) for _ in range(draws))
    return {"time_ratio": over(repeats),
            "time_ratio_90": [resampled[int(0.05 * draws)], resampled[int(0.95 * draws) - 1]],
            "repeat_ratios": [over([repeat]) for repeat in repeats]}


def agent_paths(record: dict) -> list[str]:
    return [path for path in ("agent_loops", "agent_loops_per_request") if path in record]


def print_table(record: dict, args) -> None:
    print(f"\n{record['device']}, {args.prompts} prompts x {args.n} x {args.new_tokens} tokens, one {record['engine']} "
          f"engine, {args.turns} turns each, taking turns A B .. B A\nvocab: {record['vocab']['describe']}")
    for path in ("batch", *agent_paths(record)):
        rates = record[path]["tok_per_s_runs"]
        print(f"{path:<24} {record[path]['tok_per_s']:>9,.0f} tok/s (mean of {len(rates)}: {min(rates):,.0f}-"
              f"{max(rates):,.0f}; {record[path]['seconds']:.2f} s a turn)")
    for path in agent_paths(record):
        result = record["summary"] if path == "agent_loops" else record[f"summary_{path}"]
        low, high = result["time_ratio_90"]
        repeats = result["repeat_ratios"]
        print(f"{path} / batch: {result['time_ratio']:.3f} (ratio of times: batch seconds per token over {path}'s, "
              f"over {len(repeats)} repeats; 90 % bootstrap interval {low:.3f}-{high:.3f}); repeat by repeat median "
              f"{statistics.median(repeats):.3f}, {min(repeats):.3f}-{max(repeats):.3f}")
        for label, value in result["agent_breakdown_mean"].items():
            print(f"  {path}, {label}: {value:.3f} (mean)")
    sys.stdout.flush()


def write_record(record: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(record, handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model-dir", required=True, help="the random 0.5B-shape model (made here if absent; on the "
                                                            "CPU a tiny one, made here)")
    parser.add_argument("--tokenizer", help="tokenizer directory: the model gets its vocabulary (needed on cuda)")
    parser.add_argument("--prompts", type=int, default=None, help="default 64 (cuda), 4 (cpu)")
    parser.add_argument("--n", type=int, default=None, help="default 8 (cuda), 2 (cpu)")
    parser.add_argument("--prompt-length", type=int, default=None, help="default 128 (cuda), 8 (cpu)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 512 (cuda), 8 (cpu)")
    parser.add_argument("--turns", type=int, default=8, help="timed turns of each path")
    parser.add_argument("--warmup", type=int, default=1, help="untimed turns of each path first")
    parser.add_argument("--agent-workers", type=int, default=None, help="rollout.agent.num_workers: default 8 (cuda), "
                                                                         "2 (cpu)")
    parser.add_argument("--per-request-admission", action="store_true",
                        help="a third path: the agent loops with the sglang server admitting each request on its own "
                             "(Engine.async_generate per request) instead of in batches (admission.py)")
    parser.add_argument("--override", action="append", default=[], help="extra config override (repeatable)")
    parser.add_argument("--pyspy", help="py-spy binary (scripts/gpu/stage_pyspy.sh): one more turn of each path, "
                        "profiled (this process and the engine's scheduler)")
    parser.add_argument("--engine-log", metavar="PATH", help="SGLang log_level=info; PATH is where this run's output "
                        "goes (> PATH 2>&1): its decode lines are summarized per path into the record at the end")
    parser.add_argument("--out", help="write all numbers here as JSON (rewritten after every turn)")
    args = parser.parse_args()
    for name, (on_gpu, on_cpu) in CPU_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if args.device == "cuda" else on_cpu)
    if args.device == "cuda" and not args.tokenizer:
        parser.error("--tokenizer is needed on cuda (the model's vocabulary: Qwen's, .stage/qwen_tok)")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # One CPU thread, as the trainer's processes have: its worker and its controller are Ray actors, whose
    # OMP_NUM_THREADS is their CPU share (single_controller/worker.py). With a thread per core this process spent
    # 0.2 s a turn in small CPU tensor ops (padding, concatenation) on the H200 host (py-spy, 2026-12-02), in both paths.
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the engine's sampling seed is the process's torch seed
    if args.device == "cuda":
        vocabulary = prepare_model(args)
    else:
        _, vocabulary = tiny_model(args.model_dir, ["the answer is 12 plus 30", "what is 7 times 6"] * 20,
                                   hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    record = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d"), "args": vars(args),
              "vocab": {**vocabulary.record(), "describe": vocabulary.describe()}}
    if args.engine_log:
        args.override.append("+actor_rollout_ref.rollout.engine_kwargs.sglang.log_level=info")
    run_turns(args, vocabulary, record)
    record["summary"] = summary(record)
    if "agent_loops_per_request" in record:
        record["summary_agent_loops_per_request"] = summary(record, "agent_loops_per_request")
    if args.engine_log:
        record["engine_decode_lines"] = decode_lines_by_turn(args.engine_log)
    write_record(record, args.out)
    print_table(record, args)


if __name__ == "__main__":
    main()
