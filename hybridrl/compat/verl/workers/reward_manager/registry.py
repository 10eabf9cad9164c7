"""verl's `verl.workers.reward_manager.registry`: `register` is `hybridrl.reward.managers.register_reward_manager`."""
from hybridrl.reward.managers.registry import REWARD_MANAGER_REGISTRY, get_reward_manager_cls
from hybridrl.reward.managers.registry import register_reward_manager as register

__all__ = ["REWARD_MANAGER_REGISTRY", "register", "get_reward_manager_cls"]
