"""The whole GRPO trainer step at real model shapes, per phase: seconds, tokens/s/GPU, MFU, memory; padded vs
remove padding; and generation against a standalone SGLang engine on the same prompts, in one invocation.

    PYTHONPATH=. python benchmarks/ppo_step.py --data-dir DIR --tokenizer DIR --shape 0.5b --gpus 1 \
        --layouts rmpad,padded --out $OUT/ppo_step.json

Each layout is one real run of `python -m hybridrl.main_ppo` (Ray, FSDP2 actor, colocated SGLang rollout,
GRPO, no validation) for --steps steps; LAYOUT@vllm runs the same with the colocated vLLM rollout (one table,
both engines: `--layouts rmpad32k,rmpad32k@vllm`; the standalone engine is SGLang's); the table reports the mean of the steps after the first (the first
carries the kernels' warm-up). `--vary KEY=A,B` runs the one layout four times, at A, B, B and A, and prints each
value's steps and the ratio of their means. The model is random bf16 weights of the Qwen2.5 layer shapes with the
vocabulary of --tokenizer: its tokenizer tokenizes the prompts, and its embedding count (benchmarks/vocab.py: the
directory's config.json vocab_size, else the tokenizer's length rounded up to 128) sizes the embedding and the
logits. For Qwen2.5's real 151,936, give the directory `python -m hybridrl.models.gguf_source` writes (or its
tokenizer staged by scripts/gpu/stage_qwen_tokenizer.sh); the built-in task's tokenizer gives a few hundred. The
table and the JSON record name it (`vocab:`). The standalone engine then generates from the same prompts with the
same sampling parameters and engine settings in this process.
Columns: seconds per phase (timing_s/*), tokens/s/GPU over the whole step (verl's perf/throughput: prompt
and response tokens), MFU of the update and of the log-prob pass (perf/mfu/*), peak GPU memory.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from benchmarks.trainer_run import Deadline, fresh_dir, mean_metrics, run_trainer as run_logged
from benchmarks.vocab import Vocabulary, load_vocabulary, reusable_model

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
}
LAYOUTS = {
    "padded": ["actor_rollout_ref.model.use_remove_padding=false"],
    "rmpad": ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384"],
    "rmpad32k": ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768"],
    "rmpad64k": ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=65536",
                 "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                 "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=65536"],
}
# 64k tokens fit beside the engine on an 80 GB H100 only with liger's fused norm/SwiGLU (benchmarks/README.md)
LAYOUTS["rmpad64k_liger"] = LAYOUTS["rmpad64k"] + ["actor_rollout_ref.model.use_liger=true"]
# The same layout with rollout.mode=async: one agent loop per sample through each rank's engine server.
for name in ("rmpad32k", "rmpad64k"):
    LAYOUTS[f"{name}_async"] = LAYOUTS[name] + ["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true"]
PHASES = ["gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step"]
SWITCH = ["update_weights", "resume_weights", "resume_kv_cache", "release_engine", "offload_trainer",
          "reload_actor", "offload_actor"]


# the phases recorded per steady step (steps/timing_s/<phase>), not only as means: tree_turns.py pools them
STEP_PHASES = ("gen", "reward", "old_log_prob", "update_actor", "step")

def make_model(shape: str, vocabulary: Vocabulary, out: str) -> str:
    """Random-weight bf16 Qwen2 of `shape` with `vocabulary`'s embedding count, saved with its tokenizer (unless `out`
    holds one made for it already)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if reusable_model(out, vocabulary):
        return out
    tokenizer = vocabulary.tokenizer
    config = Qwen2Config(**SHAPES[shape], vocab_size=vocabulary.embeddings, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         use_sliding_window=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


ENGINES = {  # rollout.name -> the config keys only that engine gets (the rest of a run is the same for both)
    # prefill CUDA graphs only lengthen SGLang's start here; decode graphs stay on
    "sglang": ["+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_prefill_cuda_graph=true"],
    "vllm": [],
}


def run_name(run: str) -> tuple[str, str]:
    """A --layouts entry, LAYOUT or LAYOUT@ENGINE (rmpad32k@vllm): its layout and its rollout engine (sglang if
    unnamed), each checked against what exists."""
    layout, _, engine = run.partition("@")
    engine = engine or "sglang"
    if layout not in LAYOUTS or engine not in ENGINES:
        raise SystemExit(f"--layouts: {run!r} is not LAYOUT or LAYOUT@ENGINE with LAYOUT one of {sorted(LAYOUTS)} "
                         f"and ENGINE one of {sorted(ENGINES)}")
    return layout, engine


def parse_vary(text: str | None) -> tuple[str, list[str]] | None:
    """--vary KEY=A,B as (KEY, [A, B]); None without it."""
    if text is None:
        return None
    key, _, values = text.partition("=")
    values = values.split(",")
    if not key or len(values) != 2 or not all(values):
        raise SystemExit(f"--vary: expected KEY=A,B (two values of one Hydra key), got {text!r}")
    return key, values


def planned_runs(layouts: list[str], vary: tuple[str, list[str]] | None) -> list[tuple[str, str, list[str]]]:
    """(name, layout, overrides) of each trainer run, in order. `vary` (parse_vary's KEY, [A, B]) runs the one layout at
    KEY=A, B, B, A: a drift of the host over the invocation then falls on both values alike. Runs are named LAYOUT or
    LAYOUT|KEY=V#k (the k-th run at V, KEY's last part)."""
    if vary is None:
        return [(layout, layout, []) for layout in layouts]
    if len(layouts) != 1:  # vary_summary pools every run at a value: the runs must differ in nothing else
        raise SystemExit(f"--vary: expected one layout in --layouts, got {len(layouts)}: {','.join(layouts)}")
    key, values = vary
    return [(f"{layout}|{key.rsplit('.', 1)[-1]}={value}#{1 + index // 2}", layout, [f"{key}={value}"])
            for layout in layouts for index, value in enumerate(values + values[::-1])]


def vary_summary(results: dict, vary: tuple[str, list[str]]) -> dict:
    """Per value of the varied key: the runs' steps' generation and step seconds (each run's steps after its first),
    and the second value's means over the first's."""
    key, values = vary
    short = key.rsplit(".", 1)[-1]
    sides = {}
    for value in values:
        runs = [result for name, result in results.items() if f"|{short}={value}#" in name]
        sides[value] = {phase: [seconds for run in runs for seconds in run.get(f"steps/timing_s/{phase}", [])]
                        for phase in ("gen", "step")}
    first, second = values
    summary = {"key": key, "values": sides}
    for phase in ("gen", "step"):
        if sides[first][phase] and sides[second][phase]:
            summary[f"{phase}_ratio_{second}_over_{first}"] = (statistics.mean(sides[second][phase])
                                                               / statistics.mean(sides[first][phase]))
    return summary


def trainer_overrides(args, model_dir: str, run_dir: str, engine: str = "sglang") -> list[str]:
    # 7B on 80 GB cards: the sharded fp32 weights stay on the GPU beside the engine; the AdamW state (2x the
    # weights) waits in CPU memory while the engine generates; activations are recomputed in the backward.
    offload = ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
               "actor_rollout_ref.model.enable_gradient_checkpointing=true"] if args.shape == "7b" else []
    engine_log = ["+actor_rollout_ref.rollout.engine_kwargs.sglang.log_level=info"] if (
        args.engine_log and engine == "sglang") else []
    return [
        f"data.train_files=[{args.data_dir}/train.parquet]", f"data.val_files=[{args.data_dir}/test.parquet]",
        f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cuda", f"trainer.n_gpus_per_node={args.gpus}",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.n}",
        f"data.max_response_length={args.response_length}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts // 2}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
        f"actor_rollout_ref.rollout.name={engine}", *ENGINES[engine],
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=[console,jsonl]", f"trainer.default_local_dir={run_dir}", *offload,
        *engine_log]


