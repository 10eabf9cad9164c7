"""Colocated synchronous GRPO vs one-step-off on separate pools, side by side in one invocation: seconds per step,
samples/s and tokens/s over all the run's GPUs, and what moving the weights costs.

    # GPU (2 H100: colocated on both, vs 1 trainer + 1 rollout), the Qwen2.5 layer shapes of ppo_step.py:
    PYTHONPATH=. python benchmarks/async_training.py --data-dir DIR --tokenizer DIR --shape 0.5b --gpus 2 \
        --out $OUT/async_training.json
    # CPU check (2 processes, a tiny model and a toy task built in the work dir; --tokenizer DIR: of DIR's vocabulary):
    PYTHONPATH=. python benchmarks/async_training.py --device cpu

Each layout is one real run of `python -m hybridrl.main_ppo` for --steps steps with the same model, prompts per
step, n and response length; the table reports the mean of the steps after the first two (warm-up, and
one-step-off's first step, which has nothing generated ahead). Layouts (--layouts):

    colocated      hybrid engine on all --gpus ranks, rollout.mode=sync (the default trainer)
    colocated_async  the same with rollout.mode=async (agent loops against each rank's engine server)
    one_step_off   hybrid_engine=false, --gpus/2 trainer ranks + --gpus/2 rollout ranks, rollout.mode=async,
                   async_training.mode=one_step_off
    fully_async    the same pools, async_training.mode=fully_async, max_staleness 1

Workloads: by default each answer's length is what the model samples (random weights on SGLang: close to the cap).
--tail-fraction F gives a heavy-tailed one (issue 26's: --response-length 4096 --tail-fraction 0.05 --short-length
360, 5 % of the answers running to 4k tokens): benchmarks/heavy_tail.py's generate function in every layout, which
then runs the data flow in async rollout mode (colocated too), so all layouts generate the same lengths.

Each layout gets an equal share of what is left of --deadline (on cuda by default 570 s from the start, the model's
making included, so an invocation fits a 10-minute command), at most --timeout; a run cut off keeps the steps it
logged, its log (streamed into the work dir as it runs) and its error, and the --out record is rewritten after each
layout.

Columns: s/step (timing_s/step), samples/s (prompts x n per second), tokens/s (prompt + response tokens per
second, whole run: divide by --gpus for per GPU), speed-up over the first layout, the generation's and the
update's seconds, and the weight sync's seconds and megabytes (disaggregated layouts). The line `vocab:` above the
table (and `vocab` in the JSON record) names the model's vocabulary: --tokenizer's tokenizer and embedding count
(benchmarks/vocab.py: 151,936 for Qwen2.5's), or on cpu without one a 300-token tokenizer trained on the prompts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from benchmarks.heavy_tail import heavy_tail_overrides  # noqa: E402
from benchmarks.trainer_run import Deadline, fresh_dir, mean_metrics, run_trainer  # noqa: E402
from benchmarks.vocab import Vocabulary, load_vocabulary, tiny_model  # noqa: E402

ASYNC = ["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true"]


def layouts(gpus: int) -> dict[str, list[str]]:
    half = max(gpus // 2, 1)
    split = ["actor_rollout_ref.hybrid_engine=false", *ASYNC, f"trainer.n_gpus_per_node={half}",
             f"rollout.n_gpus_per_node={max(gpus - half, 1)}"]
    return {"colocated": [f"trainer.n_gpus_per_node={gpus}"],
            "colocated_async": [f"trainer.n_gpus_per_node={gpus}", *ASYNC],
            "one_step_off": [*split, "async_training.mode=one_step_off"],
            "fully_async": [*split, "async_training.mode=fully_async", "async_training.max_staleness=1"]}


def gpu_overrides(args, model_dir: str) -> list[str]:
    offload = ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
               "actor_rollout_ref.model.enable_gradient_checkpointing=true"] if args.shape == "7b" else []
    return [f"data.train_files=[{args.data_dir}/train.parquet]", f"data.val_files=[{args.data_dir}/test.parquet]",
            f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cuda",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32", "actor_rollout_ref.rollout.name=sglang",
            f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
            "+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_prefill_cuda_graph=true",
            # packed rows in 32k-token micro-batches (ppo_step.py's rmpad32k): the update a real run would use
            "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768", *offload]


def cpu_task(work_dir: str, vocabulary: Vocabulary | None) -> tuple[list[str], Vocabulary]:
    """A tiny model (of `vocabulary`, else with a tokenizer trained on the prompts) and the toy task of
    tests/test_e2e_training.py (reward: share of "a"), built in work_dir; the overrides and the model's vocabulary."""
    from hybridrl.data.rl_parquet import write_rl_parquet

    words = ["apple", "banana", "cherry", "dog", "egg", "fig", "grape", "hat", "ink", "jam"]
    texts = [f"say something about {w}" for w in words] * 10 + ["a a aa aaa"] * 10
    model_dir, vocabulary = tiny_model(os.path.join(work_dir, "model"), texts, vocabulary, hidden_size=64,
                                       num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    rows = [{"data_source": "toy/letter_a", "prompt": [{"role": "user", "content": f"say something about {w}"}],
             "ability": "toy", "reward_model": {"style": "rule", "ground_truth": "a"}, "extra_info": {"index": i}}
            for i, w in enumerate(words * 20)]
    write_rl_parquet(rows, os.path.join(work_dir, "train.parquet"))
    write_rl_parquet(rows[:8], os.path.join(work_dir, "val.parquet"))
    reward = os.path.join(work_dir, "reward.py")
    with open(reward, "w") as f:
        f.write("def share_of_a(data_source, solution_str, ground_truth, extra_info=None):\n"
                "    text = solution_str.replace(' ', '')\n    return text.count('a') / max(len(text), 1)\n")
    # 64 prompt tokens: Qwen2.5's chat template adds a system message, 33 tokens in all
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{work_dir}/train.parquet]",
            f"data.val_files=[{work_dir}/val.parquet]", f"custom_reward_function.path={reward}",
            "custom_reward_function.name=share_of_a", "data.max_prompt_length=64", "trainer.device=cpu",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"], vocabulary


