"""examples/data_preprocess/sft_from_rl.py: RL parquet in, chat parquet out that SFTDataset reads."""
import os
import subprocess
import sys

import pyarrow.parquet as pq

from hybridrl.reward.scorers.reasoning_gym import make_train_test_rows
from hybridrl.data.rl_parquet import write_rl_parquet

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "data_preprocess", "sft_from_rl.py")


def run_script(*args):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, cwd=REPO)


def test_writes_one_conversation_per_rl_row(tmp_path):
    train_rows, _ = make_train_test_rows("chain_sum", 6, 2, seed=0, task_config={"max_terms": 2, "max_digits": 1})
    write_rl_parquet(train_rows, str(tmp_path / "train.parquet"))
    done = run_script("--rl_parquet", str(tmp_path / "train.parquet"), "--out", str(tmp_path / "sft.parquet"),
                      "--tagged_fraction", "0.5")
    assert done.returncode == 0, done.stderr
    conversations = pq.read_table(str(tmp_path / "sft.parquet")).column("messages").to_pylist()
    truths = [row["reward_model"]["ground_truth"] for row in train_rows]
    assert [c[-1]["content"] for c in conversations] == [
        f"The answer is {truths[0]}.", f"<answer>{truths[1]}</answer>", f"The answer is {truths[2]}.",
        f"<answer>{truths[3]}</answer>", f"The answer is {truths[4]}.", f"<answer>{truths[5]}</answer>"]
    assert [c[:-1] for c in conversations] == [row["prompt"] for row in train_rows]


def test_refuses_rows_of_another_answer_format(tmp_path):
    rows, _ = make_train_test_rows("chain_sum", 2, 1, seed=0)
    rows[1]["data_source"] = "openai/gsm8k"
    write_rl_parquet(rows, str(tmp_path / "mixed.parquet"))
    done = run_script("--rl_parquet", str(tmp_path / "mixed.parquet"), "--out", str(tmp_path / "sft.parquet"))
    assert done.returncode == 1
    assert "mixed.parquet row 1: data_source 'openai/gsm8k' is not a reasoning-gym task" in done.stderr
