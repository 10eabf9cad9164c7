"""Validate a composed config once, before Ray starts, and report every problem in one error.

`validate_config(cfg)` runs, in order:
  1. resolve interpolations and check every key against `schema.py` (unknown keys, types, ranges);
  2. import `extensions`, so the names they register count in step 3;
  3. rules across keys: not-implemented keys, registered names (estimators, losses, rollouts,
     reward managers, loggers), engine availability, and batch sizes that must divide.
Each problem is one line `<full.key.path>: expected <...>, got <value>`; `ConfigError.problems`
holds them all. Files are checked separately by `check_paths`, because the embedded default
data and model are written after validation and before that check.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from typing import Any, Callable

from omegaconf import DictConfig

from hybridrl.config.schema import PPOConfig
from hybridrl.config.structure import INVALID, build, check_structure, to_plain
from hybridrl.utils.import_utils import load_extensions

# Keys the YAML accepts (so verl override lists compose) but hybridrl does not implement yet:
# any value other than the one given here is refused. Remove an entry when its feature lands.
NOT_IMPLEMENTED: dict[str, Any] = {
    "actor_rollout_ref.model.enable_activation_offload": False,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.actor.use_torch_compile": False,
    "reward_model.launch_reward_fn_async": False,
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

# Keys that must equal another key: the critic reads the policy's token ids, so it has no tokenizer of its own.
SAME_AS: dict[str, str] = {
    "critic.model.tokenizer_path": "actor_rollout_ref.model.path",
}


def _registry_lookup(module_name: str, getter_name: str) -> Callable[[str], Any]:
    """The registry getter `module_name.getter_name`, imported only when a config is checked."""
    return lambda name: getattr(importlib.import_module(module_name), getter_name)(name)


def _known_rollout(name: str) -> None:
    """Like get_rollout_class, minus importing the engine (sglang, vllm) into the driver process:
    whether the engine can run here is `_engine_available`'s question."""
    from hybridrl.workers.rollout import BUILTIN_ROLLOUT_MODULES, ROLLOUT_REGISTRY

    known = set(ROLLOUT_REGISTRY) | set(BUILTIN_ROLLOUT_MODULES)
    if name not in known:
        raise ValueError(f"rollout.name={name!r} is not a registered rollout; known: {sorted(known)}")


# Names chosen from a registry: key -> lookup that raises for an unknown name, its message listing
# the registered ones. Extensions register more names before this check runs.
REGISTRIES: dict[str, Callable[[str], Any]] = {
    "algorithm.adv_estimator": _registry_lookup("hybridrl.algorithms.core_algos", "get_adv_estimator_fn"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": _registry_lookup("hybridrl.algorithms.core_algos",
                                                                      "get_policy_loss_fn"),
    "actor_rollout_ref.rollout.name": _known_rollout,
    "reward_model.reward_manager": _registry_lookup("hybridrl.reward.managers.registry",
                                                    "get_reward_manager_cls"),
}

INSTALL_GPU_EXTRAS = "pip install -e '.[gpu]'"
# Rollout engines that need a CUDA GPU: name -> how to install the package of the same name.
GPU_ENGINES = {"sglang": INSTALL_GPU_EXTRAS,
               "vllm": "pip install -e '.[vllm]'; offline GPU host: scripts/gpu/install_vllm.sh"}


