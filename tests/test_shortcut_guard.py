"""A CPU guard against the shortcut (issue 60): the embedded default, `python -m hybridrl.main_ppo`, run at several
seeds, must in every seed end above its start, keep solving the sums, and not collapse its greedy answers to a fixed
short string.

The shortcut: a reward or advantage that pays for something easier than the task (the answer format, a string that
often contains the answer) lets GRPO's per-group normalisation push the answers there. On the Qwen recipe, a wrong
number in the format scored 0.01 and a seed collapsed to bare `#### N`; on this task, chain_sum's verifier (partial
credit when the answer is a substring of the given one) drove answers to digit strings like "1110"
(hybridrl/defaults/assets.py). A change that brings such a shortcut back should fail here.

What each seed must show (`shortcut_problems`), from its own files: summary.json, the last validation's greedy
answers (trainer.validation_data_dir) and the test questions' answers (the cache's test.parquet):
- the task score (summary.json) ends above its start. The start is 0.0 by design (greedy never writes the graded
  format), so "not below its start" could not fail; healthy seeds gain 57-76 points (tests/test_default_pipeline.py).
- format-free accuracy (the last number of the answer is right, in any format) ends at FORMAT_FREE_FLOOR or more.
  Not "at its start or more": the warm start answers "The answer is N." right for 92.1 % of the questions greedily
  and is right less often once RL has moved it to the graded format (the tiny model's arithmetic is worse after the
  tag, assets.py), so every healthy seed ends below its format-free start (seed 1: 92.1 % -> 54.4 % at step 10,
  untagged, -> 60.3 % at step 30, tagged). The floor is 5 sd below the mean of the healthy seeds' final accuracies
  (the 11 runs on 2 ranks of tests/test_default_pipeline.py's docstring: 57.7-71.1 %, mean 64.4 %, sd 4.9 points; at
  the end every answer is tagged, so the task's accuracy is the format-free one: 60.3 % both for seed 1).
- no collapse: the most common answer is at most TOP_ANSWER_SHARE_MAX of all answers (healthy: 9-13 %), and the
  answers average at least MEAN_CHARS_MIN characters (healthy: 16.6-18.7; "<answer>-8</answer>" has 19).

Measured on the 2-core machine, 2026-12-06, `-m slow --learning-seeds 1,2` (the numbers: `--learning-log`):
- as committed, it passed: seed 1: score 0.0 -> 60.3 %, format-free 60.3 %, top answer 10.5 % of all, 18.7
  characters on average; seed 2: 0.0 -> 70.3 %, format-free 70.3 %, top answer 12.1 %, 18.7 characters.
- with the shortcut back (custom_reward_function.path to a reward that gives 0.5 to any answer in the graded
  format and 1.0 to a right one), it failed: seed 1 passed (its own score 0.0 -> 0.728, format-free 45.6 %, top
  answer 10.9 %); seed 2 failed, format-free 31.4 % (its own score 0.0 -> 0.657; top answer "<answer>10</answer>",
  17.6 % of all). The format was learned and the sums got worse: a right tagged answer pays only twice a wrong
  one. The answers did not collapse to one string (the tiny model's answers
  are one short line anyway); `test_the_guard_tells_a_collapse_or_a_lost_skill_from_a_healthy_run` shows that check.
"""
import collections
import json
import os

import pyarrow.parquet as pq
import pytest

from hybridrl.reward.scorers.gsm8k import extract_solution
from tests.test_default_pipeline import read_summary, run_default

GUARD_SEEDS = (1, 2, 3)
FORMAT_FREE_FLOOR = 0.40
TOP_ANSWER_SHARE_MAX = 0.5
MEAN_CHARS_MIN = 8.0


def last_validation(validation_dir) -> list[dict]:
    """The greedy answers of the run's last validation ({step}.jsonl of trainer.validation_data_dir)."""
    last_step = max(int(name.removesuffix(".jsonl")) for name in os.listdir(validation_dir))
    with open(os.path.join(validation_dir, f"{last_step}.jsonl")) as f:
        return [json.loads(line) for line in f]


