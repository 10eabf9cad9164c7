"""The arithmetic tool task learns tool use on a CPU (issue 14, point 6), as the README runs it:

    python -m hybridrl.main_ppo --config-name tool_default

Measured (README, "Multi-turn with tools"): greedy accuracy 0.8% -> 29-31% after the 30 default GRPO steps,
calculator calls per sample 0.17 (step 1) -> 0.6-0.73 (step 30), about a minute of training on 2 CPU ranks after
the warm start.
The greedy gain is a late, threshold-like event: sampled accuracy stays at 1-3 % while calculator calls per
sample rise (0.21 -> 0.5), and the greedy answer flips to calling the tool only near the end. On 2026-11-27 the
final greedy accuracy was 28.9 % in a run alone and 9.4 % in one under a full-suite load. So the test asks for a
5-point gain (the margin below the worst run seen) and, the steadier signal, for 1.5x the tool calls per sample
in the last 5 steps as in the first 5; the issue's 15 points are not yet reliable (open in issue 14).
Slow: on an empty cache it builds the warm start first (600 SFT steps, 3-9 minutes).
"""
import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_GAIN = 0.05
VAL_KEY = "val-core/hybridrl/arithmetic_tool/reward/mean@1"


@pytest.mark.slow
def test_grpo_learns_to_use_the_calculator(tmp_path):
    cache_dir = os.environ.get("HYBRIDRL_CACHE_DIR") or str(tmp_path / "cache")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "HYBRIDRL_CACHE_DIR": cache_dir}
    result = subprocess.run([sys.executable, "-m", "hybridrl.main_ppo", "--config-name", "tool_default",
                             f"trainer.default_local_dir={run_dir}", "trainer.logger=[console,jsonl]"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, f"exit code {result.returncode}; stderr ends:\n{result.stderr[-3000:]}"
    with open(run_dir / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f]
    scores = [step[VAL_KEY] for step in steps if VAL_KEY in step]
    assert scores[0] <= 0.05, scores  # the warm start answers directly when greedy, and wrongly
    assert scores[-1] - scores[0] >= MIN_GAIN, scores
    calls = [step["agent_loop/num_tool_calls/mean"] for step in steps if "agent_loop/num_tool_calls/mean" in step]
    # tool use about doubles in 30 steps (0.206 -> 0.400 and 0.234 -> 0.478 in today's two runs): ask for 1.5x
    assert sum(calls[-5:]) >= 1.5 * sum(calls[:5]), calls
    assert all(step["agent_loop/num_failed"] == 0 for step in steps if "agent_loop/num_failed" in step)
