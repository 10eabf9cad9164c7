"""MATH (Hendrycks) scoring: compare the last \\boxed{...} of the response to the ground truth.

Both sides go through `normalize_answer`, a small set of purely textual rewrites that make
equal LaTeX answers equal strings ("\\dfrac12" == "\\frac{1}{2}", "x = 5" == "5",
"90^\\circ" == "90", "0.5" == "\\frac{1}{2}"). It is not a CAS: "2/4" and "1/2" differ.

With the optional package `math-verify` installed (`pip install math-verify`), the registered
MATH scorer also accepts a boxed answer that math-verify proves equal to the ground truth
("2/4" == "\\frac{1}{2}", "\\frac{\\sqrt{8}}{2}" == "\\sqrt{2}"): `compute_score_math_verify`.
"""
from __future__ import annotations

import importlib.util
import re
import threading
from typing import Optional

from hybridrl.reward.scorers.registry import register_scorer

MATH_VERIFY_INSTALLED = importlib.util.find_spec("math_verify") is not None
MATH_VERIFY_TIMEOUT_S = 5

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed_only_string(text: str) -> Optional[str]:
    """The last "\\boxed{...}" (or "\\fbox{...}", or "\\boxed 5") in `text`, braces balanced; None if absent."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    after = start + len(command)
    if text.startswith(" ", after):  # "\boxed 5": the argument runs to the next '$' or the end
        return text[start:].split("$")[0].rstrip()
    depth = 0
    for position in range(after, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start:position + 1]
    return None  # unbalanced: the box never closes


def remove_boxed(boxed: str) -> str:
    """"\\boxed{x}" -> "x", "\\boxed x" -> "x"."""
    for command in _BOX_COMMANDS:
        if boxed.startswith(command + " "):
            return boxed[len(command) + 1:].strip()
        if boxed.startswith(command + "{") and boxed.endswith("}"):
            return boxed[len(command) + 1:-1]
    raise ValueError(f"not a boxed expression: {boxed!r}")


def normalize_answer(answer: str) -> str:
    """Textual normal form of a LaTeX answer (see the module docstring for what it equates)."""
    text = answer.replace("\n", "").replace("\\!", "").strip()
    for old, new in (("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""), ("\\right", ""),
                     ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""), ("$", ""), ("\\%", ""), ("%", "")):
        text = text.replace(old, new)
    text = re.sub(r"\\text\{\s*([^{}]*?)\s*\}", r"\1", text)
    text = re.sub(r"^[a-zA-Z]\w{0,1}\s*=\s*", "", text)  # "x = 5" -> "5" (short left-hand side only)
    text = text.replace(" ", "")
    text = re.sub(r"(^|[^0-9])\.([0-9])", r"\g<1>0.\2", text)  # ".5" -> "0.5"
    text = re.sub(r"\\sqrt([^{\\])", r"\\sqrt{\1}", text)  # "\sqrt3" -> "\sqrt{3}"
    text = _brace_frac_arguments(text)
    text = re.sub(r"^(-?[0-9]+)/([0-9]+)$", r"\\frac{\1}{\2}", text)  # "3/4" -> "\frac{3}{4}"
    if text == "0.5":
        text = "\\frac{1}{2}"
    return text


def _brace_frac_arguments(text: str) -> str:
    """"\\frac12" -> "\\frac{1}{2}", "\\frac1{2}" -> "\\frac{1}{2}", "\\frac{1}2" -> "\\frac{1}{2}"."""
    text = re.sub(r"\\frac([^{\\])([^{\\])", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac([^{\\])\{", r"\\frac{\1}{", text)
    return re.sub(r"\\frac(\{[^{}]*\})([^{\\])", r"\\frac\1{\2}", text)


def is_equiv(answer: Optional[str], ground_truth: str) -> bool:
    if answer is None:
        return False
    return normalize_answer(answer) == normalize_answer(ground_truth)


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response's last boxed answer equals the ground truth after normalization, else 0.0."""
    boxed = last_boxed_only_string(solution_str)
    answer = remove_boxed(boxed) if boxed is not None else None
    return 1.0 if is_equiv(answer, ground_truth) else 0.0


def compute_score_math_verify(solution_str: str, ground_truth: str) -> float:
    """As `compute_score`, and also 1.0 when math-verify proves the boxed answer equal to the ground truth."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    answer = remove_boxed(boxed)
    if is_equiv(answer, ground_truth):
        return 1.0
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set; elsewhere they are off.
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${ground_truth}$", parsing_timeout=timeout)
    predicted = parse(f"${answer}$", parsing_timeout=timeout)
    return 1.0 if gold and predicted and verify(gold, predicted, timeout_seconds=timeout) else 0.0


def _score_math_sample(data_source, solution_str, ground_truth, extra_info=None) -> float:
    if MATH_VERIFY_INSTALLED:
        return compute_score_math_verify(solution_str, ground_truth)
    return compute_score(solution_str, ground_truth)


for _math_source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
    register_scorer(_math_source)(_score_math_sample)
