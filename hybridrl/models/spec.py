"""The model each role loads, resolved once by the controller: `ModelSpec`.

verl's workers each read their section's `model` keys and load from them, so every worker resolves the same
path, override and LoRA settings again, in a process whose working directory may not be the driver's. Here the
controller (trainer/ppo/ray_trainer.py) turns `actor_rollout_ref.model`, `critic.model` and `reward_model.model`
into frozen specs once, before any worker starts, and hands each worker group its role's spec; the rollout
engines take the policy's. Below the controller nothing reads a section's model keys: what to load is the spec,
how to shard it (`fsdp_config`) stays in the role's section.

Resolved here: the path made absolute (a relative `model.path` names the driver's directory, whatever a Ray
worker's working directory is), `override_config` as a plain dict, and LoRA as one optional `LoraSpec` (none
when `lora_rank` is 0). The directories themselves were checked up front (models/config_checks.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hybridrl.models.attention import attention_implementation
from hybridrl.models.fsdp_utils import apply_liger, apply_lora, load_hf_model, plain
from hybridrl.utils.import_utils import load_extensions


@dataclass(frozen=True)
class LoraSpec:
    """peft LoRA adapters on a model (models/fsdp_utils.apply_lora)."""
    rank: int
    alpha: int
    target_modules: str | tuple[str, ...]
    exclude_modules: str | None = None
    adapter_path: str | None = None  # a saved peft adapter to continue from (policy only)


@dataclass(frozen=True)
class ModelSpec:
    """One role's model. key: the config section it was resolved from, for messages ("critic.model")."""
    key: str
    path: str
    trust_remote_code: bool = False
    external_lib: str | None = None  # a module registering a custom architecture with transformers' Auto classes
    override_config: dict[str, Any] = field(default_factory=dict)
    gradient_checkpointing: bool = False
    use_remove_padding: bool = False
    use_liger: bool = False
    use_fused_kernels: bool = False
    lora: LoraSpec | None = None

    @property
    def local_path(self) -> str:
        """verl's name for the local directory (HFModelConfig.local_path), for engines and loops ported from verl."""
        return self.path

    def import_external_lib(self) -> None:
        """Import `external_lib` in this process (before any Auto class looks up the architecture)."""
        if self.external_lib:
            load_extensions([self.external_lib])

    def load(self, *, dtype: torch.dtype, device: str, init_seed: int, value_head: bool = False,
             with_lora: bool = True) -> nn.Module:
        """The model on the CPU in `dtype`, unsharded: a causal LM, or with value_head the critic's backbone with a
        fresh one-output head (drawn from init_seed); liger's kernels when use_liger, LoRA adapters when with_lora
        and the spec has LoRA. The attention kernel follows the device and the batch layout (models/attention.py)."""
        self.import_external_lib()
        module = load_hf_model(self.path, value_head=value_head, trust_remote_code=self.trust_remote_code,
                               override_config=self.override_config, dtype=dtype,
                               gradient_checkpointing=self.gradient_checkpointing, init_seed=init_seed,
                               attn_implementation=attention_implementation(device, self.use_remove_padding))
        if self.use_liger:
            apply_liger(module)
        if with_lora and self.lora is not None:
            module = apply_lora(module, lora_rank=self.lora.rank, lora_alpha=self.lora.alpha,
                                target_modules=self.lora.target_modules, exclude_modules=self.lora.exclude_modules,
                                adapter_path=self.lora.adapter_path, value_head=value_head)
        return module


def policy_model_spec(config) -> ModelSpec:
    """The actor's, reference's and rollout engines' model: `actor_rollout_ref.model`."""
    model = config.actor_rollout_ref.model
    lora = None
    if model.lora_rank > 0:
        lora = LoraSpec(rank=model.lora_rank, alpha=model.lora_alpha, target_modules=_modules(model.target_modules),
                        exclude_modules=model.exclude_modules,
                        adapter_path=None if model.lora_adapter_path is None else _local(model.lora_adapter_path))
    return ModelSpec(key="actor_rollout_ref.model", path=_local(model.path), trust_remote_code=model.trust_remote_code,
                     external_lib=model.external_lib, override_config=plain(model.override_config),
                     gradient_checkpointing=model.enable_gradient_checkpointing,
                     use_remove_padding=model.use_remove_padding, use_liger=model.use_liger,
                     use_fused_kernels=model.use_fused_kernels, lora=lora)


def critic_model_spec(config) -> ModelSpec:
    """The value model's backbone: `critic.model` (its value head is trained in full, never an adapter)."""
    model = config.critic.model
    lora = None
    if model.lora_rank > 0:
        lora = LoraSpec(rank=model.lora_rank, alpha=model.lora_alpha, target_modules=_modules(model.target_modules))
    return ModelSpec(key="critic.model", path=_local(model.path), trust_remote_code=model.trust_remote_code,
                     external_lib=model.external_lib, override_config=plain(model.override_config),
                     gradient_checkpointing=model.enable_gradient_checkpointing,
                     use_remove_padding=model.use_remove_padding, lora=lora)


def reward_model_spec(config) -> ModelSpec:
    """The learned reward model: `reward_model.model` (frozen; sequence classification, loaded by its worker)."""
    model = config.reward_model.model
    return ModelSpec(key="reward_model.model", path=_local(model.path), trust_remote_code=model.trust_remote_code,
                     external_lib=model.external_lib)


def _local(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _modules(target_modules) -> str | tuple[str, ...]:
    """peft's target_modules: "all-linear" (or another single name) as it is, a list as a tuple (frozen)."""
    return target_modules if isinstance(target_modules, str) else tuple(target_modules)
