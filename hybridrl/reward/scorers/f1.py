"""Token F1 for short free-text answers (SQuAD's metric, slime's `f1` reward).

Both texts are normalised (lower case, punctuation and the articles a/an/the dropped, whitespace collapsed)
and split on spaces; F1 is the harmonic mean of precision (shared tokens / predicted tokens) and recall
(shared tokens / reference tokens), shared tokens counted with multiplicity. A yes / no / noanswer reference
or prediction must match exactly (0 otherwise: a partial overlap with "no" means nothing). With several
references (a list) the best F1 counts.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

_EXACT_ONLY = ("yes", "no", "noanswer")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in str(text).lower() if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_precision_recall(prediction: str, reference: str) -> tuple[float, float, float]:
    predicted, expected = normalize_answer(prediction), normalize_answer(reference)
    if (predicted in _EXACT_ONLY or expected in _EXACT_ONLY) and predicted != expected:
        return 0.0, 0.0, 0.0
    predicted_tokens, expected_tokens = predicted.split(), expected.split()
    shared = sum((Counter(predicted_tokens) & Counter(expected_tokens)).values())
    if shared == 0:
        return 0.0, 0.0, 0.0
    precision, recall = shared / len(predicted_tokens), shared / len(expected_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """The best token F1 of the response against the reference(s)."""
    references = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    return max((f1_precision_recall(solution_str, reference)[0] for reference in references), default=0.0)


def score_f1_sample(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return compute_score(solution_str, ground_truth)
