"""Metric (hybridrl/utils/metric.py): values that carry their aggregation, collected and reduced as verl's are."""
import numpy as np
import pytest
import torch

from hybridrl.trainer.ppo.metric_utils import reduce_metrics
from hybridrl.utils.metric import AggregationType, Metric, append_to_dict


def test_each_aggregation_of_the_same_values():
    values = [2.0, torch.tensor(6.0, requires_grad=True), np.float32(1.0), np.array([3.0])]
    assert Metric("mean", values).aggregate() == 3.0
    assert Metric(AggregationType.SUM, values).aggregate() == 12.0
    assert Metric("min", values).aggregate() == 1.0
    assert Metric("max", values).aggregate() == 6.0


def test_bad_values_and_names_are_refused_naming_them():
    with pytest.raises(ValueError, match="'median' is not a valid AggregationType"):
        Metric("median")
    with pytest.raises(ValueError, match=r"a Tensor of shape \(2,\) is not one value"):
        Metric("mean", torch.zeros(2))
    with pytest.raises(ValueError, match="got str"):
        Metric("mean", "0.5")
    with pytest.raises(ValueError, match="aggregated by sum to a metric aggregated by mean"):
        Metric("mean", 1.0).extend(Metric("sum", 2.0))
    with pytest.raises(ValueError, match="no values to take the max of"):
        Metric("max").aggregate()


def test_append_to_dict_collects_lists_and_metrics_under_the_prefix():
    collected: dict = {}
    append_to_dict(collected, {"loss": Metric("sum", 0.25), "critic/clipfrac": 0.5}, prefix="critic/")
    append_to_dict(collected, {"loss": Metric("sum", 0.5), "critic/clipfrac": [0.1, 0.3]}, prefix="critic/")
    assert sorted(collected) == ["critic/clipfrac", "critic/loss"]  # the prefix is not doubled
    assert collected["critic/clipfrac"] == [0.5, 0.1, 0.3]
    assert isinstance(collected["critic/loss"], Metric) and collected["critic/loss"].values == [0.25, 0.5]
    # a Metric by its own aggregation, a list by its mean
    assert reduce_metrics(collected) == {"critic/loss": 0.75, "critic/clipfrac": pytest.approx(0.3)}


def test_aggregate_dp_averages_the_ranks_before_a_sum_and_pools_them_for_a_max():
    rank_0, rank_1 = [1.0, 2.0, 3.0], [3.0, 4.0, 11.0]  # one value per micro-batch on each rank
    assert Metric.aggregate_dp([Metric("sum", rank_0), Metric("sum", rank_1)]) == 2.0 + 3.0 + 7.0
    assert Metric.aggregate_dp([Metric("mean", rank_0), Metric("mean", rank_1)]) == 4.0
    assert Metric.aggregate_dp([Metric("max", rank_0), Metric("max", rank_1)]) == 11.0
    assert Metric.aggregate_dp([Metric("min", rank_0), Metric("min", rank_1)]) == 1.0
    with pytest.raises(ValueError, match=r"one value per micro-batch, got \[3, 2\]"):
        Metric.aggregate_dp([Metric("sum", rank_0), Metric("sum", rank_1[:2])])
    with pytest.raises(ValueError, match=r"the ranks aggregate differently: \['sum', 'mean'\]"):
        Metric.aggregate_dp([Metric("sum", rank_0), Metric("mean", rank_1)])


def test_from_dict_makes_one_metric_per_key():
    metrics = Metric.from_dict({"a": 1.0, "b": [2.0, 4.0]}, aggregation="sum")
    assert {key: metric.aggregate() for key, metric in metrics.items()} == {"a": 1.0, "b": 6.0}
    assert all(metric.aggregation is AggregationType.SUM for metric in metrics.values())


def test_a_list_is_reduced_by_the_max_or_min_its_key_names_else_by_its_mean():
    """verl's rule: a peak over ranks stays a peak (perf/max_memory_allocated_gb of 2 ranks is the larger)."""
    reduced = reduce_metrics({"perf/max_memory_allocated_gb": [3.0, 5.0], "seqlen_balance/min_partition": [7, 4],
                              "actor/pg_loss": [1.0, 2.0]})
    assert reduced == {"perf/max_memory_allocated_gb": 5.0, "seqlen_balance/min_partition": 4.0, "actor/pg_loss": 1.5}
