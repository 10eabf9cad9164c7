"""The 0.5B recipe under verl, staged on the CPU (issue 59 item 3): verl_compare.py's table covers every setting of
run.sh, its argv composes under verl 0.9.1's own config (read from verl's released files, not run), both recipe argvs
(verl's and hybridrl's compare.sh vs_verl) carry benchmarks/vs_verl.py's layout, kernel and engine values, the
recipe's reward takes verl's call, and seed_table.py builds the held-out table from a verl-style log made here by
hand."""
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.reward.scorers.reasoning_gym import make_train_test_rows
from hybridrl.utils.import_utils import load_extern_object
from verl_release import LATEST, verl_release

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "qwen25_coder_gsm_symbolic"
SGLANG = "+actor_rollout_ref.rollout.engine_kwargs.sglang"


def load(name: str, path: Path = RECIPE):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_sh_settings() -> dict[str, str]:
    """What run.sh gives hybridrl for MODEL=0.5b, key -> value as written (quotes removed): its main_ppo lines and
    START's (MEMORY is the 1.5B's)."""
    text = (RECIPE / "run.sh").read_text()
    trainer_lines = text[text.index("exec python -m hybridrl.main_ppo"):]
    start = re.search(r"^START=\((.*)\)$", text, re.MULTILINE).group(1)
    pairs = re.findall(r"([+\w.]+)=(\"[^\"]*\"|'[^']*'|[^\s\\]+)", trainer_lines + " " + start)
    return {key: value.strip("'\"") for key, value in pairs}


def as_dict(overrides: list[str]) -> dict[str, str]:
    return dict(override.split("=", 1) for override in overrides)


@pytest.fixture(scope="module")
def verl_compare():
    return load("verl_compare")


@pytest.fixture(scope="module")
def vs_verl():
    return load("vs_verl", REPO / "benchmarks")


@pytest.fixture(scope="module")
def speed_argvs(vs_verl):
    """benchmarks/vs_verl.py's two override lists (the speed comparison) at the recipe's shape: 64 prompts x 8,
    256 + 512 tokens, 16k-token micro-batches, its memory share 0.4 (vs_verl's default: 0.5)."""
    args = vs_verl.parse_args(["--data-dir", "/d", "--tokenizer", "/t", "--dry-run", "--gpu-memory-utilization", "0.4",
                               "--max-token-len", "16384"])
    return {run["trainer"]: as_dict(run["argv"][3:]) for run in vs_verl.plan(args, "/model")[:2]}


