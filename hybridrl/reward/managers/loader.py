"""Build the configured reward manager: its class from `reward_model.reward_manager`, its scoring
function from `custom_reward_function.rm_type` (a named built-in of the reward hub) or `.path/name` when one
is set (else None: the manager's own default, the built-in scorers by data_source for naive and dapo)."""
from __future__ import annotations

import inspect

from hybridrl.reward.custom_function import load_user_reward_fn
from hybridrl.reward.hub import RewardHub
from hybridrl.reward.managers.base import RewardManagerBase
from hybridrl.reward.managers.registry import get_reward_manager_cls


def get_custom_reward_fn(config):
    """The scoring function the config names: the reward hub's named scorer when `custom_reward_function.rm_type`
    is set (per sample, or over lists for reward_manager=batch; reward/hub.py), else the user's function, or None
    when `custom_reward_function.path` is unset too."""
    custom = config.get("custom_reward_function") or {}
    if custom.get("rm_type"):
        hub = RewardHub.from_config(config)
        return hub.batch_fn() if config.reward_model.reward_manager == "batch" else hub.per_sample_fn()
    return load_user_reward_fn(config)


# The constructor arguments every manager gets from the loader, and those a manager gets from a config key when its
# constructor names them (as verl's dapo manager). reward_model.reward_kwargs may name the latter, with the value the
# key holds (reward/config_checks.py), but not the former.
LOADER_ARGUMENTS = ("tokenizer", "num_examine", "compute_score", "reward_fn_key")
CONFIG_ARGUMENTS = {"max_resp_len": "data.max_response_length", "overlong_buffer_cfg": "reward_model.overlong_buffer"}


def load_reward_manager(config, tokenizer, num_examine: int):
    """The reward manager for the whole run config (`reward_model`, `custom_reward_function`, `data`).

    Every manager gets tokenizer, num_examine, compute_score and reward_fn_key (data.reward_fn_key), and
    reward_model.reward_kwargs as keyword arguments (verl's way). A manager whose constructor also names
    `max_resp_len` gets data.max_response_length, and one that names `overlong_buffer_cfg` gets
    reward_model.overlong_buffer (as verl's dapo manager); reward_kwargs' entries of these names hold the same
    values (validation copies reward_kwargs.overlong_buffer_cfg there, config_checks refuses another max_resp_len).
    A manager built on RewardManagerBase scores reward_model.max_concurrent samples at once; with
    reward_model.score_timeout set, it is watched (see base.py) with it and trainer.heartbeat_interval.
    What the manager is built with fits it: validation checked that (reward/config_checks.py).
    """
    name = config.reward_model.reward_manager
    manager_cls = get_reward_manager_cls(name)
    accepted = inspect.signature(manager_cls).parameters
    kwargs = dict(config.reward_model.reward_kwargs)
    if "max_resp_len" in accepted:
        kwargs["max_resp_len"] = config.data.max_response_length
    if "overlong_buffer_cfg" in accepted:
        kwargs["overlong_buffer_cfg"] = config.reward_model.overlong_buffer
    manager = manager_cls(tokenizer=tokenizer, num_examine=num_examine, compute_score=get_custom_reward_fn(config),
                          reward_fn_key=config.data.reward_fn_key, **kwargs)
    if isinstance(manager, RewardManagerBase):
        manager.set_max_concurrent(config.reward_model.max_concurrent)
    score_timeout = config.reward_model.get("score_timeout")
    if score_timeout is not None and isinstance(manager, RewardManagerBase):  # others: config_checks warns
        manager.set_score_timeout(score_timeout, heartbeat_interval=config.trainer.heartbeat_interval)
    return manager
