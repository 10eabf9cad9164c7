"""Typed mirror of the YAML tree in this folder: one dataclass per YAML mapping, one attribute per key.

Attribute names are the YAML keys, so code written against the composed YAML
(`config.actor_rollout_ref.actor.ppo_mini_batch_size`) runs unchanged on these objects.

Fields have no defaults on purpose: the YAML files are the one place defaults live, and
`validate_config` reports a key missing from the YAML instead of quietly inventing a value.
Ranges that concern one key sit next to its type (`positive()`, `at_least(x)`, ...);
not-implemented keys and registries are checked by `validation.py`, and the other rules across keys (batch
divisibility, ...) beside the subsystems they concern (`<subsystem>/config_checks.py`, registered in `checks.py`).
`tests/test_config_schema.py` keeps this file and the YAML key for key in step.

Classes are top-level and plain, so instances pickle (they travel to Ray workers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union


# ---- single-key rules, stored in field metadata and applied by structure.check_structure ----

def _check(predicate, expected: str):
    """A field whose value (when not null) must satisfy `predicate`; `expected` words the rule for errors."""
    return field(metadata={"check": predicate, "expected": expected})


def positive():
    return _check(lambda v: v > 0, "> 0")


def at_least(low):
    return _check(lambda v: v >= low, f">= {low}")


def greater_than(low):
    return _check(lambda v: v > low, f"> {low}")


def between(low, high, low_open: bool = False):
    if low_open:
        return _check(lambda v: low < v <= high, f"in ({low}, {high}]")
    return _check(lambda v: low <= v <= high, f"in [{low}, {high}]")


def one_or_list():
    """A list-of-str field that also takes one bare string (`trainer.logger=console`, as verl allows)."""
    return field(metadata={"normalize": lambda v: [v] if isinstance(v, str) else v})


# ---- the `get`/`[]` access verl code uses on DictConfig, kept working on the dataclasses ----

class ConfigNode:
    """Base of every config dataclass: `cfg.get(key, default)`, `cfg[key]` and `key in cfg`,
    because code ported from verl reads its config that way."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self else default

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: str) -> bool:
        return key in self.__dataclass_fields__


Strategy = Literal["fsdp", "fsdp2"]
WarmupStyle = Literal["constant", "cosine"]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# The estimators hybridrl.algorithms.kl implements ("full" needs whole-vocabulary distributions: not yet); a "+"
# keeps the value and takes k2's gradient (straight-through).
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                 "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
# What models/checkpoint.py saves ("extra" = lr scheduler and RNG state); verl's "hf_model" is not implemented.
CheckpointContent = Literal["model", "optimizer", "extra"]


@dataclass
class CustomClassConfig(ConfigNode):
    """A user class loaded from a .py file (`path`) by name (`name`); both null means the built-in."""
    path: Optional[str]
    name: Optional[str]


@dataclass
class WrapPolicyConfig(ConfigNode):
    min_num_params: int = at_least(0)


@dataclass
class CheckpointConfig(ConfigNode):
    save_contents: list[CheckpointContent]
    load_contents: list[CheckpointContent]


# ---- data ----

@dataclass
class DataConfig(ConfigNode):
    tokenizer: Optional[str]
    train_files: list[str] = one_or_list()
    val_files: list[str] = one_or_list()
    prompt_key: str
    reward_fn_key: str
    max_prompt_length: int = positive()
    max_response_length: int = positive()
    train_batch_size: int = positive()
    val_batch_size: Optional[int] = positive()
    gen_batch_size: Optional[int] = positive()  # verl's name of data_flow.over_sampling_batch_size (validation.ALIASES)
    return_raw_input_ids: bool
    return_raw_chat: bool
    return_full_prompt: bool
    shuffle: bool
    seed: int
    truncation: Literal["error", "left", "right"]
    filter_overlong_prompts: bool
    train_max_samples: int
    val_max_samples: int
    eval_sets: list[dict[str, Any]]  # named eval sets; their keys are checked by validation (evaluation.py)
    dataloader_num_workers: int = at_least(0)
    custom_cls: CustomClassConfig
    apply_chat_template_kwargs: dict[str, Any]  # extra chat-template arguments (dataset and agent loops alike)


# ---- actor_rollout_ref ----

