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
    no_format_credit = load_extern_object(RECIPE_REWARD, "compute_score_no_format_credit")
    train, _ = make_train_test_rows("gsm_symbolic", 1, 1, seed=3, answer_format=answer_format)
    row = train[0]
    answer = row["reward_model"]["ground_truth"]
    args = (row["data_source"],)
    kwargs = {"ground_truth": answer, "extra_info": row["extra_info"]}
    right, wrong = int(answer), int(answer) + 1
    cases = {  # response: (score, no-format-credit score, acc, formatted, last_number_right, solved, answer_first)
        wrap.format(right): (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
        wrap.format(wrong): (0.01, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0),
        f"3 + 4 = 7, so {right:,}.0 apples. " + wrap.format(wrong): (0.01, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0),  # last counts
        wrap.format(right) + " That is 3 more than 4.": (1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0),  # right, a number after
        f"The answer is {right}.": (0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0),
        f"So $\\boxed{{{right:,}}}$": (0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0),  # any format, separators as GSM8K
        f"{right} apples, then 1.2.3": (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),  # the last run of digits is not a number
        "I do not know.": (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
        # the shortcut's residue: a guess in the format first, then the working and the right answer
        f"  {wrap.format(10)}\n\nFirst, 3 + 4 = 7.\n{wrap.format(right)}": (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
        f"#### Step 1\nFirst, 3 + 4 = 7.\n{wrap.format(right)}": (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0),  # a heading
        f"#### 1. Add the apples\n3 + 4 = 7.\n{wrap.format(right)}": (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0),  # one too
    }
    for response, (score, strict_score, acc, formatted, last_number_right, solved, answer_first) in cases.items():
        extras = {"acc": acc, "formatted": formatted, "last_number_right": last_number_right, "solved": solved,
                  "answer_first": answer_first}
        assert compute_score(*args, response, **kwargs) == {"score": score, **extras}, response
        assert no_format_credit(*args, response, **kwargs) == {"score": strict_score, **extras}, response


SCRIPT = os.path.join(REPO, "examples", "data_preprocess", "reasoning_gym.py")


def test_held_out_templates_split_train_and_test_by_template_and_say_how_many_of_each(tmp_path):
    from random import Random
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok

    result = run_script("reasoning_gym.py", "--task", "gsm_symbolic", "--size", "40", "--test_size", "12",
                        "--seed", "3", "--answer_format", "hash", "--drop_ungradeable", "--held_out_templates", "0.2",
                        "--local_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    files = {name: read_rows(tmp_path / "out" / f"{name}.parquet") for name in ("train", "test", "test_in_template")}
    assert {name: len(rows) for name, rows in files.items()} == {"train": 40, "test": 12, "test_in_template": 12}

    # 17 of the 85 templates (round(0.2 x 85)), drawn with the seed
    held_out = set(Random(3).sample(sorted(tasks_ok), 17))
    templates = {name: {row["extra_info"]["template"] for row in rows} for name, rows in files.items()}
    assert templates["test"] <= held_out and not templates["train"] & held_out
    assert templates["test_in_template"] <= templates["train"]
    assert not {r["prompt"][0]["content"] for r in files["train"]} & {
        r["prompt"][0]["content"] for r in files["test_in_template"]}

    # every row is the library's entry at its index, its template the one the library picked for that index
    train_seed = 3
    test_seed = train_seed + files["train"][-1]["extra_info"]["index"] + 1  # the test stream continues the train's
    for name, rows in files.items():
        seed = train_seed if name == "train" else test_seed
        library = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=2000)
        for row in rows:
            info = row["extra_info"]
            assert info["split"] == name and json.loads(info["dataset_kwargs_json"])["seed"] == seed
            assert info["template"] == library.task_indices[info["index"]]
            assert row["reward_model"]["ground_truth"] == library[info["index"]]["answer"]
            assert score(row, f"#### {row['reward_model']['ground_truth']}") == 1.0
    indices = [row["extra_info"]["index"] for row in files["train"]]
    assert indices == sorted(indices) and indices[0] == min(
        i for i, template in enumerate(reasoning_gym.create_dataset("gsm_symbolic", seed=3, size=10).task_indices)
        if template not in held_out)  # the first of the stream, in order

    printed = result.stdout.splitlines()
    assert printed[0] == ("gsm_symbolic by template: 17 of 85 templates held out of training (--held_out_templates "
                          f"0.2, seed 3): {', '.join(map(str, sorted(held_out)))}")
    for name, rows in files.items():
        counts = {}
        for row in rows:
            counts[row["extra_info"]["template"]] = counts.get(row["extra_info"]["template"], 0) + 1
        line = next(line for line in printed if line.startswith(f"  {name}: "))
        assert line.startswith(f"  {name}: {len(rows)} rows of {len(counts)} templates")
        assert line.endswith("questions per template: " + " ".join(f"{t}:{n}" for t, n in sorted(counts.items())))


def test_a_template_split_skips_ungradeable_rows_and_counts_them_or_refuses_them():
    first_rows_by_template = load_extern_object(SCRIPT, "first_rows_by_template")
    # entries 122 and 207 of seed 2048 have the answer -1, which the verifier reads as 1 (test above); one template
    task_indices = reasoning_gym.create_dataset("gsm_symbolic", seed=2048, size=300).task_indices
    template = task_indices[122]
    assert task_indices[207] == template
    same_template = [i for i, t in enumerate(task_indices) if t == template and i not in (122, 207)]
    count = sum(1 for i in same_template if i < 207) + 1  # one more than come before 207: the next one after it
    picked, drawn, notes = first_rows_by_template(2048, {"some": {template}}, {"some": count}, set(), {}, "hash", None,
                                                  True)
    assert [row["extra_info"]["index"] for row in picked["some"]] == same_template[:count]
    assert drawn == same_template[count - 1] + 1 and notes == {"some": ["2 ungradeable rows skipped"]}
    with pytest.raises(RuntimeError, match="reasoning_gym/gsm_symbolic row 122 of seed 2048: the verifier does not "
                                           "give the entry's own answer full marks; leave such rows out with "
                                           "--drop_ungradeable"):
        first_rows_by_template(2048, {"some": {template}}, {"some": count}, set(), {}, "hash", None, False)


def test_a_larger_test_set_extends_the_smaller_one_and_the_in_template_set_has_its_own_size(tmp_path):
    """The recipe validates 1,024 held-out questions and 256 in-template ones: the first rows of each file are the
    same whatever the sizes, so a larger held-out set holds the smaller one and the in-template set is unchanged."""
    def files(out, *sizes):
        result = run_script("reasoning_gym.py", "--task", "gsm_symbolic", "--size", "10", *sizes, "--seed", "3",
                            "--answer_format", "hash", "--drop_ungradeable", "--held_out_templates", "0.2",
                            "--local_dir", str(tmp_path / out), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        return {name: [row["prompt"][0]["content"] for row in read_rows(tmp_path / out / f"{name}.parquet")]
                for name in ("train", "test", "test_in_template")}

    small = files("small", "--test_size", "3")
    large = files("large", "--test_size", "8", "--in_template_test_size", "3")
    assert [len(small[name]) for name in small] == [10, 3, 3] and [len(large[name]) for name in large] == [10, 8, 3]
    assert large["train"] == small["train"] and large["test_in_template"] == small["test_in_template"]
    assert large["test"][:3] == small["test"] and len(set(large["test"])) == 8


def test_an_in_template_size_without_a_template_split_is_refused(tmp_path):
    result = run_script("reasoning_gym.py", "--task", "chain_sum", "--size", "4", "--test_size", "2",
                        "--in_template_test_size", "1", "--local_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode != 0 and "--in_template_test_size: only with --held_out_templates" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--task", "chain_sum", "--held_out_templates", "0.2"],
     "--held_out_templates: only gsm_symbolic draws its questions from templates, got --task chain_sum"),
    (["--task", "gsm_symbolic", "--held_out_templates", "0.001"],
     "--held_out_templates 0.001: expected a share that holds out at least one of the 85 templates and keeps at "
     "least one for training")])
def test_a_template_split_that_cannot_be_made_is_refused(tmp_path, args, message):
    result = run_script("reasoning_gym.py", *args, "--size", "4", "--test_size", "2",
                        "--local_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode != 0 and message in result.stderr
    assert not (tmp_path / "out").exists()