class ConfigError(ValueError):
    """Every problem found in a config; `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{len(self.problems)} config problem(s):\n" + "\n".join(self.problems))


class _Skip(Exception):
    """A rule touched a value that is missing or already reported as wrong: the rule does not apply."""


class _Values:
    """Dotted-path reads of the checked tree; reading an invalid value skips the rule that asked."""

    def __init__(self, tree: Any):
        self._tree = tree

    def __call__(self, path: str) -> Any:
        node = self._tree
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                raise _Skip(path)
            node = node[key]
        if node is INVALID:
            raise _Skip(path)
        return node


def validate_config(cfg: DictConfig) -> PPOConfig:
    """The typed config, or ConfigError listing every problem (see the module docstring)."""
    problems: list[str] = []
    interpolations: dict[str, str] = {}
    checked = check_structure(PPOConfig, to_plain(cfg, "", problems, interpolations), "", problems)
    values = _Values(checked)
    _run_rule(_load_extensions, values, problems)
    for rule in RULES:
        _run_rule(rule, values, problems)
    if problems:
        raise ConfigError([_with_origin(problem, interpolations) for problem in problems])
    checked["critic"]["enable"] = _critic_enabled(values)
    return build(PPOConfig, checked)


def _with_origin(problem: str, interpolations: dict[str, str]) -> str:
    """A problem about an interpolated key also names the key its value came from."""
    origin = interpolations.get(problem.split(":", 1)[0])
    return f"{problem} (value from {origin})" if origin and origin not in problem else problem


def _critic_enabled(values: Callable[[str], Any]) -> bool:
    """`critic.enable`, where null means: on exactly when the advantage estimator is GAE (it needs values)."""
    enable = values("critic.enable")
    return values("algorithm.adv_estimator") == "gae" if enable is None else enable


def _run_rule(rule: Callable, values: _Values, problems: list[str]) -> None:
    try:
        rule(values, problems)
    except _Skip:
        pass


def _load_extensions(values: _Values, problems: list[str]) -> None:
    for index, spec in enumerate(values("extensions")):
        try:
            load_extensions([spec])
        except Exception as err:  # any failure while importing user code is a config problem
            problems.append(f"extensions[{index}]: expected an importable module name or an existing .py file, "
                            f"got {spec!r} ({type(err).__name__}: {err})")


# ---- rules across keys ----

def _not_implemented(values: _Values, problems: list[str]) -> None:
    for key, supported in NOT_IMPLEMENTED.items():
        _run_rule(lambda v, p: _require_value(key, supported, v(key), p), values, problems)
    for key, refused in NOT_IMPLEMENTED_VALUES.items():
        _run_rule(lambda v, p: _refuse_values(key, refused, v(key), p), values, problems)
    for key, replacement in DEPRECATED.items():
        _run_rule(lambda v, p: _require_null(key, replacement, v(key), p), values, problems)
    for key, (only_value, instead) in SET_ELSEWHERE.items():
        _run_rule(lambda v, p: _require_unset(key, only_value, instead, v(key), p), values, problems)
    for key, other in SAME_AS.items():
        _run_rule(lambda v, p: _require_same(key, other, v(key), v(other), p), values, problems)


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


def _registered_names(values: _Values, problems: list[str]) -> None:
    for key, lookup in REGISTRIES.items():
        _run_rule(lambda v, p: _check_registered(key, v(key), lookup, p), values, problems)
    _run_rule(_check_loggers, values, problems)


def _check_registered(key: str, name: str, lookup: Callable[[str], Any], problems: list[str]) -> None:
    try:
        lookup(name)
    except (ValueError, KeyError) as err:
        problems.append(f"{key}: expected a registered name, got {name!r} ({err})")


def _check_loggers(values: _Values, problems: list[str]) -> None:
    from hybridrl.trainer.tracking import VALID_LOGGERS

    loggers = values("trainer.logger")
    for index, logger in enumerate(loggers):
        if logger not in VALID_LOGGERS:
            problems.append(f"trainer.logger[{index}]: expected one of {sorted(VALID_LOGGERS)}, got {logger!r}")


def _engine_available(values: _Values, problems: list[str]) -> None:
    """sglang / vllm must be importable; CUDA is required up front only for a local Ray, because a driver
    joining a cluster (`ray_init.address`) may itself have no GPU (the trainer then checks the cluster)."""
    device, rollout = values("trainer.device"), values("actor_rollout_ref.rollout.name")
    if rollout in GPU_ENGINES and importlib.util.find_spec(rollout) is None:
        problems.append(f"actor_rollout_ref.rollout.name: expected a rollout whose engine is installed, got "
                        f"{rollout!r} (the {rollout} package is not importable: {GPU_ENGINES[rollout]})")
    if values("ray_init.address") is not None:
        return
    if device == "cuda" and not _cuda_available():
        problems.append("trainer.device: expected 'cpu' or 'auto' on this machine (torch sees no CUDA GPU), "
                        "got 'cuda'")
    if rollout in GPU_ENGINES and (device == "cpu" or not _cuda_available()):
        problems.append(f"actor_rollout_ref.rollout.name: expected 'hf' without a GPU (trainer.device={device!r}, "
                        f"CUDA available: {_cuda_available()}), got {rollout!r} ({rollout} needs a CUDA GPU)")


def _cuda_available() -> bool:
    import torch  # imported only when a rule needs it: torch takes seconds to import

    return torch.cuda.is_available()


def _critic_matches_estimator(values: _Values, problems: list[str]) -> None:
    estimator = values("algorithm.adv_estimator")
    if estimator == "gae" and values("critic.enable") is False:
        problems.append("critic.enable: expected true or null when algorithm.adv_estimator='gae' "
                        "(GAE needs the critic's values), got False")


def _resume_path_given(values: _Values, problems: list[str]) -> None:
    if values("trainer.resume_mode") == "resume_path" and values("trainer.resume_from_path") is None:
        problems.append("trainer.resume_from_path: expected a checkpoint directory when "
                        "trainer.resume_mode='resume_path', got None")


def _local_ray_keys_only_for_a_local_ray(values: _Values, problems: list[str]) -> None:
    """The keys of the Ray cluster the driver starts itself (single_controller/local_cluster.py) mean nothing to a
    running cluster (`ray_init.address`): refused there, not silently ignored."""
    address = values("ray_init.address")
    if address is None:
        return
    num_cpus = values("ray_init.num_cpus")
    if num_cpus is not None:
        problems.append(f"ray_init.num_cpus: expected null when ray_init.address is set (a running cluster "
                        f"declares its own CPUs), got {num_cpus}")
    node_ip_address = values("ray_init.node_ip_address")
    if node_ip_address is not None:
        problems.append(f"ray_init.node_ip_address: expected null when ray_init.address is set (the nodes of a "
                        f"running cluster have their own addresses), got {node_ip_address!r}")
    if values("ray_init.include_dashboard"):
        problems.append("ray_init.include_dashboard: expected false when ray_init.address is set (a running "
                        "cluster has its own dashboard or none), got True")
    start_timeout_s = values("ray_init.start_timeout_s")
    if start_timeout_s is not None:
        problems.append(f"ray_init.start_timeout_s: expected null when ray_init.address is set (it bounds the start "
                        f"of a local Ray; a running cluster is joined at once), got {start_timeout_s:g}")


def _heartbeats_fit_in_their_timeout(values: _Values, problems: list[str]) -> None:
    interval, timeout = values("trainer.heartbeat_interval"), values("trainer.heartbeat_timeout")
    if timeout < 2 * interval:
        problems.append(f"trainer.heartbeat_timeout: expected at least 2 * trainer.heartbeat_interval = "
                        f"{2 * interval:g} (a rank is silent only after missing heartbeats), got {timeout:g}")


def _batch_sizes_divide(values: _Values, problems: list[str]) -> None:
    """The actor's (and an enabled critic's) batches must split evenly over prompts, ranks and micro-batches."""
    nnodes, gpus = values("trainer.nnodes"), values("trainer.n_gpus_per_node")
    world = nnodes * gpus
    world_words = f"the world size trainer.nnodes * trainer.n_gpus_per_node = {nnodes} * {gpus} = {world}"
    train_batch, n = values("data.train_batch_size"), values("actor_rollout_ref.rollout.n")
    if train_batch * n % world:
        problems.append(f"data.train_batch_size: expected train_batch_size * actor_rollout_ref.rollout.n "
                        f"divisible by {world_words}, got {train_batch} * {n} = {train_batch * n}")
    _run_rule(lambda v, p: _role_batches_divide("actor_rollout_ref.actor", v, p, world_words, world),
              values, problems)
    if _critic_enabled(values):
        _run_rule(lambda v, p: _role_batches_divide("critic", v, p, world_words, world), values, problems)


def _role_batches_divide(role: str, values: _Values, problems: list[str], world_words: str, world: int) -> None:
    train_batch, n = values("data.train_batch_size"), values("actor_rollout_ref.rollout.n")
    mini = values(f"{role}.ppo_mini_batch_size")
    if train_batch % mini:
        problems.append(f"data.train_batch_size: expected a multiple of {role}.ppo_mini_batch_size = {mini} "
                        f"(both count prompts), got {train_batch}")
    if mini * n % world:
        problems.append(f"{role}.ppo_mini_batch_size: expected ppo_mini_batch_size * actor_rollout_ref.rollout.n "
                        f"divisible by {world_words}, got {mini} * {n} = {mini * n}")
        return
    if values(f"{role}.use_dynamic_bsz"):
        return
    micro = values(f"{role}.ppo_micro_batch_size_per_gpu")
    per_gpu = mini * n // world
    if per_gpu % micro:
        problems.append(f"{role}.ppo_micro_batch_size_per_gpu: expected a divisor of the per-GPU mini-batch "
                        f"{role}.ppo_mini_batch_size * actor_rollout_ref.rollout.n / world size = "
                        f"{mini} * {n} / {world} = {per_gpu}, got {micro}")


def _tensor_parallel_divides(values: _Values, problems: list[str]) -> None:
    world = values("trainer.nnodes") * values("trainer.n_gpus_per_node")
    tp = values("actor_rollout_ref.rollout.tensor_model_parallel_size")
    if world % tp:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size: expected a divisor of the world "
                        f"size trainer.nnodes * trainer.n_gpus_per_node = {world}, got {tp}")


def _tensor_parallel_engines_built(values: _Values, problems: list[str]) -> None:
    """sglang spans tensor_model_parallel_size GPUs with one engine per group of ranks in the synchronous colocated
    trainer (rollout/tensor_parallel.py); the vllm rollout, the engine servers of rollout.mode=async and the separate
    rollout pools of hybrid_engine=false still run one engine per GPU (issue #17)."""
    tp = values("actor_rollout_ref.rollout.tensor_model_parallel_size")
    rollout = values("actor_rollout_ref.rollout.name")
    if rollout not in GPU_ENGINES or tp == 1:
        return
    if rollout != "sglang":
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size: expected 1 with "
                        f"actor_rollout_ref.rollout.name={rollout!r} (one engine per GPU; tensor parallelism across "
                        f"ranks is not implemented yet, issue #17), got {tp}")
    elif values("actor_rollout_ref.rollout.mode") != "sync" or not values("actor_rollout_ref.hybrid_engine"):
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size: expected 1 with "
                        f"actor_rollout_ref.rollout.mode={values('actor_rollout_ref.rollout.mode')!r} and "
                        f"actor_rollout_ref.hybrid_engine={values('actor_rollout_ref.hybrid_engine')} (tensor-parallel "
                        f"sglang engines run in the synchronous colocated trainer: rollout.mode=sync, "
                        f"hybrid_engine=true; engine servers and separate rollout pools are one engine per GPU, "
                        f"issue #17), got {tp}")


