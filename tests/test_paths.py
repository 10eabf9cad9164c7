"""Issue 64, item 2: every path key expands `~` and environment variables, once, in validation; the README's usage
example runs as written, `~` unquoted after `key=` included (bash leaves it to us, Hydra's lexer refused it)."""
import os
import re
import shutil
import subprocess
import sys


from hybridrl.config import compose_config, validate_config
from hybridrl.config.compose import quote_home_paths
from hybridrl.config.schema import PPOConfig
from hybridrl.config.structure import schema_key_paths
from hybridrl.config.validation import NOT_IMPLEMENTED, PATH_KEYS
from hybridrl.data.rl_parquet import write_rl_parquet
from tests.test_main_ppo import REPO_ROOT
from tests.test_preflight import inputs, rows  # noqa: F401  (inputs is a fixture)

# schema keys that name no file (a module, a Jinja template) or are pinned to null
NOT_PATHS = {"actor_rollout_ref.model.external_lib", "critic.model.external_lib", "reward_model.model.external_lib",
             "actor_rollout_ref.model.custom_chat_template"}


def test_every_path_like_key_of_the_schema_is_expanded():
    path_like = {key for key in schema_key_paths(PPOConfig)
                 if re.search(r"(path|_dir|_files|tokenizer|_file)$", key) and key not in NOT_IMPLEMENTED}
    listed = {key.replace("[*]", "") for key in PATH_KEYS}
    assert path_like - NOT_PATHS <= listed
    assert listed <= path_like | {"cache_dir", "extensions", "data.eval_sets.path"}


def test_tilde_and_variables_expand_in_every_kind_of_path_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DATA", "/data/root")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "ext.py").write_text("")  # extensions are imported by validation
    config = validate_config(compose_config(quote_home_paths([  # as the CLI hands them to Hydra
        "data.train_files=[~/a.parquet,$DATA/b.parquet]", "data.val_files='${oc.env:DATA}/v.parquet'",
        "actor_rollout_ref.model.path=~/models/m", "custom_reward_function.path=$DATA/reward.py",
        "trainer.default_local_dir=~/run", "trainer.resume_mode=resume_path",
        "trainer.resume_from_path=~/run/global_step_2",
        "+data.eval_sets=[{name: e, path: [~/e1.parquet, $DATA/e2.parquet]}]", "extensions=[~/ext.py,json]"])))
    home = str(tmp_path / "home")
    assert config.data.train_files == [f"{home}/a.parquet", "/data/root/b.parquet"]
    assert config.data.val_files == ["/data/root/v.parquet"]
    assert config.actor_rollout_ref.model.path == f"{home}/models/m"
    assert config.critic.model.path == f"{home}/models/m"  # an interpolation of the expanded key
    assert config.custom_reward_function.path == "/data/root/reward.py"
    assert config.trainer.default_local_dir == f"{home}/run"
    assert config.trainer.resume_from_path == f"{home}/run/global_step_2"
    assert config.data.eval_sets[0]["path"] == [f"{home}/e1.parquet", "/data/root/e2.parquet"]
    assert config.extensions == [f"{home}/ext.py", "json"]


def test_the_cli_quotes_tilde_values_for_hydra_and_leaves_the_rest():
    assert quote_home_paths(["data.train_files=~/d/t.parquet", "~trainer.logger", "x=[~/a, ~/b,c]", "y='~/q'",
                             "--config-dir=~/c", "z=a~b"]) == [
        "data.train_files='~/d/t.parquet'", "~trainer.logger", "x=['~/a', '~/b',c]", "y='~/q'", "--config-dir=~/c",
        "z=a~b"]


def readme_usage_command() -> list[str]:
    """The README's first usage example, as bash would split it (no quotes in it but the logger's)."""
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        text = f.read()
    block = text.split("# GRPO on your own parquet data and model (verl's layout and key names)\n", 1)[1]
    command = block.split("\n\n", 1)[0].replace("\\\n", " ")
    words = command.split()
    assert words[:3] == ["python", "-m", "hybridrl.main_ppo"]
    return [word.replace("'", "") for word in words[3:]]  # trainer.logger='[console,tensorboard]' as bash passes it


def test_the_readme_usage_example_runs_as_written(inputs, tmp_path):
    """HOME holds the README's files (a tiny model under the README's model name, data of a source with a scorer).
    Before: a Hydra lexer error at `~`; quoted, "no such file". Now every file is found and checked (rows included)
    and the one problem left is the README's 8 GPUs for a local Ray of 2 CPUs (pinned: ray_init.num_cpus=2),
    reported before Ray starts."""
    home = tmp_path / "home"
    for name in ("train", "test"):
        gsm8k_rows = [{**row, "data_source": "openai/gsm8k"} for row in rows(16)]
        write_rl_parquet(gsm8k_rows, str(home / "data" / "gsm8k" / f"{name}.parquet"))
    shutil.copytree(inputs["model"], home / "models" / "Qwen2.5-0.5B-Instruct")
    no_ray = tmp_path / "no_ray"
    (no_ray / "ray").mkdir(parents=True)
    (no_ray / "ray" / "__init__.py").write_text('raise ImportError("this test forbids importing ray")\n')
    args = readme_usage_command()
    assert "data.train_files=~/data/gsm8k/train.parquet" in args
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": f"{no_ray}{os.pathsep}{REPO_ROOT}"}
    env.pop("HYDRA_FULL_ERROR", None)
    command = [sys.executable, "-m", "hybridrl.main_ppo", *args, "ray_init.num_cpus=2"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("config error: trainer.n_gpus_per_node: expected at most ") and line.endswith(
        "got trainer.nnodes * trainer.n_gpus_per_node = 1 * 8 = 8"), line
