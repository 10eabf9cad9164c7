"""GPU: disaggregated placement on 2 GPUs (1 trainer + 1 SGLang rollout), weights over NCCL into SGLang's
weight-update group (`init_weights_update_group` / `update_weights_from_distributed`), one-step-off (issue 16).

    python -m pytest tests/gpu/test_async_training_gpu.py -q -s

A tiny random Qwen2 (head_dim 32: triton attention) and the toy task of tests/test_e2e_training.py, through
`python -m hybridrl.main_ppo`. With rollout.calculate_log_probs the engine reports the log-probs of what it sampled:
- synchronous schedule on separate pools: the engine holds the trainer's weights after every update, so its
  probabilities match the trainer's to bf16 noise (a stale or half-loaded model would be off by far more, lr 1e-2);
- one_step_off: samples are exactly one version old from step 2 on, and the engine's probabilities then differ.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("sglang")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer  # noqa: E402
from hybridrl.utils.rl_parquet import write_rl_parquet  # noqa: E402

WORDS = ["apple", "banana", "cherry", "dog", "egg", "fig", "grape", "hat", "ink", "jam"]
STEPS = 4
BF16_NOISE = 0.02  # mean |p_engine - p_trainer| per token, bf16 engine vs fp32-master/bf16-compute trainer


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    tokenizer = build_tokenizer([f"say something about {w}" for w in WORDS] * 10 + ["a a aa aaa"] * 10,
                                vocab_size=300)
    model_dir = build_tiny_model(str(root / "model"), tokenizer, hidden_size=64, num_layers=2, num_heads=2,
                                 num_kv_heads=1, intermediate_size=128)
    rows = [{"data_source": "toy/letter_a", "prompt": [{"role": "user", "content": f"say something about {w}"}],
             "ability": "toy", "reward_model": {"style": "rule", "ground_truth": "a"}, "extra_info": {"index": i}}
            for i, w in enumerate(WORDS * 8)]
    write_rl_parquet(rows, str(root / "train.parquet"))
    write_rl_parquet(rows[:8], str(root / "val.parquet"))
    (root / "reward.py").write_text("def share_of_a(data_source, solution_str, ground_truth, extra_info=None):\n"
                                    "    text = solution_str.replace(' ', '')\n"
                                    "    return text.count('a') / max(len(text), 1)\n")
    return root, model_dir


def run(task, run_dir, *overrides) -> list[dict]:
    root, model_dir = task
    command = [sys.executable, "-m", "hybridrl.main_ppo", f"actor_rollout_ref.model.path={model_dir}",
               f"data.train_files=[{root}/train.parquet]", f"data.val_files=[{root}/val.parquet]",
               f"custom_reward_function.path={root}/reward.py", "custom_reward_function.name=share_of_a",
               "data.max_prompt_length=32", "data.max_response_length=16", "data.train_batch_size=16",
               "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64", "actor_rollout_ref.actor.optim.lr=1e-2",
               "trainer.device=cuda", "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.mode=async",
               "data.return_raw_chat=true", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1",
               "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
               "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
               "actor_rollout_ref.rollout.calculate_log_probs=true", f"trainer.total_training_steps={STEPS}",
               "trainer.val_before_train=false", "trainer.test_freq=-1", f"trainer.default_local_dir={run_dir}",
               "trainer.logger=[console,jsonl]", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"exit code {result.returncode}; stderr ends:\n{result.stderr[-4000:]}"
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if "training/global_step" in line]


def test_nccl_weight_sync_gives_the_engine_the_trainers_weights(task, tmp_path):
    steps = run(task, tmp_path / "sync")
    assert len(steps) == STEPS
    for step in steps:
        print(f"step {int(step['training/global_step'])}: probs diff mean "
              f"{step['training/rollout_probs_diff_mean']:.4f} max {step['training/rollout_probs_diff_max']:.4f}; sync {step.get('timing_s/sync_weights', 0):.3f} s,"
              f" {step.get('weight_sync/megabytes', 0):.2f} MB", flush=True)
        assert step["training/rollout_probs_diff_mean"] < BF16_NOISE
    assert all(step["weight_sync/megabytes"] > 0 for step in steps[1:])


def test_one_step_off_on_two_gpus(task, tmp_path):
    steps = run(task, tmp_path / "one_step_off", "async_training.mode=one_step_off")
    assert [step["async_training/staleness/max"] for step in steps] == [0] + [1] * (STEPS - 1)
    assert [step["async_training/staleness/min"] for step in steps] == [0] + [1] * (STEPS - 1)
    assert steps[0]["training/rollout_probs_diff_mean"] < BF16_NOISE
    for step in steps:
        print(f"step {int(step['training/global_step'])}: step {step['timing_s/step']:.2f} s, wait_gen "
              f"{step['timing_s/wait_gen']:.2f} s, sync {step['timing_s/sync_weights']:.3f} s", flush=True)