STANDALONE_RESERVE_S = 120  # two standalone engines, each started (~25 s at 0.5B on an H200) and timed 3 times


def run_trainer(args, model_dir: str, run: str, timeout: float | None, extra: Sequence[str] = (),
                name: str | None = None) -> dict:
    """One main_ppo run (`run`: LAYOUT or LAYOUT@ENGINE, with the `extra` overrides) of at most `timeout` seconds; the
    mean of each metric over the steps after the first, and those steps' generation and step seconds one by one. A
    run that failed or was cut off keeps what the steps it logged measured, beside its error."""
    layout, engine = run_name(run)
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{layout}_{engine}" if name is None else f"{name}_{engine}")
    run_dir = fresh_dir(os.path.join(args.work_dir, f"run_{args.shape}_{args.gpus}gpu_{label}"))
    command = [sys.executable, "-m", "hybridrl.main_ppo", *trainer_overrides(args, model_dir, run_dir, engine),
               *LAYOUTS[layout], *args.overrides, *extra]
    log_path = os.path.join(args.work_dir, f"{label}.log")  # written as the run goes: a cut-off run leaves it
    run = run_logged(command, log_path, os.path.join(run_dir, "metrics.jsonl"), timeout=timeout)
    with open(log_path, errors="replace") as log:
        output = log.read()
    timed = run.steps[1:] or run.steps
    result = {"wall_s": run.wall_s, "steps_logged": len(run.steps), **mean_metrics(timed),
              **{f"steps/timing_s/{phase}": [step[f"timing_s/{phase}"] for step in timed if f"timing_s/{phase}" in step]
                 for phase in STEP_PHASES},
              **decode_log_summary(output)}
    return {**result, "error": run.error} if run.error else result


