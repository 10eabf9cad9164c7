"""verl's `verl.workers.reward_manager.dapo`."""
from hybridrl.reward.managers.dapo import DAPORewardManager

__all__ = ["DAPORewardManager"]
