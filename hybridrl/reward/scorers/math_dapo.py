"""DAPO's math scorer (verl's `math_dapo`): the answer after the last "Answer:", Minerva-normalised, +1 or -1.

DAPO trains on integer-answer competition problems and asks the model to end with "Answer: $ANSWER".
Only the last 300 characters of the response are read (the longest MATH-500 answer is 159 characters), the
text after the LAST "Answer:" up to the line end is the prediction, and both it and the ground truth go
through `normalize_final_answer`, the answer normalisation of the Minerva paper (Lewkowycz et al., 2022,
appendix D.1: units and filler words dropped, \\text{} unwrapped, "x = 5" -> "5", "1,000" -> "1000").
A correct answer scores +1.0, anything else -1.0 (no answer is wrong, not neutral).

The result is verl's dict: {"score": +-1.0, "acc": bool, "pred": the normalised prediction}, so `acc`
arrives as the per-sample extra `reward/acc/mean`. With `strict_box_verify` the prediction is instead the
last \\boxed{} of the last 100 characters, compared without normalisation.

Registered for verl's data sources of this scorer: "math_dapo", "math", "math_dapo_reasoning" and "aime*".
"""
from __future__ import annotations

import re
from typing import Optional

from hybridrl.reward.scorers.math import last_boxed_only_string, remove_boxed
from hybridrl.reward.scorers.registry import register_scorer

ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
NO_ANSWER = "[INVALID]"

# Minerva's normalisation, in its order: rewrites first, then expressions removed outright.
_REWRITES = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
             (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots")


def normalize_final_answer(answer: str) -> str:
    """Minerva's normal form of a final answer (see the module docstring)."""
    text = str(answer).split("=")[-1]
    for old, new in _REWRITES:
        text = text.replace(old, new)
    for removed in _REMOVED:
        text = text.replace(removed, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", text)  # keep only the first $...$ span
    for command in ("text", "textbf", "overline"):
        text = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", text)
    text = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", text)
    text = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", text)  # \frac12 -> \frac{1}{2}
    text = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", text)  # \sqrt2 -> \sqrt{2}
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def extract_prediction(solution_str: str) -> str:
    """The normalised text after the last "Answer:", or "[INVALID]" when there is none."""
    matches = ANSWER_PATTERN.findall(solution_str)
    return normalize_final_answer(matches[-1]) if matches else NO_ANSWER


def _strict_box_prediction(solution_str: str) -> Optional[str]:
    boxed = last_boxed_only_string(solution_str[-100:])
    return remove_boxed(boxed) if boxed is not None else None


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False) -> dict:
    """{"score": 1.0 if the prediction equals the ground truth else -1.0, "acc": bool, "pred": prediction}."""
    tail = solution_str[-300:]
    if strict_box_verify:
        prediction = _strict_box_prediction(tail)
        correct = prediction == ground_truth
    else:
        prediction = extract_prediction(tail)
        correct = prediction == normalize_final_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": prediction}


def score_dapo_sample(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    return compute_score(solution_str, str(ground_truth))


for _source in ("math_dapo", "math", "math_dapo_reasoning", "aime*"):
    register_scorer(_source)(score_dapo_sample)
