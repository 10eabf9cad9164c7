"""GPU: multi-turn rollouts with tools on the SGLang engine server (issue 14, point 7).

    python -m pytest tests/gpu/test_multiturn_sglang.py -q -s

The arithmetic tool task (--config-name tool_default: tiny warm-started model, calculator tool, tool_agent loop)
with rollout.name=sglang, rollout.mode=async on one GPU, many concurrent conversations (64 prompts x 8 samples).
Asserts that conversations take more than one assistant turn (turns per sample > 2: prompt + call + tool answer +
final answer is 4) and no loop fails; prints the rollout's tokens/s and turns/s per step (for benchmarks/README.md).
On an empty HYBRIDRL_CACHE_DIR the warm start is built first (CPU SFT, minutes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("sglang needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS, SAMPLES, STEPS = 64, 8, 3


def test_tool_agent_on_sglang_takes_several_turns_and_reports_throughput(tmp_path):
    cache_dir = os.environ.get("HYBRIDRL_CACHE_DIR") or str(tmp_path / "cache")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
           "HYBRIDRL_CACHE_DIR": cache_dir}
    command = [sys.executable, "-m", "hybridrl.main_ppo", "--config-name", "tool_default",
               "actor_rollout_ref.rollout.name=sglang", "trainer.device=cuda", "trainer.n_gpus_per_node=1",
               f"data.train_batch_size={PROMPTS}", f"actor_rollout_ref.rollout.n={SAMPLES}",
               "actor_rollout_ref.actor.ppo_mini_batch_size=64",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
               "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
               # the tiny model's head_dim is 32: triton attention serves it (flashinfer's kernels may not)
               "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
               f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1", "trainer.val_before_train=false",
               f"trainer.default_local_dir={run_dir}", "trainer.logger=[console,jsonl]"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, f"exit code {result.returncode}; stderr ends:\n{result.stderr[-4000:]}"
    with open(run_dir / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f if "num_turns/mean" in line]
    assert len(steps) == STEPS
    rows = PROMPTS * SAMPLES
    for step in steps:
        assert step["agent_loop/num_failed"] == 0
        seconds = step["timing_s/agent_loop"]
        tokens = step["response_length/mean"] * rows  # response tokens, tool tokens included (what was decoded
        # or prefilled as the conversation grew); the model's own share is response_mask's
        turns = step["num_turns/mean"] * rows
        print(f"step {int(step['training/global_step'])}: {rows} conversations in {seconds:.2f} s, "
              f"{tokens / seconds:.0f} response tokens/s, {turns / seconds:.0f} turns/s, "
              f"turns/sample {step['num_turns/mean']:.2f} (max {step['num_turns/max']:.0f}), "
              f"tool calls/sample {step['agent_loop/num_tool_calls/mean']:.2f}, "
              f"tool latency {step['agent_loop/tool_latency_s/mean'] * 1e3:.2f} ms", flush=True)
    assert max(step["num_turns/mean"] for step in steps) > 2
    assert max(step["num_turns/max"] for step in steps) >= 4
