"""verl and hybridrl side by side (issues 18, 59): the same model, data, reward, kernels and engine settings, taking
turns within one host job.

    python3 benchmarks/vs_verl.py --tokenizer D --shape 0.5b --out-dir DIR    # A B B A: hybridrl, verl, verl, hybridrl
    python3 benchmarks/vs_verl.py ... --dry-run        # the settings table, both command lines, both validated; runs nothing
    python3 benchmarks/vs_verl.py --check-imports      # what verl's run imports, and from where (GPU host preflight)

Each run is one subprocess: `python -m verl.trainer.main_ppo` (verl 0.9.1 from /tmp/verl-site with its own pinned
transformers first on its path, scripts/gpu/stage_verl.sh) or `python -m hybridrl.main_ppo`, for --steps GRPO steps
on the same parquet files (the built-in task, verl's layout), the same model directory (random bf16 weights of the
Qwen2.5 layer shapes with the tokenizer's vocabulary, benchmarks/ppo_step.py's make_model; `--shape default-sft`:
hybridrl's warm-started tiny model), the same reward file (vs_verl_reward.py) and every row of
benchmarks/vs_verl_settings.py, which says which kernels both get and why (use_fused_kernels=true for both: flash-attn
has no wheel for the host; remove padding: PyTorch's varlen flash attention for both) and gives each row's reason.

--order (default ABBA; A = hybridrl, B = verl) runs the trainers in turn, so a drift of the host over the job weighs
on both. Each run's first --warmup-steps steps (kernel compilation, CUDA-graph capture, first allocation) are outside
the timed window; the steps after them are the steady steps (>= 5 by default). The four runs of ABBA take longer than
one 10-minute host command: start the job with scripts/gpu/detached.sh and wait on it (benchmarks/README.md).
--merge-turns runs the two adjacent verl turns of ABBA as one process of both turns' steady steps (A, BB, A), which
keeps the order's balance and saves one start-up (about 270 s for verl) where the lease is short.

The record, DIR/vs_verl.json, is rewritten after each run: the kernels and why, each trainer's settings table (key,
value, the trainer's default, whether it departs, the reason), and per run its argv, environment (the variables that
matter), exit, per-step metrics (verl's names for both), steady-state medians per phase (generate, old log-probs,
update, weight switch, step), peak memory, and the log's path and tail (each run's log is copied to DIR as well).
The summary gives per trainer the medians over all its steady steps, and hybridrl / verl ratios of median step TIME
(never of rates), the least flattering fair one first.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import vs_verl_settings as table  # noqa: E402
from benchmarks.trainer_run import Deadline, log_tail, read_jsonl, run_trainer  # noqa: E402

VERL_SITE = os.environ.get("VS_VERL_SITE", "/tmp/verl-site")   # scripts/gpu/install_verl.sh .stage/verl
VERL_TF_SITE = "/tmp/verl-tf-site"     # TARGET=/tmp/verl-tf-site scripts/gpu/install_verl.sh .stage/verl-tf
VERL_TRANSFORMERS = "5.9.0"            # verl 0.9.1's pin for its SGLang install (extra "sglang": transformers==5.9.0)
SHARED_SITE = "/tmp/site"              # slim (SGLang 0.5.16), ray, deps: scripts/gpu/setup_host.sh
LETTERS = {"A": "hybridrl", "B": "verl"}
# the phases of a step, as both trainers log them (verl's names)
PHASES = {"generate": "timing_s/gen", "old_log_prob": "timing_s/old_log_prob", "update": "timing_s/update_actor",
          "weight_switch": "timing_s/update_weights", "step": "timing_s/step"}
PEAK_MEMORY = "perf/max_memory_allocated_gb"
THROUGHPUT = "perf/throughput"
COLUMNS = [(f"{phase} s", key, "{:.2f}") for phase, key in PHASES.items()] + [
    ("tok/s/GPU", THROUGHPUT, "{:,.0f}"), ("peak GiB", PEAK_MEMORY, "{:.1f}"),
    ("reward", "critic/score/mean", "{:.3f}"), ("resp len", "response_length/mean", "{:.0f}")]
# environment variables recorded with each run: the ones that change what a trainer or its engine does
RELEVANT_ENV = re.compile(r"^(PYTHONPATH|CUDA_VISIBLE_DEVICES|HF_HUB_OFFLINE|TRANSFORMERS_OFFLINE|HYBRIDRL_\w+|"
                          r"PYTORCH_\w+|TOKENIZERS_PARALLELISM|OMP_NUM_THREADS|(RAY|NCCL|VERL|SGLANG|TORCH|TORCHINDUCTOR|"
                          r"TRITON|FLASHINFER|TVM_FFI|CUDA)_\w+)$")
ENGINE_LINE = re.compile(r"sglang|cuda.?graph|capturing batches|attn_implementation|fused kernel|monkey patch",
                         re.IGNORECASE)
# what Ray puts before a worker's line: colour codes and "(SGLangHttpServer pid=3341) "; matched on, "sglang" would
# keep every line that server printed, blank ones too (2026-12-07: the record's last 30 were all blank)
RAY_PREFIX = re.compile(r"^(\x1b\[[0-9;]*m)*\(\w+ pid=\d+\)(\x1b\[[0-9;]*m)*\s*")


# ---------------------------------------------------------------------- the plan: one command per run

def run_order(order: str) -> list[str]:
    """The trainers of --order, in turn ("ABBA" -> hybridrl, verl, verl, hybridrl)."""
    if not order or set(order) - set(LETTERS):
        raise SystemExit(f"--order: expected letters A (hybridrl) and B (verl), e.g. ABBA or BAAB, got {order!r}")
    return [LETTERS[letter] for letter in order]


def processes(order: str, merge_turns: bool) -> list[tuple[str, int]]:
    """(trainer, turns) for each process to start: a process a turn, or with --merge-turns one process for each run
    of adjacent turns of one trainer ("ABBA" -> hybridrl 1, verl 2, hybridrl 1). Two adjacent turns of one trainer
    time the same thing in the same place of the order; merged, they cost one start-up instead of two."""
    if not merge_turns:
        return [(trainer, 1) for trainer in run_order(order)]
    return [(trainer, len(list(turns))) for trainer, turns in itertools.groupby(run_order(order))]


def python_path(trainer: str, verl_transformers: str) -> str:
    """verl's run: its own transformers (pinned) and verl first; hybridrl's run never sees either."""
    verl_sites = ([VERL_TF_SITE] if verl_transformers == "pinned" else []) + [VERL_SITE]
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and p not in (VERL_SITE, VERL_TF_SITE)]
    head = verl_sites + [REPO, SHARED_SITE] if trainer == "verl" else [REPO, SHARED_SITE]
    return ":".join(head + [p for p in inherited if p not in head])


def turn_args(args, turns: int) -> argparse.Namespace:
    """The arguments of a process of `turns` turns: its warm-up, then the steady steps of each of its turns."""
    return argparse.Namespace(**{**vars(args), "steps": args.warmup_steps + turns * (args.steps - args.warmup_steps)})


def run_spec(args, model_dir: str, index: int, trainer: str, turns: int = 1) -> dict:
    """Run `index` (1-based) of the plan: its directory, metrics file, argv and environment."""
    run_dir = os.path.join(args.work_dir, f"{index}_{trainer}_{args.shape}_{args.gpus}gpu")
    rows = table.settings(turn_args(args, turns), model_dir, run_dir)
    env = {"PYTHONPATH": python_path(trainer, args.verl_transformers)}
    if trainer == "verl":
        env["VERL_FILE_LOGGER_PATH"] = table.verl_metrics_path(run_dir)
    metrics = env.get("VERL_FILE_LOGGER_PATH") or os.path.join(run_dir, "metrics.jsonl")
    module = "verl.trainer.main_ppo" if trainer == "verl" else "hybridrl.main_ppo"
    return {"index": index, "trainer": trainer, "turns": turns, "run_dir": run_dir, "metrics": metrics,
            "argv": [sys.executable, "-m", module, *table.overrides(rows, trainer)], "env": env}


def plan(args, model_dir: str) -> list[dict]:
    return [run_spec(args, model_dir, index, trainer, turns)
            for index, (trainer, turns) in enumerate(processes(args.order, args.merge_turns), 1)]


# ---------------------------------------------------------------------- reading and summarising the steps

# metrics verl 0.9.1 logs under another name than hybridrl
VERL_NAMES = {PEAK_MEMORY: "actor/perf/max_memory_allocated_gb"}


def verl_step(record: dict) -> dict:
    """verl's file logger writes {"step": k, "data": {...}}: the metrics, under hybridrl's names."""
    metrics = record.get("data", record)
    metrics.update({ours: metrics[theirs] for ours, theirs in VERL_NAMES.items()
                    if ours not in metrics and theirs in metrics})
    return metrics


# how each trainer's JSON-lines logger writes a step (hybridrl's writes the metrics themselves)
STEP_READERS = {"verl": verl_step, "hybridrl": lambda record: record}


def read_steps(trainer: str, path: str) -> list[dict]:
    """Per-step metric dicts in step order, under hybridrl's names."""
    return read_jsonl(path, STEP_READERS[trainer])


