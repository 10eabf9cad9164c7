"""The per-role ModelSpec (models/spec.py): resolved once from the config by the controller, and the only thing a
worker loads its model from."""
from __future__ import annotations

import os
import pickle


from hybridrl.config import compose_config, validate_config
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.models.fsdp_utils import hf_module
from hybridrl.models.spec import LoraSpec, ModelSpec, critic_model_spec, policy_model_spec, reward_model_spec
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridrl.workers.critic import CriticWorker


def config(*overrides):
    return validate_config(compose_config(["data.train_files=x.parquet", "data.val_files=x.parquet", *overrides]))


def test_each_role_gets_its_sections_model_with_the_path_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = config("actor_rollout_ref.model.path=models/policy", "actor_rollout_ref.model.lora_rank=8",
                 "actor_rollout_ref.model.lora_alpha=16", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
                 "actor_rollout_ref.model.lora_adapter_path=adapters/a", "actor_rollout_ref.model.use_liger=false",
                 "actor_rollout_ref.model.use_remove_padding=true",
                 "+actor_rollout_ref.model.override_config.rope_theta=5000.0",
                 "critic.enable=true", "critic.model.path='~/critic'", "critic.model.enable_gradient_checkpointing=true",
                 "reward_model.enable=true", "reward_model.model.path=/abs/rm", "reward_model.micro_batch_size_per_gpu=1",
                 "reward_model.model.external_lib=my_rm_lib", "reward_model.model.trust_remote_code=true")

    policy = policy_model_spec(cfg)
    assert policy == ModelSpec(
        key="actor_rollout_ref.model", path=str(tmp_path / "models/policy"), override_config={"rope_theta": 5000.0},
        use_remove_padding=True,
        lora=LoraSpec(rank=8, alpha=16, target_modules=("q_proj", "v_proj"), adapter_path=str(tmp_path / "adapters/a")))
    assert policy.local_path == policy.path  # verl's name, for engines ported from verl

    critic = critic_model_spec(cfg)
    assert critic.key == "critic.model" and critic.path == str(tmp_path / "home/critic")
    assert critic.gradient_checkpointing and critic.lora is None and not critic.use_remove_padding

    assert reward_model_spec(cfg) == ModelSpec(key="reward_model.model", path="/abs/rm", trust_remote_code=True,
                                               external_lib="my_rm_lib")
    # Ray hands the spec to every worker process: it pickles to an equal spec.
    assert pickle.loads(pickle.dumps(policy)) == policy


def test_lora_rank_zero_is_no_lora_and_all_linear_stays_one_name():
    assert policy_model_spec(config("actor_rollout_ref.model.path=/m")).lora is None
    lora = policy_model_spec(config("actor_rollout_ref.model.path=/m", "actor_rollout_ref.model.lora_rank=4",
                                    "actor_rollout_ref.model.target_modules=all-linear")).lora
    assert lora == LoraSpec(rank=4, alpha=16, target_modules="all-linear")


def test_workers_load_the_spec_they_are_given_not_their_sections_model_keys(tmp_path, in_process_rank):
    """The section names a directory that does not exist and another LoRA rank; the workers load the spec's model
    (hidden size 24, LoRA rank 2), so nothing below the controller reads the section's model keys."""
    tokenizer = build_tokenizer(["one two three four five"] * 20, vocab_size=64)
    model_dir = build_tiny_model(str(tmp_path / "model"), tokenizer, hidden_size=24, num_layers=1, num_heads=2,
                                 num_kv_heads=1, intermediate_size=32)
    resolved = config(f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.lora_rank=2",
                      "actor_rollout_ref.model.target_modules=[q_proj]", f"critic.model.path={model_dir}",
                      "critic.enable=true")
    section = config("actor_rollout_ref.model.path=/no/such/model", "actor_rollout_ref.model.lora_rank=0",
                     "critic.model.path=/no/such/model", "critic.enable=true")
    assert not os.path.exists("/no/such/model")

    actor = ActorRolloutRefWorker(section.actor_rollout_ref, policy_model_spec(resolved), role="actor_ref",
                                  device="cpu")
    actor.init_model()
    policy = hf_module(actor.actor_module)
    assert policy.config.hidden_size == 24
    lora_ranks = {module.r["default"] for name, module in policy.named_modules() if name.endswith("q_proj")
                  and hasattr(module, "r")}
    assert lora_ranks == {2}
    assert actor.ref_policy.actor_module is actor.actor_module  # the LoRA reference is the actor, adapters off

    critic = CriticWorker(section.critic, critic_model_spec(resolved), rollout_n=1, device="cpu")
    critic.init_model()
    assert hf_module(critic.critic_module).config.hidden_size == 24
