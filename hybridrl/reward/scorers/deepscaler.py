"""DeepScaleR's rule reward: 1 when the boxed answer AFTER the reasoning is right, else 0.

DeepScaleR (Luo et al., 2025) trains reasoning models that think inside <think>...</think>. Its reward reads
only the text after the last "</think>" (or after "###Response"); a response that never closes its reasoning
scores 0, as does one without a \\boxed{} answer there. The boxed answer is right when it equals one of the
ground truths (a string, a number, or a list of them; a boxed ground truth is unboxed first) under the MATH
normalisation of `scorers/math.py`, or — with math-verify installed — when math-verify proves them equal.
(DeepScaleR's own second check is a sympy grader; math-verify is hybridrl's symbolic check everywhere.)
"""
from __future__ import annotations

from typing import Any

from hybridrl.reward.scorers import math as math_scorer

REASONING_ENDS = ("</think>", "###Response")


def answer_after_reasoning(response: str) -> "str | None":
    """The text after the last "</think>" (else the first "###Response"); None when the reasoning never ends."""
    if "</think>" in response:
        return response.split("</think>")[-1]
    if "###Response" in response:
        return response.split("###Response")[1]
    return None


def _ground_truths(ground_truth: Any) -> list[str]:
    truths = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    unboxed = []
    for truth in map(str, truths):
        boxed = math_scorer.last_boxed_only_string(truth) if ("\\boxed" in truth or "\\fbox" in truth) else None
        unboxed.append(math_scorer.remove_boxed(boxed) if boxed is not None else truth)
    return [truth for truth in unboxed if truth != ""]


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 or 0.0, as the module docstring says."""
    solution = answer_after_reasoning(solution_str)
    if solution is None:
        return 0.0
    boxed = math_scorer.last_boxed_only_string(solution)
    if boxed is None:
        return 0.0
    grade = math_scorer.compute_score_math_verify if math_scorer.MATH_VERIFY_INSTALLED else math_scorer.compute_score
    for truth in _ground_truths(ground_truth):
        if grade(boxed, truth) == 1.0:
            return 1.0
    return 0.0


def score_deepscaler_sample(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return compute_score(solution_str, ground_truth)