def run_layout(args, name: str, task: list[str], layout: list[str], timeout: float | None) -> dict:
    """One main_ppo run (at most `timeout` seconds); the mean of each numeric metric over the measured steps. A run
    cut off by its timeout keeps the steps it logged, with its error beside them."""
    run_dir = fresh_dir(os.path.join(args.work_dir, f"run_{name}"))
    command = [sys.executable, "-m", "hybridrl.main_ppo", *task,
               f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.n}",
               f"data.max_response_length={args.response_length}",
               f"actor_rollout_ref.actor.ppo_mini_batch_size={max(args.prompts // 2, 1)}",
               f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
               "trainer.save_freq=-1", "trainer.logger=[console,jsonl]", f"trainer.default_local_dir={run_dir}",
               "trainer.resume_mode=disable", *layout, *args.overrides]
    print(f"[{name}] {' '.join(command)}", flush=True)
    run = run_trainer(command, os.path.join(args.work_dir, f"{name}.log"), os.path.join(run_dir, "metrics.jsonl"),
                      timeout=timeout, cwd=REPO_ROOT)
    measured = run.steps[2:] or run.steps[1:] or run.steps
    result = {"wall_s": run.wall_s, "logged_steps": len(run.steps), "measured_steps": len(measured),
              **mean_metrics(measured)}
    if run.error:
        result["error"] = run.error
    return result


