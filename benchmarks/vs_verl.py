"""verl and hybridrl side by side (issue 18): the same model, data, reward and settings, one invocation.

    python3 benchmarks/vs_verl.py --data-dir D --tokenizer D/tokenizer --shape 0.5b --gpus 1 --steps 5 --out $OUT/vs.json
    python3 benchmarks/vs_verl.py ... --dry-run        # both command lines and the settings map; runs nothing
    python3 benchmarks/vs_verl.py --check-imports      # what verl's run imports, and from where (GPU host preflight)

Each trainer is one subprocess: `python -m verl.trainer.main_ppo` (verl 0.9.1 from /tmp/verl-site, see
scripts/gpu/stage_verl.sh) and `python -m hybridrl.main_ppo`, for --steps GRPO steps on the same parquet files (the
built-in task, verl's layout), the same model directory (random bf16 weights of the Qwen2.5 layer shapes with the
task's tokenizer, made by benchmarks/ppo_step.py's make_model; `--shape default-sft` takes hybridrl's warm-started
tiny model instead, the one on which GRPO visibly learns), the same reward function file (benchmarks/vs_verl_reward.py)
and every setting in SETTINGS below, given explicitly to both. Per-step metrics come from each trainer's own
JSON-lines logger (verl: trainer.logger=[console,file] with VERL_FILE_LOGGER_PATH; hybridrl: trainer.logger=[console,
jsonl] into trainer.default_local_dir/metrics.jsonl), under verl's metric names in both.

Printed: per step, each trainer's seconds per phase (timing_s/gen, old_log_prob, update_actor, step), tokens/s/GPU
(perf/throughput), peak GPU memory (perf/max_memory_allocated_gb) and reward mean (critic/score/mean); then the means
over the steps after the first (the first carries kernel compilation) and hybridrl / verl.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.trainer_run import Deadline, mean_metrics, read_jsonl, run_trainer  # noqa: E402

VERL_SITE = os.environ.get("VS_VERL_SITE", "/tmp/verl-site")   # scripts/gpu/install_verl.sh .stage/verl
VERL_TF_SITE = "/tmp/verl-tf-site"     # TARGET=/tmp/verl-tf-site scripts/gpu/install_verl.sh .stage/verl-tf
SHARED_SITE = "/tmp/site"              # slim (SGLang 0.5.16), ray, deps: scripts/gpu/setup_host.sh
REWARD_FILE = os.path.join(REPO, "benchmarks", "vs_verl_reward.py")
PHASES = ["gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights", "step"]
COLUMNS = [(f"{phase} s", f"timing_s/{phase}", "{:.2f}") for phase in PHASES] + [
    ("tok/s/GPU", "perf/throughput", "{:,.0f}"), ("peak GiB", "perf/max_memory_allocated_gb", "{:.1f}"),
    ("reward", "critic/score/mean", "{:.3f}"), ("resp len", "response_length/mean", "{:.0f}")]


def settings(args, model_dir: str) -> list[tuple[str, object, str | None, str]]:
    """(hybridrl key, value, verl key when it differs else None, note). Every row is passed to both trainers.

    Key names are verl's in hybridrl too; the rows whose verl key differs, or that only one side has, are in
    ONLY_VERL / ONLY_HYBRIDRL with the reason."""
    rmpad = not args.padded
    offload = args.shape == "7b"
    tokens = args.max_token_len
    return [
        ("data.train_files", f"[{args.data_dir}/train.parquet]", None, "the built-in task, verl's parquet layout"),
        ("data.val_files", f"[{args.data_dir}/test.parquet]", None, "never read: no validation"),
        ("data.train_batch_size", args.prompts, None, "prompts per step"),
        ("data.max_prompt_length", args.prompt_length, None, ""),
        ("data.max_response_length", args.response_length, None, ""),
        ("data.return_raw_chat", "true", None, "verl's agent loop (and hybridrl's async mode) read the raw chat"),
        ("actor_rollout_ref.model.path", model_dir, None, "one directory: weights + tokenizer"),
        ("actor_rollout_ref.model.use_remove_padding", str(rmpad).lower(), None, "see ATTENTION note"),
        ("actor_rollout_ref.model.enable_gradient_checkpointing", str(offload).lower(), None,
         "verl's default is true: set explicitly"),
        ("actor_rollout_ref.actor.strategy", "fsdp2", None, "verl's default is fsdp (FSDP1)"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", args.prompts // 2, None, "2 optimizer steps per step"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 8, None, "used when use_dynamic_bsz=false"),
        ("actor_rollout_ref.actor.use_dynamic_bsz", str(rmpad).lower(), None, ""),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", tokens, None, "tokens per micro-batch (rmpad)"),
        ("actor_rollout_ref.actor.optim.lr", args.lr, None, ""),
        ("actor_rollout_ref.actor.use_kl_loss", "false", None, "no reference model"),
        ("actor_rollout_ref.actor.entropy_coeff", 0, None, ""),
        ("actor_rollout_ref.actor.loss_agg_mode", "token-mean", None, ""),
        ("actor_rollout_ref.actor.clip_ratio", 0.2, None, ""),
        ("actor_rollout_ref.actor.grad_clip", 1.0, None, ""),
        ("actor_rollout_ref.actor.ppo_epochs", 1, None, ""),
        ("actor_rollout_ref.actor.use_torch_compile", "false", None, "verl's default is true: set explicitly"),
        ("actor_rollout_ref.actor.fsdp_config.param_offload", "false", None, ""),
        ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", str(offload).lower(), None,
         "7B on 80 GB: AdamW state in CPU memory while the engine generates"),
        ("actor_rollout_ref.rollout.name", "sglang", None, "SGLang 0.5.16 (.stage/slim) for both"),
        ("actor_rollout_ref.rollout.mode", "async", None, "verl 0.9.1 has only server mode + agent loops"),
        ("actor_rollout_ref.rollout.n", args.n, None, "GRPO group size"),
        ("actor_rollout_ref.rollout.temperature", 1.0, None, ""),
        ("actor_rollout_ref.rollout.top_p", 1.0, None, ""),
        ("actor_rollout_ref.rollout.top_k", -1, None, ""),
        ("actor_rollout_ref.rollout.gpu_memory_utilization", args.gpu_memory_utilization, None,
         "SGLang mem_fraction_static"),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size", 1, None, "verl's default is 2: set explicitly"),
        ("actor_rollout_ref.rollout.free_cache_engine", "true", None, "release the engine's memory while training"),
        ("actor_rollout_ref.rollout.enforce_eager", "false", None, "CUDA graphs on"),
        ("actor_rollout_ref.rollout.load_format", "dummy", None, "weights come from the trainer"),
        ("actor_rollout_ref.rollout.calculate_log_probs", "false", None, "verl's default is true: set explicitly"),
        ("actor_rollout_ref.rollout.max_num_seqs", 1024, None,
         "SGLang max_running_requests; verl's default is 256, below one step's 512 sequences: set explicitly"),
        ("actor_rollout_ref.rollout.max_num_batched_tokens", 8192, None, ""),
        ("actor_rollout_ref.rollout.update_weights_bucket_megabytes", 2048,
         "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
         "verl's default (hybridrl's is 512); verl moved the key under checkpoint_engine"),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 32, None, ""),
        ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", str(rmpad).lower(), None, ""),
        ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", tokens, None, ""),
        ("+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend", "triton", None,
         "FA3 kernels are not in the offline bundle; verl would default to fa3 on Hopper"),
        ("+actor_rollout_ref.rollout.engine_kwargs.sglang.sampling_backend", "pytorch", None,
         "hybridrl's default; verl's would be flashinfer (JIT-compiled)"),
        ("algorithm.adv_estimator", "grpo", None, ""),
        ("algorithm.norm_adv_by_std_in_grpo", "true", None, ""),
        ("algorithm.use_kl_in_reward", "false", None, ""),
        ("trainer.nnodes", 1, None, ""),
        ("trainer.n_gpus_per_node", args.gpus, None, ""),
        ("trainer.device", "cuda", None, ""),
        ("trainer.total_training_steps", args.steps, None, ""),
        ("trainer.val_before_train", "false", None, "no validation"),
        ("trainer.test_freq", -1, None, ""),
        ("trainer.save_freq", -1, None, "no checkpoints"),
        ("trainer.balance_batch", "true", None, ""),
        ("custom_reward_function.path", REWARD_FILE, "reward.custom_reward_function.path",
         "verl 0.9.1 reads the reward function under reward.*"),
        ("custom_reward_function.name", "compute_score", "reward.custom_reward_function.name", ""),
    ]


def only_verl(args, run_dir: str) -> list[tuple[str, object, str]]:
    return [
        ("+actor_rollout_ref.model.override_config.attn_implementation", "sdpa",
         "ATTENTION: verl's default is flash_attention_2, and flash-attn has no wheel for torch 2.11 (nor can the "
         "offline host build one). With sdpa and remove padding, transformers builds a block-diagonal mask from the "
         "packed position_ids (masking_utils.find_packed_sequence_indices): correct, but a dense tokens x tokens mask. "
         "hybridrl picks its attention itself: PyTorch's varlen flash kernel for remove padding, sdpa when padded."),
        ("actor_rollout_ref.actor.fsdp_config.use_torch_compile", "true",
         "verl's default, written out: torch.compile of the entropy from logits only (transformer_impl.py:183-187); "
         "hybridrl has no such key"),
        ("trainer.logger", "[console,file]", "per-step JSON lines into VERL_FILE_LOGGER_PATH"),
        ("+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH", os.path.join(run_dir, "verl_metrics.jsonl"),
         "the file logger lives in the TaskRunner actor: give it the path through Ray as well as the environment"),
        ("trainer.project_name", "vs_verl", ""), ("trainer.experiment_name", os.path.basename(run_dir), ""),
        ("trainer.default_local_dir", run_dir, ""),
        ("trainer.use_v1", "true", "verl 0.9.1's default trainer (TransferQueue); v0 is deprecated"),
    ]


def only_hybridrl(args, run_dir: str) -> list[tuple[str, object, str]]:
    return [("trainer.logger", "[console,jsonl]", "per-step JSON lines into trainer.default_local_dir/metrics.jsonl"),
            ("trainer.default_local_dir", run_dir, "")]


def overrides(rows, which: str) -> list[str]:
    out = []
    for row in rows:
        key, value = (row[2] or row[0]) if which == "verl" and len(row) == 4 else row[0], row[1]
        out.append(f"{key}={value}")
    return out


def commands(args, model_dir: str) -> dict[str, dict]:
    """The two command lines and their environments."""
    base = settings(args, model_dir)
    verl_dir = os.path.join(args.work_dir, f"verl_{args.shape}_{args.gpus}gpu")
    ours_dir = os.path.join(args.work_dir, f"hybridrl_{args.shape}_{args.gpus}gpu")
    verl_path = [VERL_TF_SITE] if args.verl_transformers == "pinned" else []
    verl_path += [VERL_SITE, REPO, SHARED_SITE]
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and p not in verl_path]
    return {
        "verl": {"run_dir": verl_dir, "metrics": os.path.join(verl_dir, "verl_metrics.jsonl"),
                 "argv": [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(base, "verl"),
                          *overrides(only_verl(args, verl_dir), "verl")],
                 "env": {"PYTHONPATH": ":".join(verl_path + inherited),
                         "VERL_FILE_LOGGER_PATH": os.path.join(verl_dir, "verl_metrics.jsonl")}},
        "hybridrl": {"run_dir": ours_dir, "metrics": os.path.join(ours_dir, "metrics.jsonl"),
                     "argv": [sys.executable, "-m", "hybridrl.main_ppo", *overrides(base, "hybridrl"),
                              *overrides(only_hybridrl(args, ours_dir), "hybridrl")],
                     "env": {"PYTHONPATH": ":".join([REPO, SHARED_SITE] + [p for p in inherited if p not in
                                                                              (VERL_SITE, VERL_TF_SITE)])}},
    }


# metrics verl 0.9.1 logs under another name than hybridrl (and verl's own trainer before the engine workers)
VERL_NAMES = {"perf/max_memory_allocated_gb": "actor/perf/max_memory_allocated_gb"}


def verl_step(record: dict) -> dict:
    """verl's file logger writes {"step": k, "data": {...}}: the metrics, under hybridrl's names."""
    metrics = record.get("data", record)
    metrics.update({ours: metrics[theirs] for ours, theirs in VERL_NAMES.items()
                    if ours not in metrics and theirs in metrics})
    return metrics


# how each trainer's JSON-lines logger writes a step (hybridrl's writes the metrics themselves)
STEP_READERS = {"verl": verl_step, "hybridrl": lambda record: record}


def read_steps(name: str, path: str) -> list[dict]:
    """Per-step metric dicts in step order, under hybridrl's names."""
    return read_jsonl(path, STEP_READERS[name])


