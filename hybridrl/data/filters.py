"""Built-in filters of the data flow, selectable by name with `path: null` (hooks.py has the contracts).

- check_reward_nonzero_std (dynamic sampling, DAPO): keep a group whose rewards are not all equal; an all-correct
  or all-wrong group gives every sample the same group-relative advantage of 0 and teaches nothing.
- sort_by_reward_std (over-sampling): the groups with the most spread-out rewards first.
- pop_first (buffer): first in, first out.
- metric_nonzero_std(metric): verl's algorithm.filter_groups (DAPO) on `metric`: "score", "seq_reward" and
  "seq_final_reward" are the sample's reward; any other name a numeric key of the reward manager's extra info
  (e.g. "acc").
"""
from __future__ import annotations

import numpy as np

__all__ = ["check_reward_nonzero_std", "sort_by_reward_std", "pop_first"]


def group_reward_std(group) -> float:
    return float(np.std([sample.reward_value() for sample in group]))


def check_reward_nonzero_std(config, group) -> bool:
    return group_reward_std(group) > 1e-6


def sort_by_reward_std(config, groups):
    return sorted(groups, key=group_reward_std, reverse=True)  # stable: ties keep their order


def pop_first(config, step, buffer, num_groups):
    return buffer[:num_groups]


def metric_nonzero_std(metric: str):
    """The dynamic-sampling filter of algorithm.filter_groups: the group's `metric` is not the same for all."""
    def value(sample) -> float:
        if metric in ("score", "seq_reward", "seq_final_reward"):
            return sample.reward_value()
        extra = sample.metadata.get("reward_extra_info") or {}
        if metric not in extra:
            raise KeyError(f"algorithm.filter_groups.metric={metric!r}: the reward gave no such value (its extra "
                           f"info has {sorted(extra)}); use score or a key the scorer returns")
        return float(extra[metric])

    def keep(config, group) -> bool:
        return float(np.std([value(sample) for sample in group])) > 1e-6
    return keep
