"""The attention kernel of verl's run in benchmarks/vs_verl.py: hybridrl's `hybridrl_varlen` (PyTorch's own varlen
flash attention, hybridrl/models/attention.py), registered with transformers in verl's processes.

verl imports this module through its own extension hook, `actor_rollout_ref.model.external_lib` (HFModelConfig's
__post_init__ imports it in every process that builds the model config, before the model loads), and loads the
model with `override_config.attn_implementation=hybridrl_varlen`. So with remove padding both trainers attend with the
same kernel; verl's own default, flash_attention_2, needs flash-attn, which has no wheel for the GPU host
(benchmarks/vs_verl_settings.py says why)."""
from hybridrl.models.attention import register

register()
