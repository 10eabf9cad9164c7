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
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


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


def test_gsm8k_multiturn_with_tool_from_local_files(tmp_path):
    """verl's multi-turn layout: agent_name column, system prompt naming the tool, ground truth in tools_kwargs."""
    raw = tmp_path / "raw"
    raw.mkdir()
    pd.DataFrame([{"question": "Tom has 1,000 apples and buys 234 more. How many?", "answer": "so\n#### 1,234"}]
                 ).to_json(raw / "train.jsonl", orient="records", lines=True)
    pd.DataFrame([{"question": "10 - 4?", "answer": "#### 6"}]).to_parquet(raw / "test.parquet")

    result = run_script("gsm8k_multiturn_w_tool.py", "--local_dataset_path", str(raw), "--local_dir",
                        str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr

    table = pq.read_table(tmp_path / "out" / "train.parquet")
    assert table.column_names == ["data_source", "agent_name", "prompt", "ability", "reward_model", "extra_info"]
    (row,) = table.to_pylist()
    assert (row["data_source"], row["agent_name"], row["ability"]) == ("openai/gsm8k", "tool_agent", "math")
    system, user = row["prompt"]
    assert system["role"] == "system" and "`calc_gsm8k_reward` tool" in system["content"]
    assert user == {"role": "user", "content": "Tom has 1,000 apples and buys 234 more. How many? "
                                               'Let\'s think step by step and output the final answer after "####".'}
    assert row["reward_model"] == {"style": "rule", "ground_truth": "1234"}
    assert row["extra_info"]["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "1234"}}}
    assert row["extra_info"]["need_tools_kwargs"] is True and row["extra_info"]["index"] == 0
    (test_row,) = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert test_row["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"] == "6"

    # the shipped tool YAML's tool takes exactly these kwargs and scores the right answer 1.0
    import asyncio

    from hybridrl.tools import initialize_tools_from_config, tool_phase_kwargs
    (tool,) = initialize_tools_from_config(os.path.join(
        REPO, "examples", "sglang_multiturn", "config", "tool_config", "gsm8k_tool_config.yaml"))

    async def submit(answer):
        instance_id, _ = await tool.create(**tool_phase_kwargs(row["extra_info"]["tools_kwargs"], tool.name, "create"))
        await tool.execute(instance_id, {"answer": answer})
        return await tool.calc_reward(instance_id)
    assert asyncio.run(submit("1234")) == 1.0 and asyncio.run(submit("1233")) == 0.0


def test_write_rl_parquet_refuses_mixed_or_empty_agent_names(tmp_path):
    from hybridrl.data.rl_parquet import write_rl_parquet
    base = {"data_source": "d", "prompt": [{"role": "user", "content": "q"}], "ability": "a",
            "reward_model": {"ground_truth": "1"}, "extra_info": {}}
    with_agent = {"data_source": "d", "agent_name": "tool_agent", **{k: v for k, v in base.items() if k != "data_source"}}
    with pytest.raises(ValueError, match="row 1 has columns .* the same in every row"):
        write_rl_parquet([with_agent, base], str(tmp_path / "x.parquet"))
    with pytest.raises(ValueError, match="row 0: agent_name must be a non-empty string"):
        write_rl_parquet([{**with_agent, "agent_name": ""}], str(tmp_path / "x.parquet"))


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
