"""What the one-process GPU worker tests share: a tiny Qwen2 built here, its prompts, and a world of size 1.

Imported by tests/gpu/test_workers_gpu.py and tests/gpu/test_scale_features_gpu.py (pytest puts this
folder on sys.path for them).
"""
from __future__ import annotations

import os
import socket

import torch.distributed as dist

from hybridrl.protocol import DataProto
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer

PROMPT_LENGTH, RESPONSE_LENGTH = 8, 16
TEXTS = ["what is 12 plus 7 ? the answer is 19", "count to five : 1 2 3 4 5", "the cat sat on the mat",
         "seven times six is 42"]


def single_gpu_tiny_model(model_dir: str):
    """Yields (model dir, tokenizer) with RANK/WORLD_SIZE/MASTER_* set for a world of size 1 on a free port (the
    workers' init_process_group reads them); destroys the process group afterwards. Use as a fixture body."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tokenizer = build_tokenizer(TEXTS * 20, vocab_size=128)
    yield build_tiny_model(model_dir, tokenizer, hidden_size=64), tokenizer
    if dist.is_initialized():
        dist.destroy_process_group()


def prompts(tokenizer, validate: bool = False) -> DataProto:
    """TEXTS as left-padded prompts of PROMPT_LENGTH tokens, with the meta_info generate_sequences needs."""
    encoded = tokenizer(TEXTS, padding="max_length", max_length=PROMPT_LENGTH, truncation=True, return_tensors="pt")
    mask = encoded["attention_mask"]
    return DataProto.from_dict({"input_ids": encoded["input_ids"], "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                               meta_info={"eos_token_id": tokenizer.eos_token_id,
                                          "pad_token_id": tokenizer.pad_token_id, "validate": validate})


def generate(worker, batch: DataProto) -> DataProto:
    """One generation inside a rollout-mode window (rollout_mode, generate_sequences, trainer_mode), as the
    trainer runs it."""
    worker.rollout_mode()
    output = worker.generate_sequences(batch)
    worker.trainer_mode()
    return output


# ---- whole-trainer GPU tests (test_async_training_gpu.py, test_engine_tp.py): the toy task of test_e2e_training.py
WORDS = ["apple", "banana", "cherry", "dog", "egg", "fig", "grape", "hat", "ink", "jam"]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_toy_task(root, num_heads: int = 2, num_kv_heads: int = 1) -> dict[str, str]:
    """A tiny random Qwen2 (head_dim 32: triton attention), 80 prompts "say something about <word>" and a reward
    (the share of "a" in the answer), under `root`; returns their paths."""
    from hybridrl.data.rl_parquet import write_rl_parquet

    tokenizer = build_tokenizer([f"say something about {w}" for w in WORDS] * 10 + ["a a aa aaa"] * 10,
                                vocab_size=300)
    model_dir = build_tiny_model(os.path.join(root, "model"), tokenizer, hidden_size=32 * num_heads,
                                 num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                 intermediate_size=64 * num_heads)
    rows = [{"data_source": "toy/letter_a", "prompt": [{"role": "user", "content": f"say something about {w}"}],
             "ability": "toy", "reward_model": {"style": "rule", "ground_truth": "a"}, "extra_info": {"index": i}}
            for i, w in enumerate(WORDS * 8)]
    paths = {"model": model_dir, "train": os.path.join(root, "train.parquet"),
             "val": os.path.join(root, "val.parquet"), "reward": os.path.join(root, "reward.py")}
    write_rl_parquet(rows, paths["train"])
    write_rl_parquet(rows[:8], paths["val"])
    with open(paths["reward"], "w") as f:
        f.write("def share_of_a(data_source, solution_str, ground_truth, extra_info=None):\n"
                "    text = solution_str.replace(' ', '')\n    return text.count('a') / max(len(text), 1)\n")
    return paths


def run_toy_task(task: dict[str, str], run_dir, *overrides, steps: int = 4) -> list[dict]:
    """`python -m hybridrl.main_ppo` on the toy task with sglang on CUDA (16 prompts x 4, lr 1e-2, the engine's
    log-probs reported); the metrics of each training step."""
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "hybridrl.main_ppo", f"actor_rollout_ref.model.path={task['model']}",
               f"data.train_files=[{task['train']}]", f"data.val_files=[{task['val']}]",
               f"custom_reward_function.path={task['reward']}", "custom_reward_function.name=share_of_a",
               "data.max_prompt_length=32", "data.max_response_length=16", "data.train_batch_size=16",
               "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64", "actor_rollout_ref.actor.optim.lr=1e-2",
               "trainer.device=cuda", "actor_rollout_ref.rollout.name=sglang",
               "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
               "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
               "actor_rollout_ref.rollout.calculate_log_probs=true", f"trainer.total_training_steps={steps}",
               "trainer.val_before_train=false", "trainer.test_freq=-1", f"trainer.default_local_dir={run_dir}",
               "trainer.logger=[console,jsonl]", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, cwd=os.path.dirname(str(run_dir)), env=env, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, f"exit code {result.returncode}; stderr ends:\n{result.stderr[-4000:]}"
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "training/global_step" in line]


BF16_NOISE = 0.02  # mean |p_engine - p_trainer| per token, bf16 engine vs fp32-master/bf16-compute trainer


def check_engine_follows_trainer(steps: list[dict], label: str, shown: tuple[str, ...] = ()) -> None:
    """Every step's engine probabilities are the trainer's to bf16 noise (training/rollout_probs_diff_mean: the engine
    held the pushed weights when it generated); each step is printed with its diff and the `shown` metrics."""
    for step in steps:
        extra = ", ".join(f"{key} {step.get(key, float('nan')):.3f}" for key in shown)
        print(f"{label} step {int(step['training/global_step'])}: probs diff mean "
              f"{step['training/rollout_probs_diff_mean']:.4f} max "
              f"{step.get('training/rollout_probs_diff_max', float('nan')):.4f}; {extra}", flush=True)
        assert step["training/rollout_probs_diff_mean"] < BF16_NOISE, f"{label} step {step['training/global_step']}"