MIN_RUN_S = 60  # less than this is not even a trainer's start-up


def run_one(name: str, spec: dict, timeout: float) -> dict:
    os.makedirs(spec["run_dir"], exist_ok=True)
    run = run_trainer(spec["argv"], os.path.join(spec["run_dir"], f"{name}.log"), spec["metrics"], timeout,
                      env={**os.environ, **spec["env"]}, read_step=STEP_READERS[name])
    result = {"wall_s": run.wall_s, "steps": run.steps, "log": run.log_path}
    if run.error:
        result["error"] = run.error
    return result


def print_tables(results: dict, args) -> None:
    print(f"\n{args.shape} shape, {args.gpus} GPU(s), {args.prompts} prompts x {args.n}, responses <= "
          f"{args.response_length} tokens, {'padded' if args.padded else 'remove padding'}")
    for name, result in results.items():
        print(f"\n{name}: {len(result['steps'])} steps logged, wall {result['wall_s']:.0f} s"
              + (f", FAILED: {result['error']}" if "error" in result else "") + f" (log: {result['log']})")
        if not result["steps"]:
            continue
        print("| step | " + " | ".join(title for title, _, _ in COLUMNS) + " |")
        print("|---" * (len(COLUMNS) + 1) + "|")
        for index, step in enumerate(result["steps"], 1):
            cells = [fmt.format(step[key]) if isinstance(step.get(key), (int, float)) else "-" for _, key, fmt in COLUMNS]
            print(f"| {index} | " + " | ".join(cells) + " |")
    first = {name: result["steps"][0] for name, result in results.items() if result["steps"]}
    print_ratio_table("step 1 (kernel compilation and warm-up included)", first)
    print_ratio_table("mean of steps 2.. (a trainer with fewer than 2 steps has none)",
                      {name: mean_after_first(result["steps"]) for name, result in results.items()})


