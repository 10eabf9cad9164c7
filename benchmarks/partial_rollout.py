"""Partial rollout against waiting for every answer, on heavy-tailed response lengths, in one invocation.

    python benchmarks/partial_rollout.py --device cpu                      # a tiny model built here, hf engine
    python benchmarks/partial_rollout.py --device cuda --model ~/models/Qwen2.5-0.5B-Instruct   # sglang engine
    python benchmarks/partial_rollout.py --device cuda --tokenizer DIR     # random 0.5B shape, DIR's vocabulary

The vocabulary (table line `vocab:` and the --out record): the model's own with --model; with --tokenizer, that
tokenizer and its embedding count (benchmarks/vocab.py: 151,936 for Qwen2.5's, so the logits are a real model's
width), on a random model built here (the 0.5B shape of ppo_step.py on cuda, a tiny one on cpu); with neither, on
cpu, a tokenizer of at most 300 tokens trained on the prompts.

Both runs are `python -m hybridrl.main_ppo` (subprocesses, GRPO, rollout.mode=async with the data flow) on the same
prompts and model for the same number of steps, so they train on the same number of samples
(steps x train_batch_size x n). Only the rollout differs:

- baseline: data.train_batch_size groups in flight; the step waits for the longest answer;
- partial:  data_flow.partial_rollout=true with data_flow.over_sampling_batch_size = --over-sampling x
  train_batch_size groups in flight; once train_batch_size groups are done the rest are aborted and continued at the
  next step under the new weights.

Heavy-tailed lengths (benchmarks/heavy_tail.py): a custom generate function (data_flow.custom_generate_function,
written to the work directory) gives each sample a length budget drawn from its index: --tail-fraction of them get the whole
response_length, the others --short-length tokens; on sglang `rollout.ignore_eos=true` makes the engine use the
whole budget (the hf engine's tiny random model rarely ends earlier).

What is compared (issue 59): whole-step time per trained response token, over every step of each run. Both runs'
warm-up is inside that window: the partial run trains only short answers at first while its long ones are still in
flight, so any window that leaves its first steps out also leaves out part of the work its later steps train, and the
partial run pays for the samples still in flight at its last step without training them. Second, the steps after
--warmup-steps with only the samples whose generation started there (started_version, from the runs' rollout dumps):
it leaves out the start-up both runs pay in their first steps, and charges partial rollout in that window for what it
carries out of it while crediting nothing it carried in. Both are printed with the staleness of every trained sample
(min, median, max, histogram), read back from the dumps and checked against the trainer's data_flow/staleness/max. A
table is printed (markdown), also when a run failed or was cut off at its share of --deadline (column `ended`; its
logged steps still count); the issue's target is partial >= 1.5x faster on one H100.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from benchmarks.heavy_tail import heavy_tail_overrides  # noqa: E402
from benchmarks.trainer_run import Deadline, fresh_dir, run_trainer  # noqa: E402
from benchmarks.vocab import Vocabulary, load_vocabulary, tiny_model  # noqa: E402
from hybridrl.trainer.ppo.checkpointing import weights_version_after  # noqa: E402

REWARD_FILE = '''
def length_reward(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 7) / 7.0   # any varying number: the benchmark times generation, not learning
'''

WORDS = ["apple", "banana", "cherry", "dog", "egg", "fig", "grape", "hat", "ink", "jam", "kiwi", "lemon"]


def model_and_vocabulary(args, work_dir: str) -> tuple[str, Vocabulary]:
    """The model both runs train, and its vocabulary:
    - --model: that directory as it is, with the tokenizer saved in it;
    - --tokenizer: a random model made in `work_dir` with that tokenizer and its embedding count (benchmarks/vocab.py:
      151,936 for Qwen2.5's), of ppo_step.py's 0.5B shape on cuda, tiny on cpu;
    - neither, on cpu: a tiny model with a tokenizer trained on the prompts."""
    if args.model:
        model = os.path.expanduser(args.model)
        return model, load_vocabulary(model)
    vocabulary = load_vocabulary(args.tokenizer) if args.tokenizer else None
    if args.device == "cuda":
        if vocabulary is None:
            raise SystemExit("--device cuda needs --model or --tokenizer")
        from benchmarks.ppo_step import make_model

        return make_model("0.5b", vocabulary, os.path.join(work_dir, "model_0.5b")), vocabulary
    texts = [f"say something about {word}" for word in WORDS] + ["a a a a aa aaa " * 4, "banana apple " * 4]
    return tiny_model(os.path.join(work_dir, "model"), texts * 10, vocabulary, hidden_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=1, intermediate_size=64)


def write_prompts(work_dir: str) -> str:
    from hybridrl.data.rl_parquet import write_rl_parquet

    rows = [{"data_source": "bench/lengths", "prompt": [{"role": "user", "content": f"say something about {word}"}],
             "ability": "bench", "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": i}}
            for i, word in enumerate(WORDS * 40)]
    path = os.path.join(work_dir, "prompts.parquet")
    write_rl_parquet(rows, path)
    return path


def rollouts_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "rollouts")


def trained_samples(run_dir: str, steps: list[dict]) -> dict[int, list[dict]]:
    """Per logged step, its trained samples as the trainer dumped them (generation_dump.rollout_records: the rows
    with response_tokens and started_version; the filter's dropped groups, never trained, left out)."""
    samples = {}
    for step in steps:
        number = int(step["training/global_step"])
        with open(os.path.join(rollouts_dir(run_dir), f"{number}.jsonl")) as dump:
            samples[number] = [record for record in map(json.loads, dump) if not record.get("filtered")]
    return samples


def run(name: str, overrides: list[str], work_dir: str, timeout: float | None) -> tuple[list[dict], dict, str | None]:
    """One main_ppo run, at most `timeout` seconds: the steps it logged, their trained samples, and its error (None
    when it finished). A run that failed or was cut off keeps its steps, so the table still shows what it did."""
    run_dir = fresh_dir(os.path.join(work_dir, name))
    command = [sys.executable, "-m", "hybridrl.main_ppo", f"trainer.default_local_dir={run_dir}",
               "trainer.logger=[console,jsonl]", f"trainer.rollout_data_dir={rollouts_dir(run_dir)}", *overrides]
    log_path = os.path.join(work_dir, f"{name}.log")
    limit = "no time limit" if timeout is None else f"at most {timeout:.0f} s"
    print(f"[{name}] {' '.join(command)}\n[{name}] log: {log_path} ({limit})", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])}
    trained = run_trainer(command, log_path, os.path.join(run_dir, "metrics.jsonl"), timeout=timeout, env=env,
                          cwd=REPO_ROOT)
    if trained.error:
        with open(log_path) as log:
            print(f"[{name}] main_ppo {trained.error}\n[{name}] the end of {log_path}:\n{log.read()[-4000:]}",
                  flush=True)
    return trained.steps, trained_samples(run_dir, trained.steps), trained.error


