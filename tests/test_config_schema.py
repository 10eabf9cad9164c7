"""The dataclasses in hybridrl/config/schema.py mirror the YAML tree exactly, for every group choice."""
import dataclasses
import itertools
import os
import pickle

import pytest
from omegaconf import DictConfig, OmegaConf

from hybridrl.config import CONFIG_DIR, NOT_IMPLEMENTED, NOT_IMPLEMENTED_VALUES, compose_config, validate_config
from hybridrl.config.checks import REGISTRIES
from hybridrl.config.schema import PPOConfig
from hybridrl.config.structure import schema_key_paths
from hybridrl.config.validation import DEPRECATED

# Every group of ppo_trainer.yaml (as an override names it) and the choices its folder holds.
GROUP_KEYS = {"data": "data", "actor": "actor@actor_rollout_ref.actor", "rollout": "rollout@actor_rollout_ref.rollout",
              "ref": "ref@actor_rollout_ref.ref", "critic": "critic", "reward_model": "reward_model",
              "algorithm": "algorithm", "trainer": "trainer", "ray_init": "ray_init",
              "data_flow": "data_flow"}
GROUPS = {GROUP_KEYS[folder]: sorted(name[:-5] for name in os.listdir(os.path.join(CONFIG_DIR, folder))
                                     if name.endswith(".yaml"))
          for folder in GROUP_KEYS}
GROUP_CHOICES = [dict(zip(GROUPS, combo)) for combo in itertools.product(*GROUPS.values())]


def yaml_key_paths(node: DictConfig, prefix: str = "") -> set[str]:
    """Leaf key paths of a composed config; an empty mapping ({} in YAML) is a leaf."""
    paths = set()
    for key in node.keys():
        path = f"{prefix}.{key}" if prefix else key
        child = node._get_node(key)
        if isinstance(child, DictConfig) and len(child) > 0:
            paths |= yaml_key_paths(child, path)
        else:
            paths.add(path)
    return paths


def test_every_group_folder_has_a_choice():
    assert GROUPS["algorithm"] == ["gae", "grpo"]
    assert all(GROUPS.values())


@pytest.mark.parametrize("choices", GROUP_CHOICES, ids=lambda c: ",".join(f"{g}={v}" for g, v in c.items()))
def test_dataclass_keys_equal_yaml_keys(choices):
    cfg = compose_config([f"{group}={choice}" for group, choice in choices.items()])
    yaml_keys, schema_keys = yaml_key_paths(cfg), schema_key_paths(PPOConfig)
    assert yaml_keys - schema_keys == set(), "keys in the YAML but not in schema.py"
    assert schema_keys - yaml_keys == set(), "keys in schema.py but not in the YAML"


def test_rule_tables_name_real_keys_and_yaml_defaults_pass_them():
    cfg = compose_config()
    schema_keys = schema_key_paths(PPOConfig)
    for key, supported in NOT_IMPLEMENTED.items():
        assert key in schema_keys
        assert OmegaConf.select(cfg, key) == supported, f"YAML default of {key} is itself not implemented"
    for key in [*NOT_IMPLEMENTED_VALUES, *DEPRECATED, *DEPRECATED.values(), *REGISTRIES]:
        assert key in schema_keys


def test_defaults_validate_and_resolve_critic_enable():
    grpo = validate_config(compose_config())
    gae = validate_config(compose_config(["algorithm=gae"]))
    assert isinstance(grpo, PPOConfig)
    assert (grpo.algorithm.adv_estimator, grpo.critic.enable) == ("grpo", False)
    assert (gae.algorithm.adv_estimator, gae.critic.enable) == ("gae", True)


def test_attribute_names_are_yaml_keys_and_values_are_typed():
    config = validate_config(compose_config())
    actor = config.actor_rollout_ref.actor
    assert actor.ppo_mini_batch_size == 8 and actor.ppo_micro_batch_size_per_gpu == 4
    assert actor.optim.lr == 1e-4 and type(actor.optim.lr) is float
    assert actor.optim.betas == [0.9, 0.999]
    assert actor.checkpoint.load_contents == ["model", "optimizer", "extra"]  # ${.save_contents} resolved
    assert config.critic.ppo_mini_batch_size == 8  # ${actor_rollout_ref.actor.ppo_mini_batch_size}
    assert config.actor_rollout_ref.rollout.prompt_length == config.data.max_prompt_length == 64
    assert config.trainer.logger == ["console"]
    assert config.data.train_files == [os.path.join(config.cache_dir, "data/default/train.parquet")]
    assert config.actor_rollout_ref.rollout.engine_kwargs.sglang == {}


def test_verl_style_get_and_item_access():
    config = validate_config(compose_config())
    assert config.trainer.get("nnodes") == 1
    assert config.trainer.get("no_such_key", "fallback") == "fallback"
    assert config["data"]["seed"] == 1
    assert "ppo_epochs" in config.actor_rollout_ref.actor and "get" not in config.actor_rollout_ref.actor
    with pytest.raises(KeyError):
        config.data["nope"]


def test_config_pickles_unchanged():
    config = validate_config(compose_config(["algorithm=gae"]))
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config and copy is not config
    assert dataclasses.asdict(copy)["critic"]["optim"]["lr"] == 1e-5
