from hybridrl.trainer.ppo.metric_utils import timer as simple_timer

__all__ = ["simple_timer"]
