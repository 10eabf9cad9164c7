"""The reward both trainers use in benchmarks/vs_verl.py: hybridrl's reasoning-gym scorer, as a verl
`custom_reward_function` (path + name). verl's naive reward manager calls it with keyword arguments; hybridrl
loads the same file through its own `custom_reward_function` key, so both grade every response identically."""
from __future__ import annotations

from typing import Any

from hybridrl.reward.scorers.reasoning_gym import compute_score as reasoning_gym_score


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  **unused: Any) -> float:
    return reasoning_gym_score(data_source, solution_str, ground_truth, extra_info)