def print_table(results: dict, args, vocabulary: Vocabulary) -> None:
    samples = args.prompts * args.n
    print(f"\nprompts/step {args.prompts}, n {args.n}, response_length {args.response_length}, {args.gpus} "
          f"{'GPUs' if args.device == 'cuda' else 'CPU processes'}, steps {args.steps} (mean of steps 3+)\n"
          f"vocab: {vocabulary.describe()}\nlengths: " + (f"{args.tail_fraction:.0%} to {args.response_length}, the "
                                                          f"rest {args.short_length} (heavy_tail.py)\n"
                                                          if args.tail_fraction > 0 else "as sampled\n"))
    print("| layout | s/step | samples/s | tokens/s | speed-up | gen s | update_actor s | sync_weights s | sync MB | "
          "staleness max |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for name, result in results.items():
        if "timing_s/step" not in result:
            print(f"| {name} | failed: {result['error']} | | | | | | | | |")
            continue
        step = result["timing_s/step"]
        base = base or step
        print(f"| {name} | {step:.2f} | {samples / step:.1f} | {result['perf/total_num_tokens'] / step:.0f} | "
              f"{base / step:.2f}x | {result.get('timing_s/gen', float('nan')):.2f} | "
              f"{result.get('timing_s/update_actor', float('nan')):.2f} | "
              f"{result.get('timing_s/sync_weights', float('nan')):.3f} | "
              f"{result.get('weight_sync/megabytes', float('nan')):.1f} | "
              f"{result.get('async_training/staleness/max', float('nan')):.0f} |")
    for name, result in results.items():
        if "error" in result and "timing_s/step" in result:
            print(f"{name}: {result['logged_steps']} of {args.steps} steps logged before {result['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--data-dir", help="cuda: train.parquet / test.parquet in verl's layout")
    parser.add_argument("--tokenizer", help="tokenizer directory, its vocabulary sizes the model (cuda: required; cpu: "
                                            "default a tokenizer trained on the prompts)")
    parser.add_argument("--shape", choices=["0.5b", "7b"], default="0.5b")
    parser.add_argument("--model-dir", default=None, help="cuda: where the random-weight model is (made if absent)")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--layouts", default="colocated,one_step_off")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default 64 cuda, 8 cpu)")
    parser.add_argument("--n", type=int, default=None, help="responses per prompt (default 8 cuda, 4 cpu)")
    parser.add_argument("--response-length", type=int, default=None, help="default 512 cuda, 16 cpu")
    parser.add_argument("--steps", type=int, default=None, help="default 8 cuda, 6 cpu")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--tail-fraction", type=float, default=0.0,
                        help="heavy-tailed lengths (benchmarks/heavy_tail.py): this share of the answers runs to "
                             "--response-length, the rest to --short-length, in every layout; 0: as sampled")
    parser.add_argument("--short-length", type=int, default=None, help="the short answers' budget (cap / 16)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per layout at most (a run past it is killed and keeps the steps it logged)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for the whole invocation (default cuda 570, so it fits a 10-minute command; cpu "
                             "none; 0: none): each layout gets an equal share of what is left")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--out", default=None, help="write the results as JSON here too")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every layout")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if args.deadline is None and cuda:
        args.deadline = 570.0
    deadline = Deadline(args.deadline or None)  # counted from here: making the model spends it too
    args.prompts = args.prompts or (64 if cuda else 8)
    args.n = args.n or (8 if cuda else 4)
    args.response_length = args.response_length or (512 if cuda else 16)
    args.steps = args.steps or (8 if cuda else 6)
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="hybridrl-async-training-")
    os.makedirs(args.work_dir, exist_ok=True)

    if cuda and not (args.data_dir and args.tokenizer):
        parser.error("--device cuda needs --data-dir and --tokenizer")
    vocabulary = load_vocabulary(args.tokenizer) if args.tokenizer else None
    if cuda:
        from benchmarks.ppo_step import make_model

        model_dir = make_model(args.shape, vocabulary, args.model_dir or os.path.join(args.work_dir, args.shape))
        task = gpu_overrides(args, model_dir)
    else:
        task, vocabulary = cpu_task(args.work_dir, vocabulary)
    known = layouts(args.gpus)
    chosen = args.layouts.split(",")
    unknown = [name for name in chosen if name not in known]
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; known: {sorted(known)}")
    if args.tail_fraction > 0:
        args.short_length = args.short_length or max(1, args.response_length // 16)
        task = [*task, *heavy_tail_overrides(args.work_dir, args.tail_fraction, args.short_length, args.device)]
    results = {}
    for index, name in enumerate(chosen):  # the record is rewritten after each layout: a cut-off invocation keeps
        timeout = deadline.share(len(chosen) - index, args.timeout)  # what it measured
        results[name] = run_layout(args, name, task, known[name], timeout)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "vocab": vocabulary.record(), "results": results}, f, indent=2)
    print_table(results, args, vocabulary)


if __name__ == "__main__":
    main()