def engine_version(step: int) -> int:
    """The policy version the engines hold while step `step` generates: the weights of the steps before it (this
    benchmark has no critic warm-up)."""
    return weights_version_after(step - 1, critic_warmup=0)


def staleness_summary(staleness: list[int]) -> dict:
    """min, median, max and the histogram (staleness: samples) of the trained samples' staleness."""
    if not staleness:
        return dict.fromkeys(["min", "median", "max", "histogram"])
    return {"min": min(staleness), "median": statistics.median(staleness), "max": max(staleness),
            "histogram": {str(k): n for k, n in sorted(collections.Counter(staleness).items())}}


def summarise(name: str, steps: list[dict], samples: dict[int, list[dict]], error: str | None, warmup: int) -> dict:
    """One table row (see the module docstring): whole-step seconds per trained response token over every step, and
    over the steps after `warmup` counting only the samples whose generation started after it; the staleness of every
    trained sample. A staleness read back from the dumps that differs from the trainer's own data_flow/staleness/max
    stops the benchmark: the version arithmetic would be wrong. A run with no step (or none after the warm-up) has
    None there, not a 0 that reads as infinitely fast."""
    staleness = []
    for step in steps:
        number = int(step["training/global_step"])
        own = [engine_version(number) - sample["started_version"] for sample in samples[number]]
        if max(own) != step["data_flow/staleness/max"]:
            raise SystemExit(f"{name}, step {number}: the dumped samples' staleness reaches {max(own)}, the trainer "
                             f"logged data_flow/staleness/max={step['data_flow/staleness/max']}")
        staleness += own
    timed = [step for step in steps if step["training/global_step"] > warmup]
    timed_samples = [sample for step in timed for sample in samples[int(step["training/global_step"])]]
    started_after = [sample for sample in timed_samples if sample["started_version"] >= engine_version(warmup + 1)]
    own_tokens = sum(sample["response_tokens"] for sample in started_after)
    tokens = sum(sample["response_tokens"] for step in steps for sample in samples[int(step["training/global_step"])])
    step_s = sum(step["timing_s/step"] for step in steps)
    timed_s = sum(step["timing_s/step"] for step in timed)
    return {"mode": name, "ended": "finished" if error is None else f"{error.split(':')[0]} after {len(steps)} steps",
            "steps": len(steps), "trained tokens": tokens, "step s (sum)": step_s,
            "gen s (sum)": sum(step["timing_s/gen"] for step in steps),
            "ms / token": 1000 * step_s / tokens if tokens else None,
            "steps after warm-up": len(timed), "carried-in samples": len(timed_samples) - len(started_after),
            "ms / token after warm-up": 1000 * timed_s / own_tokens if own_tokens else None,
            "staleness": staleness_summary(staleness)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", help="model directory (default on cpu: a tiny random model built here)")
    parser.add_argument("--tokenizer", help="tokenizer directory: a random model is built here with its vocabulary")
    parser.add_argument("--data", help="prompt parquet (default: short generated prompts)")
    parser.add_argument("--gpus", type=int, default=1, help="ranks (trainer.n_gpus_per_node); cpu: 2")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default cpu 6, cuda 12)")
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="the second measure's warm-up: steps it leaves out, with the samples started in them")
    parser.add_argument("--train-batch-size", type=int, default=None, help="groups per step (cpu 8, cuda 64)")
    parser.add_argument("--n", type=int, default=4, help="samples per group (rollout.n)")
    parser.add_argument("--response-length", type=int, default=None, help="length cap (cpu 64, cuda 1024)")
    parser.add_argument("--short-length", type=int, default=None, help="budget of the short answers (cap / 16)")
    parser.add_argument("--tail-fraction", type=float, default=0.05, help="share of answers that run to the cap")
    parser.add_argument("--over-sampling", type=float, default=2.0, help="groups in flight / train_batch_size")
    parser.add_argument("--work-dir", help="where runs and logs go (default: a fresh temporary directory)")
    parser.add_argument("--out", help="write the rows as JSON here too")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for the whole invocation, the model's making included (default cuda 570, so it "
                             "fits the GPU host's 10-minute command; cpu none; 0: none): each run gets an equal "
                             "share of what is left and keeps the steps it logged when cut off")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for both runs")
    args = parser.parse_args()
    if args.deadline is None and args.device == "cuda":
        args.deadline = 570.0
    deadline = Deadline(args.deadline or None)  # counted from here: making the model spends it too
    if args.model and args.tokenizer:
        parser.error("--model brings its own tokenizer; --tokenizer is for a random model made here")

    cpu = args.device == "cpu"
    steps = args.steps or (6 if cpu else 12)
    batch = args.train_batch_size or (8 if cpu else 64)
    cap = args.response_length or (64 if cpu else 1024)
    short = args.short_length or max(1, cap // 16)
    gpus = 2 if cpu and args.gpus == 1 else args.gpus
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="hybridrl-partial-rollout-")
    os.makedirs(work_dir, exist_ok=True)
    model, vocabulary = model_and_vocabulary(args, work_dir)
    data = args.data or write_prompts(work_dir)
    reward_path = os.path.join(work_dir, "reward.py")
    with open(reward_path, "w") as f:
        f.write(REWARD_FILE)

    mini = max(1, batch // 2)
    common = [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", f"data.val_files={data}",
        f"custom_reward_function.path={reward_path}", "custom_reward_function.name=length_reward",
        "data.max_prompt_length=64", f"data.max_response_length={cap}", f"data.train_batch_size={batch}",
        f"actor_rollout_ref.rollout.n={args.n}", f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.strategy=fsdp2",
        f"trainer.n_gpus_per_node={gpus}", f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", f"trainer.device={args.device}",
        *heavy_tail_overrides(work_dir, args.tail_fraction, short, args.device),
        f"actor_rollout_ref.rollout.name={'hf' if cpu else 'sglang'}",
        # on the GPU the update must not hide the generation: padded to 1,088 tokens a row it took 12 s of a
        # 15-19 s step (H200, 2026-11-27); packed rows take about 1 s. The update's micro-batches hold 16k tokens, not
        # the log-probs' 32k: on an H100 a 28,740-token one of the partial run's continued answers ran out of memory
        # (65 GiB allocated, 2026-12-07)
        *([] if cpu else ["actor_rollout_ref.model.use_remove_padding=true",
                          "actor_rollout_ref.actor.use_dynamic_bsz=true",
                          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
                          "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                          "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768"]),
        *args.overrides,
    ]
    over = max(batch + 1, int(round(args.over_sampling * batch)))
    rows = []
    runs = [("baseline", "baseline (wait for all)", []),
            ("partial", f"partial rollout ({over} groups in flight)",
             ["data_flow.partial_rollout=true", f"data_flow.over_sampling_batch_size={over}"])]
    for index, (name, mode, extra) in enumerate(runs):
        timeout = deadline.share(len(runs) - index)  # an equal share of what is left; the last run, all of it
        steps_logged, samples, error = run(name, common + extra, work_dir, timeout)
        rows.append(summarise(mode, steps_logged, samples, error, args.warmup_steps))
        write_record(args, vocabulary, rows)  # after each run: a benchmark cut off at its limit keeps the first
    print(f"\ndevice {args.device}, {gpus} rank(s), model {model}; {batch} groups x {args.n} per step, {steps} steps "
          f"(after warm-up: the steps after {args.warmup_steps}); lengths: {args.tail_fraction:.0%} to {cap}, the "
          f"rest {short}\nvocab: {vocabulary.describe()}\n")
    print_table(rows)
    print(f"\nwork dir: {work_dir}")


def print_table(rows: list[dict]) -> None:
    """The rows as markdown, each speed-up the baseline's ms / token over the row's (- where a run timed nothing)."""
    keys = [key for key in rows[0] if key != "staleness"]
    print("| " + " | ".join(keys + ["staleness min / median / max", "speed-up", "speed-up after warm-up"]) + " |")
    print("|" + " --- |" * (len(keys) + 3))
    for row in rows:
        cells = [f"{row[key]:.3g}" if isinstance(row[key], float) else "-" if row[key] is None else str(row[key])
                 for key in keys]
        stale = row["staleness"]
        cells.append("-" if stale["min"] is None else f"{stale['min']} / {stale['median']:g} / {stale['max']}")
        for key in ("ms / token", "ms / token after warm-up"):
            base, own = rows[0][key], row[key]
            cells.append(f"{base / own:.2f}x" if base is not None and own is not None else "-")
        print("| " + " | ".join(cells) + " |")
    for row in rows:
        print(f"{row['mode']}: staleness histogram (staleness: trained samples) {row['staleness']['histogram']}")


def write_record(args, vocabulary: Vocabulary, rows: list[dict]) -> None:
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "vocab": vocabulary.record(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
