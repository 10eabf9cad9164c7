"""Validate a composed config once, before Ray starts, and report every problem in one error.

`validate_config(cfg)` runs, in order:
  1. resolve interpolations, expand `~` and environment variables in the path keys (PATH_KEYS), copy each verl
     name's value to the key it names (ALIASES), and check every key against `schema.py` (unknown keys, types,
     ranges);
  2. import `extensions`, so the names they register count in step 3;
  3. keys pinned by the tables below (not implemented, deprecated, set elsewhere, same as another key);
  4. names chosen from a registry (estimators, losses, rollouts, reward managers: checks.REGISTRIES);
  5. every rule across keys the subsystems registered (checks.py; hybridrl/checks.py imports them all).
Each problem is one line `<full.key.path>: expected <...>, got <value>`; `ConfigError.problems`
holds them all. Files are checked separately by `check_paths` (preflight.py), because the embedded default
data and model are written after validation and before that check.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from omegaconf import DictConfig

from hybridrl.config.checks import REGISTRIES, Values, critic_enabled, registered_checks, run_rule
from hybridrl.config.schema import PPOConfig
from hybridrl.config.structure import INVALID, build, check_structure, to_plain
from hybridrl.utils.import_utils import load_extensions

# Keys the YAML accepts (so verl override lists compose) but hybridrl does not implement yet:
# any value other than the one given here is refused. Remove an entry when its feature lands.
NOT_IMPLEMENTED: dict[str, Any] = {
    "actor_rollout_ref.model.enable_activation_offload": False,
    "actor_rollout_ref.actor.use_torch_compile": False,
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
    "actor_rollout_ref.ref.fsdp_config.use_torch_compile": False,
    "critic.model.fsdp_config.use_torch_compile": False,
    # chunked prefill: the vllm and sglang engines run with it on (their default).
    "actor_rollout_ref.rollout.enable_chunked_prefill": True,
    "reward_model.launch_reward_fn_async": False,
    # The reward model scores padded rows (micro-batches of rows or of a token budget), never packed ones.
    "reward_model.model.use_remove_padding": False,
    "algorithm.use_pf_ppo": False,
    "trainer.default_hdfs_dir": None,
    "trainer.del_local_ckpt_after_load": False,
    "ray_init.timeline_json_file": None,
    # verl's unpadded prompt ids (raw_prompt_ids): nothing here reads them; the reward model re-tokenises raw_prompt.
    "data.return_raw_input_ids": False,
    # vLLM's stats logging switch; the hf and sglang rollouts have no per-request stats logger to turn on.
    "actor_rollout_ref.rollout.disable_log_stats": True,
    # Hybrid sharding (shard within groups of fsdp_size, replicate across): every model is fully sharded.
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": -1,
    "critic.model.fsdp_config.fsdp_size": -1,
    "reward_model.model.fsdp_config.fsdp_size": -1,
    # Size-based FSDP units: units are always the decoder layers (HF's _no_split_modules).
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params": 0,
    "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params": 0,
    "critic.model.fsdp_config.wrap_policy.min_num_params": 0,
    "reward_model.model.fsdp_config.wrap_policy.min_num_params": 0,
    # verl's save-before-the-ESI-instance-expires timer (a cloud-specific scheduler).
    "trainer.esi_redundant_time": 0,
    # verl's bypass mode (rollout log-probs used as old_log_probs) and its plain policy-gradient loss.
    "algorithm.rollout_correction.bypass_mode": False,
    "algorithm.rollout_correction.use_policy_gradient": False,
    # verl's switch to render multi-turn ids with the inference template (which drops earlier turns' thinking):
    # the agent loops here render every turn with the one template the run trains with.
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template": False,
    # verl's repeats of one interaction rollout: rollout.n repeats each prompt here.
    "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts": None,
    # verl's over-sampling that aborts a batch's last requests: data_flow.over_sampling_batch_size over-samples here.
    "actor_rollout_ref.rollout.over_sample_rate": 0,
}


# Values of otherwise implemented keys that are not implemented yet.
NOT_IMPLEMENTED_VALUES: dict[str, tuple] = {}


# verl keys kept only so old override lists compose: they must stay null.
DEPRECATED: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu",
}


# Keys whose value comes from elsewhere: key -> (the only accepted value, what to set instead).
SET_ELSEWHERE: dict[str, tuple[Any, str]] = {
    # The trainer passes the run length to the workers that build LR schedules.
    "actor_rollout_ref.actor.optim.total_training_steps": (-1, "trainer.total_training_steps"),
    "critic.optim.total_training_steps": (-1, "trainer.total_training_steps"),
}


# verl's names for one of our keys: verl key -> (our key, our key's default). A verl key that is set (not null, or
# present in a free dict) gives its value to our key while ours holds its default; both set to different values is
# refused, naming both. Nothing reads the verl key itself.
ALIASES: dict[str, tuple[str, Any]] = {
    # verl's DAPO prompts per generation batch: the data flow's groups requested at a time
    "data.gen_batch_size": ("data_flow.over_sampling_batch_size", None),
    # verl's place of the weight-sync bucket size
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        ("actor_rollout_ref.rollout.update_weights_bucket_megabytes", 512),
    # verl's DAPO manager argument (reward_model.reward_kwargs, passed to the manager as verl does)
    **{f"reward_model.reward_kwargs.overlong_buffer_cfg.{key}": (f"reward_model.overlong_buffer.{key}", default)
       for key, default in (("enable", False), ("len", 0), ("penalty_factor", 0.0), ("log", False))},
}


# Keys that must equal another key: the critic reads the policy's token ids, so it has no tokenizer of its own.
SAME_AS: dict[str, str] = {
    "critic.model.tokenizer_path": "actor_rollout_ref.model.path",
}


# Keys that name files or directories: `~` and `$VAR` / `${VAR}` in them are expanded once, here, as a shell would,
# so every later reader (checks, workers on other nodes) sees the one absolute-or-relative path. `[*]` is each entry
# of a list; `.path` under `eval_sets[*]` may itself be one path or a list. extensions hold module names or .py files
# (a module name has neither `~` nor `$`). An unset variable stays as written, and the file check names that path.
DATA_FLOW_HOOKS = ("rollout_function", "eval_function", "custom_generate_function", "dynamic_sampling_filter",
                   "over_sampling_filter", "buffer_filter", "reward_function")
PATH_KEYS: tuple[str, ...] = (
    "cache_dir", "extensions[*]",
    "data.tokenizer", "data.train_files[*]", "data.val_files[*]", "data.eval_sets[*].path", "data.custom_cls.path",
    "actor_rollout_ref.model.path", "actor_rollout_ref.model.lora_adapter_path",
    "actor_rollout_ref.rollout.custom_cls.path", "actor_rollout_ref.rollout.agent.agent_loop_config_path",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
    "critic.model.path", "critic.model.tokenizer_path",
    "reward_model.model.path", "reward_model.model.input_tokenizer",
    "custom_reward_function.path",
    "trainer.default_local_dir", "trainer.resume_from_path", "trainer.rollout_data_dir",
    "trainer.validation_data_dir",
    *(f"data_flow.{hook}.path" for hook in DATA_FLOW_HOOKS),
)


class ConfigError(ValueError):
    """Every problem found in a config; `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{len(self.problems)} config problem(s):\n" + "\n".join(self.problems))


def validate_config(cfg: DictConfig) -> PPOConfig:
    """The typed config, or ConfigError listing every problem (see the module docstring)."""
    rules = registered_checks("config")
    problems: list[str] = []
    interpolations: dict[str, str] = {}
    plain = to_plain(cfg, "", problems, interpolations)
    for key in PATH_KEYS:
        _expand_path_key(plain, key.split("."))
    for verl_key, (key, default) in ALIASES.items():
        _apply_alias(plain, verl_key, key, default, problems, interpolations)
    checked = check_structure(PPOConfig, plain, "", problems)
    values = Values(checked)
    for rule in (_load_extensions, _not_implemented, _registered_names, *rules):
        run_rule(rule, values, problems)
    if problems:
        raise ConfigError([_with_origin(problem, interpolations) for problem in problems])
    checked["critic"]["enable"] = critic_enabled(values)
    return build(PPOConfig, checked)


def _expand_path_key(node: Any, parts: list[str]) -> None:
    """Expand the path(s) at the dotted `parts` under `node` in place; a missing or mistyped key is left for the
    schema check to report."""
    name, rest = parts[0], parts[1:]
    each = name.endswith("[*]")
    name = name.removesuffix("[*]")
    if not isinstance(node, dict) or name not in node:
        return
    if each and isinstance(node[name], list):
        for index, entry in enumerate(node[name]):
            if rest:
                _expand_path_key(entry, rest)
            else:
                node[name][index] = _expand_path(entry)
    elif rest:
        _expand_path_key(node[name], rest)
    elif isinstance(node[name], list):  # eval_sets[*].path: one path or a list of them
        node[name] = [_expand_path(entry) for entry in node[name]]
    else:
        node[name] = _expand_path(node[name])


def _expand_path(value: Any) -> Any:
    return os.path.expanduser(os.path.expandvars(value)) if isinstance(value, str) else value


_MISSING = object()


def _apply_alias(plain: dict, verl_key: str, key: str, default: Any, problems: list[str],
                 origins: dict[str, str]) -> None:
    """Copy verl's value at `verl_key` to `key` while `key` holds its default (later problems about `key` then name
    `verl_key` as the value's origin); refuse two different values. A missing key is left for the schema check."""
    verl_value, value = _lookup(plain, verl_key), _lookup(plain, key)
    if verl_value in (None, _MISSING, INVALID) or value in (_MISSING, INVALID) or verl_value == value:
        return
    if value != default:
        problems.append(f"{verl_key}: expected null or the value of {key} = {value!r} (verl's name for the same "
                        f"setting), got {verl_value!r}")
        return
    parent, _, name = key.rpartition(".")
    _lookup(plain, parent)[name] = verl_value
    origins[key] = verl_key


def _lookup(plain: dict, key: str) -> Any:
    """The value at the dotted `key` of the plain tree, or _MISSING."""
    node: Any = plain
    for name in key.split("."):
        if not isinstance(node, dict) or name not in node:
            return _MISSING
        node = node[name]
    return node


def _with_origin(problem: str, interpolations: dict[str, str]) -> str:
    """A problem about an interpolated key also names the key its value came from."""
    origin = interpolations.get(problem.split(":", 1)[0])
    return f"{problem} (value from {origin})" if origin and origin not in problem else problem


def _load_extensions(values: Values, problems: list[str]) -> None:
    for index, spec in enumerate(values("extensions")):
        try:
            load_extensions([spec])
        except Exception as err:  # any failure while importing user code is a config problem
            problems.append(f"extensions[{index}]: expected an importable module name or an existing .py file, "
                            f"got {spec!r} ({type(err).__name__}: {err})")


def _not_implemented(values: Values, problems: list[str]) -> None:
    for key, supported in NOT_IMPLEMENTED.items():
        run_rule(lambda v, p: _require_value(key, supported, v(key), p), values, problems)
    for key, refused in NOT_IMPLEMENTED_VALUES.items():
        run_rule(lambda v, p: _refuse_values(key, refused, v(key), p), values, problems)
    for key, replacement in DEPRECATED.items():
        run_rule(lambda v, p: _require_null(key, replacement, v(key), p), values, problems)
    for key, (only_value, instead) in SET_ELSEWHERE.items():
        run_rule(lambda v, p: _require_unset(key, only_value, instead, v(key), p), values, problems)
    for key, other in SAME_AS.items():
        run_rule(lambda v, p: _require_same(key, other, v(key), v(other), p), values, problems)


def _require_value(key: str, supported: Any, value: Any, problems: list[str]) -> None:
    if value != supported:
        problems.append(f"{key}: expected {supported!r} (other values are not implemented yet), got {value!r}")


def _refuse_values(key: str, refused: tuple, value: Any, problems: list[str]) -> None:
    if value in refused:
        problems.append(f"{key}: expected a value other than {', '.join(map(repr, refused))} "
                        f"(not implemented yet), got {value!r}")


def _require_null(key: str, replacement: str, value: Any, problems: list[str]) -> None:
    if value is not None:
        problems.append(f"{key}: expected null (deprecated, set {replacement} instead), got {value!r}")


def _require_unset(key: str, only_value: Any, instead: str, value: Any, problems: list[str]) -> None:
    if value != only_value:
        problems.append(f"{key}: expected {only_value!r} (set {instead} instead), got {value!r}")


def _require_same(key: str, other: str, value: Any, other_value: Any, problems: list[str]) -> None:
    if value != other_value:
        problems.append(f"{key}: expected the value of {other} = {other_value!r} (a different one is not "
                        f"implemented), got {value!r}")


def _registered_names(values: Values, problems: list[str]) -> None:
    for key, lookup in REGISTRIES.items():
        run_rule(lambda v, p: _check_registered(key, v(key), lookup, p), values, problems)


def _check_registered(key: str, name: str, lookup: Callable[[str], Any], problems: list[str]) -> None:
    try:
        lookup(name)
    except (ValueError, KeyError) as err:
        problems.append(f"{key}: expected a registered name, got {name!r} ({err})")