@dataclass
class ModelConfig(ConfigNode):
    path: str
    custom_chat_template: Optional[str]
    external_lib: Optional[str]
    override_config: dict[str, Any]
    trust_remote_code: bool
    enable_gradient_checkpointing: bool
    enable_activation_offload: bool
    use_remove_padding: bool
    use_liger: bool
    use_fused_kernels: bool
    lora_rank: int = at_least(0)
    lora_alpha: int = positive()
    target_modules: Union[str, list[str]]
    exclude_modules: Optional[str]
    lora_adapter_path: Optional[str]


@dataclass
class OptimConfig(ConfigNode):
    lr: float = at_least(0)
    lr_warmup_steps: int
    lr_warmup_steps_ratio: float = between(0, 1)
    min_lr_ratio: float = between(0, 1)
    num_cycles: float
    warmup_style: WarmupStyle
    total_training_steps: int
    weight_decay: float = at_least(0)
    betas: list[float]


@dataclass
class FSDPConfig(ConfigNode):
    wrap_policy: WrapPolicyConfig
    param_offload: bool
    optimizer_offload: bool
    offload_policy: bool
    reshard_after_forward: bool
    fsdp_size: int
    forward_prefetch: bool
    use_torch_compile: bool                           # verl's key; only false (validation.NOT_IMPLEMENTED)
    full_determinism: bool                            # utils/determinism.enable_full_determinism in its process


@dataclass
class PolicyLossConfig(ConfigNode):
    loss_mode: str
    clip_cov_ratio: float = at_least(0)
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float = at_least(0)
    ppo_kl_coef: float
    dro_beta: Optional[float] = positive()   # DRO's quadratic log-ratio penalty; required with loss_mode=dro


@dataclass
class ActorConfig(ConfigNode):
    strategy: Strategy
    ppo_mini_batch_size: int = positive()
    ppo_micro_batch_size: Optional[int]
    ppo_micro_batch_size_per_gpu: int = positive()
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int = positive()
    grad_clip: float = positive()
    clip_ratio: float = at_least(0)
    clip_ratio_low: float = at_least(0)
    clip_ratio_high: float = at_least(0)
    clip_ratio_c: float = greater_than(1)
    tau_pos: float = positive()   # SAPO's gate temperature where the advantage is > 0
    tau_neg: float = positive()   # ... and where it is <= 0
    policy_loss: PolicyLossConfig
    loss_agg_mode: LossAggMode
    loss_scale_factor: Optional[float] = positive()   # seq-mean-token-sum-norm's divisor; None: the padded width
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float = at_least(0)
    kl_loss_type: KLType
    use_torch_compile: bool
    ppo_epochs: int = positive()
    shuffle: bool
    ulysses_sequence_parallel_size: int = positive()
    entropy_checkpointing: bool                       # recompute the entropy in backward (torch_functional)
    entropy_from_logits_with_chunking: bool           # the entropy's backward in row chunks too (torch_functional)
    checkpoint: CheckpointConfig
    optim: OptimConfig
    fsdp_config: FSDPConfig


@dataclass
class EngineKwargsConfig(ConfigNode):
    """Extra keyword arguments passed as-is to the named inference engine."""
    vllm: dict[str, Any]
    sglang: dict[str, Any]


@dataclass
class AgentConfig(ConfigNode):
    """`rollout.mode=async` or the data flow: the agent-loop workers on the controller and the loops they may run
    (agent_loop/)."""
    num_workers: int = positive()
    agent_loop_config_path: Optional[str]
    default_agent_loop: str
    # share of a batch's agent loops that may raise before the step fails (each failed one costs its sample)
    max_failed_sample_ratio: float = between(0, 1)


@dataclass
class MultiTurnConfig(ConfigNode):
    """Multi-turn rollouts with tools (verl's keys): the `tool_agent` loop reads them (agent_loop/tool_agent.py)."""
    enable: bool
    max_assistant_turns: Optional[int] = positive()   # null: bounded only by response_length
    max_user_turns: Optional[int] = positive()        # tool and interaction turns; null: response_length only
    tool_config_path: Optional[str]
    max_parallel_calls: int = positive()
    max_tool_response_length: int = positive()        # characters of one tool response
    tool_response_truncate_side: Literal["left", "middle", "right"]
    format: str                                       # tool-call syntax; "hermes" (agent_loop/tool_parser.py)
    tokenization_sanity_check_mode: Literal["strict", "ignore_strippable", "disable"]
    interaction_config_path: Optional[str]            # interaction YAML (hybridrl/interactions/registry.py)
    use_inference_chat_template: bool                 # verl's key; only false (validation.NOT_IMPLEMENTED)
    num_repeat_rollouts: Optional[int]                # verl's key; only null (validation.NOT_IMPLEMENTED)


