"""Rule-based scorers: hand examples with exact expected scores, and dispatch by data_source."""
import pytest

from hybridrl.reward.scorers import default_compute_score, register_scorer, registered_scorer_keys
from hybridrl.reward.scorers import gsm8k, math as math_score
from hybridrl.reward.scorers import reasoning_gym as rg_score


# ---------------------------------------------------------------------------------------------- GSM8K

@pytest.mark.parametrize("text, method, expected", [
    ("3 + 4 = 7 so #### 7", "strict", 1.0),
    ("3 + 4 = 7 so the answer is 7", "strict", 0.0),          # no '#### ': strict finds nothing
    ("3 + 4 = 7 so the answer is 7", "flexible", 1.0),        # flexible takes the last number
    ("#### 6 wait, no: #### 7", "strict", 1.0),               # the last '####' counts
    ("#### 7 and then 8", "flexible", 0.0),                   # flexible: last number is 8
    ("I have 7.", "flexible", 1.0),                           # sentence period dropped
    ("Hmm...", "flexible", 0.0),                              # dots alone are no number
])
def test_gsm8k_strict_and_flexible(text, method, expected):
    assert gsm8k.compute_score(text, "7", method=method) == expected


def test_gsm8k_separators_format_score_and_score():
    assert gsm8k.compute_score("#### 1,234.", "1234") == 1.0
    assert gsm8k.compute_score("#### $1,234", "1,234") == 1.0
    assert gsm8k.compute_score("#### -5", "-5") == 1.0
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "72", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 72", "72", score=2.0) == 2.0
    assert gsm8k.extract_solution("#### 3.50") == "3.50"  # string comparison: "3.50" != "3.5"
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        gsm8k.compute_score("#### 1", "1", method="loose")


# ---------------------------------------------------------------------------------------------- MATH

def test_last_boxed_and_remove_boxed():
    text = "first \\boxed{1} then \\boxed{\\frac{1}{2}} done"
    assert math_score.last_boxed_only_string(text) == "\\boxed{\\frac{1}{2}}"
    assert math_score.remove_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert math_score.last_boxed_only_string("so $\\boxed 5$.") == "\\boxed 5"
    assert math_score.remove_boxed("\\boxed 5") == "5"
    assert math_score.last_boxed_only_string("\\fbox{a{b}c} x") == "\\fbox{a{b}c}"
    assert math_score.last_boxed_only_string("\\boxed{1") is None
    assert math_score.last_boxed_only_string("no box") is None


@pytest.mark.parametrize("response, ground_truth, expected", [
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{3/4}", "\\frac34", 1.0),
    ("\\boxed{\\sqrt3}", "\\sqrt{3}", 1.0),
    ("\\boxed{.5}", "0.5", 1.0),
    ("\\boxed{2/4}", "\\frac{1}{2}", 0.0),   # textual, not a CAS
    ("the answer is 5", "5", 0.0),          # no box, no answer
])
def test_math_compute_score(response, ground_truth, expected):
    assert math_score.compute_score(response, ground_truth) == expected


# ---------------------------------------------------------------------------------------------- dispatch

def test_default_compute_score_dispatches_by_data_source():
    assert default_compute_score("openai/gsm8k", "#### 12", "12") == 1.0
    assert default_compute_score("openai/gsm8k", "12", "12") == 0.0  # strict by default
    assert default_compute_score("lighteval/MATH", "\\boxed{12}", "12") == 1.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{1}", "12") == 0.0


def test_unknown_data_source_lists_known_ones():
    with pytest.raises(NotImplementedError) as error:
        default_compute_score("nobody/knows", "x", "y")
    message = str(error.value)
    assert "'nobody/knows'" in message and "'openai/gsm8k'" in message and "'reasoning_gym/*'" in message


def test_exact_name_beats_pattern_and_longest_pattern_wins():
    register_scorer("test_dispatch/*")(lambda *args: 1.0)
    register_scorer("test_dispatch/deep/*")(lambda *args: 2.0)
    register_scorer("test_dispatch/deep/exact")(lambda *args: 3.0)
    assert default_compute_score("test_dispatch/other", "", "") == 1.0
    assert default_compute_score("test_dispatch/deep/other", "", "") == 2.0
    assert default_compute_score("test_dispatch/deep/exact", "", "") == 3.0
    assert "test_dispatch/deep/*" in registered_scorer_keys()
    with pytest.raises(ValueError, match="already registered"):
        register_scorer("test_dispatch/*")(lambda *args: 0.0)


# ---------------------------------------------------------------------------------------------- reasoning-gym

def _score(row, response):
    return default_compute_score(row["data_source"], response, row["reward_model"]["ground_truth"], row["extra_info"])


def test_reasoning_gym_uses_the_library_verifier_on_the_tagged_answer():
    row = rg_score.make_rows("chain_sum", size=2, seed=0, split="train")[0]
    answer = row["reward_model"]["ground_truth"]
    assert row["data_source"] == "reasoning_gym/chain_sum"
    assert _score(row, f"thinking <answer>{answer}</answer>") == 1.0
    assert _score(row, f"<answer>{int(answer) + 1}</answer> no, <answer> {answer} </answer>") == 1.0  # last pair
    assert _score(row, f"<answer>{answer}.00</answer>") == 1.0  # chain_sum's verifier compares decimals
    assert _score(row, f"<answer>{int(answer) + 1}</answer>") == 0.0
    assert _score(row, answer) == 0.0  # no tags: no answer (no fallback to the raw text)
    assert _score(row, f"<answer>{answer}") == 0.0  # unclosed tag


def test_reasoning_gym_wrong_answer_gets_the_library_partial_score():
    row = rg_score.make_rows("gsm_symbolic", size=1, seed=3, split="train")[0]
    answer = row["reward_model"]["ground_truth"]
    assert _score(row, f"<answer>{answer}</answer>") == 1.0
    assert _score(row, f"<answer>{int(answer) + 1}</answer>") == 0.01  # gsm_symbolic's own rule for a wrong number


def test_reasoning_gym_verifier_that_raises_scores_zero():
    row = rg_score.make_rows("prime_factorization", size=1, seed=0, split="train")[0]
    assert _score(row, f"<answer>{row['reward_model']['ground_truth']}</answer>") == 1.0
    assert _score(row, "<answer>not a product</answer>") == 0.0


def test_reasoning_gym_needs_its_extra_info():
    with pytest.raises(ValueError, match="entry_json"):
        default_compute_score("reasoning_gym/chain_sum", "<answer>1</answer>", "1", {"split": "train"})
    row = rg_score.make_rows("chain_sum", size=1, seed=0, split="train")[0]
    with pytest.raises(ValueError, match="differs from the entry's answer"):
        default_compute_score(row["data_source"], "<answer>1</answer>", "not-the-answer", row["extra_info"])