def medians(steps: list[dict]) -> dict[str, float]:
    """The median of each phase's seconds over `steps` (a phase no step logged is left out)."""
    out = {}
    for phase, key in PHASES.items():
        values = [step[key] for step in steps if isinstance(step.get(key), (int, float))]
        if values:
            out[phase] = statistics.median(values)
    return out


def steady_summary(steps: list[dict], warmup: int) -> dict:
    """A run's steady steps (those after the warm-up) as medians per phase, their count, the median throughput and
    the peak memory over all its steps (the warm-up's included: a peak is a peak)."""
    steady = steps[warmup:]
    throughput = [step[THROUGHPUT] for step in steady if isinstance(step.get(THROUGHPUT), (int, float))]
    peaks = [step[PEAK_MEMORY] for step in steps if isinstance(step.get(PEAK_MEMORY), (int, float))]
    return {"steady_steps": len(steady), "median_s": medians(steady),
            "median_throughput": statistics.median(throughput) if throughput else None,
            "peak_memory_gb": max(peaks) if peaks else None}


def turns_of(run: dict, warmup: int, per_turn: int) -> list[list[dict]]:
    """A run's steady steps, one list for each of its turns: a merged run's turns are its consecutive blocks of
    `per_turn` steps (the last takes what is left, should the run have been cut off)."""
    steady, count = run["steps"][warmup:], run.get("turns", 1)
    return [steady[k * per_turn:] if k == count - 1 else steady[k * per_turn:(k + 1) * per_turn] for k in range(count)]


