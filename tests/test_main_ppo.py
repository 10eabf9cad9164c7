"""`python -m hybridrl.main_ppo` as a user runs it: --cfg job, a user's YAML, and one-line config errors.

Each case is a real subprocess (a few seconds each), so there are few of them; everything that the
compose API can show is tested in test_config_*.py instead.
"""
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from hybridrl.config import compose_config
from tests.test_config_compose import USER_YAML
from tests.test_preflight import copy_model, empty_parquet, inputs  # noqa: F401 (inputs is a fixture)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_main(args: list[str], cwd, path_first: str | None = None) -> subprocess.CompletedProcess:
    """main_ppo in a subprocess; `path_first`: a folder put before the repository on its PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path_first, REPO_ROOT]))}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "hybridrl.main_ppo", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)  # 42 s seen at load 20


def test_cfg_job_prints_the_composed_config_and_starts_nothing(tmp_path):
    overrides = ["algorithm=gae", "data.train_batch_size=32", "+trainer.note=x"]
    result = run_main(["--cfg", "job", *overrides], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.to_container(OmegaConf.create(result.stdout))
    assert printed == OmegaConf.to_container(compose_config(overrides))
    assert printed["data"]["train_batch_size"] == 32 and printed["algorithm"]["adv_estimator"] == "gae"
    assert os.listdir(tmp_path) == []  # no Hydra run directory: the job itself never ran


def test_plus_on_a_key_we_define_overrides_it_on_the_command_line(tmp_path):
    """verl's `+key=value` for a key verl's YAML lacks and ours has: an override here (a new key: still an append)."""
    overrides = ["+reward_model.overlong_buffer.enable=True", "+reward_model.overlong_buffer.len=4", "+trainer.note=x"]
    result = run_main(["--cfg", "job", *overrides], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.create(result.stdout)
    assert (printed.reward_model.overlong_buffer.enable, printed.reward_model.overlong_buffer.len) == (True, 4)
    assert printed.trainer.note == "x"


def test_the_entry_point_imports_no_torch_before_a_run_starts():
    """--cfg job and config errors answer in about a second: torch (and Ray) load only once a run starts."""
    probe = "import sys, hybridrl.main_ppo; print(sorted({'torch', 'ray', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert (result.returncode, result.stdout) == (0, "[]\n"), result.stderr


@pytest.mark.parametrize("flag", ["--config-path", "--config-dir"])
def test_user_yaml_extends_ours(tmp_path, flag):
    user_dir = tmp_path / "my_configs"
    user_dir.mkdir()
    if flag == "--config-path":  # replaces our config dir: the YAML names it in hydra.searchpath (absolute path)
        (user_dir / "my_run.yaml").write_text(USER_YAML)
        location = str(user_dir)
    else:  # adds a dir next to ours: no searchpath needed, relative to the current directory
        (user_dir / "my_run.yaml").write_text("defaults:" + USER_YAML.split("defaults:")[1])
        location = "my_configs"
    result = run_main([flag, location, "--config-name", "my_run", "--cfg", "job", "trainer.nnodes=3"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.create(result.stdout)
    assert printed.data.train_batch_size == 32
    assert printed.actor_rollout_ref.actor.optim.lr == 2e-6
    assert printed.algorithm.adv_estimator == "gae"
    assert printed.trainer.nnodes == 3
    assert printed.actor_rollout_ref.rollout.name == "hf" and "hydra" not in printed


@pytest.mark.parametrize("override, message", [
    ("data.train_batch_sise=3",
     "config error: data.train_batch_sise: expected a key of the config, got unknown key 'data.train_batch_sise' "
     "(did you mean data.train_batch_size?); to add a new key write +data.train_batch_sise=3"),
    ("algorithm=ppo", "config error: algorithm: expected one of gae, grpo, got 'ppo'"),
    ("trainer.logger=[console", "config error: trainer.logger: expected an override in Hydra's syntax (key=value), "
                                "got 'trainer.logger=[console' (no viable alternative at input '[console')"),
], ids=["unknown-key", "unknown-group-choice", "unparsable"])
def test_bad_override_exits_2_with_one_line(tmp_path, override, message):
    result = run_main([override], cwd=tmp_path)
    assert (result.returncode, result.stdout, result.stderr.splitlines()) == (2, "", [message])


def test_validation_problems_exit_2_with_one_line_each(tmp_path):
    result = run_main(["data.train_batch_size=12", "actor_rollout_ref.actor.clip_ratio_c=0.5"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "config error: actor_rollout_ref.actor.clip_ratio_c: expected > 1, got 0.5",
        "config error: data.train_batch_size: expected a multiple of actor_rollout_ref.actor.ppo_mini_batch_size = 8 "
        "(both count prompts), got 12",
    ]


def test_bad_inputs_exit_2_before_ray_starts_naming_each(inputs, tmp_path):
    """Issue 19: an empty parquet, a wrong reward function name, truncated weights and an unwritable run directory
    used to surface one at a time, after Ray and the workers had started; now all at once, no Ray. "No Ray" is
    checked as such, rather than as a time a loaded machine could stretch: the driver runs with a `ray` package
    that refuses to be imported, and its output is still exactly the five lines."""
    no_ray = tmp_path / "no_ray"
    (no_ray / "ray").mkdir(parents=True)
    (no_ray / "ray" / "__init__.py").write_text('raise ImportError("this test forbids importing ray")\n')
    empty = empty_parquet(inputs, tmp_path / "empty.parquet")
    model = copy_model(inputs, tmp_path / "model")
    weights = os.path.join(model, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    result = run_main([f"actor_rollout_ref.model.path={model}", f"data.train_files={empty}",
                       f"data.val_files={inputs['val']}", f"custom_reward_function.path={inputs['reward']}",
                       "custom_reward_function.name=letter_b", "trainer.device=cpu",
                       f"trainer.default_local_dir={blocker / 'run'}"], cwd=tmp_path, path_first=str(no_ray))
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.splitlines() == [
        f"config error: data.train_files[0]: expected a parquet file with rows, got '{empty}' (0 rows)",
        f"config error: data.train_files: expected at least data.train_batch_size=16 rows in all (one training "
        f"batch), got 0 ({empty}: 0)",
        f"config error: actor_rollout_ref.model.path: expected complete safetensors weights, got '{weights}' "
        f"(model.safetensors is {size // 2} bytes, its header describes {size} (truncated or damaged))",
        f"config error: custom_reward_function.name: expected a function defined in custom_reward_function.path, got "
        f"'letter_b' ({inputs['reward']} defines no 'letter_b'; names it defines: ['letter_a', 'threshold'])",
        f"config error: trainer.default_local_dir: expected a directory this process can create and write "
        f"(checkpoints, metrics and summary.json go there), got '{blocker / 'run'}' ([Errno 20] Not a directory: "
        f"'{blocker / 'run'}')",
    ]