def _engine_kwargs_leave_config_keys_alone(values: _Values, problems: list[str]) -> None:
    """rollout.engine_kwargs.<engine> adds engine arguments; one that a rollout key sets is refused up front (the
    engine would refuse it at start, on every worker)."""
    rollout = values("actor_rollout_ref.rollout.name")
    if rollout not in GPU_ENGINES:
        return
    extra = values(f"actor_rollout_ref.rollout.engine_kwargs.{rollout}") or {}
    module = importlib.import_module(f"hybridrl.workers.rollout.{rollout}_rollout")  # imports torch, not the engine
    owned = module.CONFIG_OWNED_ENGINE_KWARGS
    for key in sorted(set(extra) & set(owned)):
        problems.append(f"actor_rollout_ref.rollout.engine_kwargs.{rollout}.{key}: expected to be unset (set it "
                        f"through {owned[key]}), got {extra[key]!r}")


def _liger_runs_on_a_gpu(values: _Values, problems: list[str]) -> None:
    """liger's kernels are Triton kernels: CUDA only, and the package comes with the gpu extra."""
    if not values("actor_rollout_ref.model.use_liger"):
        return
    device = values("trainer.device")
    if device == "cpu" or (values("ray_init.address") is None and not _cuda_available()):
        problems.append(f"actor_rollout_ref.model.use_liger: expected false without a GPU (liger's kernels run only "
                        f"on CUDA; trainer.device={device!r}, CUDA available: {_cuda_available()}), got True")
    elif importlib.util.find_spec("liger_kernel") is None:
        problems.append(f"actor_rollout_ref.model.use_liger: expected the liger-kernel package to be installed "
                        f"({INSTALL_GPU_EXTRAS}), got True (liger_kernel is not importable)")


