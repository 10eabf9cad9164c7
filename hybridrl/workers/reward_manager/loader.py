"""Build the configured reward manager: its class from `reward_model.reward_manager`, its scoring
function from `custom_reward_function.path/name` when a path is set, else the built-in dispatcher."""
from __future__ import annotations

from hybridrl.utils.import_utils import load_extern_object
from hybridrl.utils.reward_score import default_compute_score
from hybridrl.workers.reward_manager.registry import get_reward_manager_cls


def get_custom_reward_fn(config):
    """The user's scoring function, or None when `custom_reward_function.path` is unset."""
    custom = config.get("custom_reward_function") or {}
    if not custom.get("path"):
        return None
    if not custom.get("name"):
        raise ValueError(f"custom_reward_function.path is {custom['path']!r} but custom_reward_function.name is empty")
    return load_extern_object(custom["path"], custom["name"])


def load_reward_manager(config, tokenizer, num_examine: int):
    """The reward manager for the whole run config (`reward_model`, `custom_reward_function`, `data.reward_fn_key`)."""
    manager_cls = get_reward_manager_cls(config.reward_model.reward_manager)
    compute_score = get_custom_reward_fn(config) or default_compute_score
    return manager_cls(tokenizer=tokenizer, num_examine=num_examine, compute_score=compute_score,
                       reward_fn_key=config.data.reward_fn_key)
