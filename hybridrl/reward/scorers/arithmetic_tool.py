"""Scorer of the built-in arithmetic tool task (hybridrl/defaults/tool_task.py): 1 when the response's last
"The answer is N" states the right number, else 0 (a tool call alone earns nothing)."""
from __future__ import annotations

import re

from hybridrl.reward.scorers.registry import register_scorer

ANSWER = re.compile(r"The answer is (-?\d+)")


@register_scorer("hybridrl/arithmetic_tool")
def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    answers = ANSWER.findall(solution_str)
    return float(bool(answers) and answers[-1] == str(ground_truth).strip())