@dataclass
class ValKwargsConfig(ConfigNode):
    """Sampling used for validation generations (greedy by default)."""
    top_k: int
    top_p: float = between(0, 1, low_open=True)
    temperature: float = at_least(0)
    n: int = positive()
    do_sample: bool


@dataclass
class CheckpointEngineConfig(ConfigNode):
    update_weights_bucket_megabytes: Optional[int]


@dataclass
class RolloutConfig(ConfigNode):
    name: str
    mode: Literal["sync", "async"]
    temperature: float = at_least(0)
    top_k: int
    top_p: float = between(0, 1, low_open=True)
    do_sample: bool
    full_determinism: bool                            # per-request seeds, stable routing (rollout/request_seeds.py)
    seed: int                                         # the sampling seed under full_determinism
    n: int = positive()
    prompt_length: int = positive()
    response_length: int = positive()
    dtype: Literal["bfloat16", "float16", "float32"]
    gpu_memory_utilization: float = between(0, 1, low_open=True)
    ignore_eos: bool
    enforce_eager: bool
    free_cache_engine: bool
    load_format: str
    tensor_model_parallel_size: int = positive()
    max_num_batched_tokens: int = positive()
    max_model_len: Optional[int] = positive()
    max_num_seqs: int = positive()
    log_prob_micro_batch_size_per_gpu: Optional[int] = positive()
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int = positive()
    disable_log_stats: bool
    calculate_log_probs: bool
    multi_stage_wake_up: bool
    checkpoint_engine: CheckpointEngineConfig        # verl's place of the key below (validation.ALIASES)
    update_weights_bucket_megabytes: int = positive()
    enable_chunked_prefill: bool                      # verl's key; only true (validation.NOT_IMPLEMENTED)
    engine_kwargs: EngineKwargsConfig
    val_kwargs: ValKwargsConfig
    custom_cls: CustomClassConfig
    agent: AgentConfig
    multi_turn: MultiTurnConfig
    over_sample_rate: float                           # verl's key; only 0 (validation.NOT_IMPLEMENTED)


@dataclass
class RefFSDPConfig(ConfigNode):
    param_offload: bool
    reshard_after_forward: bool
    forward_prefetch: bool
    use_torch_compile: bool                           # verl's key; only false (validation.NOT_IMPLEMENTED)
    full_determinism: bool                            # utils/determinism.enable_full_determinism in its process
    wrap_policy: WrapPolicyConfig


@dataclass
class RefConfig(ConfigNode):
    strategy: Strategy
    fsdp_config: RefFSDPConfig
    ulysses_sequence_parallel_size: int = positive()  # models/sequence_parallel.py
    entropy_checkpointing: bool                       # verl's key; the reference computes no entropy (as in verl)
    entropy_from_logits_with_chunking: bool           # verl's key; the reference computes no entropy (as in verl)
    log_prob_micro_batch_size_per_gpu: Optional[int] = positive()
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int = positive()


@dataclass
class ActorRolloutRefConfig(ConfigNode):
    hybrid_engine: bool
    model: ModelConfig
    actor: ActorConfig
    rollout: RolloutConfig
    ref: RefConfig


# ---- critic ----

@dataclass
class CriticModelConfig(ConfigNode):
    path: str
    tokenizer_path: str
    override_config: dict[str, Any]
    external_lib: Optional[str]
    trust_remote_code: bool
    enable_gradient_checkpointing: bool
    use_remove_padding: bool
    lora_rank: int = at_least(0)
    lora_alpha: int = positive()
    target_modules: Union[str, list[str]]
    fsdp_config: FSDPConfig


