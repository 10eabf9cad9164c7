"""The reward of the gsm_symbolic recipes: reasoning-gym's own score, with `acc` and `formatted` beside it for the logs.

The score is exactly the built-in scorer's (1.0 right number, 0.01 a wrong number given in the row's
answer format, 0.0 no answer in that format), so training is the same as without this file. The two
extras separate what the one score mixes: `formatted` (the model gave an answer in the format) and
`acc` (the number was right). The trainer logs them as reward/{acc,formatted}/mean each step and
val-aux/{acc,formatted}/mean@1 at each validation, so a rising validation score can be told apart:
format learned, or problems solved.
"""
from hybridrl.reward.scorers import default_compute_score
from hybridrl.reward.scorers.reasoning_gym import extract_answer, row_answer_format


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    score = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    answer = extract_answer(solution_str, row_answer_format(extra_info))
    return {"score": score, "acc": float(score == 1.0), "formatted": float(answer is not None)}