def print_ratio_table(title: str, values: dict[str, dict]) -> None:
    print(f"\n{title} | verl | hybridrl | hybridrl / verl |\n|---|---|---|---|")
    for column, key, fmt in COLUMNS:
        verl, ours = values.get("verl", {}).get(key), values.get("hybridrl", {}).get(key)
        ratio = f"{ours / verl:.2f}" if verl and ours is not None else "-"
        print(f"| {column} | {fmt.format(verl) if verl is not None else '-'} | "
              f"{fmt.format(ours) if ours is not None else '-'} | {ratio} |")


def mean_after_first(steps: list[dict]) -> dict:
    """Means over the steps after the first (which carries compilation); empty with fewer than 2 steps, so a
    first step is never compared with another trainer's later ones."""
    return mean_metrics(steps[1:])


def print_dry_run(args, specs: dict, model_dir: str) -> None:
    print("settings given to both (hybridrl key = value [verl key when it differs]  # note):")
    for key, value, verl_key, note in settings(args, model_dir):
        print(f"  {key} = {value}" + (f"   [verl: {verl_key}]" if verl_key else "") + (f"   # {note}" if note else ""))
    for name, extra in (("verl", only_verl(args, specs["verl"]["run_dir"])),
                        ("hybridrl", only_hybridrl(args, specs["hybridrl"]["run_dir"]))):
        print(f"only {name}:")
        for key, value, note in extra:
            print(f"  {key} = {value}" + (f"   # {note}" if note else ""))
    for name, spec in specs.items():
        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in spec["env"].items())
        print(f"\n{name} command:\n  {env} \\\n  " + " \\\n    ".join(shlex.quote(part) for part in spec["argv"]))