@dataclass
class CriticConfig(ConfigNode):
    # null in the YAML means "on exactly when algorithm.adv_estimator is gae";
    # validate_config replaces it by that bool, so readers always see true/false.
    enable: Optional[bool]
    strategy: Strategy
    optim: OptimConfig
    model: CriticModelConfig
    ppo_mini_batch_size: int = positive()
    ppo_micro_batch_size: Optional[int]
    ppo_micro_batch_size_per_gpu: int = positive()
    forward_micro_batch_size_per_gpu: int = positive()
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int = positive()
    forward_max_token_len_per_gpu: int = positive()
    ppo_epochs: int = positive()
    shuffle: bool
    grad_clip: float = positive()
    cliprange_value: float = at_least(0)
    loss_agg_mode: LossAggMode
    loss_scale_factor: Optional[float] = positive()
    checkpoint: CheckpointConfig


# ---- reward_model ----

@dataclass
class RewardModelFSDPConfig(ConfigNode):
    param_offload: bool
    reshard_after_forward: bool
    fsdp_size: int
    forward_prefetch: bool
    wrap_policy: WrapPolicyConfig


@dataclass
class RewardModelModelConfig(ConfigNode):
    input_tokenizer: Optional[str]
    path: Optional[str]
    external_lib: Optional[str]
    trust_remote_code: bool
    use_remove_padding: bool
    fsdp_config: RewardModelFSDPConfig


@dataclass
class OverlongBufferConfig(ConfigNode):
    """DAPO's soft penalty for responses that run into the last `len` tokens of the budget."""
    enable: bool
    len: int = at_least(0)
    penalty_factor: float = at_least(0)
    log: bool


@dataclass
class RewardModelConfig(ConfigNode):
    enable: bool
    strategy: Strategy
    model: RewardModelModelConfig
    micro_batch_size_per_gpu: Optional[int] = positive()
    max_length: Optional[int] = positive()
    use_dynamic_bsz: bool
    forward_max_token_len_per_gpu: int = positive()
    reward_manager: str
    launch_reward_fn_async: bool
    overlong_buffer: OverlongBufferConfig
    reward_kwargs: dict[str, Any]  # keyword arguments of the manager's constructor, as verl passes them
    score_timeout: Optional[float] = positive()
    max_concurrent: int = positive()


@dataclass
class RemoteRewardModelConfig(ConfigNode):
    """slime's remote_rm: a reward model over HTTP (reward/remote_rm.py)."""
    url: Optional[str]
    timeout: float = positive()
    max_retries: int = at_least(0)
    retry_delay: float = at_least(0)
    max_concurrency: int = positive()


@dataclass
class CustomRewardFunctionConfig(ConfigNode):
    path: Optional[str]
    name: str
    rm_type: Optional[str]  # a reward-hub scorer by name (reward/hub.py)
    remote_rm: RemoteRewardModelConfig


# ---- algorithm ----

@dataclass
class KLControlConfig(ConfigNode):
    type: Literal["fixed", "adaptive"]
    kl_coef: float = at_least(0)
    horizon: int = positive()
    target_kl: float = positive()


@dataclass
class RolloutCorrectionConfig(ConfigNode):
    """verl's algorithm.rollout_correction (decoupled mode): IS weights and rejection from the rollout's
    log-probs (algorithms/rollout_correction.py)."""
    rollout_is: Optional[Literal["token", "sequence"]]
    rollout_is_threshold: float = positive()
    rollout_is_batch_normalize: bool
    rollout_rs: Optional[Literal["token", "sequence", "geometric"]]
    rollout_rs_threshold: Optional[float] = positive()
    rollout_rs_threshold_lower: Optional[float] = positive()
    rollout_token_veto_threshold: Optional[float] = positive()
    bypass_mode: bool
    use_policy_gradient: bool


@dataclass
class FilterGroupsConfig(ConfigNode):
    """verl's DAPO dynamic sampling; runs through the data flow (trainer/ppo/group_rollout.py)."""
    enable: bool
    metric: str
    max_num_gen_batches: int = at_least(0)


@dataclass
class AlgorithmConfig(ConfigNode):
    adv_estimator: str
    gamma: float = between(0, 1)
    lam: float = between(0, 1)
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: KLType
    kl_ctrl: KLControlConfig
    use_pf_ppo: bool
    rollout_correction: RolloutCorrectionConfig
    filter_groups: FilterGroupsConfig
    gdpo_reward_keys: Optional[list[str]]        # GDPO's reward components: keys of the scorer's returned dict
    gdpo_reward_weights: Optional[list[float]]   # their weights (null: all 1)


