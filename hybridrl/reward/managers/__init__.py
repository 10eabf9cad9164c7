"""Reward managers turn generated responses into token-level scores; pick one by name in the config."""
from hybridrl.reward.managers.registry import get_reward_manager_cls, register_reward_manager
from hybridrl.reward.managers.base import RewardManagerBase  # noqa: E402
# Imported for their @register_reward_manager side effect ("naive", "batch", "dapo").
from hybridrl.reward.managers.naive import NaiveRewardManager  # noqa: E402
from hybridrl.reward.managers.batch import BatchRewardManager  # noqa: E402
from hybridrl.reward.managers.dapo import DAPORewardManager  # noqa: E402
from hybridrl.reward.managers.loader import get_custom_reward_fn, load_reward_manager  # noqa: E402

__all__ = ["register_reward_manager", "get_reward_manager_cls", "RewardManagerBase", "NaiveRewardManager",
           "BatchRewardManager", "DAPORewardManager", "load_reward_manager", "get_custom_reward_fn"]
