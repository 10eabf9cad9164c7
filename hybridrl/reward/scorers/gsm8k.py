"""GSM8K scoring: the answer is the number after '#### ' (strict) or the last number in the text (flexible).

Both extractions drop thousands separators and '$' and compare the result to the ground truth
as a string, so "#### 1,234" matches "1234" but "3.50" does not match "3.5" (GSM8K answers are
integers; a trailing sentence period, as in "#### 72.", is dropped).
"""
from __future__ import annotations

import re
from typing import Optional

from hybridrl.reward.scorers.registry import register_scorer

_STRICT_ANSWER = re.compile(r"#### \$?(-?[0-9.,]+)")
_ANY_NUMBER = re.compile(r"-?[0-9.,]+")
_HAS_DIGIT = re.compile(r"[0-9]")


def extract_solution(solution_str: str, method: str = "strict") -> Optional[str]:
    """The model's final answer, or None when the text has none in the requested format."""
    if method == "strict":
        candidates = _STRICT_ANSWER.findall(solution_str)
    elif method == "flexible":
        candidates = _ANY_NUMBER.findall(solution_str)
    else:
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    candidates = [c for c in candidates if _HAS_DIGIT.search(c)]  # "," or "." alone is not a number
    if not candidates:
        return None
    return _clean_number(candidates[-1])


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").rstrip(".")


def compute_score(solution_str: str, ground_truth: str, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` for the right answer, `format_score` for a wrong one in the right format, 0 for no answer."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == _clean_number(str(ground_truth)) else format_score


@register_scorer("openai/gsm8k")
def score_gsm8k_sample(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return compute_score(solution_str, ground_truth)