def ratios(runs: list[dict], warmup: int, per_turn: int) -> list[dict]:
    """hybridrl / verl of median step time, every fair way of pairing the turns, least flattering (largest) first:
    all steady steps of each trainer pooled; each pair of turns (the k-th of each, neighbours in an ABBA order); and
    hybridrl's slowest turn against verl's fastest, a bound no pairing can exceed."""
    turns = {trainer: [(f"run {run['index']}" + (f" turn {k + 1}" if run.get("turns", 1) > 1 else ""), steps)
                       for run in runs if run["trainer"] == trainer and run.get("steps")
                       for k, steps in enumerate(turns_of(run, warmup, per_turn)) if steps]
             for trainer in table.TRAINERS}
    ours, theirs = turns["hybridrl"], turns["verl"]

    def step_median(selected: list[tuple[str, list[dict]]]) -> float | None:
        return medians([step for _, steps in selected for step in steps]).get("step")

    candidates = [("pooled: all steady steps of each trainer", ours, theirs)]
    candidates += [(f"pair {k + 1}: {a[0]} (hybridrl) / {b[0]} (verl)", [a], [b])
                   for k, (a, b) in enumerate(zip(ours, theirs))]
    slowest = [turn for turn in ours if step_median([turn]) is not None]
    fastest = [turn for turn in theirs if step_median([turn]) is not None]
    if len(slowest) > 1 or len(fastest) > 1:
        candidates.append(("bound: hybridrl's slowest turn / verl's fastest turn",
                           [max(slowest, key=lambda turn: step_median([turn]))] if slowest else [],
                           [min(fastest, key=lambda turn: step_median([turn]))] if fastest else []))
    out = []
    for name, a, b in candidates:
        numerator, denominator = step_median(a), step_median(b)
        if numerator is not None and denominator:
            out.append({"ratio": numerator / denominator, "what": name, "hybridrl_step_s": numerator,
                        "verl_step_s": denominator})
    return sorted(out, key=lambda entry: entry["ratio"], reverse=True)


