"""verl's `verl.workers.reward_manager`: the reward-manager registry and the built-in managers.

A verl user's `@register("name")` class is selected with `reward_model.reward_manager=name`.
"""
from hybridrl.compat.verl.workers.reward_manager.registry import get_reward_manager_cls, register
from hybridrl.compat.verl.workers.reward_manager.abstract import AbstractRewardManager
from hybridrl.reward.managers import BatchRewardManager, DAPORewardManager, NaiveRewardManager

__all__ = ["AbstractRewardManager", "BatchRewardManager", "DAPORewardManager", "NaiveRewardManager", "register",
           "get_reward_manager_cls"]
