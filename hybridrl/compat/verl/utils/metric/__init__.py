from hybridrl.trainer.ppo.metric_utils import reduce_metrics
from hybridrl.utils.metric import AggregationType, Metric

__all__ = ["reduce_metrics", "AggregationType", "Metric"]