def _reward_model_ready(values: _Values, problems: list[str]) -> None:
    """An enabled reward model needs its checkpoint and a micro-batch size; it scores fixed-size padded batches."""
    if not values("reward_model.enable"):
        return
    if values("reward_model.model.path") is None:
        problems.append("reward_model.model.path: expected a sequence-classification model directory when "
                        "reward_model.enable=true, got None")
    if values("reward_model.micro_batch_size_per_gpu") is None:
        problems.append("reward_model.micro_batch_size_per_gpu: expected rows per reward-model forward when "
                        "reward_model.enable=true, got None")
    for key in ("reward_model.use_dynamic_bsz", "reward_model.model.use_remove_padding"):
        if values(key):
            problems.append(f"{key}: expected False when reward_model.enable=true (the reward model scores padded "
                            f"batches of micro_batch_size_per_gpu rows; set it to false), got True")


# Token budgets of the dynamic batch size, each with the switch that puts it to use.
TOKEN_BUDGETS: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    "critic.ppo_max_token_len_per_gpu": "critic.use_dynamic_bsz",
    "critic.forward_max_token_len_per_gpu": "critic.use_dynamic_bsz",
}


def _token_budgets_hold_a_sequence(values: _Values, problems: list[str]) -> None:
    """A token budget in use must hold the longest possible row, max_prompt_length + max_response_length."""
    longest = values("data.max_prompt_length") + values("data.max_response_length")
    for budget_key, switch_key in TOKEN_BUDGETS.items():
        if budget_key.startswith("critic.") and not _critic_enabled(values):
            continue
        if values(switch_key) and values(budget_key) < longest:
            problems.append(f"{budget_key}: expected at least data.max_prompt_length + data.max_response_length = "
                            f"{longest} tokens (one whole sequence) with {switch_key}=true, got {values(budget_key)}")


def _lora_settings(values: _Values, problems: list[str]) -> None:
    rank = values("actor_rollout_ref.model.lora_rank")
    adapter = values("actor_rollout_ref.model.lora_adapter_path")
    if rank == 0 and adapter is not None:
        problems.append(f"actor_rollout_ref.model.lora_adapter_path: expected null when "
                        f"actor_rollout_ref.model.lora_rank=0 (no LoRA to load the adapter into), got {adapter!r}")