def summarize(runs: list[dict], warmup: int, per_turn: int) -> dict:
    """Per trainer: medians over all its steady steps and its peak memory; the step-time ratios; per-phase ratios
    of the pooled medians."""
    trainers = {}
    for trainer in table.TRAINERS:
        steps = [step for run in runs if run["trainer"] == trainer for step in run.get("steps", [])[warmup:]]
        peaks = [run["peak_memory_gb"] for run in runs if run["trainer"] == trainer and run.get("peak_memory_gb")]
        trainers[trainer] = {"steady_steps": len(steps), "median_s": medians(steps),
                             "peak_memory_gb": max(peaks) if peaks else None}
    ours, theirs = trainers["hybridrl"]["median_s"], trainers["verl"]["median_s"]
    phase_ratios = {phase: ours[phase] / theirs[phase] for phase in PHASES if phase in ours and theirs.get(phase)}
    return {"trainers": trainers, "step_time_ratios": ratios(runs, warmup, per_turn),
            "phase_ratios_pooled": phase_ratios}


# ---------------------------------------------------------------------- the record

def relevant_env(env: dict) -> dict:
    return {key: value for key, value in sorted(env.items()) if RELEVANT_ENV.match(key)}


def hybridrl_commit(given: str | None) -> str | None:
    """--commit when given (the host's copy of the tree has no .git), else this checkout's HEAD (+ '-dirty')."""
    if given:
        return given
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def installed_version(site: str, package: str) -> str | None:
    """The version of `package` installed in `site` (its dist-info folder), None when absent."""
    if not os.path.isdir(site):
        return None
    found = [name for name in os.listdir(site) if re.match(rf"{package}-[^-]+\.dist-info$", name)]
    return found[0][len(package) + 1:-len(".dist-info")] if found else None


def new_record(args, runs: list[dict], model_dir: str) -> dict:
    # each trainer's table from its first run (a merged run gives verl more steps than --steps)
    rows = {run["trainer"]: table.settings(turn_args(args, run["turns"]), model_dir, "RUN_DIR")
            for run in reversed(runs)}
    return {
        "issue": 59, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": vars(args), "order": args.order, "warmup_steps": args.warmup_steps,
        "kernels": table.KERNELS,
        "settings": {trainer: table.override_table(rows[trainer], trainer, table.default_config(trainer, VERL_SITE))
                     for trainer in table.TRAINERS if trainer in rows},
        "versions": {"hybridrl_commit": hybridrl_commit(args.commit),
                     "verl": installed_version(VERL_SITE, "verl"),
                     "verl_transformers": (installed_version(VERL_TF_SITE, "transformers")
                                           if args.verl_transformers == "pinned" else "the image's")},
        "runs": [{key: run[key] for key in ("index", "trainer", "turns", "run_dir", "argv")}
                 | {"env": relevant_env({**os.environ, **run["env"]})} for run in runs],
    }


