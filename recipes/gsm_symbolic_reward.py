"""The reward of the gsm_symbolic recipes: reasoning-gym's own score, with `acc`, `formatted` and `last_number_right`
beside it for the logs; and one variant of the score.

`compute_score` is exactly the built-in scorer's (1.0 right number, 0.01 a wrong number given in the row's
answer format, 0.0 no answer in that format), so training is the same as without this file. The extras separate
what the one score mixes: `formatted` (the model gave an answer in the format), `acc` (the number was right),
`last_number_right` (the last number of the answer is right, in any format: what the model can solve, whether or
not it learned the format) and `solved` (either: right in the format or as the last number). `solved` is there
because a trained model often writes "#### 42" and then a sentence with another number in it: right, yet not
`last_number_right`. `answer_first` (the response opens with an answer in the format, a guess before any reasoning:
"#### 10" then the working) is what the shortcut leaves once the reasoning has come back, which neither the score nor
the answer length shows. The trainer logs them as reward/<extra>/mean each step and, at each validation,
val-aux/<extra>/mean@1 (all sets) and eval/<set>/<extra> (each of data.eval_sets), so a rising validation score
can be told apart: format learned, or problems solved.

`compute_score_no_format_credit` (custom_reward_function.name=compute_score_no_format_credit) scores a wrong number
in the format 0.0 instead of 0.01, as verl's GSM8K scorer does by default (format_score=0). Why it matters: GRPO
divides a group's advantages by its standard deviation, so a lone 0.01 in a group of zeros gets the same advantage
as a lone right answer, and writing "#### N" at all pays as much as being right (recipes/qwen25_coder_gsm_symbolic/
README.md).
"""
from hybridrl.reward.scorers import default_compute_score
from hybridrl.reward.scorers.gsm8k import extract_solution
from hybridrl.reward.scorers.reasoning_gym import ANSWER_FORMATS, extract_answer, row_answer_format


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    score = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    return {"score": score, **_extras(score, solution_str, ground_truth, extra_info)}


def compute_score_no_format_credit(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    score = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    return {"score": float(score == 1.0), **_extras(score, solution_str, ground_truth, extra_info)}


def _extras(score: float, solution_str: str, ground_truth, extra_info: dict) -> dict:
    """acc, formatted, last_number_right, solved and answer_first of one answer (the module docstring); `score`: the
    built-in one."""
    answer_format = row_answer_format(extra_info)
    answer = extract_answer(solution_str, answer_format)
    last_number = extract_solution(solution_str, method="flexible")  # GSM8K's: thousands separators, "$" dropped
    acc = score == 1.0
    last_number_right = last_number is not None and _same_number(last_number, ground_truth)
    return {"acc": float(acc), "formatted": float(answer is not None), "last_number_right": float(last_number_right),
            "solved": float(acc or last_number_right),
            "answer_first": float(_answer_first(solution_str, answer_format))}


def _answer_first(solution_str: str, answer_format: str) -> bool:
    """The first line is an answer in the format and nothing else ("#### 10", the working after it); a markdown
    heading ("#### 1. Find the cost") is not one."""
    line = solution_str.strip().split("\n", 1)[0].strip()
    before, after = (part.strip() for part in ANSWER_FORMATS[answer_format].oracle_template.split("{answer}"))
    if not (line.startswith(before) and line.endswith(after)):
        return False
    inside = line[len(before):len(line) - len(after)].split()
    return len(inside) == 1 and extract_answer(line, answer_format) is not None


def _same_number(text: str, ground_truth) -> bool:
    """Equal as numbers ("12.0" is 12), as reasoning-gym's gsm_symbolic verifier compares them."""
    try:
        return float(text) == float(ground_truth)
    except ValueError:  # "1.2.3": the flexible extraction keeps any run of digits, dots and commas
        return False