def run_compare_sh(folder: Path, variant: str, model: str = "0.5b") -> list[str]:
    """main_ppo's argv, an argument a line, for `MODEL=model compare.sh variant 1` run for real (compare.sh -> run.sh
    -> the data and model preparation -> exec python -m hybridrl.main_ppo) with a `python` first on PATH that records
    main_ppo's arguments and writes one validation file where the trainer would, instead of training; it leaves the
    preparation's steps out and runs verl_compare.py with this interpreter. The work directory is folder/work."""
    fake = folder / "bin" / "python"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/usr/bin/env bash\n"
                    f'case "$1" in */verl_compare.py) exec {sys.executable} "$@" ;; esac\n'
                    '[ "$1 $2" = "-m hybridrl.main_ppo" ] || exit 0\n'
                    'printf "%s\\n" "${@:3}" > "$ARGV_OUT"\n'
                    'for a in "$@"; do case "$a" in trainer.validation_data_dir=*)\n'
                    '    mkdir -p "${a#*=}" && echo \'{"step": 0}\' > "${a#*=}/0.jsonl" ;; esac; done\n')
    fake.chmod(0o755)
    out = folder / f"{model}_{variant}_argv.txt"
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "WORK_DIR": str(folder / "work"),
           "ARGV_OUT": str(out), "MODEL": model}
    result = subprocess.run(["bash", str(RECIPE / "compare.sh"), variant, "1"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return out.read_text().splitlines()


@pytest.fixture(scope="module")
def compare_sh_run(tmp_path_factory):
    """`compare.sh vs_verl 1` (run_compare_sh): main_ppo's argv and the work directory."""
    tmp = tmp_path_factory.mktemp("compare_sh")
    return run_compare_sh(tmp, "vs_verl"), tmp / "work"


@pytest.fixture(scope="module")
def compare_sh_argv(compare_sh_run):
    return compare_sh_run[0]


def test_compare_sh_packs_each_seeds_answers_to_copy_back(compare_sh_run):
    import tarfile

    with tarfile.open(compare_sh_run[1] / "compare" / "0.5b_vs_verl_seed1" / "val_generations.tgz") as packed:
        assert sorted(packed.getnames()) == ["val_generations", "val_generations/0.jsonl"]
        assert packed.extractfile("val_generations/0.jsonl").read() == b'{"step": 0}\n'


def test_every_setting_of_run_sh_is_mapped_and_the_argv_composes_under_verls_own_config(tmp_path, verl_compare):
    """Each key run.sh sets is a row of verl_compare's table, with run.sh's value where verl takes it as it is; a row
    verl cannot take says why; verl's argv gives each key once and composes with verl 0.9.1's ppo_trainer config
    (hydra refuses an unknown key), to the values the table gives."""
    from hydra import compose, initialize_config_dir

    rows = verl_compare.settings(2, tmp_path, tmp_path / "compare" / "0.5b_verl_seed2")
    mapped = {match for row in rows for match in re.findall(r"([+\w.]+)=", row.recipe)}
    run_sh = run_sh_settings()
    assert set(run_sh) <= mapped, sorted(set(run_sh) - mapped)
    assert all(row.note for row in rows if row.verl_key is None or row.recipe.startswith("-"))
    assert {key: run_sh[key] for key in verl_compare.RUN_SH} == verl_compare.RUN_SH  # RUN_SH is run.sh's

    argv = verl_compare.verl_argv(rows)
    assert argv[1:3] == ["-m", "verl.trainer.main_ppo"]
    keys = [entry.split("=", 1)[0] for entry in argv[3:]]
    assert len(keys) == len(set(keys)), sorted(key for key in keys if keys.count(key) > 1)
    with initialize_config_dir(config_dir=str(verl_release(LATEST) / "verl" / "trainer" / "config"),
                               version_base=None):
        config = compose("ppo_trainer", overrides=argv[3:])
    rollout, model = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    assert (config.data.seed, rollout.seed, rollout.n, rollout.tensor_model_parallel_size) == (2, 2, 8, 1)
    assert config.data.val_files == [f"{tmp_path}/data/test.parquet"]  # the held-out set alone
    # vs_verl's engine settings at the recipe's shape: graphs up to 64 x 8 = 512, context 256 + 512 + 2
    assert dict(rollout.engine_kwargs.sglang) == {"attention_backend": "triton", "cuda_graph_max_bs_decode": 512,
                                                  "sampling_backend": "pytorch", "chunked_prefill_size": 8192,
                                                  "context_length": 770}
    assert (rollout.mode, rollout.gpu_memory_utilization, rollout.max_num_seqs) == ("async", 0.4, 1024)
    assert (model.use_fused_kernels, model.external_lib) == (True, "benchmarks.vs_verl_attention")
    assert model.override_config.attn_implementation == "hybridrl_varlen"
    # verl's default FSDP1, not the shared row's FSDP2 (verl_compare.VERL_DEPARTURES; the test after the next)
    assert (config.actor_rollout_ref.actor.strategy, model.enable_gradient_checkpointing) == ("fsdp", False)
    assert config.reward.custom_reward_function.path == str(REPO / "recipes" / "gsm_symbolic_reward.py")
    assert (config.algorithm.adv_estimator, config.actor_rollout_ref.actor.optim.lr) == ("grpo", 3e-6)
    assert list(config.trainer.logger) == ["console", "file"]

    env = verl_compare.verl_env(tmp_path / "run")
    assert env["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "run" / "metrics.jsonl")


VERL_FUSED_FORWARD = """
import sys, types, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl.models.transformers.dense_common import forward_with_torch_backend
from verl.utils.fsdp_utils import apply_fsdp2, get_fsdp_wrap_policy

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
ids = torch.randint(0, 64, (1, 8))
for strategy in ("fsdp2", "fsdp"):
    for tied in (True, False):
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))
        if strategy == "fsdp2":
            apply_fsdp2(model, {"mesh": init_device_mesh("cpu", (1,))}, {})
            wrapped = model
        else:
            wrapped = FullyShardedDataParallel(model, auto_wrap_policy=get_fsdp_wrap_policy(model),
                                               device_id=torch.device("cpu"))
        model.forward = types.MethodType(forward_with_torch_backend, model)  # what use_fused_kernels patches in
        try:
            result = "log_probs %s" % (tuple(wrapped(input_ids=ids, return_dict=True).log_probs.shape),)
        except RuntimeError as error:
            result = str(error).split(",")[0]
        print(strategy, "tied" if tied else "untied", result, flush=True)
"""


def test_verls_fsdp2_fused_forward_fails_on_an_untied_lm_head_and_its_fsdp1_does_not(tmp_path):
    """Why verl_compare gives verl FSDP1 (VERL_DEPARTURES): verl 0.9.1's own files, wrapping a 2-layer Qwen2 as its
    engine does (apply_fsdp2; FSDP1 with its wrap policy) with its fused forward, on the CPU with gloo. FSDP2 wraps an
    untied lm_head on its own, and the fused forward multiplies by lm_head.weight, still a sharded DTensor, outside
    that unit: the error the recipe's verl run stopped on at its first old log-probs (H100, 2026-12-07)."""
    script = tmp_path / "fused_forward.py"
    script.write_text(VERL_FUSED_FORWARD)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "pg")], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(verl_release(LATEST))}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "fsdp2 tied log_probs (1, 8)",
        "fsdp2 untied aten.mm.default got mixed torch.Tensor and DTensor",
        "fsdp tied log_probs (1, 8)",
        "fsdp untied log_probs (1, 8)",
    ]


