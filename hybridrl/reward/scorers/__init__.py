"""Rule-based reward scores, dispatched by the sample's `data_source`.

`default_compute_score` is what the reward managers call when the user gives no
`custom_reward_function`. Built-in scorers (GSM8K, MATH, DAPO's math, reasoning-gym tasks) register
themselves on import below; users add theirs with `@register_scorer("my/source")`. Scorers chosen by name
instead of by data source (deepscaler, f1, a remote reward model, ...) are the reward hub's: reward/hub.py.
"""
from __future__ import annotations

from typing import Any, Optional

from hybridrl.reward.scorers.registry import get_scorer, register_scorer, registered_scorer_keys
# Imported for their @register_scorer side effect.
from hybridrl.reward.scorers import arithmetic_tool, gsm8k, math, math_dapo, reasoning_gym  # noqa: F401,E402

__all__ = ["default_compute_score", "register_scorer", "get_scorer", "registered_scorer_keys"]


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: Optional[dict] = None) -> "float | dict":
    """Score one decoded response with the scorer registered for `data_source`."""
    scorer = get_scorer(data_source)
    return scorer(data_source, solution_str, ground_truth, extra_info)
