"""A bad reward inside a real training run: the toy task of test_e2e_training (real local Ray, 2 gloo ranks).

Before, a scorer returning NaN for 1 sample in 4 made every loss NaN while reward/errors stayed 0 and the run
exited 0 without learning; and a scorer that slept passed unnoticed.
"""
import math
import re

import pytest

from hybridrl.reward.managers.base import ScoreTimeoutError
from tests.test_e2e_training import assert_weights_changed, make_config, read_metrics, run

NAN_FOR_EVERY_FOURTH_PROMPT = '''
def share_of_a(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 4 == 0:
        return float("nan")
    text = solution_str.replace(" ", "")
    return text.count("a") / max(len(text), 1)
'''

SLEEPS_ON_PROMPT_3 = '''
import time

def share_of_a(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 3:
        time.sleep(30)
    return 0.5
'''


@pytest.mark.slow
def test_a_nan_reward_for_one_sample_in_four_is_counted_and_training_still_learns(ray_local, toy_task, tmp_path):
    reward_file = tmp_path / "nan_reward.py"
    reward_file.write_text(NAN_FOR_EVERY_FOURTH_PROMPT)
    # data.shuffle=false: step 1 trains on prompts 0-7, step 2 on 8-15; prompts 0, 4 / 8, 12 (x rollout.n=2) are NaN
    config = make_config({**toy_task, "reward": str(reward_file)}, str(tmp_path), "data.shuffle=false")
    _, summary, before, after = run(config)

    steps = read_metrics(str(tmp_path))
    assert [m["step"] for m in steps] == [1, 2] and summary["steps"] == 2
    for m in steps:
        assert m["reward/errors"] == 4.0  # 4 of the batch's 16 samples
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean"):
            assert math.isfinite(m[key]), f"step {m['step']}: {key} = {m[key]}"
    assert_weights_changed(before, after)


def test_a_reward_function_that_hangs_fails_the_run_naming_it(ray_local, toy_task, tmp_path):
    """The scorer sleeps 30 s on prompt 3; ScoreTimeoutError at all means the watch ended the run (it would
    otherwise have scored 0.5 after the sleep), and its message gives the seconds the watch saw: at least the
    timeout, with no upper bound that a loaded machine could break. The heartbeat timeout stays at its default
    (60 s): a shorter one could fail a healthy rank that a loaded machine left silent for a few seconds."""
    reward_file = tmp_path / "sleepy_reward.py"
    reward_file.write_text(SLEEPS_ON_PROMPT_3)
    config = make_config({**toy_task, "reward": str(reward_file)}, str(tmp_path), "data.shuffle=false",
                         "reward_model.score_timeout=2", "trainer.heartbeat_interval=0.5")
    with pytest.raises(ScoreTimeoutError) as caught:
        run(config)
    message = str(caught.value)
    assert message.startswith("reward_model.score_timeout=2 s exceeded: scorer share_of_a (")
    # prompt 3's two responses (rollout.n=2), scored at once: whichever call began first
    busy = re.search(rf"{re.escape(str(reward_file))}\) has been busy for (\d+\.\d) s with sample [67] "
                     rf"\(data_source 'toy/letter_a', row 3\)", message)
    assert busy and float(busy.group(1)) >= 2.0, message