def format_free_accuracy(samples: list[dict], test_file) -> float:
    """Share of answers whose last number is the question's answer, in any format; the question is found by its
    prompt text, which the dumped input (the chat-templated prompt) contains."""
    answers = {row["prompt"][0]["content"]: row["reward_model"]["ground_truth"]
               for row in pq.read_table(test_file).to_pylist()}
    right = 0
    for sample in samples:
        (answer,) = [answer for prompt, answer in answers.items() if prompt in sample["input"]]
        last_number = extract_solution(sample["output"], method="flexible")
        right += last_number is not None and float(last_number) == float(answer)
    return right / len(samples)


def shortcut_problems(before: float, after: float, format_free: float, outputs: list[str]) -> list[str]:
    """What a seed's run shows of the shortcut (the module docstring); [] for a healthy run."""
    problems = []
    if after <= before:
        problems.append(f"the score ended at {after:.3f}, not above its start {before:.3f}")
    if format_free < FORMAT_FREE_FLOOR:
        problems.append(f"format-free accuracy {format_free:.3f} < {FORMAT_FREE_FLOOR}")
    (top_answer, top_count), = collections.Counter(outputs).most_common(1)
    mean_chars = sum(map(len, outputs)) / len(outputs)
    if top_count / len(outputs) > TOP_ANSWER_SHARE_MAX or mean_chars < MEAN_CHARS_MIN:
        problems.append(f"collapsed: {top_count} of {len(outputs)} answers are {top_answer!r}, answers average "
                        f"{mean_chars:.1f} characters")
    return problems


def test_the_guard_tells_a_collapse_or_a_lost_skill_from_a_healthy_run():
    healthy = [f"<answer>{n}</answer>" for n in range(-8, 19)] * 4  # 108 answers, none more than 4 times
    assert shortcut_problems(0.0, 0.6, 0.6, healthy) == []
    assert shortcut_problems(0.0, 0.6, 0.39, healthy) == ["format-free accuracy 0.390 < 0.4"]
    assert shortcut_problems(0.1, 0.1, 0.6, healthy) == ["the score ended at 0.100, not above its start 0.100"]
    one_string = ["<answer>1110</answer>"] * 55 + healthy[:53]  # 55 x 21 characters, 53 x 17-19
    assert shortcut_problems(0.0, 0.3, 0.6, one_string) == [
        "collapsed: 55 of 108 answers are '<answer>1110</answer>', answers average 19.8 characters"]
    assert shortcut_problems(0.0, 0.3, 0.6, ["<answer>1110</answer>"] * 54 + healthy[:54]) == []  # half: not yet
    bare_numbers = [str(n) for n in range(-8, 19)] * 4  # no answer more than 4 times, but 44 / 27 characters
    assert shortcut_problems(0.0, 0.3, 0.6, bare_numbers) == [
        "collapsed: 4 of 108 answers are '-8', answers average 1.6 characters"]


@pytest.mark.slow
@pytest.mark.learning_seeds(*GUARD_SEEDS)
def test_the_default_run_ends_above_its_start_without_collapsing_in_every_seed(tmp_path, builtin_cache, seed_overrides,
                                                                              learning_log):
    run_dir = tmp_path / "run"
    validation_dir = run_dir / "val_generations"
    result = run_default(builtin_cache, run_dir, [*seed_overrides, f"trainer.validation_data_dir={validation_dir}"],
                         timeout_s=1500)
    summary = read_summary(result, run_dir)
    outputs = [sample["output"] for sample in last_validation(validation_dir)]
    format_free = format_free_accuracy(last_validation(validation_dir),
                                       os.path.join(builtin_cache, "data", "default", "test.parquet"))
    learning_log(before=summary["val_score_before"], after=summary["val_score_after"], format_free_after=format_free,
                 top_answers=collections.Counter(outputs).most_common(3),
                 mean_chars=sum(map(len, outputs)) / len(outputs))
    assert shortcut_problems(summary["val_score_before"], summary["val_score_after"], format_free, outputs) == []
