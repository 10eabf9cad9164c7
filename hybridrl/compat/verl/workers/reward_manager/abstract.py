"""verl's `verl.workers.reward_manager.abstract`: the base class verl users subclass for their reward manager."""
from hybridrl.reward.managers.registry import AbstractRewardManager

__all__ = ["AbstractRewardManager"]
