"""verl's `verl.workers.reward_manager.batch`."""
from hybridrl.reward.managers.batch import BatchRewardManager

__all__ = ["BatchRewardManager"]
