"""What a user sees when something goes wrong after the start (issue 64, items 4, 5, 6): real CLI runs of the toy task
of test_e2e_training (2 CPU ranks, a tiny model, 2 steps, data in file order), and the mechanism under them.

Before: an error after Ray started came under Hydra's `Error executing job with overrides: [...]` with the driver's
stack around the worker's, the cause on the last line; a reward function raising for some samples scored them 0,
and the run exited 0 with nothing in summary.json; the last step's console line was missing in 14 of 22 runs.
"""
import json
import os
import subprocess
import sys

import pytest
import ray

from hybridrl.config import check_before_start
from hybridrl.config.cli_errors import describe_run_error
from hybridrl.trainer.forwarded_output import END_OF_OUTPUT, print_end_of_output, wait_for_runner_output
from tests.test_e2e_training import base_overrides, make_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Raises for the prompts of rows 0, 4, 8, ... (extra_info.index, the dataset row), or for every row.
RAISES_FOR_EVERY_FOURTH_ROW = '''
def share_of_a(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 4 == 0:
        raise ValueError("no answer tag")
    return solution_str.count("a") / max(len(solution_str), 1)
'''
RAISES_FOR_EVERY_ROW = '''
def share_of_a(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("no answer tag")
'''


def run_cli(toy_task, run_dir, reward_file) -> subprocess.CompletedProcess:
    overrides = base_overrides({**toy_task, "reward": str(reward_file)}, str(run_dir)) + ["data.shuffle=false"]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "hybridrl.main_ppo", *overrides], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_reward_function_failing_on_every_sample_is_one_run_error_line_then_its_traceback_once(toy_task,
                                                                                                  tmp_path):
    reward_file = tmp_path / "broken_reward.py"
    reward_file.write_text(RAISES_FOR_EVERY_ROW)
    result = run_cli(toy_task, tmp_path / "run", reward_file)

    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    failure = [i for i, line in enumerate(lines) if line.startswith("run error:")]
    assert len(failure) == 1, result.stderr[-3000:]
    # the worker's exception, first: step 1 trains on rows 0-7, two responses each; sample 0 is row 0's first
    assert lines[failure[0]] == (
        "run error: RuntimeError: the reward scorer failed on all 16 samples of the batch (it raised or returned no "
        f"finite number), so the scorer itself is broken; first: share_of_a ({reward_file}) raised ValueError: no "
        "answer tag for sample 0 (data_source 'toy/letter_a', row 0)")
    # then the traceback of where it was raised (the TaskRunner, down to the reward file), once, and nothing else
    traceback_lines = lines[failure[0] + 1:]
    assert "ray::TaskRunner.run()" in traceback_lines[0]
    assert traceback_lines[-1].startswith("RuntimeError: the reward scorer failed on all 16 samples")
    assert result.stderr.count(f'File "{reward_file}", line 3, in share_of_a') == 1
    assert result.stderr.count('raise ValueError("no answer tag")') == 1
    assert not any(line.lstrip("\x1b[0-9m").startswith("(TaskRunner") for line in traceback_lines)
    assert "Error executing job" not in result.stderr and "ray.get" not in result.stderr