def check_hybridrl_overrides(specs: dict) -> None:
    """Compose and validate hybridrl's side here: an unknown or refused key fails the dry run. On a machine without
    a GPU or SGLang the validator also says so; those problems (and only those) are this machine's, not the config's."""
    import hybridrl.checks  # noqa: F401  registers the subsystems' config checks
    from hybridrl.config import compose_config, validate_config
    from hybridrl.config.validation import ConfigError

    argv = specs["hybridrl"]["argv"][3:]
    try:
        validate_config(compose_config(argv))
        print("\nhybridrl: the override list composes and validates")
    except ConfigError as error:
        machine = ("CUDA", "not importable", "no CUDA GPU")
        real = [problem for problem in error.problems if not any(word in problem for word in machine)]
        if real:
            raise ConfigError(real) from None
        print(f"\nhybridrl: the override list composes and validates, except {len(error.problems)} problem(s) of this "
              "machine (no GPU / no SGLang):\n  " + "\n  ".join(error.problems))


def check_verl_overrides(specs: dict) -> None:
    """Compose verl's own config with the verl override list (Hydra struct mode refuses unknown keys) and build
    verl's validated config objects, where verl is importable (VS_VERL_SITE; on the GPU host /tmp/verl-site)."""
    if not os.path.isdir(os.path.join(VERL_SITE, "verl")):
        print(f"\nverl: not checked ({VERL_SITE}/verl missing; VS_VERL_SITE points elsewhere)")
        return
    code = ("import sys, os\n"
            "from hydra import compose, initialize_config_dir\n"
            "import verl.trainer.main_ppo as m\n"
            "from verl.utils.config import validate_config, omega_conf_to_dataclass\n"
            "from verl.trainer.ppo.utils import need_critic, need_reference_policy\n"
            "d = os.path.join(os.path.dirname(m.__file__), 'config')\n"
            "with initialize_config_dir(config_dir=d, version_base=None):\n"
            "    c = compose(config_name='ppo_trainer', overrides=sys.argv[1:])\n"
            "validate_config(config=c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))\n"
            "omega_conf_to_dataclass(c.actor_rollout_ref.rollout); omega_conf_to_dataclass(c.actor_rollout_ref.actor)\n"
            "print('verl: the override list composes and validates (verl', __import__('verl').__version__, ')')\n")
    env = {**os.environ, "PYTHONPATH": specs["verl"]["env"]["PYTHONPATH"]}
    completed = subprocess.run([sys.executable, "-c", code, *specs["verl"]["argv"][3:]], env=env,
                               capture_output=True, text=True)
    lines = [line for line in (completed.stdout + completed.stderr).splitlines() if "WARN" not in line
             and "warn" not in line]
    print("\n" + "\n".join(lines[-12:]))
    if completed.returncode != 0:
        raise SystemExit("verl refused the override list (above)")


