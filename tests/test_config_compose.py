"""Composition with Hydra's compose API: group choices, dot overrides, `+` additions, a user's YAML on top of ours."""
import importlib.util
import textwrap

import pytest
import torch
from hydra.errors import ConfigCompositionException

from hybridrl.config import ConfigError, compose_config, validate_config
from hybridrl.config.compose import override_defined_keys

USER_YAML = textwrap.dedent("""
    hydra:
      searchpath:
        - pkg://hybridrl.config
    defaults:
      - ppo_trainer
      - override algorithm: gae
      - _self_
    data:
      train_batch_size: 32
    actor_rollout_ref:
      actor:
        optim:
          lr: 2e-6
""")


def test_algorithm_group_choice():
    grpo, gae = compose_config(), compose_config(["algorithm=gae"])
    assert (grpo.algorithm.adv_estimator, gae.algorithm.adv_estimator) == ("grpo", "gae")
    assert validate_config(gae).critic.enable is True


def test_dot_overrides_reach_the_keys_that_interpolate_them():
    cfg = compose_config(["data.max_prompt_length=77", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                          "actor_rollout_ref.actor.optim.lr=3e-6"])
    config = validate_config(cfg)
    assert config.actor_rollout_ref.rollout.prompt_length == 77
    assert config.critic.ppo_mini_batch_size == 4 and config.critic.ppo_micro_batch_size_per_gpu == 2
    assert config.actor_rollout_ref.actor.optim.lr == 3e-6


def test_plus_adds_a_key_and_validation_then_names_it():
    cfg = compose_config(["+trainer.note=hello"])
    assert cfg.trainer.note == "hello"
    with pytest.raises(ConfigError) as caught:
        validate_config(cfg)
    assert caught.value.problems == [
        "trainer.note: expected a known key, got unknown key (value 'hello'); did you mean trainer.nnodes?"]


def test_plus_on_a_key_we_define_overrides_it_as_verl_scripts_write():
    """verl's scripts add with '+' the keys verl's YAML lacks; where ours has the key the '+' is an override. On a new
    key it stays Hydra's append, and on a config group (a dict) Hydra's own rule: one choice per group."""
    overrides = ["+reward_model.overlong_buffer.enable=True", "+reward_model.overlong_buffer.len=4",
                 "+trainer.logger=[console]", "+trainer.note=hello", "++data.train_batch_size=8", "algorithm=gae"]
    assert override_defined_keys(overrides, compose_config()) == [
        "++reward_model.overlong_buffer.enable=True", "++reward_model.overlong_buffer.len=4",
        "++trainer.logger=[console]", "+trainer.note=hello", "++data.train_batch_size=8", "algorithm=gae"]
    cfg = compose_config(overrides)
    assert (cfg.reward_model.overlong_buffer.enable, cfg.reward_model.overlong_buffer.len) == (True, 4)
    assert (list(cfg.trainer.logger), cfg.trainer.note, cfg.data.train_batch_size) == (["console"], "hello", 8)
    with pytest.raises(ConfigCompositionException, match="Multiple values for algorithm"):
        compose_config(["+algorithm=gae"])


def test_plus_is_judged_against_the_config_the_other_overrides_compose(tmp_path):
    """A key only a user's YAML defines is defined too: `+` on it overrides it."""
    (tmp_path / "my_run.yaml").write_text(USER_YAML + "my_setting: 1\n")
    assert compose_config(["+my_setting=2"], config_name="my_run", config_dir=str(tmp_path)).my_setting == 2


def test_override_of_unknown_key_without_plus_is_refused_by_hydra():
    with pytest.raises(ConfigCompositionException, match="data.train_batch_sise"):
        compose_config(["data.train_batch_sise=3"])


def test_user_yaml_extends_ours(tmp_path):
    (tmp_path / "my_run.yaml").write_text(USER_YAML)
    cfg = compose_config(["trainer.nnodes=2", "trainer.n_gpus_per_node=1"], config_name="my_run",
                         config_dir=str(tmp_path))
    assert "hydra" not in cfg
    config = validate_config(cfg)
    assert config.data.train_batch_size == 32
    assert config.actor_rollout_ref.actor.optim.lr == 2e-6
    assert config.algorithm.adv_estimator == "gae" and config.critic.enable is True
    assert config.trainer.nnodes == 2
    assert config.actor_rollout_ref.rollout.name == "hf"  # everything else from ppo_trainer.yaml


def test_typo_in_user_yaml_is_caught_by_validation(tmp_path):
    (tmp_path / "typo.yaml").write_text(USER_YAML.replace("train_batch_size: 32", "train_bach_size: 32"))
    with pytest.raises(ConfigError) as caught:
        validate_config(compose_config(config_name="typo", config_dir=str(tmp_path)))
    assert caught.value.problems == [
        "data.train_bach_size: expected a known key, got unknown key (value 32); did you mean data.train_batch_size?"]


def test_verl_grpo_override_list_composes_and_only_what_this_machine_lacks_is_refused():
    # verl's GRPO example command line (examples/grpo_trainer), unchanged except for local paths.
    verl_overrides = """
        algorithm.adv_estimator=grpo data.train_files=/d/train.parquet data.val_files=/d/test.parquet
        data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=1024
        data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.model.path=/m/qwen
        actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
        actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
        actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
        actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
        algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=[console,wandb]
        trainer.project_name=verl_grpo_example_gsm8k trainer.experiment_name=qwen2_7b_function_rm
        trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
    """.split()
    cfg = compose_config(verl_overrides)
    assert cfg.actor_rollout_ref.rollout.n == 5 and cfg.trainer.n_gpus_per_node == 8
    # Batch sizes divide (1024 % 256 = 0; 256 * 5 / 8 = 160 rows per GPU, 4 micro-batches of 40) and vLLM's
    # tensor parallelism is built (vllm_rollout.py), so only what this machine lacks is refused: vLLM and a GPU.
    expected = [] if importlib.util.find_spec("vllm") else [
        "actor_rollout_ref.rollout.name: expected a rollout whose engine is installed, got 'vllm' (the vllm package "
        "is not importable: pip install -e '.[vllm]'; offline GPU host: scripts/gpu/install_vllm.sh)"]
    if not torch.cuda.is_available():
        expected.append("actor_rollout_ref.rollout.name: expected 'hf' without a GPU (trainer.device='auto', CUDA "
                        "available: False), got 'vllm' (vllm needs a CUDA GPU)")
    if not expected:  # a GPU machine with vLLM: the example validates as it is
        validate_config(cfg)
        return
    with pytest.raises(ConfigError) as caught:
        validate_config(cfg)
    assert caught.value.problems == expected