def decode_log_summary(log: str) -> dict:
    """The engine's own view of decoding (--engine-log): SGLang's 'Decode batch' lines carry the running
    requests, whether the CUDA graph ran, and the scheduler's generation rate. A slow trainer generation with
    the scheduler's rate equal to a fast one's points outside the engine; a lower rate points inside it."""
    running, graph, rate = [], [], []
    for match in re.finditer(r"Decode batch.*?#running-req: (\d+).*?cuda graph: (\w+), gen throughput \(token/s\): "
                             r"([\d.]+)", log):
        running.append(int(match.group(1)))
        graph.append(match.group(2) == "True")
        rate.append(float(match.group(3)))
    if not rate:
        return {}
    return {"engine/decode_lines": len(rate), "engine/cuda_graph_share": sum(graph) / len(graph),
            "engine/running_req_median": statistics.median(running),
            "engine/gen_tok_per_s_median": statistics.median(rate),
            "engine/gen_tok_per_s_at_full_batch": statistics.median(
                [r for r, n in zip(rate, running) if n >= max(running) // 2] or rate)}


def standalone_generation(args, model_dir: str) -> dict:
    """tok/s of a standalone sglang.Engine on one GPU's share of the same prompts (all of them on 1 GPU, half on 2),
    with the same sampling parameters: once with the trainer's engine settings, CUDA graphs sized for the load
    included (rollout/engine_load.py), and once with SGLang's default graph sizes, which shows what the sizing
    is worth."""
    import pyarrow.parquet as pq
    import sglang
    from transformers import AutoTokenizer

    import hybridrl.checks  # noqa: F401  registers the subsystems' config checks
    from hybridrl.config import compose_config, validate_config
    from hybridrl.workers.rollout.engine_load import engine_load
    from hybridrl.workers.rollout.sglang_rollout import engine_kwargs, sampling_params

    config = validate_config(compose_config(trainer_overrides(args, model_dir, "/tmp/unused")))
    rollout = config.actor_rollout_ref.rollout
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = pq.read_table(f"{args.data_dir}/train.parquet").slice(0, args.prompts).column("prompt").to_pylist()
    texts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) for messages in rows]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts for _ in range(args.n)]
    prompts = prompts[:len(prompts) // args.gpus]  # one trainer engine's share: the same work per GPU
    params = sampling_params(rollout, {"validate": False}, [tokenizer.eos_token_id])  # what the trainer sends
    measured = {}
    for name, load in (("sized", engine_load(config)), ("default_graphs", None)):
        kwargs = engine_kwargs(rollout, model_dir, gpu_id=0, seed=0, load=load)
        kwargs["load_format"] = "auto"
        engine = sglang.Engine(**kwargs)
        results = []
        for _ in range(3):
            engine.flush_cache()
            torch.cuda.synchronize()
            started = time.perf_counter()
            outputs = engine.generate(input_ids=prompts, sampling_params=params)
            seconds = time.perf_counter() - started
            tokens = sum(len(output["output_ids"]) for output in outputs)
            results.append({"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds})
        engine.shutdown()
        best = max(results, key=lambda result: result["tok_per_s"])
        measured[name] = {**best, "mean_response_length": best["tokens"] / len(prompts),
                          "cuda_graph_max_bs_decode": kwargs.get("cuda_graph_max_bs_decode", "sglang default")}
    return {**measured["sized"], "default_graphs": measured["default_graphs"]}


def print_table(results: dict, args, vocabulary: Vocabulary) -> None:
    runs = {name: layout for name, layout, _ in planned_runs(args.layouts.split(","), parse_vary(args.vary))
            if name in results}
    layouts = list(runs)
    print(f"\n{args.shape} shape, {args.gpus} GPU(s), {torch.cuda.get_device_name()}, {args.prompts} prompts x "
          f"{args.n}, responses <= {args.response_length} tokens, steps 2..{args.steps} averaged\n"
          f"vocab: {vocabulary.describe()}")
    rows = [("response length (mean tokens)", "response_length/mean", "{:.0f}")]
    rows += [(f"{phase} (s)", f"timing_s/{phase}", "{:.2f}") for phase in PHASES]
    rows += [(f"  switch: {part} (s)", f"timing_s/{part}", "{:.3f}") for part in SWITCH]
    # rollout.mode=async: when the engine server's first and last request came (the engine has its full batch only
    # after the last), the manager's whole call against its slowest sample's generate, and the mean sample's
    rows += [("  server: first request after serve (s)", "timing_s/server_first_request", "{:.2f}"),
             ("  server: last request after serve (s)", "timing_s/server_last_request", "{:.2f}"),
             ("  agent loops: whole call (s)", "timing_s/agent_loop", "{:.2f}"),
             ("  agent loops: slowest generate (s)", "timing_s/agent_loop/slowest/generate_sequences", "{:.2f}"),
             ("  agent loops: mean generate (s)", "timing_s/agent_loop/generate_sequences/mean", "{:.2f}"),
             ("  engine_generate (s)", "timing_s/engine_generate", "{:.2f}"),
             ("  engine CUDA graph share (decode lines)", "engine/cuda_graph_share", "{:.2f}"),
             ("  engine running requests (median)", "engine/running_req_median", "{:.0f}"),
             ("  engine gen tok/s (median)", "engine/gen_tok_per_s_median", "{:,.0f}"),
             ("  engine gen tok/s at full batch", "engine/gen_tok_per_s_at_full_batch", "{:,.0f}")]
    rows += [("tokens/s/GPU (whole step)", "perf/throughput", "{:,.0f}"), ("MFU update_actor", "perf/mfu/actor", "{:.1%}"),
             ("MFU old_log_prob", "perf/mfu/actor_infer", "{:.1%}"),
             ("peak GPU memory allocated (GiB)", "perf/max_memory_allocated_gb", "{:.1f}"),
             ("actor/grad_norm", "actor/grad_norm", "{:.4g}")]
    print(f"| {'measure':<36} | " + " | ".join(f"{layout:>12}" for layout in layouts) + " |")
    print(f"|{'-' * 38}|" + "|".join("-" * 14 for _ in layouts) + "|")
    for name, key, fmt in rows:
        cells = [fmt.format(results[layout][key]) if key in results[layout] else "-" for layout in layouts]
        if any(cell != "-" for cell in cells):
            print(f"| {name:<36} | " + " | ".join(f"{cell:>12}" for cell in cells) + " |")
    for layout in layouts:
        if "error" in results[layout]:
            print(f"{layout}: FAILED after {results[layout]['steps_logged']} steps (the column is their mean): "
                  f"{results[layout]['error']}")
    if "standalone" in results:
        standalone = results["standalone"]
        print(f"standalone sglang.Engine, same prompts and settings: {standalone['tok_per_s']:,.0f} tok/s "
              f"({standalone['tokens']} tokens in {standalone['seconds']:.2f} s, mean length "
              f"{standalone['mean_response_length']:.0f}; decode CUDA graphs up to {standalone['cuda_graph_max_bs_decode']})")
        if "default_graphs" in standalone:
            print(f"  with SGLang's default CUDA-graph sizes instead: {standalone['default_graphs']['tok_per_s']:,.0f} tok/s")
        for layout in layouts:
            layout_result = results[layout]
            if "timing_s/gen" in layout_result and run_name(runs[layout])[1] == "sglang":  # SGLang's
                generated = layout_result["response_length/mean"] * args.prompts * args.n / args.gpus
                trainer_rate = generated / layout_result["timing_s/gen"]
                print(f"  trainer generation ({layout}), per GPU: {trainer_rate:,.0f} tok/s = "
                      f"{trainer_rate / standalone['tok_per_s']:.2f} of standalone (timing_s/gen includes the switch)")
    if "vary" in results:
        summary = results["vary"]
        for value, side in summary["values"].items():
            print(f"{summary['key']}={value}: gen s " + ", ".join(f"{x:.2f}" for x in side["gen"]) + "; step s "
                  + ", ".join(f"{x:.2f}" for x in side["step"]))
        for key, ratio in summary.items():
            if "_ratio_" in key:
                print(f"  {key}: {ratio:.3f}")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="train.parquet / test.parquet in verl's layout")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (its vocabulary sizes the model: "
                                                           "benchmarks/vocab.py)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--layouts", default="rmpad,padded",
                        help="comma-separated runs, each LAYOUT or LAYOUT@ENGINE (rmpad32k@vllm; sglang if unnamed), "
                             f"LAYOUT one of {', '.join(LAYOUTS)}")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--no-standalone", action="store_true")
    parser.add_argument("--engine-log", action="store_true",
                        help="SGLang log_level=info: summarise the scheduler's decode lines per layout")
    parser.add_argument("--work-dir", default="/tmp/ppo_step")
    parser.add_argument("--out", default=None, help="write the results as JSON here too")
    parser.add_argument("--deadline", type=float, default=570,
                        help="seconds for the whole invocation (0: none), so it fits the GPU host's 10-minute command: "
                             "each layout's run gets an equal share of what is left, less %d s kept for the "
                             "standalone engine, and keeps the steps it logged when cut off" % STANDALONE_RESERVE_S)
    parser.add_argument("--vary", default=None, metavar="KEY=A,B",
                        help="run the one layout at KEY=A, B, B, A (e.g. actor_rollout_ref.rollout.enforce_eager=false,true) "
                             "and compare the two values' generation and step seconds")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every trainer run")
    args = parser.parse_args()
    for run in args.layouts.split(","):
        run_name(run)  # a misspelt run stops here, before any model is made
    vary = parse_vary(args.vary)
    runs = planned_runs(args.layouts.split(","), vary)
    deadline = Deadline(args.deadline or None)  # counted from here: making the model spends it too
    os.makedirs(args.work_dir, exist_ok=True)
    vocabulary = load_vocabulary(args.tokenizer)
    model_dir = make_model(args.shape, vocabulary, os.path.join(args.work_dir, f"model_{args.shape}"))
    results = {}
    reserve = 0 if args.no_standalone else STANDALONE_RESERVE_S  # the standalone engines run after the layouts
    for index, (name, layout, extra) in enumerate(runs):
        results[name] = run_trainer(args, model_dir, layout, deadline.share(len(runs) - index, reserve=reserve),
                                    extra, name)
        if vary:
            results["vary"] = vary_summary({key: value for key, value in results.items() if key != "vary"}, vary)
        write_record(args, vocabulary, results)  # after each part: a run cut off at its limit keeps what it measured
    if not args.no_standalone:
        results["standalone"] = standalone_generation(args, model_dir)
        write_record(args, vocabulary, results)
    print_table(results, args, vocabulary)


def write_record(args, vocabulary: Vocabulary, results: dict) -> None:
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "vocab": vocabulary.record(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