def check_imports() -> None:
    """On the GPU host: import what verl's run imports, with verl's PYTHONPATH, and say where each package came from."""
    modules = ["transformers", "sglang", "ray", "verl.trainer.main_ppo", "verl.trainer.ppo.v1.trainer_sync",
               "transfer_queue", "verl.workers.engine_workers", "verl.workers.engine.fsdp.transformer_impl",
               "verl.experimental.agent_loop", "verl.experimental.reward_loop", "verl.utils.dataset.rl_dataset",
               "verl.workers.rollout.sglang_rollout.async_sglang_server",
               "verl.workers.rollout.sglang_rollout.sglang_rollout"]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    try:\n        importlib.import_module(m); print('OK  ', m)\n"
            "    except Exception as e:\n        print('FAIL', m, type(e).__name__, str(e)[:300])\n"
            "for top in sorted({n.split('.')[0] for n in sys.modules}):\n"
            "    f = getattr(sys.modules.get(top), '__file__', None) or ''\n"
            "    if 'site' in f or 'dist-packages' in f: print('FROM', top, f.rsplit('/', 2)[0])\n"
            "import transformers, torch; print('VERSIONS transformers', transformers.__version__, 'torch', torch.__version__)\n")
    for variant in ("image", "pinned"):
        path = ([VERL_TF_SITE] if variant == "pinned" else []) + [VERL_SITE, REPO, SHARED_SITE]
        if variant == "pinned" and not os.path.isdir(VERL_TF_SITE):
            continue
        print(f"== verl's imports with transformers from the {variant} ({':'.join(path)})", flush=True)
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ":".join(path)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="train.parquet / test.parquet in verl's layout (default: the built-in task)")
    parser.add_argument("--tokenizer", help="tokenizer directory for the random-weight shapes (default: the built-in "
                                            "task's, i.e. the embedded default model's tokenizer)")
    parser.add_argument("--shape", choices=["0.5b", "7b", "default-sft"], default="0.5b")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--padded", action="store_true", help="use_remove_padding=false (both use sdpa then)")
    parser.add_argument("--max-token-len", type=int, default=32768, help="ppo/log_prob max token len per GPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--trainers", default="verl,hybridrl")
    parser.add_argument("--verl-transformers", choices=["image", "pinned"], default="image",
                        help="image: the host's transformers 5.17 (as hybridrl and SGLang use); pinned: 5.10.4 from "
                             f"{VERL_TF_SITE} (verl's own pin <5.11)")
    parser.add_argument("--timeout", type=float, default=540, help="seconds per trainer run, at most")
    parser.add_argument("--deadline", type=float, default=570,
                        help="seconds for the whole invocation (model and data preparation included), 0: none. Each "
                             "trainer's limit is cut to what is left, so the last one ends inside the GPU host's "
                             "10-minute command with its steps read; one left under %d s is recorded as not run"
                             % MIN_RUN_S)
    parser.add_argument("--work-dir", default="/tmp/vs_verl")
    parser.add_argument("--out", help="write args and every step's metrics as JSON here")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--check-imports", action="store_true")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="print the tables from earlier --out files (one trainer per call, e.g. under a 10-minute "
                             "limit per command) instead of running")
    args = parser.parse_args()
    deadline = Deadline(args.deadline or None)  # counted from here: preparing the model and data spends it too
    if args.check_imports:
        return check_imports()
    if args.merge:
        results = {}
        for path in args.merge:
            with open(path) as f:
                saved = json.load(f)
            results.update(saved["results"])
            args = argparse.Namespace(**{**saved["args"], "merge": args.merge})
        return print_tables(results, args)
    if args.shape == "default-sft" or not (args.data_dir and args.tokenizer):
        from hybridrl.defaults.assets import prepare_default_assets

        cache_dir = os.environ.get("HYBRIDRL_CACHE_DIR", os.path.expanduser("~/.cache/hybridrl"))
        paths = prepare_default_assets(cache_dir, with_model=args.shape == "default-sft" or not args.tokenizer)
        args.data_dir = args.data_dir or paths.data_dir
        args.tokenizer = args.tokenizer or paths.sft_model_dir
    if args.shape == "default-sft":
        model_dir = paths.sft_model_dir
    elif args.dry_run:
        model_dir = os.path.join(args.work_dir, f"model_{args.shape}")
    else:
        from benchmarks.ppo_step import make_model
        from benchmarks.vocab import load_vocabulary

        model_dir = make_model(args.shape, load_vocabulary(args.tokenizer),
                               os.path.join(args.work_dir, f"model_{args.shape}"))
    specs = commands(args, model_dir)
    if args.dry_run:
        print_dry_run(args, specs, model_dir)
        check_hybridrl_overrides(specs)
        check_verl_overrides(specs)
        return
    results = {}
    for name in args.trainers.split(","):  # the record is rewritten after each trainer: a cut-off call keeps the first
        timeout = deadline.share(asked=args.timeout)
        if timeout is not None and timeout < MIN_RUN_S:
            results[name] = {"wall_s": 0.0, "steps": [], "log": None,
                             "error": f"not run: {timeout:.0f} s were left of --deadline {args.deadline:.0f}"}
        else:
            results[name] = run_one(name, specs[name], timeout)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "commands": specs, "results": results}, f, indent=1)
    print_tables(results, args)


if __name__ == "__main__":
    main()
