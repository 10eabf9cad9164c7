"""The preprocess scripts, run as a user runs them, on small fixtures written here; parquet read back."""
import json
import os
import subprocess
import sys

import pandas as pd
import pyarrow.parquet as pq
import pytest
import reasoning_gym

from hybridrl.reward.scorers import default_compute_score

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def run_script(name, *args, cwd):
    """`python examples/data_preprocess/<name> ...` from a foreign cwd, hybridrl importable as if installed."""
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, os.path.join(REPO, "examples", "data_preprocess", name), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def read_rows(path):
    table = pq.read_table(path)
    assert table.column_names == LAYOUT
    return table.to_pylist()


def test_gsm8k_from_local_files(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    train = [{"question": "Tom has 1,000 apples and buys 234 more. How many?", "answer": "1000+234=1234\n#### 1,234"},
             {"question": "2 + 3?", "answer": "2+3=5\n#### 5"}]
    pd.DataFrame(train).to_json(raw / "train.jsonl", orient="records", lines=True)
    pd.DataFrame([{"question": "10 - 4?", "answer": "#### 6"}]).to_parquet(raw / "test.parquet")

    result = run_script("gsm8k.py", "--local_dataset_path", str(raw), "--local_dir", str(tmp_path / "out"),
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr

    rows = read_rows(tmp_path / "out" / "train.parquet")
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    assert rows[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{train[0]['question']} {instruction}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1234"},
        "extra_info": {"split": "train", "index": 0, "answer": train[0]["answer"], "question": train[0]["question"]},
    }
    assert rows[1]["reward_model"]["ground_truth"] == "5" and rows[1]["extra_info"]["index"] == 1
    test_rows = read_rows(tmp_path / "out" / "test.parquet")
    assert len(test_rows) == 1 and test_rows[0]["reward_model"]["ground_truth"] == "6"
    assert test_rows[0]["extra_info"]["split"] == "test"
    gt = rows[0]["reward_model"]["ground_truth"]
    assert default_compute_score(rows[0]["data_source"], "so #### 1,234", gt) == 1.0


def test_math_from_hub_shaped_local_dir(tmp_path):
    data = tmp_path / "raw" / "data"
    data.mkdir(parents=True)
    train = [{"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
              "type": "Algebra"},
             {"problem": "Nested?", "solution": "First \\boxed{1}, finally \\boxed{\\sqrt{x^{2}}}", "level": "Level 2",
              "type": "Algebra"}]
    pd.DataFrame(train).to_parquet(data / "train-00000-of-00001.parquet")
    test = pd.DataFrame([{"problem": "1+1?", "solution": "\\boxed{2}"}])
    test.to_json(data / "test-00000.jsonl", orient="records", lines=True)

    result = run_script("math_dataset.py", "--local_dataset_path", str(tmp_path / "raw"), "--local_dir",
                        str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr

    rows = read_rows(tmp_path / "out" / "train.parquet")
    assert rows[0] == {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": "Half of one? Let's think step by step and output the final answer "
                                                "within \\boxed{}."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
        "extra_info": {"split": "train", "index": 0},
    }
    assert rows[1]["reward_model"]["ground_truth"] == "\\sqrt{x^{2}}"
    assert [r["reward_model"]["ground_truth"] for r in read_rows(tmp_path / "out" / "test.parquet")] == ["2"]
    assert default_compute_score(rows[0]["data_source"], "so \\boxed{\\dfrac12}", "\\frac{1}{2}") == 1.0


def test_local_path_errors_are_clear(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "examples", "data_preprocess"))
    import hub_or_local
    import math_dataset

    with pytest.raises(ValueError, match=r"MATH solution without \\boxed\{\}: 'no box here'"):
        math_dataset.ground_truth_of("no box here")
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    assert hub_or_local.load_split("test", str(tmp_path), hub_name="unused") == [{"question": "q", "answer": "#### 1"}]
    with pytest.raises(FileNotFoundError, match=f"no train file under {tmp_path}: expected train"):
        hub_or_local.load_split("train", str(tmp_path), hub_name="unused")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        hub_or_local.load_split("train", str(tmp_path / "test.jsonl"), hub_name="unused")


def test_reasoning_gym_task_to_parquet_and_back_through_the_scorer(tmp_path):
    task_config = {"min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 3}
    result = run_script("reasoning_gym.py", "--task", "chain_sum", "--size", "8", "--test_size", "4", "--seed", "5",
                        "--task_config", json.dumps(task_config), "--local_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "chain_sum: 8 train rows, 4 test rows (0 test questions also in train dropped)" in result.stdout

    train, test = read_rows(tmp_path / "out" / "train.parquet"), read_rows(tmp_path / "out" / "test.parquet")
    library_train = reasoning_gym.create_dataset("chain_sum", seed=5, size=8, **task_config)
    library_test = reasoning_gym.create_dataset("chain_sum", seed=5 + 8, size=4, **task_config)
    assert [r["reward_model"]["ground_truth"] for r in train] == [library_train[i]["answer"] for i in range(8)]
    assert [r["reward_model"]["ground_truth"] for r in test] == [library_test[i]["answer"] for i in range(4)]
    assert {r["prompt"][0]["content"] for r in train}.isdisjoint(r["prompt"][0]["content"] for r in test)

    first = train[0]
    assert first["data_source"] == "reasoning_gym/chain_sum" and first["ability"] == "reasoning"
    assert first["prompt"] == [{"role": "user", "content": library_train[0]["question"]
                                + "\nGive only the final answer inside <answer> </answer> tags."}]
    assert json.loads(first["extra_info"]["entry_json"]) == json.loads(json.dumps(library_train[0]))
    assert first["extra_info"]["task"] == "chain_sum" and first["extra_info"]["split"] == "train"

    for row in train + test:
        answer = row["reward_model"]["ground_truth"]
        args = (row["data_source"], answer, row["extra_info"])
        assert default_compute_score(args[0], f"<answer>{answer}</answer>", *args[1:]) == 1.0
        assert default_compute_score(args[0], f"<answer>{int(answer) + 1}</answer>", *args[1:]) < 1.0


def test_reasoning_gym_refuses_a_task_whose_answer_is_not_gradeable(tmp_path):
    result = run_script("reasoning_gym.py", "--task", "graph_color", "--size", "2", "--test_size", "1",
                        "--local_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode != 0
    assert "reasoning_gym/graph_color train row 0: the verifier scores the entry's own answer" in result.stderr
    assert not (tmp_path / "out").exists()
