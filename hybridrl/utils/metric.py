"""A metric that carries how its values combine (verl's `Metric`), for values reported once per micro-batch.

Most per-micro-batch metrics are means of something and are averaged. A loss normalised by the global batch's
counts is a share of the global loss instead, and reads as the global value only when summed over the
micro-batches (our own update loop sums those itself: workers/ppo_update_loop.MicroBatchLoss.loss_terms). verl
lets worker code say which with `Metric(aggregation="sum", value=loss)`; `reduce_metrics`
(trainer/ppo/metric_utils.py) honours it, so verl code that reports metrics this way ports unchanged.
"""
from __future__ import annotations

import math
import numbers
from enum import Enum
from typing import Any, Callable

import numpy as np
import torch


class AggregationType(Enum):
    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_REDUCERS: dict[AggregationType, Callable[[Any], Any]] = {
    AggregationType.MEAN: np.mean, AggregationType.SUM: np.sum, AggregationType.MIN: np.min,
    AggregationType.MAX: np.max}


class Metric:
    """The values one metric took (numbers; a one-element tensor or array is read as its number) and how they
    combine into one: `aggregate()`."""

    def __init__(self, aggregation: str | AggregationType, value: Any = None) -> None:
        self.aggregation = AggregationType(aggregation)  # an unknown name raises ValueError naming it
        self.values: list[float] = []
        if isinstance(value, list):
            self.extend(value)
        elif value is not None:
            self.append(value)

    def __repr__(self) -> str:
        return f"Metric(aggregation={self.aggregation.value!r}, values={self.values})"

    def append(self, value: Any) -> None:
        """Add one value, or all of another Metric's values."""
        if isinstance(value, Metric):
            self.extend(value)
        else:
            self.values.append(_number(value))

    def extend(self, values: Metric | list) -> None:
        """Add several values; another Metric's only when it aggregates the same way."""
        if isinstance(values, Metric):
            if values.aggregation != self.aggregation:
                raise ValueError(f"Metric: cannot add values aggregated by {values.aggregation.value} to a metric "
                                 f"aggregated by {self.aggregation.value}")
            values = values.values
        for value in values:
            self.append(value)

    def aggregate(self) -> float:
        if not self.values:
            raise ValueError(f"Metric: no values to take the {self.aggregation.value} of")
        return float(_REDUCERS[self.aggregation](self.values))

    def init_list(self) -> Metric:
        """An empty Metric that aggregates the same way (what append_to_dict starts a new key with)."""
        return Metric(self.aggregation)

    @classmethod
    def from_dict(cls, data: dict[str, Any], aggregation: str | AggregationType) -> dict[str, Metric]:
        return {key: cls(aggregation, value) for key, value in data.items()}

    @classmethod
    def aggregate_dp(cls, per_rank: list[Metric]) -> float:
        """One value from each data-parallel rank's Metric, each holding one value per micro-batch.

        mean and sum: the micro-batch values are first averaged over the ranks (as FSDP averages the gradients
        of the losses they stand for), then aggregated; min and max: over every value of every rank.
        """
        if not per_rank:
            raise ValueError("Metric.aggregate_dp: no metrics given")
        aggregation = per_rank[0].aggregation
        if any(metric.aggregation != aggregation for metric in per_rank):
            raise ValueError(f"Metric.aggregate_dp: the ranks aggregate differently: "
                             f"{[metric.aggregation.value for metric in per_rank]}")
        lengths = [len(metric.values) for metric in per_rank]
        if len(set(lengths)) != 1:
            raise ValueError(f"Metric.aggregate_dp: every rank must hold one value per micro-batch, got {lengths}")
        values = np.array([metric.values for metric in per_rank])  # (ranks, micro-batches)
        if aggregation in (AggregationType.MEAN, AggregationType.SUM):
            values = values.mean(axis=0)
        return float(_REDUCERS[aggregation](values))


def append_to_dict(data: dict[str, list | Metric], new_data: dict[str, Any], prefix: str = "") -> None:
    """Collect `new_data` into `data` (verl's `py_functional.append_to_dict`): each value is appended to the list
    under `prefix + key` (a list value: each of its items), or to a Metric there when the value is a Metric. A key
    that already starts with `prefix` keeps its name."""
    for key, value in new_data.items():
        name = key if key.startswith(prefix) else prefix + key
        collected = data.setdefault(name, value.init_list() if isinstance(value, Metric) else [])
        if isinstance(value, list):
            collected.extend(value)
        else:
            collected.append(value)


def _number(value: Any) -> float:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if math.prod(value.shape) != 1:
            raise ValueError(f"Metric: a {type(value).__name__} of shape {tuple(value.shape)} is not one value")
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(f"Metric: expected a number or a one-element tensor, got {type(value).__name__}")
    return value
