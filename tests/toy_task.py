"""The toy task of the end-to-end tests: whatever the prompt, the reward is the share of the letter "a" among the
response's characters (a custom reward function loaded from a file). A random policy scores a little above 0 and can
only improve by learning. Built once per test session (conftest's `toy_task` fixture) and read by every module."""
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.data.rl_parquet import write_rl_parquet

WORDS = ["apple", "banana", "cherry", "dog", "egg", "fig", "grape", "hat", "ink", "jam"]

REWARD_FILE = '''
def share_of_a(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str.replace(" ", "")
    return text.count("a") / max(len(text), 1)
'''


def build_toy_task(root) -> dict:
    """Model dir, train/val parquet and the reward file under `root` (a pathlib.Path)."""
    texts = [f"say something about {w}" for w in WORDS] + ["a a a a aa aaa " * 4, "banana apple " * 4]
    tokenizer = build_tokenizer(texts * 10, vocab_size=300)
    model_dir = build_tiny_model(str(root / "model"), tokenizer, hidden_size=32, num_layers=2, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64)
    write_rl_parquet(toy_rows(WORDS * 4), str(root / "train.parquet"))
    write_rl_parquet(toy_rows(WORDS[:8]), str(root / "val.parquet"))
    (root / "reward.py").write_text(REWARD_FILE)
    return {"root": root, "model": model_dir, "train": str(root / "train.parquet"), "val": str(root / "val.parquet"),
            "reward": str(root / "reward.py")}


def toy_rows(words) -> list[dict]:
    return [{"data_source": "toy/letter_a", "prompt": [{"role": "user", "content": f"say something about {w}"}],
             "ability": "toy", "reward_model": {"style": "rule", "ground_truth": "a"}, "extra_info": {"index": i}}
            for i, w in enumerate(words)]
