"""GPU: verl's determinism keys give two runs of one config bitwise-equal metrics, per engine (SGLang's deterministic
inference, vLLM's batch invariance) and per agent loop (single-turn, the tool agent), on one GPU (issue 62).

    bash scripts/gpu/determinism.sh            # this test, then the keys' cost (benchmarks/ppo_step.py --vary)
    python -m pytest tests/gpu/test_determinism_gpu.py -q -s    # this test alone

Each case runs `python -m hybridrl.main_ppo` twice, 5 GRPO steps with validation before and after, and compares
every metric of metrics.jsonl but the wall-time and memory ones (tests/test_determinism.py's NOT_COMPARED):
- single_turn: the Qwen2.5-0.5B layer shapes (random bf16 weights, the toy task's 300-token vocabulary:
  tests/gpu/tiny_gpu.py) on the toy task, rollout.mode=sync (the engine's batch call, a seed per row);
- tool_agent: `--config-name tool_default`, the built-in arithmetic tool task (its warm-started tiny model calls the
  calculator; a random 0.5B never would, so its turns would not be tested), rollout.mode=async: requests reach the
  engine server in whatever order the agent-loop workers send them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tiny_gpu import REPO_ROOT, write_toy_task  # noqa: E402

from hybridrl.defaults.tool_task import prepare_tool_task  # noqa: E402
from tests.test_determinism import KEYS_ON, assert_bitwise_equal  # noqa: E402

STEPS = 5


@pytest.fixture(scope="module")
def toy_05b(tmp_path_factory) -> dict[str, str]:
    """The toy task with its model replaced by random bf16 weights of the Qwen2.5-0.5B layer shapes (ppo_step.py's)."""
    from benchmarks.ppo_step import make_model
    from benchmarks.vocab import load_vocabulary

    task = write_toy_task(str(tmp_path_factory.mktemp("toy")))
    model_dir = make_model("0.5b", load_vocabulary(task["model"]), str(tmp_path_factory.mktemp("q05_shape")))
    return {**task, "model": model_dir}


@pytest.fixture(scope="module")
def tool_cache(tmp_path_factory) -> str:
    """The built-in tool task prepared once (data and warm start) for both engines' runs. TOOL_TASK_CACHE names one
    prepared on another machine (its warm start is 3 to 4 CPU-minutes the GPU would wait for); a complete one is
    reused as it is (defaults/tool_task.py)."""
    cache = os.environ.get("TOOL_TASK_CACHE") or str(tmp_path_factory.mktemp("tool_cache"))
    prepare_tool_task(cache)
    return cache


def single_turn_overrides(task: dict[str, str]) -> list[str]:
    return [f"actor_rollout_ref.model.path={task['model']}", f"data.train_files=[{task['train']}]",
            f"data.val_files=[{task['val']}]", f"custom_reward_function.path={task['reward']}",
            "custom_reward_function.name=share_of_a", "data.max_prompt_length=32", "data.max_response_length=64",
            "data.train_batch_size=16", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.optim.lr=1e-5"]


def run_main_ppo(run_dir, *overrides, config_name: str = "ppo_trainer") -> list[dict]:
    """`python -m hybridrl.main_ppo` for STEPS steps on one GPU, validating before and at the end; metrics.jsonl."""
    command = [sys.executable, "-m", "hybridrl.main_ppo", "--config-name", config_name, "trainer.device=cuda",
               "trainer.n_gpus_per_node=1", f"trainer.total_training_steps={STEPS}", f"trainer.test_freq={STEPS}",
               "trainer.val_before_train=true", "trainer.save_freq=-1", "trainer.logger=[console,jsonl]",
               f"trainer.default_local_dir={run_dir}", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
               *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, cwd=os.path.dirname(str(run_dir)), env=env, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, f"exit code {result.returncode}; stderr ends:\n{result.stderr[-4000:]}"
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(1200)  # two trainer runs of about 150 s each with a fresh host's kernel builds; 300 s cut one
@pytest.mark.parametrize("loop", ["single_turn", "tool_agent"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_two_runs_with_the_keys_on_log_bitwise_equal_metrics(engine, loop, request, tmp_path):
    pytest.importorskip(engine)
    # each loop's fixture only where it runs: a single-turn case alone does not wait for the tool task's warm start
    if loop == "single_turn":
        overrides, config_name = single_turn_overrides(request.getfixturevalue("toy_05b")), "ppo_trainer"
    else:
        overrides = [f"cache_dir={request.getfixturevalue('tool_cache')}", "data.val_max_samples=32"]
        config_name = "tool_default"
    overrides = [*overrides, f"actor_rollout_ref.rollout.name={engine}", *KEYS_ON]
    first = run_main_ppo(tmp_path / "a", *overrides, config_name=config_name)
    second = run_main_ppo(tmp_path / "b", *overrides, config_name=config_name)
    assert [line["step"] for line in first] == list(range(STEPS + 1))
    if loop == "tool_agent":
        assert first[1]["agent_loop/num_tool_calls/mean"] > 0
    for line in first:
        print(f"{engine} {loop} step {line['step']}: " + ", ".join(
            f"{key} {line[key]:.6g}" for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm",
                                                 "response_length/mean") if key in line), flush=True)
    assert_bitwise_equal(first, second)
