"""Check what a run reads and writes before Ray starts, so that a bad input fails in seconds and by name instead of
in a worker minutes later.

`check_paths(config)` runs the "paths" checks the subsystems registered (config/checks.py): every configured file
and model directory exists. `check_before_start(config)` runs them and the "preflight" checks, after
`validate_config` (keys and values) and after the embedded default assets are prepared. Either reports every
problem in one ConfigError, one `<key>: expected ..., got ...` line each. The preflight checks, beside their code:

  data       data/config_checks.py: each parquet file the run reads has a readable schema, rows, and the columns
             the dataset reads; the training files hold at least one batch; data/row_checks.py: every row's
             messages, and its prompt's length as the dataset renders it against data.max_prompt_length and the
             model's max_position_embeddings (measured in parallel, cached by file hash). The validation files and
             eval sets are not opened when the run never validates;
  models     models/config_checks.py: config.json parses, the weights are there and every safetensors file is
             complete (its header is read, never its tensors); the policy's tokenizer folder has its files and a
             chat template, and loads;
  reward     reward/config_checks.py: custom_reward_function.name names a function of custom_reward_function.path,
             the data holds the ground truth the reward manager reads, and every row's data_source has a scorer;
  rollout    tools/, interactions/ and agent_loop/config_checks.py: the tool and interaction YAMLs build; in async
             mode every agent-loop YAML entry's _target_ imports and the default loop is registered;
             workers/rollout/config_checks.py: a tensor-parallel engine's size divides the attention heads;
  resources  single_controller/config_checks.py: a local Ray has a CPU for every rank, and on CUDA a GPU;
  resume     trainer/resume_checks.py: the checkpoint trainer.resume_mode picks is of this model, complete, and
             of this batch layout;
  run dir    trainer/config_checks.py: trainer.default_local_dir can be created and written (test-written here).

`check_before_start` returns the "warnings" that do not stop the run (trainer/config_checks.py: the free disk
space under default_local_dir against one checkpoint and against all the checkpoints the run keeps, a batch layout
change accepted by trainer.resume_accept_layout_change; data/row_checks.py: prompts truncated or dropped, empty
messages).
"""
from __future__ import annotations

from hybridrl.config.checks import registered_checks
from hybridrl.config.schema import PPOConfig
from hybridrl.config.validation import ConfigError


def check_paths(config: PPOConfig) -> None:
    """Raise ConfigError naming every configured file or directory that is missing or of the wrong kind."""
    problems = _problems(config, "paths")
    if problems:
        raise ConfigError(problems)


def check_before_start(config: PPOConfig) -> list[str]:
    """Raise ConfigError listing every problem found (see the module docstring); return the warnings."""
    problems = _problems(config, "paths") + _problems(config, "preflight")
    if problems:
        raise ConfigError(problems)
    return [warning for check in registered_checks("warnings") for warning in check(config)]


def _problems(config: PPOConfig, stage: str) -> list[str]:
    problems: list[str] = []
    for check in registered_checks(stage):
        check(config, problems)
    return problems
