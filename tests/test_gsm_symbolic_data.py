"""reasoning-gym gsm_symbolic as RL data: the preprocess script run as a user runs it, the parquet read back,
every row through the scorer, and the SmolLM2 recipe's reward function (score plus acc/formatted)."""
import json
import os

import pytest
import reasoning_gym

from hybridrl.utils.import_utils import load_extern_object
from hybridrl.reward.scorers import default_compute_score
from hybridrl.reward.scorers.reasoning_gym import INSTRUCTION, make_train_test_rows
from tests.test_data_preprocess import REPO, read_rows, run_script

RECIPE_REWARD = os.path.join(REPO, "recipes", "gsm_symbolic_reward.py")
CUSTOM = "Solve it step by step, then end with <answer>NUMBER</answer>."
HASH_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def score(row, response):
    return default_compute_score(row["data_source"], response, row["reward_model"]["ground_truth"], row["extra_info"])


def test_gsm_symbolic_to_parquet_with_an_instruction_and_back_through_the_scorer(tmp_path):
    result = run_script("reasoning_gym.py", "--task", "gsm_symbolic", "--size", "6", "--test_size", "3", "--seed", "11",
                        "--instruction", CUSTOM, "--drop_ungradeable", "--local_dir", str(tmp_path / "out"),
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "gsm_symbolic: 6 train rows, 3 test rows (0 test questions also in train dropped)" in result.stdout

    train, test = read_rows(tmp_path / "out" / "train.parquet"), read_rows(tmp_path / "out" / "test.parquet")
    library_train = reasoning_gym.create_dataset("gsm_symbolic", seed=11, size=6)
    library_test = reasoning_gym.create_dataset("gsm_symbolic", seed=11 + 6, size=3)
    assert [r["reward_model"]["ground_truth"] for r in train] == [library_train[i]["answer"] for i in range(6)]
    assert [r["reward_model"]["ground_truth"] for r in test] == [library_test[i]["answer"] for i in range(3)]
    first = train[0]
    assert first["data_source"] == "reasoning_gym/gsm_symbolic" and first["ability"] == "reasoning"
    assert first["prompt"] == [{"role": "user", "content": f"{library_train[0]['question']}\n{CUSTOM}"}]
    assert first["reward_model"] == {"style": "rule", "ground_truth": library_train[0]["answer"]}
    assert set(first["extra_info"]) == {"split", "index", "task", "entry_json", "dataset_kwargs_json", "answer_format"}
    assert first["extra_info"]["answer_format"] == "tags"
    assert json.loads(first["extra_info"]["dataset_kwargs_json"]) == {"seed": 11, "size": 6}
    assert [r["extra_info"]["index"] for r in train] == list(range(6))

    for row in train + test:
        answer = row["reward_model"]["ground_truth"]
        assert score(row, f"Step by step ... so she has {answer}. <answer>{answer}</answer>") == 1.0
        assert score(row, f"<answer>{int(answer) + 7}</answer>") == 0.01  # gsm_symbolic's rule: a wrong number
        assert score(row, f"The answer is {answer}.") == 0.0  # no tags: no answer
        assert score(row, f"#### {answer}") == 0.0  # another format's answer is no answer
        assert score(row, "<answer>many</answer>") == 0.0  # tags without a number


def test_gsm_symbolic_in_gsm8k_hash_format(tmp_path):
    result = run_script("reasoning_gym.py", "--task", "gsm_symbolic", "--size", "4", "--test_size", "2", "--seed", "11",
                        "--answer_format", "hash", "--local_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    train, test = read_rows(tmp_path / "out" / "train.parquet"), read_rows(tmp_path / "out" / "test.parquet")
    question = reasoning_gym.create_dataset("gsm_symbolic", seed=11, size=4)[0]["question"]
    assert train[0]["prompt"] == [{"role": "user", "content": f"{question}\n{HASH_INSTRUCTION}"}]
    assert train[0]["extra_info"]["answer_format"] == "hash"
    for row in train + test:
        answer = row["reward_model"]["ground_truth"]
        assert score(row, f"3 + 4 = 7\n#### 7\nthen\n#### {answer}\nThe answer is {answer}.") == 1.0  # the last ####
        assert score(row, f"#### {int(answer):,}.") == 1.0  # thousands separators and a final period, as GSM8K
        assert score(row, f"#### {int(answer) + 7}") == 0.01
        assert score(row, f"<answer>{answer}</answer>") == 0.0
        assert score(row, f"The answer is {answer}.") == 0.0


def test_rows_written_before_the_answer_format_key_are_tags():
    train, _ = make_train_test_rows("gsm_symbolic", 1, 1, seed=5)
    row = train[0]
    del row["extra_info"]["answer_format"]
    answer = row["reward_model"]["ground_truth"]
    assert score(row, f"<answer>{answer}</answer>") == 1.0 and score(row, f"#### {answer}") == 0.0


def test_default_instruction_is_unchanged():
    train, _ = make_train_test_rows("gsm_symbolic", 2, 1, seed=0)
    question = reasoning_gym.create_dataset("gsm_symbolic", seed=0, size=2)[0]["question"]
    assert train[0]["prompt"][0]["content"] == f"{question}\nGive only the final answer inside <answer> </answer> tags."
    assert INSTRUCTION == "Give only the final answer inside <answer> </answer> tags."


@pytest.mark.parametrize("answer_format, instruction, marker", [
    ("tags", "Finish with #### N.", "<answer>"), ("hash", "Give the answer in <answer></answer>.", "####")])
def test_an_instruction_without_the_format_marker_is_refused(tmp_path, answer_format, instruction, marker):
    result = run_script("reasoning_gym.py", "--task", "gsm_symbolic", "--size", "2", "--test_size", "1",
                        "--answer_format", answer_format, "--instruction", instruction,
                        "--local_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode != 0
    assert (f"instruction {instruction!r} must ask for the answer with {marker}: with answer_format={answer_format!r} "
            "the scorer reads the answer only there") in result.stderr
    assert not (tmp_path / "out").exists()


def test_hash_format_refuses_a_task_with_non_numeric_answers():
    with pytest.raises(RuntimeError, match="reasoning_gym/letter_jumble train row 0: the verifier scores"):
        make_train_test_rows("letter_jumble", 2, 1, seed=0, answer_format="hash")


def test_ungradeable_rows_are_refused_or_dropped_and_counted(capsys):
    # Test entries 122 and 207 of seed 2048 have the answer -1, which gsm_symbolic's verifier reads as 1 (0.01).
    entry = reasoning_gym.create_dataset("gsm_symbolic", seed=2048, size=123)[122]
    assert entry["answer"] == "-1"
    with pytest.raises(RuntimeError, match=r"reasoning_gym/gsm_symbolic test row 122: the verifier scores the "
                                           r"entry's own answer '-1' as 0.01, not 1.0 \(2 such rows\)"):
        make_train_test_rows("gsm_symbolic", 8, 256, seed=2040)
    capsys.readouterr()
    train, test = make_train_test_rows("gsm_symbolic", 8, 256, seed=2040, drop_ungradeable=True)
    assert len(train) == 8 and len(test) == 254
    assert sorted(row["extra_info"]["index"] for row in test)[120:124] == [120, 121, 123, 124]
    printed = capsys.readouterr().out
    assert "gsm_symbolic: 8 train rows, 254 test rows (0 test questions also in train dropped; 2 ungradeable rows " \
           "dropped: reasoning_gym/gsm_symbolic test row 122 (answer '-1' scores 0.01), reasoning_gym/gsm_symbolic " \
           "test row 207 (answer '-1' scores 0.01))" in printed


@pytest.mark.parametrize("answer_format, wrap", [("tags", "<answer>{}</answer>"), ("hash", "#### {}")])
def test_recipe_reward_keeps_the_score_and_tells_format_from_accuracy(answer_format, wrap):
    compute_score = load_extern_object(RECIPE_REWARD, "compute_score")
    train, _ = make_train_test_rows("gsm_symbolic", 1, 1, seed=3, answer_format=answer_format)
    row = train[0]
    answer = row["reward_model"]["ground_truth"]
    args = (row["data_source"],)
    kwargs = {"ground_truth": answer, "extra_info": row["extra_info"]}
    assert compute_score(*args, wrap.format(answer), **kwargs) == {"score": 1.0, "acc": 1.0, "formatted": 1.0}
    assert compute_score(*args, wrap.format(int(answer) + 1), **kwargs) == {
        "score": 0.01, "acc": 0.0, "formatted": 1.0}
    assert compute_score(*args, f"The answer is {answer}.", **kwargs) == {"score": 0.0, "acc": 0.0, "formatted": 0.0}