def write_record(record: dict, out_dir: str) -> None:
    """Rewrite DIR/vs_verl.json whole (a temporary file renamed over it: a reader never sees half of one)."""
    path = os.path.join(out_dir, "vs_verl.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def run_one(spec: dict, timeout: float | None, warmup: int, out_dir: str) -> dict:
    """Run one trainer; its steps, steady summary, exit and log (copied into out_dir) for the record."""
    os.makedirs(spec["run_dir"], exist_ok=True)
    name = f"{spec['index']}_{spec['trainer']}"
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    run = run_trainer(spec["argv"], os.path.join(spec["run_dir"], f"{name}.log"), spec["metrics"], timeout,
                      env={**os.environ, **spec["env"]}, read_step=STEP_READERS[spec["trainer"]])
    shutil.copy(run.log_path, os.path.join(out_dir, f"{name}.log"))
    with open(run.log_path, errors="replace") as log:
        engine_lines = [text[:300] for text in (RAY_PREFIX.sub("", line).strip() for line in log)
                        if ENGINE_LINE.search(text)]
    return {"started": started, "wall_s": run.wall_s, "exit": run.code, "error": run.error, "steps": run.steps,
            **steady_summary(run.steps, warmup), "log": run.log_path, "log_copy": f"{name}.log",
            "log_tail": log_tail(run.log_path, 40), "engine_log_lines": engine_lines[-30:]}


# ---------------------------------------------------------------------- printing

def print_tables(record: dict) -> None:
    warmup = record["warmup_steps"]
    for run in record["runs"]:
        if "steps" not in run:
            continue
        print(f"\nrun {run['index']} {run['trainer']}: {len(run['steps'])} steps logged, wall {run['wall_s']:.0f} s"
              + (f", FAILED: {run['error']}" if run["error"] else "") + f" (log: {run['log']})")
        print("| step | " + " | ".join(title for title, _, _ in COLUMNS) + " |")
        print("|---" * (len(COLUMNS) + 1) + "|")
        for number, step in enumerate(run["steps"], 1):
            cells = [fmt.format(step[key]) if isinstance(step.get(key), (int, float)) else "-"
                     for _, key, fmt in COLUMNS]
            print(f"| {number}{' (warm-up)' if number <= warmup else ''} | " + " | ".join(cells) + " |")
    summary = record.get("summary")
    if not summary:
        return
    print(f"\nmedians over the steady steps (after {warmup} warm-up step(s)) | verl | hybridrl | hybridrl / verl |"
          "\n|---|---|---|---|")
    verl, ours = (summary["trainers"][name] for name in ("verl", "hybridrl"))
    for phase in PHASES:
        a, b = verl["median_s"].get(phase), ours["median_s"].get(phase)
        ratio = summary["phase_ratios_pooled"].get(phase)
        print(f"| {phase} s | {'-' if a is None else f'{a:.2f}'} | {'-' if b is None else f'{b:.2f}'} | "
              f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    print(f"| steady steps | {verl['steady_steps']} | {ours['steady_steps']} | |")
    print(f"| peak GiB | {verl['peak_memory_gb']} | {ours['peak_memory_gb']} | |")
    print("\nhybridrl / verl, median step time (least flattering first):")
    for entry in summary["step_time_ratios"]:
        print(f"  {entry['ratio']:.3f}  {entry['what']} ({entry['hybridrl_step_s']:.2f} s / {entry['verl_step_s']:.2f} s)")


def print_dry_run(record: dict, runs: list[dict]) -> None:
    print(f"kernels: {record['kernels']['choice']}\n  verl's log-probs: {record['kernels']['verl_log_probs']}")
    for trainer, rows in record["settings"].items():
        print(f"\n{trainer}: key = value   [default; * departs]   # reason")
        for row in rows:
            mark = "*" if row["departs"] else " " if row["departs"] is False else "?"
            print(f"  {mark} {row['key']} = {row['value']}   [{row['default']}]   # {row['reason']}")
    steady = record["args"]["steps"] - record["warmup_steps"]
    order = " ".join(f"{run['index']}:{run['trainer']}" + (f" ({run['turns']} turns)" if run["turns"] > 1 else "")
                     for run in runs)
    print(f"\norder: {order}, {record['warmup_steps']} warm-up step(s) a process + {steady} steady steps a turn")
    for run in {run["trainer"]: run for run in runs}.values():
        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in run["env"].items())
        print(f"\n{run['trainer']} command (run {run['index']}):\n  {env} \\\n  "
              + " \\\n    ".join(shlex.quote(part) for part in run["argv"]))


# ---------------------------------------------------------------------- checks before any run

def check_hybridrl_overrides(argv: list[str]) -> None:
    """Compose and validate hybridrl's side here: an unknown or refused key fails the dry run. On a machine without
    a GPU or SGLang the validator also says so; those problems (and only those) are this machine's, not the config's."""
    import hybridrl.checks  # noqa: F401  registers the subsystems' config checks
    from hybridrl.config import compose_config, validate_config
    from hybridrl.config.validation import ConfigError

    try:
        validate_config(compose_config(argv[3:]))
        print("\nhybridrl: the override list composes and validates")
    except ConfigError as error:
        machine = ("CUDA", "not importable", "no CUDA GPU")
        real = [problem for problem in error.problems if not any(word in problem for word in machine)]
        if real:
            raise ConfigError(real) from None
        print(f"\nhybridrl: the override list composes and validates, except {len(error.problems)} problem(s) of this "
              "machine (no GPU / no SGLang):\n  " + "\n  ".join(error.problems))


VERL_CHECK = """\
import sys, os
from hydra import compose, initialize_config_dir
import verl.trainer.main_ppo as m
from verl.utils.config import validate_config, omega_conf_to_dataclass
from verl.trainer.ppo.utils import need_critic, need_reference_policy
d = os.path.join(os.path.dirname(m.__file__), 'config')
with initialize_config_dir(config_dir=d, version_base=None):
    c = compose(config_name='ppo_trainer', overrides=sys.argv[1:])
validate_config(config=c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
omega_conf_to_dataclass(c.actor_rollout_ref.rollout); omega_conf_to_dataclass(c.actor_rollout_ref.actor)
print('verl: the override list composes and validates (verl', __import__('verl').__version__, ')')
"""


def check_verl_overrides(argv: list[str], env: dict) -> None:
    """Compose verl's own config with the verl override list (Hydra struct mode refuses unknown keys) and build
    verl's validated config objects, where verl is importable (VS_VERL_SITE; on the GPU host /tmp/verl-site)."""
    if not os.path.isdir(os.path.join(VERL_SITE, "verl")):
        print(f"\nverl: not checked ({VERL_SITE}/verl missing; VS_VERL_SITE points elsewhere)")
        return
    completed = subprocess.run([sys.executable, "-c", VERL_CHECK, *argv[3:]], env={**os.environ, **env},
                               capture_output=True, text=True)
    lines = [line for line in (completed.stdout + completed.stderr).splitlines() if "warn" not in line.lower()]
    print("\n" + "\n".join(lines[-12:]))
    if completed.returncode != 0:
        raise SystemExit("verl refused the override list (above)")


def check_installed(trainers: list[str], verl_transformers: str) -> None:
    """Before any run: verl and its pinned transformers are where verl's PYTHONPATH looks."""
    if "verl" not in trainers:
        return
    missing = []
    if not os.path.isdir(os.path.join(VERL_SITE, "verl")):
        missing.append(f"{VERL_SITE}/verl (bash scripts/gpu/install_verl.sh .stage/verl)")
    if verl_transformers == "pinned" and installed_version(VERL_TF_SITE, "transformers") != VERL_TRANSFORMERS:
        missing.append(f"transformers {VERL_TRANSFORMERS} in {VERL_TF_SITE} (TARGET={VERL_TF_SITE} bash "
                       "scripts/gpu/install_verl.sh .stage/verl-tf), or --verl-transformers image")
    if missing:
        raise SystemExit("verl's run needs " + "; ".join(missing))


def check_imports() -> None:
    """On the GPU host: import what verl's run imports, with verl's PYTHONPATH, and say where each package came from."""
    modules = ["transformers", "sglang", "ray", "verl.trainer.main_ppo", "verl.trainer.ppo.v1.trainer_sync",
               "transfer_queue", "verl.workers.engine_workers", "verl.workers.engine.fsdp.transformer_impl",
               "verl.experimental.agent_loop", "verl.experimental.reward_loop", "verl.utils.dataset.rl_dataset",
               "verl.workers.rollout.sglang_rollout.async_sglang_server",
               "verl.workers.rollout.sglang_rollout.sglang_rollout", "verl.models.transformers.dense_common",
               "verl.utils.experimental.torch_functional", table.VERL_ATTENTION_LIB]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    try:\n        importlib.import_module(m); print('OK  ', m)\n"
            "    except Exception as e:\n        print('FAIL', m, type(e).__name__, str(e)[:300])\n"
            "for top in sorted({n.split('.')[0] for n in sys.modules}):\n"
            "    f = getattr(sys.modules.get(top), '__file__', None) or ''\n"
            "    if 'site' in f or 'dist-packages' in f: print('FROM', top, f.rsplit('/', 2)[0])\n"
            "from transformers import AttentionInterface\n"
            f"print('ATTENTION {table.VARLEN} registered:', {table.VARLEN!r} in AttentionInterface._global_mapping)\n"
            "import transformers, torch; print('VERSIONS transformers', transformers.__version__, 'torch', torch.__version__)\n")
    for variant in ("image", "pinned"):
        if variant == "pinned" and not os.path.isdir(VERL_TF_SITE):
            continue
        path = python_path("verl", variant)
        print(f"== verl's imports with transformers from the {variant} ({path})", flush=True)
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path})


