"""Scorer registry: which function scores a sample, chosen by the sample's `data_source`.

A scorer has the signature of verl's `compute_score`:
    scorer(data_source, solution_str, ground_truth, extra_info) -> float | dict
(a dict carries the reward under "score" plus extra per-sample values for metrics).
Keys are either an exact data source ("openai/gsm8k") or a prefix pattern ending in "*"
("reasoning_gym/*"). An exact key wins over a pattern; among patterns the longest prefix wins.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

Scorer = Callable[[str, str, Any, Optional[dict]], "float | dict"]

_SCORERS: dict[str, Scorer] = {}


def register_scorer(prefix_or_name: str) -> Callable[[Scorer], Scorer]:
    """Decorator: score every sample whose data_source is `prefix_or_name` (or starts with it, if it ends in '*')."""
    def decorator(scorer: Scorer) -> Scorer:
        if prefix_or_name in _SCORERS:
            raise ValueError(f"a scorer is already registered for {prefix_or_name!r}: {_SCORERS[prefix_or_name]}")
        _SCORERS[prefix_or_name] = scorer
        return scorer
    return decorator


def get_scorer(data_source: str) -> Scorer:
    """The scorer registered for `data_source`; the error lists every known key."""
    if data_source in _SCORERS:
        return _SCORERS[data_source]
    matching_patterns = [key for key in _SCORERS if key.endswith("*") and data_source.startswith(key[:-1])]
    if matching_patterns:
        return _SCORERS[max(matching_patterns, key=len)]
    raise NotImplementedError(
        f"no reward scorer for data_source {data_source!r}; known: {sorted(_SCORERS)}. "
        "Register one with hybridrl.reward.scorers.register_scorer or set custom_reward_function.path/name."
    )


def registered_scorer_keys() -> list[str]:
    return sorted(_SCORERS)