# Models whose state param_offload / optimizer_offload park on the CPU between phases (models/offload.py):
# (strategy key, fsdp_config key, its parking flags, whether that fsdp_config has offload_policy).
OFFLOAD_FLAGS = (
    ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.fsdp_config", ("param_offload", "optimizer_offload"),
     True),
    ("actor_rollout_ref.ref.strategy", "actor_rollout_ref.ref.fsdp_config", ("param_offload",), False),
    ("critic.strategy", "critic.model.fsdp_config", ("param_offload", "optimizer_offload"), True),
)


def _offload_settings(values: _Values, problems: list[str]) -> None:
    """Parking between phases moves FSDP2's sharded DTensors; FSDP1 has its own permanent CPU offload
    (offload_policy, torch's CPUOffload), and offload_policy already keeps everything on the CPU."""
    for strategy_key, fsdp_key, flags, has_policy in OFFLOAD_FLAGS:
        if strategy_key.startswith("critic.") and not _critic_enabled(values):
            continue
        for flag in flags:
            key = f"{fsdp_key}.{flag}"
            if not values(key):
                continue
            if values(strategy_key) == "fsdp":
                instead = (f"set {fsdp_key}.offload_policy=true (FSDP1's own CPUOffload: parameters, gradients and "
                           f"optimizer state on the CPU all the time) or {strategy_key}=fsdp2" if has_policy
                           else f"set {strategy_key}=fsdp2")
                problems.append(f"{key}: expected False with {strategy_key}='fsdp' (parking state on the CPU between "
                                f"phases is implemented for fsdp2 only; {instead}), got True")
            elif has_policy and values(f"{fsdp_key}.offload_policy"):
                problems.append(f"{key}: expected False with {fsdp_key}.offload_policy=true (that keeps parameters, "
                                f"gradients and optimizer state on the CPU all the time; {flag} parks them there "
                                f"between phases only: choose one), got True")
    ref_key = "actor_rollout_ref.ref.fsdp_config.param_offload"
    actor_key = "actor_rollout_ref.actor.fsdp_config.param_offload"
    if values("actor_rollout_ref.model.lora_rank") > 0 and values(ref_key) and not values(actor_key):
        problems.append(f"{ref_key}: expected False when {actor_key}=false and actor_rollout_ref.model.lora_rank > 0 "
                        f"(the LoRA reference is the actor's own module with its adapters disabled, so it is parked "
                        f"exactly when the actor is), got True")


def _async_rollout_settings(values: _Values, problems: list[str]) -> None:
    """rollout.mode=async: agent loops read the raw chat; the engine server serves the built-in engines; the hf
    server's requests run unsynchronised across ranks, which only FSDP2's whole-model gather allows."""
    if values("actor_rollout_ref.rollout.mode") != "async":
        return
    if not values("data.return_raw_chat"):
        problems.append("data.return_raw_chat: expected true with actor_rollout_ref.rollout.mode='async' (agent "
                        "loops get the raw chat messages as raw_prompt), got False")
    custom = values("actor_rollout_ref.rollout.custom_cls")
    if custom.get("path") is not None or custom.get("name") is not None:
        problems.append("actor_rollout_ref.rollout.custom_cls: expected null with actor_rollout_ref.rollout.mode="
                        "'async' (the engine server serves the built-in hf, sglang and vllm engines), got "
                        f"{custom!r}")
    if values("actor_rollout_ref.rollout.name") == "hf" and values("actor_rollout_ref.actor.strategy") == "fsdp":
        problems.append("actor_rollout_ref.actor.strategy: expected 'fsdp2' with actor_rollout_ref.rollout.mode="
                        "'async' and rollout.name='hf' (each rank's server generates on its own schedule; FSDP1 "
                        "may gather layers at every step, a collective the ranks would not join together), got "
                        "'fsdp'")


def _placement_and_schedule(values: _Values, problems: list[str]) -> None:
    """hybrid_engine=false puts the rollout on its own pool, where it serves agent loops (rollout.mode=async);
    an overlapping schedule (async_training.mode) needs that separate pool, and generates ahead of the update."""
    schedule = values("async_training.mode")
    if values("actor_rollout_ref.hybrid_engine"):
        if schedule != "sync":
            problems.append(f"async_training.mode: expected 'sync' with actor_rollout_ref.hybrid_engine=true "
                            f"(generation overlaps training only on separate pools: set "
                            f"actor_rollout_ref.hybrid_engine=false and rollout.n_gpus_per_node), got {schedule!r}")
        return
    if values("actor_rollout_ref.rollout.mode") != "async":
        problems.append("actor_rollout_ref.rollout.mode: expected 'async' with actor_rollout_ref.hybrid_engine=false "
                        "(the rollout pool's ranks are engine servers that agent loops call), got "
                        f"{values('actor_rollout_ref.rollout.mode')!r}")
    if schedule != "sync" and values("algorithm.adv_estimator") == "remax":
        problems.append(f"algorithm.adv_estimator: expected an estimator without a greedy baseline rollout with "
                        f"async_training.mode={schedule!r} (ReMax generates its baseline from the current weights "
                        f"inside the step), got 'remax'")


