"""verl's `verl.workers.reward_manager.naive`."""
from hybridrl.reward.managers.naive import NaiveRewardManager

__all__ = ["NaiveRewardManager"]
