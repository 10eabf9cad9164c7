"""The 0.5B recipe under verl 0.9.1 at the same settings (issue 59 item 3: learning beside speed).

    python recipes/qwen25_coder_gsm_symbolic/verl_compare.py --dry-run         # the table, argv and environment
    python recipes/qwen25_coder_gsm_symbolic/verl_compare.py [--seeds 1 2 3]  # on the GPU host, one seed after another
    python recipes/qwen25_coder_gsm_symbolic/verl_compare.py --hybridrl-overrides  # what compare.sh vs_verl adds

Each seed is one `python -m verl.trainer.main_ppo` on the recipe's own parquet files, model directory and reward
function (recipes/gsm_symbolic_reward.py, which takes verl 0.9.1's keyword call: data_source, solution_str,
ground_truth, extra_info). The workload is run.sh's (RUN_SH, the same key and value in verl; where verl cannot take a
setting, the nearest and why). The layout, kernels and engine are benchmarks/vs_verl_settings.py's shared rows, the
ones benchmarks/vs_verl.py gives both trainers (fused log-probs, hybridrl's varlen attention kernel in verl through
its external_lib hook, the same explicit SGLang settings), for the workload recipe_workload() derives from run.sh's
values, but for VERL_DEPARTURES (verl on its default FSDP1: its FSDP2 path fails on this model's untied lm_head).
`compare.sh vs_verl` gives hybridrl the same rows where run.sh does not set them (--hybridrl-overrides prints them);
run it first in the same WORK_DIR: it prepares the data and the model.

verl runs in its own environment (VERL_TF_SITE: the transformers it pins; VERL_SITE: verl 0.9.1; benchmarks/
vs_verl.py and scripts/gpu/install_verl.sh) and logs every step as JSON lines (trainer.logger=file,
VERL_FILE_LOGGER_PATH) to $WORK_DIR/compare/0.5b_verl_seed<N>/metrics.jsonl, beside a summary.json of this
script's (the wall time and the exit status). seed_table.py --trainer verl reads them back into the same held-out
table as hybridrl's runs, verl's metric names mapped to the recipe's (seed_table.VERL_METRICS).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import vs_verl_settings as table  # noqa: E402
from benchmarks.vs_verl import SHARED_SITE, VERL_SITE, VERL_TF_SITE  # noqa: E402

MODEL, SOURCE = "0.5b", "qwen2.5-coder-0.5b-instruct"  # run.sh's MODEL and the model directory it converts
# run.sh's settings for MODEL=0.5b other than its paths and seed (settings() adds those): verl takes each under the
# same key with the same value
RUN_SH = {
    "data.max_prompt_length": "256", "data.max_response_length": "512", "data.train_batch_size": "64",
    "actor_rollout_ref.model.use_remove_padding": "true", "actor_rollout_ref.actor.optim.lr": "3e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "32", "actor_rollout_ref.actor.use_dynamic_bsz": "true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "16384", "actor_rollout_ref.actor.use_kl_loss": "false",
    "actor_rollout_ref.actor.entropy_coeff": "0", "actor_rollout_ref.rollout.name": "sglang",
    "actor_rollout_ref.rollout.n": "8", "actor_rollout_ref.rollout.temperature": "1.0",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "0.4",
    "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend": "triton",
    "trainer.nnodes": "1", "trainer.n_gpus_per_node": "1", "trainer.total_training_steps": "25",
    "trainer.test_freq": "5", "trainer.save_freq": "-1", "trainer.resume_mode": "disable",
    "trainer.val_before_train": "true", "trainer.project_name": "qwen25_coder_gsm_symbolic",
}


# Where verl departs from vs_verl_settings' shared rows in this comparison alone: verl key -> (value, why). The speed
# benchmark's random model ties lm_head to the embeddings; this recipe's model does not (its GGUF has its own
# output.weight, hybridrl/models/gguf_source.py).
VERL_DEPARTURES = {
    "actor_rollout_ref.actor.strategy": (
        "fsdp", "verl's default (FSDP1): verl 0.9.1's FSDP2 gives an untied lm_head an FSDP unit of its own, and its "
        "fused log-prob path reads lm_head.weight outside that unit's forward, so the first old log-probs failed "
        "('aten.mm.default got mixed torch.Tensor and DTensor', H100, 2026-12-07); FSDP1 leaves lm_head in the root "
        "unit. hybridrl keeps its default, FSDP2 (tests/test_gsm_symbolic_verl_compare.py shows both on the CPU)"),
}


@dataclass(frozen=True)
class Setting:
    recipe: str           # the setting as run.sh (or compare.sh vs_verl) gives it to hybridrl; "-": hybridrl's default
    verl_key: str | None  # the key verl takes it under; None: verl has none (the note says what stands in)
    value: str            # the value verl gets
    note: str = ""        # why the key or value differs, or why verl needs it spelt out


def recipe_workload() -> table.Workload:
    """The workload of vs_verl_settings' shared rows, derived from run.sh's values, so that what those rows derive
    from it (decode CUDA graphs up to 64 x 8 = 512 sequences on one engine, a context of 256 + 512 + 2 tokens, the
    engine's memory share, the micro-batch tokens) follows the recipe, not vs_verl.py's benchmark shape. 0.5B: no
    offload."""
    return table.Workload(prompts=int(RUN_SH["data.train_batch_size"]), n=int(RUN_SH["actor_rollout_ref.rollout.n"]),
                          gpus=int(RUN_SH["trainer.n_gpus_per_node"]),
                          prompt_length=int(RUN_SH["data.max_prompt_length"]),
                          response_length=int(RUN_SH["data.max_response_length"]),
                          max_token_len=int(RUN_SH["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]),
                          gpu_memory_utilization=float(RUN_SH["actor_rollout_ref.rollout.gpu_memory_utilization"]),
                          padded=RUN_SH["actor_rollout_ref.model.use_remove_padding"] != "true")


def shared_rows() -> list[table.Setting]:
    """vs_verl_settings' layout, kernel and engine rows for the recipe's workload. A key run.sh sets too must have
    run.sh's value: otherwise the two comparisons would not run the same settings, and one of them must change."""
    rows = table.shared(recipe_workload())
    clashes = [f"{row.key}: run.sh gives {RUN_SH[row.key]}, benchmarks/vs_verl_settings.py {row.value}"
               for row in rows
               if row.applies_to("hybridrl") and row.key in RUN_SH and RUN_SH[row.key] != str(row.value)]
    if clashes:
        raise SystemExit("run.sh and vs_verl's shared rows disagree (derive the value from the workload, or change "
                         "one of them): " + "; ".join(clashes))
    return rows


def hybridrl_overrides() -> list[str]:
    """What compare.sh vs_verl gives hybridrl beyond run.sh: the shared rows whose key run.sh does not set."""
    return [row.override("hybridrl") for row in shared_rows() if row.applies_to("hybridrl") and row.key not in RUN_SH]


def from_table(row: table.Setting) -> Setting:
    """One shared row as verl gets it, with what hybridrl gets (run.sh's own setting, or compare.sh vs_verl's)."""
    given = ("run.sh" if row.key in RUN_SH else "compare.sh vs_verl") if row.applies_to("hybridrl") else None
    key = row.key_for("verl")
    value, note = VERL_DEPARTURES.get(key, (str(row.value),
                                            f"vs_verl_settings.py{f' ({given})' if given else ''}: {row.reason}"))
    return Setting(row.override("hybridrl") if given else "- (verl only)", key, value, note)


def settings(seed: int, work_dir: Path, run_dir: Path) -> list[Setting]:
    """Every setting of run.sh for MODEL=0.5b, and vs_verl's shared rows, as verl takes them."""
    data, model = work_dir / "data", work_dir / SOURCE
    shared = [row for row in shared_rows() if row.applies_to("verl")]
    same = {"data.train_files": f"{data}/train.parquet", "data.seed": str(seed),
            "actor_rollout_ref.model.path": str(model), **RUN_SH, "trainer.default_local_dir": str(run_dir),
            "trainer.validation_data_dir": f"{run_dir}/val_generations",
            "trainer.experiment_name": f"verl_{MODEL}_seed{seed}"}
    in_table = {row.key for row in shared}
    return [Setting(f"{key}={value}", key, value) for key, value in same.items() if key not in in_table] + [
        from_table(row) for row in shared] + [
        Setting("algorithm=grpo", "algorithm.adv_estimator", "grpo",
                "verl has no preset group; hybridrl's grpo preset differs from verl's defaults only there"),
        Setting("data.val_files=[] data.eval_sets=[held_out: test.parquet, in_template: test_in_template.parquet]",
                "data.val_files", f"[{data}/test.parquet]",
                "verl has no eval sets: it pools its val files by data_source, and both sets are "
                "reasoning_gym/gsm_symbolic. Nearest: the held-out set alone (the headline); in_template is not "
                "measured under verl"),
        Setting(f"trainer.seed={seed}", "actor_rollout_ref.rollout.seed", str(seed),
                "verl has no trainer.seed; hybridrl's seeds each worker's torch and its engine's sampling. Nearest: "
                "verl's sampling seed (SGLang's random_seed); the pretrained model needs no init seed"),
        Setting("trainer.summary_metric=eval/held_out/solved", None, "",
                "verl has no summary metric: seed_table.py reads each validation from the log"),
        Setting("trainer.logger=[console,jsonl]", "trainer.logger", "[console,file]",
                "verl's JSON-lines logger: one line a step into VERL_FILE_LOGGER_PATH"),
        Setting("-", "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH", str(run_dir / "metrics.jsonl"),
                "the file logger lives in verl's TaskRunner actor: the path reaches it through Ray"),
        Setting("custom_reward_function.path=recipes/gsm_symbolic_reward.py", "reward.custom_reward_function.path",
                str(REPO / "recipes" / "gsm_symbolic_reward.py"), "verl 0.9.1 reads it under reward.*"),
        Setting("custom_reward_function.name=compute_score", "reward.custom_reward_function.name", "compute_score",
                "verl 0.9.1 reads it under reward.*"),
    ]


def verl_argv(rows: list[Setting]) -> list[str]:
    return [sys.executable, "-m", "verl.trainer.main_ppo"] + [f"{row.verl_key}={row.value}" for row in rows
                                                               if row.verl_key is not None]


def verl_env(run_dir: Path) -> dict[str, str]:
    """verl's own site first (its pinned transformers, then verl), this repository for the reward's imports, then
    the shared site (SGLang, Ray, reasoning-gym)."""
    return {"PYTHONPATH": ":".join([VERL_TF_SITE, VERL_SITE, str(REPO), SHARED_SITE]),
            "VERL_FILE_LOGGER_PATH": str(run_dir / "metrics.jsonl")}


def run_dir_of(work_dir: Path, seed: int) -> Path:
    return work_dir / "compare" / f"{MODEL}_verl_seed{seed}"  # compare.sh's <MODEL>_<VARIANT>_seed<N>


def check_prepared(work_dir: Path, run_dir: Path) -> None:
    """Before verl starts: the data and model compare.sh prepared, verl's site, and a run directory not yet used."""
    needed = [work_dir / "data" / "train.parquet", work_dir / "data" / "test.parquet", work_dir / SOURCE,
              Path(VERL_TF_SITE), Path(VERL_SITE)]
    missing = [str(path) for path in needed if not path.exists()]
    if missing:
        raise SystemExit(f"missing: {', '.join(missing)} (run `WORK_DIR={work_dir} bash "
                         f"recipes/qwen25_coder_gsm_symbolic/compare.sh vs_verl` first; verl's sites: "
                         f"scripts/gpu/install_verl.sh)")
    if (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{run_dir} already holds a run (metrics.jsonl): choose another WORK_DIR or move it")


def run_seed(seed: int, work_dir: Path) -> int:
    """One verl run, its output in run_dir/verl.log; summary.json: wall time, exit status, argv, environment."""
    run_dir = run_dir_of(work_dir, seed)
    check_prepared(work_dir, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    argv, env = verl_argv(settings(seed, work_dir, run_dir)), verl_env(run_dir)
    started = time.perf_counter()
    with open(run_dir / "verl.log", "w") as log:
        status = subprocess.run(argv, env={**os.environ, **env}, cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT).returncode
    summary = {"trainer": "verl 0.9.1", "wall_s": round(time.perf_counter() - started, 2), "returncode": status,
               "argv": argv, "env": env}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"== verl seed {seed}: exit {status}, {summary['wall_s']:.0f} s, {run_dir}", flush=True)
    return status


def print_dry_run(seeds: list[int], work_dir: Path) -> None:
    rows = settings(seeds[0], work_dir, run_dir_of(work_dir, seeds[0]))
    print("| recipe (run.sh, hybridrl) | verl key | verl value | note |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| `{row.recipe}` | {f'`{row.verl_key}`' if row.verl_key else '(none)'} | `{row.value}` | {row.note} |")
    for seed in seeds:
        run_dir = run_dir_of(work_dir, seed)
        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in verl_env(run_dir).items())
        argv = " \\\n    ".join(shlex.quote(part) for part in verl_argv(settings(seed, work_dir, run_dir)))
        print(f"\nseed {seed}:\n  {env} \\\n  {argv}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--work-dir", type=Path,
                        default=Path(os.environ.get("WORK_DIR", "/tmp/qwen25_coder_gsm_symbolic")),
                        help="run.sh's WORK_DIR (default $WORK_DIR, else /tmp/qwen25_coder_gsm_symbolic)")
    parser.add_argument("--dry-run", action="store_true", help="print the settings table and each seed's command")
    parser.add_argument("--hybridrl-overrides", action="store_true",
                        help="print what compare.sh vs_verl gives hybridrl beyond run.sh, one override a line")
    args = parser.parse_args()
    if args.hybridrl_overrides:
        print("\n".join(hybridrl_overrides()))
        return
    if args.dry_run:
        print_dry_run(args.seeds, args.work_dir)
        return
    failed = [seed for seed in args.seeds if run_seed(seed, args.work_dir) != 0]  # a failed seed: the next one runs
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