# ---- data_flow (slime's): hybridrl/data, trainer/ppo/group_rollout.py ----

@dataclass
class HookConfig(ConfigNode):
    """A function named by a .py file (`path`) and its name; path null + name: a built-in; both null: none."""
    path: Optional[str]
    name: Optional[str]


@dataclass
class DataFlowConfig(ConfigNode):
    enable: bool
    over_sampling_batch_size: Optional[int] = positive()
    max_num_gen_batches: int = at_least(0)
    insufficient_groups: Literal["fail", "train"]
    partial_rollout: bool
    mask_offpolicy_in_partial_rollout: bool
    group_reward: bool
    reward_key: Optional[str]
    rollout_function: HookConfig
    eval_function: HookConfig
    custom_generate_function: HookConfig
    dynamic_sampling_filter: HookConfig
    over_sampling_filter: HookConfig
    buffer_filter: HookConfig
    reward_function: HookConfig


# ---- trainer, ray_init, root ----

@dataclass
class TrainerConfig(ConfigNode):
    device: Literal["auto", "cuda", "cpu"]
    nnodes: int = positive()
    n_gpus_per_node: int = positive()
    total_epochs: int = positive()
    total_training_steps: Optional[int] = positive()
    project_name: str
    experiment_name: str
    logger: list[str] = one_or_list()
    log_val_generations: int = at_least(0)
    rollout_data_dir: Optional[str]
    rollout_data_max_mb: Optional[float] = positive()
    validation_data_dir: Optional[str]
    balance_batch: bool
    save_freq: int
    test_freq: int
    val_before_train: bool
    val_only: bool
    summary_metric: Optional[str]  # summary.json's score: this validation metric; None: the mean of val-core/*
    critic_warmup: int = at_least(0)
    max_consecutive_nonfinite_steps: int = positive()
    seed: int
    resume_mode: Literal["auto", "disable", "resume_path"]
    resume_from_path: Optional[str]
    resume_accept_layout_change: bool
    default_local_dir: str
    max_actor_ckpt_to_keep: Optional[int] = positive()
    max_critic_ckpt_to_keep: Optional[int] = positive()
    del_local_ckpt_after_load: bool
    default_hdfs_dir: Optional[str]
    esi_redundant_time: float = at_least(0)
    ray_wait_register_center_timeout: float = positive()
    worker_call_timeout: Optional[float] = positive()
    heartbeat_interval: float = positive()
    heartbeat_timeout: float = positive()
    stop_on_signal: Literal["after_step", "now"]

    def runs_validation(self) -> bool:
        """Whether the trainer validates at all: before training or every test_freq steps (val_only validates
        through val_before_train)."""
        return self.val_before_train or self.test_freq > 0


@dataclass
class RolloutPoolConfig(ConfigNode):
    """The rollout's own resource pool when actor_rollout_ref.hybrid_engine=false (verl's recipe keys)."""
    nnodes: int = positive()
    n_gpus_per_node: int = positive()


@dataclass
class AsyncTrainingConfig(ConfigNode):
    """How generation and training are scheduled (trainer/ppo/schedule.py)."""
    mode: Literal["sync", "one_step_off", "fully_async"]
    max_staleness: int = at_least(0)
    stale_samples: Literal["drop", "requeue"]


@dataclass
class RayInitConfig(ConfigNode):
    address: Optional[str]
    num_cpus: Optional[int] = positive()
    node_ip_address: Optional[str]
    include_dashboard: bool
    start_timeout_s: Optional[float] = positive()
    timeline_json_file: Optional[str]


@dataclass
class PPOConfig(ConfigNode):
    """The whole job: what `python -m hybridrl.main_ppo` composes and the trainer reads."""
    data: DataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    critic: CriticConfig
    reward_model: RewardModelConfig
    custom_reward_function: CustomRewardFunctionConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    ray_init: RayInitConfig
    data_flow: DataFlowConfig
    rollout: RolloutPoolConfig
    async_training: AsyncTrainingConfig
    cache_dir: str
    extensions: list[str]