def test_a_reward_function_failing_on_some_samples_is_warned_once_counted_and_every_step_is_on_the_console(
        toy_task, tmp_path):
    """Rows 0 and 4 of each step's 8 (two responses each) and of the 8 validation rows (one response) fail."""
    reward_file = tmp_path / "partly_broken_reward.py"
    reward_file.write_text(RAISES_FOR_EVERY_FOURTH_ROW)
    run_dir = tmp_path / "run"
    result = run_cli(toy_task, run_dir, reward_file)

    assert result.returncode == 0, result.stderr[-3000:]
    with open(run_dir / "summary.json") as f:
        assert json.load(f)["reward_errors"] == {"train": 8, "val": 2}
    with open(run_dir / "metrics.jsonl") as f:
        assert [json.loads(line)["reward/errors"] for line in f] == [4.0, 4.0]
    warning = ("reward scorer failed on {} samples: share_of_a ({}) raised ValueError: no answer tag for sample 0 "
               "(data_source 'toy/letter_a', row 0); a failed sample scores 0 and is counted in reward/errors and "
               "in summary.json's reward_errors (this warning is shown once)")
    assert result.stderr.count(warning.format("4 of 16", reward_file)) == 1  # the training steps' manager
    assert result.stderr.count(warning.format("2 of 8", reward_file)) == 1  # validation's
    # every step's line and table on the console, the last one included (item 6), and the driver's lines last
    stdout = result.stdout.splitlines()
    for step in (1, 2):
        assert sum(f"step:{step} - " in line for line in stdout) == 1, result.stdout[-3000:]
        assert sum(f"step {step}/2 | " in line for line in stdout) == 1, result.stdout[-3000:]
    assert stdout[-1] == f"summary: {run_dir / 'summary.json'}"
    assert END_OF_OUTPUT not in result.stdout + result.stderr


def test_the_driver_gets_every_line_an_actor_printed_before_it_goes_on(ray_local, capsys):
    """Ray forwards an actor's output about every 0.1 s, so a driver going on right after the actor's call returned
    missed the last lines (that was the missing last step). wait_for_runner_output returns only once they arrived."""
    class Talker:  # defined here, so that Ray ships the class itself (the workers cannot import this test module)
        """Prints its lines as a TaskRunner prints its steps, and ends its output as the TaskRunner does."""

        def talk(self, round_number: int, lines: int) -> None:
            for line in range(lines):
                print(f"round {round_number} line {line}", flush=True)

        def end_output(self) -> None:
            print_end_of_output()

    talker = ray.remote(num_cpus=0)(Talker).remote()
    for round_number in range(5):
        ray.get(talker.talk.remote(round_number, lines=40))
        wait_for_runner_output(talker)
        printed = capsys.readouterr().out
        assert all(f"round {round_number} line {line}\n" in printed for line in range(40)), printed[-2000:]
    ray.kill(talker)
    wait_for_runner_output(talker)  # a runner that is gone: nothing to wait for, no warning
    assert "did not reach this console" not in capsys.readouterr().err


def test_a_workers_exception_handed_up_twice_is_named_as_the_worker_raised_it(ray_local):
    """A rank raises, the TaskRunner's ray.get re-raises it, the driver's ray.get wraps it again: the run error line
    is the rank's own exception; the traceback below it is Ray's text of both remote stacks, each once."""
    def rank_step():
        raise KeyError("lm_head.weight")

    def task_runner_run():
        return ray.get(ray.remote(rank_step).remote())

    with pytest.raises(ray.exceptions.RayTaskError) as caught:
        ray.get(ray.remote(task_runner_run).remote())
    report = describe_run_error(caught.value).splitlines()
    assert report[0] == "run error: KeyError: 'lm_head.weight'"
    traceback_text = "\n".join(report[1:])
    assert "ray::task_runner_run()" in report[1]
    assert traceback_text.count("in rank_step") == 1 and traceback_text.count("in task_runner_run") == 1
    assert report[-1].endswith("KeyError: 'lm_head.weight'")


def test_a_group_estimator_with_one_response_per_prompt_is_warned_before_the_start(toy_task, tmp_path):
    config = make_config(toy_task, str(tmp_path), "actor_rollout_ref.rollout.n=1",
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    assert check_before_start(config) == [
        "algorithm.adv_estimator='grpo' with actor_rollout_ref.rollout.n=1 has no baseline: it compares each response "
        "with the other responses to the same prompt, and there are none (verl runs it so too); set "
        "actor_rollout_ref.rollout.n to 2 or more"]
    assert check_before_start(make_config(toy_task, str(tmp_path))) == []  # rollout.n=2
    assert check_before_start(make_config(toy_task, str(tmp_path), "algorithm=gae", "actor_rollout_ref.rollout.n=1",
                                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")) == []
