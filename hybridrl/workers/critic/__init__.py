"""The critic: DataParallelPPOCritic (update logic) and CriticWorker (one rank of the value model)."""
from hybridrl.workers.critic.dp_critic import DataParallelPPOCritic
from hybridrl.workers.critic.worker import CriticWorker

__all__ = ["CriticWorker", "DataParallelPPOCritic"]