# ---------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    parser.add_argument("--order", default="ABBA", help="the runs in turn: A = hybridrl, B = verl (ABBA, BAAB, AB, ...)")
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per turn, the warm-up included")
    parser.add_argument("--merge-turns", action="store_true",
                        help="adjacent turns of one trainer (the BB of ABBA) run as one process: one warm-up, then "
                             "the steady steps of both turns (one start-up less, for a short lease)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="first steps of each run outside the timed window")
    parser.add_argument("--padded", action="store_true", help="use_remove_padding=false (both use sdpa then)")
    parser.add_argument("--max-token-len", type=int, default=16384, help="ppo/log_prob max token len per GPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--verl-transformers", choices=["pinned", "image"], default="pinned",
                        help=f"pinned: transformers {VERL_TRANSFORMERS} from {VERL_TF_SITE}, verl's own pin; image: "
                             "the host's (as hybridrl and SGLang use)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run, at most")
    parser.add_argument("--deadline", type=float, default=0,
                        help="seconds for the whole invocation, 0: none (a detached job). Each run's limit is cut to "
                             "what is left")
    parser.add_argument("--work-dir", default="/tmp/vs_verl")
    parser.add_argument("--out-dir", help="the record (vs_verl.json) and each run's log, rewritten after each run")
    parser.add_argument("--commit", help="hybridrl's commit, for the record (default: git rev-parse HEAD here)")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--check-imports", action="store_true")
    args = parser.parse_args(argv)
    run_order(args.order)
    if not 0 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps: expected 0 <= it < --steps ({args.steps}), got {args.warmup_steps}")
    if not (args.dry_run or args.check_imports or args.out_dir):
        parser.error("--out-dir: expected a directory for the record (or --dry-run)")
    return args


def model_and_data(args) -> str:
    """Fill in the data and tokenizer defaults; the model directory (made unless this is a dry run)."""
    if args.shape == "default-sft" or not (args.data_dir and args.tokenizer):
        from hybridrl.defaults.assets import prepare_default_assets

        cache_dir = os.environ.get("HYBRIDRL_CACHE_DIR", os.path.expanduser("~/.cache/hybridrl"))
        paths = prepare_default_assets(cache_dir, with_model=args.shape == "default-sft" or not args.tokenizer)
        args.data_dir = args.data_dir or paths.data_dir
        args.tokenizer = args.tokenizer or paths.sft_model_dir
        if args.shape == "default-sft":
            return paths.sft_model_dir
    model_dir = os.path.join(args.work_dir, f"model_{args.shape}")
    if args.dry_run:
        return model_dir
    from benchmarks.ppo_step import make_model
    from benchmarks.vocab import load_vocabulary

    return make_model(args.shape, load_vocabulary(args.tokenizer), model_dir)


def main() -> None:
    args = parse_args()
    deadline = Deadline(args.deadline or None)  # counted from here: preparing the model and data spends it too
    if args.check_imports:
        return check_imports()
    if not args.dry_run:
        check_installed(run_order(args.order), args.verl_transformers)
    model_dir = model_and_data(args)
    runs = plan(args, model_dir)
    record = new_record(args, runs, model_dir)
    if args.dry_run:
        print_dry_run(record, runs)
        first = {run["trainer"]: run for run in reversed(runs)}
        if "hybridrl" in first:
            check_hybridrl_overrides(first["hybridrl"]["argv"])
        if "verl" in first:
            check_verl_overrides(first["verl"]["argv"], first["verl"]["env"])
        return
    os.makedirs(args.out_dir, exist_ok=True)
    write_record(record, args.out_dir)
    for spec, entry in zip(runs, record["runs"]):
        entry.update(run_one(spec, deadline.share(asked=args.timeout), args.warmup_steps, args.out_dir))
        record["summary"] = summarize(record["runs"], args.warmup_steps, args.steps - args.warmup_steps)
        write_record(record, args.out_dir)
    print_tables(record)


if __name__ == "__main__":
    main()