def test_the_recipes_workload_is_derived_from_run_sh(verl_compare):
    """The shared rows' sizes follow the recipe, not vs_verl.py's benchmark shape: 64 prompts x 8 samples on one
    engine -> decode graphs up to 512; 256 + 512 + 2 = 770 tokens of context; run.sh's memory share 0.4 and
    16,384-token micro-batches; packed rows (the varlen kernel), no offload (0.5B)."""
    workload = verl_compare.recipe_workload()
    assert workload == verl_compare.table.Workload(prompts=64, n=8, gpus=1, prompt_length=256, response_length=512,
                                                max_token_len=16384, gpu_memory_utilization=0.4)
    rows = {row.key_for("verl"): row.value for row in verl_compare.shared_rows()}
    assert (rows[f"{SGLANG}.cuda_graph_max_bs_decode"], rows[f"{SGLANG}.context_length"]) == (512, 770)
    assert rows["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] == 16384


def test_a_shared_row_that_disagrees_with_run_sh_is_refused(verl_compare, monkeypatch):
    monkeypatch.setitem(verl_compare.RUN_SH, "actor_rollout_ref.rollout.temperature", "0.7")
    with pytest.raises(SystemExit, match=r"actor_rollout_ref.rollout.temperature: run.sh gives 0.7, "
                                         r"benchmarks/vs_verl_settings.py 1.0"):
        verl_compare.shared_rows()


def test_both_recipe_argvs_carry_the_speed_comparisons_kernel_and_engine_values(tmp_path, verl_compare, vs_verl,
                                                                                speed_argvs, compare_sh_argv):
    """verl's argv (verl_compare.py) and hybridrl's (compare.sh vs_verl, through run.sh) give each layout, kernel and
    engine key of vs_verl_settings.shared the value benchmarks/vs_verl.py gives that trainer at the recipe's shape;
    hybridrl's argv composes (no key given twice, none unknown) and validates (but for this machine's lack of a GPU
    and SGLang)."""
    verl = as_dict(verl_compare.verl_argv(verl_compare.settings(1, tmp_path, tmp_path / "run"))[3:])
    ours = as_dict(compare_sh_argv)
    shared = verl_compare.shared_rows()
    for trainer, argv in (("verl", verl), ("hybridrl", ours)):
        keys = [row.key_for(trainer) for row in shared if row.applies_to(trainer)
                and not (trainer == "verl" and row.key_for(trainer) in verl_compare.VERL_DEPARTURES)]
        assert {key: argv.get(key) for key in keys} == {key: speed_argvs[trainer][key] for key in keys}, trainer
    # the one departure: verl on its default FSDP1 here, where the speed benchmark gives both FSDP2
    assert list(verl_compare.VERL_DEPARTURES) == ["actor_rollout_ref.actor.strategy"]
    assert (verl["actor_rollout_ref.actor.strategy"], ours["actor_rollout_ref.actor.strategy"]) == ("fsdp", "fsdp2")
    assert speed_argvs["verl"]["actor_rollout_ref.actor.strategy"] == "fsdp2"
    # by hand: the kernels and engine both trainers get
    for argv in (verl, ours):
        assert argv["actor_rollout_ref.model.use_fused_kernels"] == "true"
        assert (argv[f"{SGLANG}.cuda_graph_max_bs_decode"], argv[f"{SGLANG}.attention_backend"],
                argv[f"{SGLANG}.sampling_backend"]) == ("512", "triton", "pytorch")
        assert (argv["actor_rollout_ref.rollout.gpu_memory_utilization"], argv["actor_rollout_ref.rollout.mode"],
                argv["actor_rollout_ref.rollout.max_num_seqs"]) == ("0.4", "async", "1024")
    assert ours["actor_rollout_ref.rollout.max_num_batched_tokens"] == verl[f"{SGLANG}.chunked_prefill_size"] == "8192"
    assert verl["actor_rollout_ref.model.external_lib"] == "benchmarks.vs_verl_attention"
    # the rest of hybridrl's argv is run.sh's own
    assert (ours["actor_rollout_ref.actor.optim.lr"], ours["trainer.experiment_name"]) == ("3e-6", "vs_verl_0.5b_seed1")
    vs_verl.check_hybridrl_overrides(["python", "-m", "hybridrl.main_ppo", *compare_sh_argv])


def test_compare_sh_vs_verl_refuses_another_model(tmp_path):
    result = subprocess.run(["bash", str(RECIPE / "compare.sh"), "vs_verl", "1"], capture_output=True, text=True,
                            env={**os.environ, "MODEL": "1.5b", "WORK_DIR": str(tmp_path)}, timeout=60)
    assert result.returncode == 2 and "VARIANT=vs_verl: expected MODEL=0.5b, got 1.5b" in result.stderr
    assert not (tmp_path / "compare").exists()


def test_dry_run_prints_the_table_and_each_seeds_command_and_a_real_run_refuses_before_verl_starts(tmp_path):
    script = str(RECIPE / "verl_compare.py")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    dry = subprocess.run([sys.executable, script, "--dry-run", "--seeds", "1", "3", "--work-dir", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert "| `trainer.seed=1` | `actor_rollout_ref.rollout.seed` | `1` |" in dry.stdout
    assert "| `- (verl only)` | `actor_rollout_ref.model.external_lib` | `benchmarks.vs_verl_attention` |" in dry.stdout
    assert f"VERL_FILE_LOGGER_PATH={tmp_path}/compare/0.5b_verl_seed3/metrics.jsonl" in dry.stdout
    assert "data.seed=3" in dry.stdout and "-m \\\n    verl.trainer.main_ppo" in dry.stdout
    real = subprocess.run([sys.executable, script, "--seeds", "1", "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert real.returncode != 0 and f"missing: {tmp_path}/data/train.parquet" in real.stderr
    assert not (tmp_path / "compare").exists()


def test_the_recipe_reward_takes_verls_call():
    """verl 0.9.1's naive reward manager (experimental/reward_loop/reward_manager/naive.py) calls the custom
    function with keywords data_source, solution_str, ground_truth and extra_info (the row's, plus num_turns and
    rollout_reward_scores), and reads a dict's "score" and its other keys as extra info (the validation metrics)."""
    compute_score = load_extern_object(str(REPO / "recipes" / "gsm_symbolic_reward.py"), "compute_score")
    train, _ = make_train_test_rows("gsm_symbolic", 1, 1, seed=3, answer_format="hash")
    row = train[0]
    answer = row["reward_model"]["ground_truth"]
    call = {"data_source": row["data_source"], "solution_str": f"so #### {answer}", "ground_truth": answer,
            "extra_info": {**row["extra_info"], "num_turns": 2, "rollout_reward_scores": {}}}
    inspect.signature(compute_score).bind(**call)
    assert compute_score(**call) == {"score": 1.0, "acc": 1.0, "formatted": 1.0, "last_number_right": 1.0,
                                    "solved": 1.0, "answer_first": 0.0}
    assert row["data_source"] == load("seed_table").VERL_DATA_SOURCE  # verl names its val metrics by it


def verl_line(step: int, data: dict) -> dict:
    return {"step": step, "data": data}


def write_run(folder: Path, name: str, lines: list[dict], summary: dict) -> None:
    """A seed's run folder as compare.sh or verl_compare.py writes it and host_seeds.sh copies it back."""
    (folder / name).mkdir()
    (folder / name / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / name / "summary.json").write_text(json.dumps(summary))


def seed_table(folder: Path, variant: str, out: Path, *options: str) -> subprocess.CompletedProcess:
    """seed_table.py on the run folders in `folder`."""
    return subprocess.run([sys.executable, str(RECIPE / "seed_table.py"), str(folder), variant, *options, "--commit",
                           "c", "--date", "d", "--card", "none", "--command", "by hand", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


def val(source: str, held_out: float, acc: float) -> dict:
    """verl's validation metrics: `held_out` solved, 0.1 less with the last number right, `acc` in the format, a
    quarter of the answers opening with `#### N`."""
    return {f"val-aux/{source}/solved/mean@1": held_out, f"val-aux/{source}/last_number_right/mean@1": held_out - 0.1,
            f"val-core/{source}/acc/mean@1": acc, f"val-aux/{source}/formatted/mean@1": 1.0,
            f"val-aux/{source}/answer_first/mean@1": 0.25, f"val-aux/{source}/reward/mean@1": acc,
            "val-aux/num_turns/mean": 2.0}


def train(seconds: float, length: float) -> dict:
    return {"timing_s/step": seconds, "response_length/mean": length, "actor/perf/max_memory_allocated_gb": 40.0}


def test_seed_table_reads_verls_file_logger_into_the_held_out_table(tmp_path):
    """Two verl seeds as verl's file logger writes them (validation at step 0 alone, at step 2 in the step's line),
    by hand: held-out solved 0.2 / 0.4 at step 0 and 0.3 / 0.5 at step 2 -> means 0.3 and 0.4, sd 0.1414;
    training seconds to step 2: 10 + 12 and 20 + 22 -> 32 ± 14.1; the in-template columns verl does not log show
    as "-"."""
    source = "reasoning_gym/gsm_symbolic"
    for seed, (before, after, seconds) in {1: (0.2, 0.3, (10.0, 12.0)), 2: (0.4, 0.5, (20.0, 22.0))}.items():
        lines = [verl_line(0, val(source, before, 0.0)), verl_line(1, train(seconds[0], 250.0)),
                 verl_line(2, {**train(seconds[1], 240.0), **val(source, after, after)})]
        write_run(tmp_path, f"0.5b_verl_seed{seed}", lines, {"wall_s": 300.0, "returncode": 0})
    out = tmp_path / "table.json"
    result = seed_table(tmp_path, "verl", out, "--trainer", "verl")
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    table = record["table_mean_sd"]
    headline = table["eval/held_out/solved"]
    assert headline["0"]["per_seed"] == [0.2, 0.4] and headline["2"]["mean"] == pytest.approx(0.4)
    assert table["eval/held_out/last_number_right"]["2"]["mean"] == pytest.approx(0.3)
    assert headline["2"]["sd"] == pytest.approx(0.1414, abs=1e-4)
    assert table["eval/held_out/acc"]["2"]["per_seed"] == [0.3, 0.5]
    assert table["train_s_to_step"]["2"]["per_seed"] == [22.0, 42.0] and table["train_s_to_step"]["0"]["mean"] == 0
    assert "eval/in_template/acc" not in table and record["trainer"] == "verl"
    assert record["seeds"]["1"]["peak_memory_allocated_gib"] == 40.0
    assert record["seeds"]["2"]["validation"]["2"]["eval/held_out/answer_first"] == 0.25  # under the recipe's name
    assert "| 2 | 40.0 ± 14.1 (30.0, 50.0) | 30.0 ± 14.1 | 40.0 ± 14.1 | - | - | 32 ± 14 |" in result.stdout


def test_seed_table_reads_hybridrls_own_log_and_refuses_a_log_without_the_headline(tmp_path):
    """hybridrl's metrics.jsonl (the metrics themselves a line, both eval sets): every column filled, and the training
    seconds to step 2 beside them (one seed: sd 0). A seed of a run before `solved` was logged is refused by name."""
    sets = {"held_out": {"solved": (0.375, 0.625), "last_number_right": (0.25, 0.5), "acc": (0.125, 0.5)},
            "in_template": {"solved": (0.5, 0.875), "last_number_right": (0.5, 0.75), "acc": (0.125, 0.75)}}

    def evals(index: int) -> dict:
        return {f"eval/{name}/{metric}": values[index] for name, metrics in sets.items()
                for metric, values in metrics.items()}

    lines = [{"step": 0, **evals(0)}, {"step": 1, **train(7.0, 200.0)}, {"step": 2, **train(8.0, 210.0), **evals(1)}]
    write_run(tmp_path, "0.5b_vs_verl_seed1", lines, {"wall_s": 100.0})
    result = seed_table(tmp_path, "vs_verl", tmp_path / "t.json")
    assert result.returncode == 0, result.stderr
    assert "| 2 | 62.5 ± 0.0 (62.5) | 50.0 ± 0.0 | 50.0 ± 0.0 | 87.5 ± 0.0 | 75.0 ± 0.0 | 15 ± 0 |" in result.stdout
    record = json.loads((tmp_path / "t.json").read_text())
    assert record["trainer"] == "hybridrl" and record["table_mean_sd"]["eval/in_template/solved"]["0"]["mean"] == 0.5
    old = [{key: value for key, value in line.items() if not key.endswith("/solved")} for line in lines]
    write_run(tmp_path, "0.5b_vs_verl_seed2", old, {"wall_s": 100.0})
    result = seed_table(tmp_path, "vs_verl", tmp_path / "t.json")
    assert result.returncode != 0
    assert "0.5b_vs_verl_seed2/metrics.jsonl: no validation logged eval/held_out/solved" in result.stderr


def test_seed_table_refuses_a_seed_that_did_not_end_or_failed_or_validated_at_other_steps(tmp_path):
    """host_seeds.sh packs seeds still running when a lease ends: such a seed has no summary.json and is refused by
    name, as is a verl seed whose run failed, and seeds whose validations stop at different steps (the means would
    mix 2 seeds with 1). --cut-off keeps a seed without a summary for a record of what a lease ran, marked."""
    source = "reasoning_gym/gsm_symbolic"
    lines = [verl_line(0, val(source, 0.2, 0.0)), verl_line(1, train(10.0, 250.0)),
             verl_line(2, {**train(12.0, 240.0), **val(source, 0.3, 0.3)})]
    write_run(tmp_path, "0.5b_verl_seed1", lines, {"returncode": 0})
    write_run(tmp_path, "0.5b_verl_seed2", lines[:2], {"returncode": 0})
    summary = tmp_path / "0.5b_verl_seed2" / "summary.json"
    refusals = [(None, "0.5b_verl_seed2/summary.json: missing, so the run did not end"),
                ({"returncode": 1}, "0.5b_verl_seed2/summary.json: the run did not finish (returncode 1"),
                ({"returncode": 0}, "the seeds validated at different steps, so their means would mix: seed 1 at 0, "
                                    "2; seed 2 at 0")]
    for written, error in refusals:
        summary.unlink(missing_ok=True)
        if written is not None:
            summary.write_text(json.dumps(written))
        result = seed_table(tmp_path, "verl", tmp_path / "t.json", "--trainer", "verl")
        assert result.returncode != 0 and error in result.stderr, result.stderr
    assert not (tmp_path / "t.json").exists()
    # --cut-off keeps the seed without a summary, marked with the last step it trained (1), and the table holds the
    # validation every seed reached (step 0: 0.2 in both); a failed seed stays refused
    summary.unlink()
    result = seed_table(tmp_path, "verl", tmp_path / "t.json", "--trainer", "verl", "--cut-off")
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "t.json").read_text())
    assert record["cut_off_after_step"] == {"2": 1} and record["what"].endswith("cut off with the lease: seed 2 after "
                                                                                  "step 1")
    assert record["seeds"]["2"]["summary"] is None and record["seeds"]["1"]["summary"] == {"returncode": 0}
    assert list(record["table_mean_sd"]["eval/held_out/solved"]) == ["0"]
    summary.write_text(json.dumps({"returncode": 1}))
    result = seed_table(tmp_path, "verl", tmp_path / "t.json", "--trainer", "verl", "--cut-off")
    assert result.returncode != 0 and "the run did not finish (returncode 1" in result.stderr, result.stderr
    write_run(tmp_path, "0.5b_verl_seed3", lines, {"returncode": 0})  # with seed 2 moved out, the table is made
    (tmp_path / "0.5b_verl_seed2").rename(tmp_path / "cut_off")
    (tmp_path / "t.json").unlink()
    assert seed_table(tmp_path, "verl", tmp_path / "t.json", "--trainer", "verl").returncode == 0
    assert json.loads((tmp_path / "t.json").read_text())["cut_off_after_step"] == {}