def _multi_turn_settings(values: _Values, problems: list[str]) -> None:
    """multi_turn: the tool_agent loop runs only as an agent loop (async mode), with a tool-call syntax it parses."""
    from hybridrl.agent_loop.tool_parser import TOOL_PARSERS

    if not values("actor_rollout_ref.rollout.multi_turn.enable"):
        return
    if values("actor_rollout_ref.rollout.mode") != "async":
        problems.append("actor_rollout_ref.rollout.mode: expected 'async' with actor_rollout_ref.rollout.multi_turn."
                        "enable=true (multi-turn rollouts run as agent loops against engine servers), got "
                        f"{values('actor_rollout_ref.rollout.mode')!r}")
    tool_format = values("actor_rollout_ref.rollout.multi_turn.format")
    if tool_format not in TOOL_PARSERS:
        problems.append(f"actor_rollout_ref.rollout.multi_turn.format: expected one of {sorted(TOOL_PARSERS)}, got "
                        f"{tool_format!r}")


ROLLOUT_CORRECTION = "algorithm.rollout_correction"


def _rollout_correction_settings(values: _Values, problems: list[str]) -> None:
    """A correction that changes training needs the rollout's log-probs, rejection needs its threshold, the lower
    threshold lies below the upper, and IS weights need a policy loss that takes them."""
    def correction(key: str):
        return values(f"{ROLLOUT_CORRECTION}.{key}")

    uses = [f"{ROLLOUT_CORRECTION}.{key}={correction(key)!r}"
            for key in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold") if correction(key) is not None]
    if uses and not values("actor_rollout_ref.rollout.calculate_log_probs"):
        problems.append(f"actor_rollout_ref.rollout.calculate_log_probs: expected true with {', '.join(uses)} (the "
                        "correction compares the trainer's log-probs with the rollout's), got False")
    upper, lower = correction("rollout_rs_threshold"), correction("rollout_rs_threshold_lower")
    if correction("rollout_rs") is not None and upper is None:
        problems.append(f"{ROLLOUT_CORRECTION}.rollout_rs_threshold: expected an upper threshold > 0 with "
                        f"{ROLLOUT_CORRECTION}.rollout_rs={correction('rollout_rs')!r}, got None")
    if upper is not None and lower is not None and not lower < upper:
        problems.append(f"{ROLLOUT_CORRECTION}.rollout_rs_threshold_lower: expected less than "
                        f"rollout_rs_threshold={upper}, got {lower}")
    if correction("rollout_is") is not None:
        _run_rule(_policy_loss_takes_is_weights, values, problems)


def _policy_loss_takes_is_weights(values: _Values, problems: list[str]) -> None:
    from hybridrl.algorithms.core_algos import get_policy_loss_fn

    key = "actor_rollout_ref.actor.policy_loss.loss_mode"
    try:
        loss = get_policy_loss_fn(values(key))
    except ValueError:  # an unregistered name: _registered_names reports it
        return
    if "rollout_is_weights" not in inspect.signature(loss).parameters:
        problems.append(f"{key}: expected a policy loss taking rollout_is_weights (verl's signature) with "
                        f"{ROLLOUT_CORRECTION}.rollout_is set, got {values(key)!r} (its parameters: "
                        f"{list(inspect.signature(loss).parameters)})")


def _reward_hub_settings(values: _Values, problems: list[str]) -> None:
    """custom_reward_function.rm_type names a hub scorer (not together with a path); remote_rm has an http(s)
    url, and its worst case (every attempt timing out) fits in reward_model.score_timeout."""
    from hybridrl.reward.hub import check_rm_type

    rm_type, path = values("custom_reward_function.rm_type"), values("custom_reward_function.path")
    remote_url = values("custom_reward_function.remote_rm.url")
    if rm_type is not None:
        try:
            check_rm_type(rm_type)
        except ValueError as err:
            problems.append(f"custom_reward_function.rm_type: expected a reward-hub scorer, got {rm_type!r} ({err})")
        if path is not None:
            problems.append(f"custom_reward_function.rm_type: expected null with custom_reward_function.path set "
                            f"(one scorer for the run: the user's function or a named one), got {rm_type!r}")
        if rm_type.removeprefix("boxed_") == "remote_rm" and not remote_url:
            problems.append("custom_reward_function.remote_rm.url: expected the reward server's http(s) URL with "
                            "custom_reward_function.rm_type=remote_rm, got None")
        if rm_type.removeprefix("boxed_") == "math_verify" and importlib.util.find_spec("math_verify") is None:
            problems.append("custom_reward_function.rm_type: expected a scorer whose package is installed, got "
                            "'math_verify' (pip install math-verify, or pip install -e '.[math]')")
    if remote_url:
        if not remote_url.startswith(("http://", "https://")):
            problems.append(f"custom_reward_function.remote_rm.url: expected an http:// or https:// URL, got "
                            f"{remote_url!r}")
        _run_rule(_remote_rm_fits_in_score_timeout, values, problems)


def _remote_rm_fits_in_score_timeout(values: _Values, problems: list[str]) -> None:
    from hybridrl.reward.remote_rm import RemoteRewardModel

    key = "custom_reward_function.remote_rm"
    score_timeout = values("reward_model.score_timeout")
    timeout = values(f"{key}.timeout")
    worst = RemoteRewardModel(url=values(f"{key}.url"), timeout=timeout, max_retries=values(f"{key}.max_retries"),
                              retry_delay=values(f"{key}.retry_delay"), max_concurrency=1).worst_case_seconds()
    if score_timeout is not None and worst >= score_timeout:
        problems.append(f"{key}.timeout: expected timeout * (max_retries + 1) plus the retry delays = {worst:g} s "
                        f"below reward_model.score_timeout={score_timeout:g} (else a slow server fails the run "
                        f"instead of costing its samples), got {timeout:g}")


def _eval_sets_settings(values: _Values, problems: list[str]) -> None:
    """Each named eval set is well formed (trainer/ppo/evaluation.py); validating needs something to validate."""
    entries = values("data.eval_sets")
    if entries:
        from hybridrl.trainer.ppo.evaluation import eval_set_problems

        problems += eval_set_problems(entries, values("actor_rollout_ref.rollout.response_length"))
    validates = values("trainer.val_before_train") or values("trainer.test_freq") > 0
    if validates and not entries and not values("data.val_files"):
        problems.append("data.val_files: expected at least one .parquet file when the run validates "
                        "(trainer.val_before_train or trainer.test_freq > 0) and data.eval_sets is empty, got []")


# data_flow keys that do something only when the data flow is on, with their off values.
DATA_FLOW_DEFAULTS: dict[str, Any] = {
    "over_sampling_batch_size": None, "max_num_gen_batches": 0, "insufficient_groups": "fail",
    "partial_rollout": False, "mask_offpolicy_in_partial_rollout": False, "group_reward": False, "reward_key": None,
}


def _data_flow_settings(values: _Values, problems: list[str]) -> None:
    """data_flow (slime's) and algorithm.filter_groups (verl's DAPO form of it): on only in async mode, its hooks
    importable with the right signatures (hybridrl/data/hooks.py), its keys unused while it is off refused."""
    from hybridrl.data.hooks import HOOKS, HookError, load_hook

    flow = values("data_flow")
    filter_groups = values("algorithm.filter_groups")
    if not (flow["enable"] or filter_groups["enable"]):
        for key, default in DATA_FLOW_DEFAULTS.items():
            if flow[key] != default:
                problems.append(f"data_flow.{key}: expected {default!r} with data_flow.enable=false (it acts only in "
                                f"the data flow; set data_flow.enable=true), got {flow[key]!r}")
        for hook in HOOKS:
            if flow[hook].get("path") is not None or flow[hook].get("name") is not None:
                problems.append(f"data_flow.{hook}: expected null path and name with data_flow.enable=false (set "
                                f"data_flow.enable=true), got {flow[hook]!r}")
        return
    switch = "data_flow.enable" if flow["enable"] else "algorithm.filter_groups.enable"
    if values("actor_rollout_ref.rollout.mode") != "async":
        problems.append(f"actor_rollout_ref.rollout.mode: expected 'async' with {switch}=true (groups run as "
                        f"agent-loop requests on the engine servers, which can abort them), got "
                        f"{values('actor_rollout_ref.rollout.mode')!r}")
    if values("async_training.mode") != "sync" or not values("actor_rollout_ref.hybrid_engine"):
        problems.append(f"async_training.mode / actor_rollout_ref.hybrid_engine: expected 'sync' and true with "
                        f"{switch}=true (the data flow runs on the colocated engines for now), got "
                        f"{values('async_training.mode')!r} and {values('actor_rollout_ref.hybrid_engine')!r}")
    if values("reward_model.enable"):
        problems.append(f"reward_model.enable: expected false with {switch}=true (groups are scored as they finish, "
                        f"while the engines hold the devices), got True")
    if values("algorithm.adv_estimator") == "remax":
        problems.append(f"algorithm.adv_estimator: expected an estimator other than 'remax' with {switch}=true (its "
                        f"greedy baseline generation is not part of the data flow), got 'remax'")
    generates_itself = any(flow[hook].get("name") is not None for hook in ("rollout_function",
                                                                          "custom_generate_function"))
    loop = values("actor_rollout_ref.rollout.agent.default_agent_loop")
    if loop != "single_turn_agent" and not generates_itself:
        problems.append(f"actor_rollout_ref.rollout.agent.default_agent_loop: expected 'single_turn_agent' with "
                        f"{switch}=true (the built-in generate function is single-turn and continues aborted samples; "
                        f"for other loops set data_flow.custom_generate_function), got {loop!r}")
    if filter_groups["enable"] and flow["max_num_gen_batches"] not in (0, filter_groups["max_num_gen_batches"]):
        problems.append(f"data_flow.max_num_gen_batches: expected 0 or algorithm.filter_groups.max_num_gen_batches = "
                        f"{filter_groups['max_num_gen_batches']} (the same cap), got {flow['max_num_gen_batches']!r}")
    train_batch = values("data.train_batch_size")
    over = flow["over_sampling_batch_size"]
    if flow["over_sampling_filter"].get("name") is not None and (over or train_batch) < train_batch + 1:
        problems.append(f"data_flow.over_sampling_batch_size: expected more than data.train_batch_size = {train_batch} "
                        f"groups with data_flow.over_sampling_filter set (it orders them and keeps the first "
                        f"train_batch_size), got {over!r}")
    if flow["group_reward"] and flow["reward_function"].get("name") is None:
        problems.append("data_flow.group_reward: expected false without data_flow.reward_function (the reward "
                        "manager scores samples itself), got True")
    for hook in HOOKS:
        try:
            load_hook(hook, flow[hook])
        except HookError as err:
            problems.append(str(err))


RULES: list[Callable[[_Values, list[str]], None]] = [
    _not_implemented,
    _registered_names,
    _engine_available,
    _critic_matches_estimator,
    _resume_path_given,
    _local_ray_keys_only_for_a_local_ray,
    _heartbeats_fit_in_their_timeout,
    _batch_sizes_divide,
    _tensor_parallel_divides,
    _tensor_parallel_engines_built,
    _engine_kwargs_leave_config_keys_alone,
    _liger_runs_on_a_gpu,
    _reward_model_ready,
    _token_budgets_hold_a_sequence,
    _lora_settings,
    _offload_settings,
    _async_rollout_settings,
    _placement_and_schedule,
    _multi_turn_settings,
    _rollout_correction_settings,
    _reward_hub_settings,
    _eval_sets_settings,
    _data_flow_settings,
]


# ---- files: checked after the embedded defaults are prepared ----

def check_paths(config: PPOConfig) -> None:
    """Raise ConfigError naming every configured file or directory that is missing or of the wrong kind."""
    problems: list[str] = []
    for key, files in (("data.train_files", config.data.train_files), ("data.val_files", config.data.val_files)):
        for index, path in enumerate(files):
            _expect_file(f"{key}[{index}]", path, ".parquet", problems)
    for index, entry in enumerate(config.data.eval_sets):
        files = [entry["path"]] if isinstance(entry["path"], str) else entry["path"]
        for file_index, path in enumerate(files):
            _expect_file(f"data.eval_sets[{index}].path" + (f"[{file_index}]" if len(files) > 1 else ""), path,
                         ".parquet", problems)
    _expect_model_dir("actor_rollout_ref.model.path", config.actor_rollout_ref.model.path, problems)
    if config.critic.enable:
        _expect_model_dir("critic.model.path", config.critic.model.path, problems)
    if config.reward_model.enable:
        _expect_model_dir("reward_model.model.path", config.reward_model.model.path, problems)
    adapter = config.actor_rollout_ref.model.lora_adapter_path
    if config.actor_rollout_ref.model.lora_rank > 0 and adapter is not None \
            and not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        problems.append(f"actor_rollout_ref.model.lora_adapter_path: expected a peft adapter directory containing "
                        f"adapter_config.json, got {adapter!r}")
    for key, path in (("custom_reward_function.path", config.custom_reward_function.path),
                      ("data.custom_cls.path", config.data.custom_cls.path),
                      ("actor_rollout_ref.rollout.custom_cls.path", config.actor_rollout_ref.rollout.custom_cls.path)):
        if path is not None:
            _expect_file(key, path, ".py", problems)
    if config.trainer.resume_mode == "resume_path" and not os.path.isdir(config.trainer.resume_from_path):
        problems.append(f"trainer.resume_from_path: expected an existing checkpoint directory, "
                        f"got {config.trainer.resume_from_path!r}")
    if problems:
        raise ConfigError(problems)


def _expect_file(key: str, path: str, suffix: str, problems: list[str]) -> None:
    if not os.path.isfile(path):
        problems.append(f"{key}: expected an existing {suffix} file, got {path!r} (no such file)")
    elif not path.endswith(suffix):
        problems.append(f"{key}: expected a {suffix} file, got {path!r}")


def _expect_model_dir(key: str, path: str, problems: list[str]) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        problems.append(f"{key}: expected a local model directory containing config.json, got {path!r}")
